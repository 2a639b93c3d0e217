//! The replica's own unanswered dispatches, per worker rank.
//!
//! Workers publish load only when it changes, so between two samples the picker would send a
//! whole burst to the worker that looked idle. Each dispatch therefore adds its prompt tokens
//! (prefill leg) and blocks (decode leg) to its ranks' backlog until a sample newer than the
//! dispatch arrives from that rank, the request ends, or [`UNANSWERED_FOR`] passes. A dispatch
//! of [`STALL_MIN_BLOCKS`] or more left unanswered for [`STALL_AFTER`] marks its rank stalled.
//!
//! One mutex guards the state; every critical section is a few map operations, and the picker
//! queries all its candidates under a single acquisition.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use continuum_proto::model::{Backlog, LoadKey};
use continuum_proto::view::FleetView;
use prometheus::IntCounter;

use super::Selection;
use super::fast_hash::FastMap;
use super::outliers::Outliers;

/// A dispatch adds to its ranks' backlog at most this long.
pub const UNANSWERED_FOR: Duration = Duration::from_secs(30);
/// A dispatch unanswered this long may mean a stalled engine.
pub const STALL_AFTER: Duration = Duration::from_secs(5);
/// Smaller dispatches never mark a rank stalled.
pub const STALL_MIN_BLOCKS: u64 = 2;
/// Dispatches held at once; further ones are refused (counted) rather than growing memory.
pub const LEDGER_CAPACITY: usize = 65_536;
/// Block size assumed for a worker whose card declares none (Dynamo's and vLLM's default).
pub const FALLBACK_BLOCK_SIZE: u32 = 16;
/// How often recording sweeps out expired dispatches of ranks nobody queries any more.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// A recorded dispatch, to end when its request finishes, is refused, fails or is cancelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DispatchId(u64);

impl DispatchId {
    /// What a refused record returns; ending it does nothing.
    pub const UNRECORDED: DispatchId = DispatchId(0);

    pub fn is_recorded(self) -> bool {
        self != Self::UNRECORDED
    }
}

/// What a rank's unanswered dispatches add to its last sample.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankBacklog {
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    /// A dispatch of at least [`STALL_MIN_BLOCKS`] has gone unanswered for [`STALL_AFTER`].
    pub stalled: bool,
}

impl RankBacklog {
    /// This replica's backlog joined with the fleet-wide one the control plane streams.
    ///
    /// The fleet-wide sum already holds this replica's reported dispatches, a stream turn
    /// late; the local ledger holds them at once. Adding the two would count each of this
    /// replica's dispatches twice, so each field takes the larger: the fleet's once it has
    /// caught up, the replica's own until then. Stalls stay local: only this replica knows
    /// which of its dispatches are a pair's decode leg.
    pub fn with_fleet(self, fleet: Option<&Backlog>) -> Self {
        let Some(fleet) = fleet else {
            return self;
        };
        Self {
            prefill_tokens: self.prefill_tokens.max(fleet.prefill_tokens),
            decode_blocks: self.decode_blocks.max(fleet.decode_blocks),
            stalled: self.stalled,
        }
    }
}

#[derive(Debug)]
pub struct DispatchLedger {
    capacity: usize,
    state: Mutex<State>,
    refused: AtomicU64,
    /// The replica's registered metric for refusals, when it has one.
    refused_metric: Option<IntCounter>,
    /// Ranks whose pinned dispatches keep failing.
    outliers: Outliers,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    /// Legs per rank, in dispatch order.
    ranks: FastMap<LoadKey, Rank>,
    /// The ranks each live dispatch has legs on.
    dispatches: FastMap<DispatchId, [Option<LoadKey>; 2]>,
    last_sweep: Option<Instant>,
}

/// One rank's legs, with their sums kept up to date so that the common query (every leg
/// unanswered, none old enough to stall) costs no walk over them.
#[derive(Debug, Default)]
struct Rank {
    /// In recording order, which is id order.
    legs: VecDeque<Leg>,
    prefill_tokens: u64,
    decode_blocks: u64,
    /// No leg is older than this; exact except after expiry pops, which recompute it.
    oldest: Option<Instant>,
}

