//! Reporting the ledger's dispatches again on a new Fleet stream: the control plane forgot
//! them with the last stream, or restarted. Each leg keeps its first report's id, and a replay
//! records it as reported by the replay's operation, so the join counts it once.

use std::time::{Duration, Instant};

use continuum_proto::model::LoadKey;
use continuum_proto::{MAX_DISPATCH_BLOCK_HASHES, STALL_MIN_BLOCKS};

use super::{DispatchId, DispatchLedger, Leg, NOT_REPORTED, Rank, SinceFleet};

/// How a dispatch was reported when recorded: the operation's number, and the report's id for
/// each leg (0: none), the prefill rank's first when there is one. The ids let the ledger
/// report its legs again on a new stream ([`DispatchLedger::replay_legs`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recorded {
    pub op: u64,
    pub legs: [u64; 2],
    /// Its client takes the answer whole ([`Report::buffered`](crate::fleet::Report::buffered)),
    /// which a replay of the leg that prefills says again.
    pub buffered: bool,
}

impl From<u64> for Recorded {
    /// Recorded by operation `op`, with no report ids (a test's, or an unreported dispatch).
    fn from(op: u64) -> Self {
        Recorded { op, legs: [0; 2], buffered: false }
    }
}

/// A leg of a dispatch in flight as a new stream reports it again: what it still weighs on its
/// rank, and since when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayedLeg {
    /// The id its first report gave it.
    pub report: u64,
    pub rank: LoadKey,
    /// Prompt tokens still to prefill: none once its response began.
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    pub block_hashes: Vec<u64>,
    pub age: Duration,
    /// Its response began.
    pub answered: bool,
    /// Its client takes the answer whole: no first token will be reported.
    pub buffered: bool,
    /// Left unanswered, it may mark its rank stalled, as when it was first reported.
    pub may_stall: bool,
}

impl DispatchLedger {
    /// The dispatches with a leg the control plane does not hold on the stream whose
    /// operations start at `stream_first`: recorded before it opened, or unreported. For
    /// [`Self::replay_legs`], in recording order.
    pub fn dispatches_before(&self, stream_first: u64) -> Vec<DispatchId> {
        let state = self.lock();
        let mut ids: Vec<DispatchId> = state
            .ranks
            .values()
            .flat_map(|rank| rank.legs.iter())
            .filter(|leg| leg.replays_on(stream_first))
            .map(|leg| leg.id)
            .collect();
        ids.sort_unstable_by_key(|id| id.0);
        ids.dedup();
        ids
    }

    /// Reports the legs of the first of `ids` again, by operation `op` on the stream whose
    /// operations start at `stream_first`: from now on the fleet's sums hold them from that
    /// operation on, as if recorded by it. Takes dispatches until their chains would pass
    /// `max_hashes` (one at least) and returns how many it took, with what each of their legs
    /// reports; legs that weigh nothing and whose end was reported (a prefill worker's, once
    /// its response began) are left out. Chains are cut to the reports' bound.
    pub fn replay_legs(
        &self,
        ids: &[DispatchId],
        max_hashes: usize,
        op: u64,
        stream_first: u64,
        now: Instant,
    ) -> (usize, Vec<ReplayedLeg>) {
        let mut state = self.lock();
        // Nothing counts longer than `UNANSWERED_FOR`: what the ranks of these dispatches hold
        // that has expired since the last sweep goes now, rather than be reported again to
        // count in the fleet's sums afresh. Their ranks only: a sweep walks every rank, and a
        // replay of tens of thousands of dispatches, in chunks, holds up every dispatch
        // recorded meanwhile.
        let ranks: Vec<LoadKey> =
            ids.iter().filter_map(|id| state.dispatches.get(id)).flatten().flatten().cloned().collect();
        for rank in &ranks {
            state.expire(rank, now);
        }
        let mut replayed = Vec::new();
        let mut hashes = 0;
        for (taken, id) in ids.iter().enumerate() {
            let Some(keys) = state.dispatches.get(id).cloned() else { continue };
            let more: usize = keys.iter().flatten().filter_map(|key| state.ranks.get(key)?.chain_len(*id)).sum();
            if taken > 0 && hashes + more > max_hashes {
                return (taken, replayed);
            }
            hashes += more;
            for key in keys.into_iter().flatten() {
                let Some(rank) = state.ranks.get_mut(&key) else { continue };
                replayed.extend(rank.replay(&key, *id, op, stream_first, now));
            }
        }
        (ids.len(), replayed)
    }
}

impl Rank {
    /// The length of dispatch `id`'s leg's chain as a report carries it.
    fn chain_len(&self, id: DispatchId) -> Option<usize> {
        let leg = self.position(id).and_then(|index| self.legs.get(index))?;
        Some(leg.block_hashes.len().min(MAX_DISPATCH_BLOCK_HASHES))
    }

    /// Reports dispatch `id`'s leg again by operation `op` (see [`DispatchLedger::replay_legs`]);
    /// `None` when it is already reported on this stream, has no report id, or weighs nothing
    /// and was answered (its end went with its first token).
    fn replay(
        &mut self,
        key: &LoadKey,
        id: DispatchId,
        op: u64,
        stream_first: u64,
        now: Instant,
    ) -> Option<ReplayedLeg> {
        let leg = self.position(id).and_then(|index| self.legs.get_mut(index))?;
        if op == NOT_REPORTED || !leg.replays_on(stream_first) {
            return None;
        }
        if leg.op == NOT_REPORTED {
            self.unreported.decode_blocks = self.unreported.decode_blocks.saturating_sub(leg.added);
            self.unreported.prefill_tokens = self.unreported.prefill_tokens.saturating_sub(leg.prefill_tokens);
        }
        let recorded = (leg.op, leg.at);
        leg.op = op;
        let replayed = ReplayedLeg {
            report: leg.report,
            rank: key.clone(),
            prefill_tokens: leg.prefill_tokens,
            decode_blocks: leg.decode_blocks,
            block_hashes: leg.block_hashes.iter().take(MAX_DISPATCH_BLOCK_HASHES).copied().collect(),
            age: now.saturating_duration_since(leg.at),
            answered: leg.answered,
            buffered: leg.buffered,
            may_stall: leg.stall_blocks >= STALL_MIN_BLOCKS,
        };
        let started =
            SinceFleet { decode_started: leg.added, prefill_started: leg.prefill_tokens, ..Default::default() };
        self.changed(op, now, started);
        // The rank's newest leg is now the sums' to hold, under its new number: left under the
        // old one, it would read as dispatched just now, ahead of every rank the sums order.
        if self.newest == Some(recorded) {
            self.newest = Some((op, recorded.1));
        }
        Some(replayed)
    }
}

impl Leg {
    /// Whether a stream whose operations start at `stream_first` lacks this leg and should be
    /// told of it: recorded before the stream (or unreported), with a report id, and not over
    /// (a prefill worker's leg ends in the reports with its first token, and holds nothing).
    fn replays_on(&self, stream_first: u64) -> bool {
        let over = self.answered && self.decode_blocks == 0;
        // Unreported is number 0, below every stream's first.
        self.op < stream_first && self.report != 0 && !over
    }
}
