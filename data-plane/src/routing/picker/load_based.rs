//! The default picker: the seed's load-only costs over the fleet view's samples plus the
//! fleet's dispatches (this replica's ledger, joined with the fleet-wide backlogs).
//! Per-phase round-robin cursors rotate ties and stand in for costs when the load stream tells
//! nothing. The KV-aware picker reuses its rank states, cursors and counters.
//!
//! Graph-local: decode candidates of every eligible namespace compete together; the prefill
//! worker is then chosen within the decode winner's namespace.

use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use continuum_proto::fast_hash::{FastHasher, FastMap};
use continuum_proto::model::{Backlog, LoadSample, Role};
use continuum_proto::view::FleetView;
use prometheus::{IntCounter, IntCounterVec};

use super::candidates::{Candidate, PoolCache, Pools};
use super::cost::{self, CostInputs, Phase, Scored, Standing};
use super::ledger::{DispatchLedger, RankBacklog};
use super::{Few, PickRequest, Picker, REASONS, Reason, Selection};

/// Round-robin cursors held at once. Models and namespaces come from the fleet, so the map is
/// bounded; past the bound it starts over, which only resets rotation.
pub const MAX_CURSORS: usize = 4096;

/// A `role` label of `continuum_dynamo_selection_total` and its index.
pub(super) type SelectedRole = (usize, &'static str);
pub(super) const DECODE: SelectedRole = (0, "decode");
pub(super) const PREFILL: SelectedRole = (1, "prefill");

/// One candidate rank as the load stream and the fleet's dispatches leave it.
#[derive(Clone, Copy, Debug)]
pub(super) struct RankState<'v> {
    pub sample: Option<&'v LoadSample>,
    pub dispatched: RankBacklog,
}

#[derive(Debug)]
pub struct LoadBasedPicker {
    ledger: Arc<DispatchLedger>,
    /// `continuum_dynamo_selection_total{role, reason}`, by role ([`DECODE`], [`PREFILL`])
    /// and reason, looked up once; `None` if the vector was built with other labels.
    counters: Option<[[IntCounter; REASONS]; 2]>,
    /// Per phase, model and (for prefill) namespace, keyed by hash: two pools sharing a cursor
    /// after a collision still rotate.
    cursors: Mutex<FastMap<u64, usize>>,
    /// Where a new cursor starts: random per picker, as Envoy starts each round robin at a
    /// random host. Replicas started together then do not walk tied workers in step; from the
    /// first candidate, every replica's first request into an idle fleet would land on one
    /// worker before the fleet-wide backlogs could tell them apart.
    cursor_start: usize,
    pools: PoolCache,
}

impl LoadBasedPicker {
    /// `selections` must have the labels `role` and `reason` (see `Metrics::selections`).
    pub fn new(ledger: Arc<DispatchLedger>, selections: IntCounterVec) -> Self {
        Self {
            ledger,
            counters: series(&selections),
            cursors: Mutex::default(),
            cursor_start: usize::from(rand::random::<u16>()),
            pools: PoolCache::default(),
        }
    }

    /// The same picker with every cursor starting at the first contender (a reproducible rotation).
    #[cfg(test)]
    pub fn from_first_contender(self) -> Self {
        Self { cursor_start: 0, ..self }
    }

    /// The ledger the dispatch phase records this picker's pins in.
    #[cfg(test)]
    pub fn ledger(&self) -> &Arc<DispatchLedger> {
        &self.ledger
    }

    /// The ranks that may serve `request`, less those this replica's dispatches keep failing on.
    pub(super) fn pools(&self, view: &FleetView, request: &PickRequest<'_>, now: Instant) -> Arc<Pools> {
        self.pools.get(view, request.model, request.namespaces).skip_ejected(self.ledger.outliers(), now)
    }

