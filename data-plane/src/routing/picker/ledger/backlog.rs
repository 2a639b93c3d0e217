//! What a rank's dispatches add to its last sample, as a pick reads it: this replica's ledger
//! ([`RankBacklog`]), brought up to date with the fleet-wide sums the control plane streams
//! ([`RankBacklog::with_fleet`]), and what the cost formulas take from it.

use std::time::Instant;

use continuum_proto::model::Backlog;

#[cfg(doc)]
use super::{STALL_AFTER, STALL_MIN_BLOCKS};
use crate::routing::picker::Few;

/// What a rank's dispatches add to its last sample.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankBacklog {
    /// Of the dispatches whose response has not begun.
    pub prefill_tokens: u64,
    /// Of those, this replica's that no sample has answered: what the seed's rule adds to a
    /// sample's prefill queue where the control plane has not measured it.
    pub unanswered_prefill_tokens: u64,
    /// Of the dispatches no sample has answered.
    pub decode_blocks: u64,
    /// Of every dispatch in flight, answered or not.
    pub in_flight_decode_blocks: u64,
    /// What this replica did that the fleet-wide sums do not hold; `None` when the control
    /// plane has not said which of its reports they hold.
    pub since_fleet: Option<SinceFleet>,
    /// What the rank's last sample showed beyond the fleet's dispatches in flight when it
    /// arrived (the control plane measures it). When known, the rank's decode backlog is this
    /// plus `in_flight_decode_blocks` instead of the sample plus `decode_blocks`: samples lag
    /// both a burst's ends and a new request's arrival at the engine.
    pub foreign_decode_blocks: Option<u64>,
    /// What the rank's last sample showed queued for prefill beyond the fleet's dispatches
    /// awaiting their first token when it arrived (the control plane measures it, for engines
    /// that publish `active_prefill_tokens`). When known, the rank's prefill backlog is this
    /// plus the queued tokens instead of the sample plus them: the sample already counts the
    /// dispatches the engine had received.
    pub foreign_prefill_tokens: Option<u64>,
    /// Of the decode blocks in flight, those the control plane expects to end before a request
    /// dispatched now reaches the rank by hand-over (less those this replica saw end since).
    pub ending_decode_blocks: u64,
    /// Of `prefill_tokens`, those the control plane expects the rank to have prefilled already
    /// (the prefill under way, part done), less those this replica saw answered since.
    pub prefilled_tokens: u64,
    /// A dispatch of at least [`STALL_MIN_BLOCKS`] has gone unanswered for [`STALL_AFTER`].
    pub stalled: bool,
    /// How recently the fleet sent the rank a dispatch.
    pub last_dispatch: LastDispatch,
}

/// How recently the fleet sent a rank a dispatch: pickers break ties toward the rank that went
/// longest without one, as a round robin does, whichever replica sent the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LastDispatch {
    /// The control plane's number for the newest dispatch its sums hold (0: none); larger is
    /// more recent.
    Folded(u64),
    /// When this replica sent one the sums do not hold yet: more recent than any they hold.
    Local(Instant),
}

impl LastDispatch {
    /// Of `candidates` (index, last dispatch), the indices of those the fleet sent a dispatch
    /// longest ago.
    pub fn longest_idle(candidates: impl Iterator<Item = (usize, Self)> + Clone) -> Few<usize> {
        let longest = candidates.clone().map(|(_, last)| last).min();
        candidates.filter(|(_, last)| Some(*last) == longest).map(|(i, _)| i).collect()
    }
}

impl Default for LastDispatch {
    fn default() -> Self {
        Self::Folded(0)
    }
}

/// What this replica's operations did to a rank that the fleet-wide sums do not hold: those
/// after the range the control plane said it summed (a dispatch that started and ended there
/// adds and takes away the same), and the legs in flight from before the range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SinceFleet {
    /// Decode blocks the rank's dispatches added.
    pub decode_started: u64,
    /// Decode blocks their ends freed.
    pub decode_ended: u64,
    /// Prompt tokens they queued.
    pub prefill_started: u64,
    /// Prompt tokens that stopped loading the rank: the response began, or the dispatch ended
    /// (a buffered answer's end excepted: see `Rank::take`).
    pub prefill_done: u64,
}