impl Rank {
    fn push(&mut self, leg: Leg) {
        self.prefill_tokens = self.prefill_tokens.saturating_add(leg.prefill_tokens);
        self.decode_blocks = self.decode_blocks.saturating_add(leg.decode_blocks);
        self.oldest = Some(self.oldest.map_or(leg.at, |oldest| oldest.min(leg.at)));
        self.legs.push_back(leg);
    }

    fn take(&mut self, id: DispatchId) {
        let found = match self.legs.binary_search_by_key(&id.0, |leg| leg.id.0) {
            Ok(index) => Some(index),
            // Ids only leave order if the counter wrapped; look the slow way then.
            Err(_) => self.legs.iter().position(|leg| leg.id == id),
        };
        if let Some(leg) = found.and_then(|index| self.legs.remove(index)) {
            self.forget(&leg);
            if self.oldest.is_none_or(|oldest| leg.at <= oldest) {
                self.oldest = self.legs.iter().map(|leg| leg.at).min();
            }
        }
    }

    fn pop_expired(&mut self, now: Instant) -> Option<DispatchId> {
        let leg = self.legs.front().filter(|leg| now.saturating_duration_since(leg.at) >= UNANSWERED_FOR)?;
        let leg = *leg;
        self.legs.pop_front();
        self.forget(&leg);
        Some(leg.id)
    }

    fn forget(&mut self, leg: &Leg) {
        self.prefill_tokens = self.prefill_tokens.saturating_sub(leg.prefill_tokens);
        self.decode_blocks = self.decode_blocks.saturating_sub(leg.decode_blocks);
    }
}

#[derive(Clone, Copy, Debug)]
struct Leg {
    id: DispatchId,
    at: Instant,
    prefill_tokens: u64,
    decode_blocks: u64,
    /// Blocks that count toward a stall: zero for the decode leg of a prefill+decode pair,
    /// which receives the request only after the prefill finishes.
    stall_blocks: u64,
}

impl Default for DispatchLedger {
    fn default() -> Self {
        Self::new()
    }
}

impl DispatchLedger {
    pub fn new() -> Self {
        Self::with_capacity(LEDGER_CAPACITY)
    }

    /// The ranks this replica's pinned dispatches keep failing on; pickers skip them.
    pub fn outliers(&self) -> &Outliers {
        &self.outliers
    }