    /// Each candidate's last sample and what the fleet's dispatches add to it: this
    /// replica's ledger joined with the fleet-wide backlogs, under one ledger acquisition.
    pub(super) fn ranks<'v>(&self, view: &'v FleetView, candidates: &[Candidate], now: Instant) -> Few<RankState<'v>> {
        self.ranks_with(view, candidates, now, |_, rank| rank)
    }

    /// What `each` makes of each candidate's [`RankState`] (given its position among
    /// `candidates`): a caller that keeps only a little of each keeps no vector of them.
    fn ranks_with<'v, T>(
        &self,
        view: &'v FleetView,
        candidates: &[Candidate],
        now: Instant,
        mut each: impl FnMut(usize, RankState<'v>) -> T,
    ) -> Few<T> {
        // Looked up before the ledger is: it is held only for what it holds.
        let (loads, fleet) = (view.loads(), view.backlogs());
        let views: Few<(Option<&LoadSample>, Option<&Backlog>)> =
            candidates.iter().map(|c| (loads.get(&c.load_key), fleet.get(&c.load_key))).collect();
        // The ledger keys dispatches by their pin.
        let queries = candidates.iter().zip(&views).map(|(c, (sample, _))| (&c.pin_key, sample.map(|s| s.received_at)));
        self.ledger.backlogs_with(queries, view.reports_folded(), now, |i, local| {
            let (sample, fleet) = views[i];
            each(i, RankState { sample, dispatched: local.with_fleet(fleet) })
        })
    }

    /// The candidates a phase's cursor chooses among, and why.
    fn contenders(
        &self,
        view: &FleetView,
        phase: Phase,
        candidates: &[Candidate],
        prompt_tokens: u64,
        now: Instant,
    ) -> (Reason, Few<usize>) {
        let params = &view.config().picker;
        let max_staleness = params.max_staleness;
        let prefill_load_scale = cost::weight(params.prefill_load_scale);
        let score = |candidate: &Candidate, rank: &RankState<'_>| {
            let standing = cost::standing(phase, rank.sample, max_staleness, now);
            let handover = candidate.hands_over;
            let queued_prefill_tokens = match phase {
                Phase::Prefill => 0,
                // The fleet's dispatches queue prefill only on a rank that prefills them.
                Phase::Decode if handover => rank.dispatched.queued_prefill_tokens(),
                Phase::Decode => {
                    rank.dispatched.prefill_backlog(cost::fresh_load(Phase::Prefill, rank.sample, max_staleness, now))
                }
            };
            let inputs = CostInputs {
                capacity: &candidate.worker.capacity,
                block_size: candidate.worker.block_size,
                prompt_tokens,
                standing,
                dispatched: rank.dispatched,
                handover,
                queued_prefill_tokens,
                prefill_load_scale,
            };
            let fresh = matches!(standing, Standing::Fresh(_));
            let heard = rank.sample.is_some_and(|sample| sample.age(now) < max_staleness);
            let (stalled, last_dispatch) = (rank.dispatched.stalled, rank.dispatched.last_dispatch);
            Scored { cost: cost::cost(phase, &inputs), fresh, heard, stalled, last_dispatch }
        };
        let scored: Few<Scored> = if tracing::enabled!(target: "continuum_data_plane::routing::pick", tracing::Level::DEBUG)
        {
            let ranks = self.ranks(view, candidates, now);
            let scored: Few<Scored> =
                candidates.iter().zip(&ranks).map(|(candidate, rank)| score(candidate, rank)).collect();
            explain(phase, candidates, &ranks, &scored, max_staleness, now);
            scored
        } else {
            // Scored as the ledger gives each rank: the ranks' states (some 150 bytes each) are
            // never kept side by side.
            self.ranks_with(view, candidates, now, |i, rank| score(&candidates[i], &rank))
        };
        cost::contenders(&scored)
    }

    /// One candidate of `candidates`, chosen by the phase's cursor among the contenders.
    pub(super) fn choose<'c>(
        &self,
        view: &FleetView,
        phase: Phase,
        candidates: &'c [Candidate],
        cursor: impl Hash,
        request: &PickRequest<'_>,
        now: Instant,
    ) -> Option<(&'c Candidate, Reason)> {
        let (reason, contenders) = self.contenders(view, phase, candidates, request.prompt_tokens, now);
        if contenders.is_empty() {
            return None;
        }
        let turn = self.advance(cursor) % contenders.len();
        let chosen = contenders.get(turn).and_then(|i| candidates.get(*i))?;
        Some((chosen, reason))
    }

    /// The cursor's current turn, moving it on: successive calls with one cursor rotate.
    pub(super) fn advance(&self, cursor: impl Hash) -> usize {
        // Cursors are keyed by models and namespaces of the fleet (a request for an unknown model
        // never reaches one), so a fast hash will do.
        let mut hasher = FastHasher::default();
        cursor.hash(&mut hasher);
        let key = hasher.finish();
        let mut cursors = self.cursors.lock().unwrap_or_else(PoisonError::into_inner);
        if cursors.len() >= MAX_CURSORS && !cursors.contains_key(&key) {
            cursors.clear();
        }
        let turn = cursors.entry(key).or_insert(self.cursor_start);
        let current = *turn;
        *turn = turn.wrapping_add(1);
        current
    }

    /// Counts a selection on `continuum_dynamo_selection_total{role, reason}`.
    pub(super) fn count(&self, (index, _): SelectedRole, reason: Reason) {
        // A vector built with other labels only loses the counts; selection goes on.
        if let Some(counter) = self.counters.as_ref().and_then(|c| c.get(index)?.get(reason as usize)) {
            counter.inc();
        }
    }
}