impl RankBacklog {
    /// This replica's backlog joined with the fleet-wide one the control plane streams.
    ///
    /// The fleet-wide sums already hold this replica's reported dispatches, a stream turn
    /// late; the local ledger holds them at once. Told which of its operations the sums hold,
    /// the replica brings them up to date with exactly the rest. Taking the larger of the two
    /// instead would drop dispatches: a rank with one of this replica's prompts queued and
    /// another replica's in the sums would count one, not two, until the sums caught up, so a
    /// burst through several replicas would stack its prompts on one worker. Untold, each
    /// field takes the larger. A rank is stalled when either says so: the control plane sees
    /// every replica's dispatches, this replica its own at once.
    pub fn with_fleet(self, fleet: Option<&Backlog>) -> Self {
        let Some(fleet) = fleet else {
            return self;
        };
        let (prefill_tokens, in_flight_decode_blocks, ending_decode_blocks, prefilled_tokens) = match self.since_fleet {
            // What ended since was most likely among the ending, and a prefill done since most
            // likely the one under way, so neither is subtracted twice.
            Some(since) => (
                fleet.prefill_tokens.saturating_add(since.prefill_started).saturating_sub(since.prefill_done),
                fleet.decode_blocks.saturating_add(since.decode_started).saturating_sub(since.decode_ended),
                fleet.ending_decode_blocks.saturating_sub(since.decode_ended),
                fleet.prefilled_tokens.saturating_sub(since.prefill_done),
            ),
            None => (
                self.prefill_tokens.max(fleet.prefill_tokens),
                self.in_flight_decode_blocks.max(fleet.decode_blocks),
                fleet.ending_decode_blocks,
                fleet.prefilled_tokens,
            ),
        };
        // The fleet's `decode_blocks` are its dispatches in flight, which a rank no sample has
        // measured (no foreign part) counts whole: up to date, as the in-flight sum is, when
        // the range is known, else the larger.
        let fleet_decode_blocks =
            if self.since_fleet.is_some() { in_flight_decode_blocks } else { fleet.decode_blocks };
        Self {
            prefill_tokens,
            unanswered_prefill_tokens: self.unanswered_prefill_tokens,
            decode_blocks: self.decode_blocks.max(fleet_decode_blocks),
            in_flight_decode_blocks,
            foreign_decode_blocks: fleet.foreign_decode_blocks,
            foreign_prefill_tokens: fleet.foreign_prefill_tokens,
            ending_decode_blocks,
            prefilled_tokens,
            since_fleet: None,
            stalled: self.stalled || fleet.stalled,
            last_dispatch: self.last_dispatch.max(LastDispatch::Folded(fleet.last_dispatch)),
        }
    }

    /// The prompt tokens the fleet's dispatches still have to prefill on the rank: those queued,
    /// less what the prefill under way should have done.
    pub fn queued_prefill_tokens(&self) -> u64 {
        self.prefill_tokens.saturating_sub(self.prefilled_tokens)
    }

    /// The rank's prefill backlog given its fresh sample's `active_prefill_tokens` (`None`
    /// when it has no fresh sample carrying them): the fleet's queued tokens plus the sample's
    /// foreign part when the control plane measured it; else the seed's rule, the sample plus
    /// the dispatches no sample has answered (the sample counts those the engine had).
    pub fn prefill_backlog(&self, sampled: Option<u64>) -> u64 {
        match (sampled, self.foreign_prefill_tokens) {
            (None, _) => self.queued_prefill_tokens(),
            (Some(_), Some(foreign)) => foreign.saturating_add(self.queued_prefill_tokens()),
            (Some(sampled), None) => sampled.saturating_add(self.unanswered_prefill_tokens),
        }
    }

    /// The rank's decode backlog given its sample's (`sampled`): the fleet's own dispatches in
    /// flight plus the sample's foreign part when the control plane measured it, else the
    /// sample plus the unanswered dispatches (the seed's rule).
    pub fn decode_backlog(&self, sampled: u64) -> u64 {
        match self.foreign_decode_blocks {
            Some(foreign) => foreign.saturating_add(self.in_flight_decode_blocks),
            None => sampled.saturating_add(self.decode_blocks),
        }
    }

    /// The decode backlog a request will find if it reaches the rank by hand-over after its
    /// prefill: [`Self::decode_backlog`] less the dispatches expected to have ended by then.
    /// A direct-mode router pins the decode worker at dispatch, one prefill before Dynamo's
    /// frontend would choose it.
    pub fn handover_decode_backlog(&self, sampled: u64) -> u64 {
        self.decode_backlog(sampled).saturating_sub(self.ending_decode_blocks)
    }
}