    /// A ledger whose refusals count on `refused` (the replica's registered metric).
    pub fn counting_refusals(refused: IntCounter) -> Self {
        Self { refused_metric: Some(refused), ..Self::new() }
    }

    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            capacity,
            state: Mutex::new(State::default()),
            refused: AtomicU64::new(0),
            refused_metric: None,
            outliers: Outliers::default(),
        }
    }

    /// Records a dispatch of `prompt_tokens` pinned as `selection`. `block_size` is the decode
    /// worker's (see [`dispatch_block_size`]); 0 counts as 1.
    pub fn record(&self, selection: &Selection, prompt_tokens: u64, block_size: u32, now: Instant) -> DispatchId {
        let blocks = prompt_tokens.div_ceil(u64::from(block_size.max(1)));
        let mut state = self.lock();
        if state.last_sweep.is_none_or(|at| now.saturating_duration_since(at) >= SWEEP_EVERY) {
            state.sweep(now);
        }
        if state.dispatches.len() >= self.capacity {
            drop(state);
            self.refused.fetch_add(1, Ordering::Relaxed);
            if let Some(metric) = &self.refused_metric {
                metric.inc();
            }
            return DispatchId::UNRECORDED;
        }
        state.next_id = state.next_id.wrapping_add(1).max(1);
        let id = DispatchId(state.next_id);
        let decode = Leg { id, at: now, prefill_tokens: 0, decode_blocks: blocks, stall_blocks: blocks };
        let legs = match &selection.prefill {
            Some(prefill) => {
                let prefill_leg = Leg { prefill_tokens: prompt_tokens, decode_blocks: 0, ..decode };
                state.push(prefill.rank_key(), prefill_leg);
                state.push(selection.decode.rank_key(), Leg { stall_blocks: 0, ..decode });
                [Some(prefill.rank_key()), Some(selection.decode.rank_key())]
            }
            None => {
                state.push(selection.decode.rank_key(), decode);
                [Some(selection.decode.rank_key()), None]
            }
        };
        state.dispatches.insert(id, legs);
        id
    }

    /// Ends a dispatch: its request finished, was refused, failed or was cancelled, so it no
    /// longer loads its workers nor counts toward a stall. Ending twice does nothing.
    pub fn end(&self, id: DispatchId, now: Instant) {
        let mut state = self.lock();
        state.remove(id);
        if state.last_sweep.is_none_or(|at| now.saturating_duration_since(at) >= SWEEP_EVERY) {
            state.sweep(now);
        }
    }

    /// The backlog of each rank, given when its last sample was received (`None`: never).
    pub fn backlogs(&self, ranks: &[(LoadKey, Option<Instant>)], now: Instant) -> Vec<RankBacklog> {
        let mut state = self.lock();
        ranks.iter().map(|(key, sampled_at)| state.backlog(key, *sampled_at, now)).collect()
    }

    /// Dispatches refused because the ledger was full.
    pub fn refused_total(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Dispatches held.
    pub fn len(&self) -> usize {
        self.lock().dispatches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    fn push(&mut self, key: LoadKey, leg: Leg) {
        self.ranks.entry(key).or_default().push(leg);
    }

    fn remove(&mut self, id: DispatchId) {
        let Some(keys) = self.dispatches.remove(&id) else {
            return;
        };
        for key in keys.into_iter().flatten() {
            if let Some(rank) = self.ranks.get_mut(&key) {
                rank.take(id);
                if rank.legs.is_empty() {
                    self.ranks.remove(&key);
                }
            }
        }
    }

    fn backlog(&mut self, key: &LoadKey, sampled_at: Option<Instant>, now: Instant) -> RankBacklog {
        self.expire(key, now);
        let mut backlog = RankBacklog::default();
        let Some(rank) = self.ranks.get(key) else {
            return backlog;
        };
        // Every leg is younger than the stall age and no sample answers any: the sums are it.
        if let Some(oldest) = rank.oldest
            && now.saturating_duration_since(oldest) < STALL_AFTER
            && sampled_at.is_none_or(|at| at <= oldest)
        {
            backlog.prefill_tokens = rank.prefill_tokens;
            backlog.decode_blocks = rank.decode_blocks;
            return backlog;
        }
        let unanswered = |leg: &&Leg| {
            sampled_at.is_none_or(|at| at <= leg.at) && now.saturating_duration_since(leg.at) < UNANSWERED_FOR
        };
        for leg in rank.legs.iter().filter(unanswered) {
            backlog.prefill_tokens = backlog.prefill_tokens.saturating_add(leg.prefill_tokens);
            backlog.decode_blocks = backlog.decode_blocks.saturating_add(leg.decode_blocks);
            let waited = now.saturating_duration_since(leg.at);
            backlog.stalled |= leg.stall_blocks >= STALL_MIN_BLOCKS && waited >= STALL_AFTER;
        }
        backlog
    }

    /// Drops a rank's legs older than [`UNANSWERED_FOR`], with their dispatches.
    fn expire(&mut self, key: &LoadKey, now: Instant) {
        let Some(rank) = self.ranks.get_mut(key) else {
            return;
        };
        if rank.oldest.is_none_or(|oldest| now.saturating_duration_since(oldest) < UNANSWERED_FOR) {
            return;
        }
        let mut expired = Vec::new();
        while let Some(id) = rank.pop_expired(now) {
            expired.push(id);
        }
        rank.oldest = rank.legs.iter().map(|leg| leg.at).min();
        for id in expired {
            self.remove(id);
        }
        if self.ranks.get(key).is_some_and(|rank| rank.legs.is_empty()) {
            self.ranks.remove(key);
        }
    }

    fn sweep(&mut self, now: Instant) {
        self.last_sweep = Some(now);
        let keys: Vec<LoadKey> = self.ranks.keys().cloned().collect();
        for key in &keys {
            self.expire(key, now);
        }
    }
}

/// The block size to record a dispatch with: the decode worker's, else [`FALLBACK_BLOCK_SIZE`].
pub fn dispatch_block_size(view: &FleetView, selection: &Selection) -> u32 {
    view.worker(&selection.decode.worker)
        .and_then(|worker| worker.block_size)
        .filter(|size| *size > 0)
        .unwrap_or(FALLBACK_BLOCK_SIZE)
}

#[cfg(test)]
mod tests;