/// Every series of `selections` by role and reason; `None` if it was built with other labels.
fn series(selections: &IntCounterVec) -> Option<[[IntCounter; REASONS]; 2]> {
    let row = |role| -> Option<[IntCounter; REASONS]> {
        let row: Vec<IntCounter> = Reason::ALL
            .iter()
            .map(|reason| selections.get_metric_with_label_values(&[role, reason.as_str()]).ok())
            .collect::<Option<_>>()?;
        row.try_into().ok()
    };
    Some([row(DECODE.1)?, row(PREFILL.1)?])
}

impl Picker for LoadBasedPicker {
    fn pick(&self, view: &FleetView, request: &PickRequest<'_>, now: Instant) -> Option<Selection> {
        let pools = self.pools(view, request, now);
        let decode_cursor = (Phase::Decode, request.model);
        let (decode, decode_reason) = self.choose(view, Phase::Decode, &pools.decode, decode_cursor, request, now)?;
        let namespace = Arc::clone(&decode.worker.key.namespace);
        let pool = pools.prefill.get(&namespace).filter(|_| decode.worker.role == Role::Decode);
        let prefill = pool.and_then(|pool| {
            let cursor = (Phase::Prefill, request.model, &*namespace);
            self.choose(view, Phase::Prefill, pool, cursor, request, now)
        });
        let (prefill, prefill_reason) = match prefill {
            Some((candidate, reason)) => (Some(candidate.pin()), reason),
            None => (None, Reason::NoPrefillPool),
        };
        self.count(DECODE, decode_reason);
        self.count(PREFILL, prefill_reason);
        Some(Selection {
            namespace,
            model: request.model.to_string(),
            decode: decode.pin(),
            prefill,
            decode_reason,
            prefill_reason,
            cached_tokens: 0,
        })
    }

    /// From the listing the pick itself uses, kept per set of workers.
    fn serves(&self, view: &FleetView, model: &str, namespaces: &[String]) -> bool {
        !self.pools.get(view, model, Some(namespaces)).decode.is_empty()
    }
}

/// One pick's inputs per candidate, at debug level: the sample the cost started from, what the
/// fleet's dispatches add, and the cost.
fn explain(
    phase: Phase,
    candidates: &[Candidate],
    ranks: &[RankState<'_>],
    scored: &[Scored],
    max_staleness: std::time::Duration,
    now: Instant,
) {
    use std::fmt::Write;
    let mut line = format!("{phase:?}:");
    for ((candidate, rank), scored) in candidates.iter().zip(ranks).zip(scored) {
        let d = &rank.dispatched;
        let _ = write!(
            line,
            " {}/{}[{:?} age {:?} foreign {:?} in flight {} ending {} unanswered {} prefill {} (done {}) cost {:?} last {:?}]",
            candidate.worker.key.instance_id,
            candidate.rank,
            cost::standing(phase, rank.sample, max_staleness, now),
            rank.sample.map(|s| s.age(now)),
            d.foreign_decode_blocks,
            d.in_flight_decode_blocks,
            d.ending_decode_blocks,
            d.decode_blocks,
            d.prefill_tokens,
            d.prefilled_tokens,
            scored.cost,
            scored.last_dispatch,
        );
    }
    tracing::debug!(target: "continuum_data_plane::routing::pick", "{line}");
}
