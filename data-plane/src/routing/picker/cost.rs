//! The seed's load-only cost formulas, and the rule that turns a phase's costs into the set
//! of candidates its round-robin cursor chooses among.
//!
//! * prefill cost = active_prefill_tokens / max_num_batched_tokens
//! * decode cost = (active_decode_blocks + ceil(prompt_tokens / block_size)
//!   + prefill_load_scale * ceil(queued_prefill_tokens / block_size)) / total_kv_blocks
//!
//! The decode cost's prefill term departs from the seed, which scores a worker that prefills
//! its own requests (an aggregated worker) by its decode memory alone. A request sent to such a
//! worker while it prefills another waits for that prefill before its own begins, whatever its
//! decode memory; decoding beside more requests delays a first token far less. On the
//! aggregated unique-prompt benchmark the seed's cost sent a third of the requests behind a
//! running prefill while the other worker had none, and lost to round-robin by a fifth on TTFT
//! p90 in every table (`docs/benchmark-notes.md`). Dynamo's KV router, with no overlap, counts the
//! same queue at the same scale (`--router-prefill-load-scale`). A decode worker of a pair
//! prefills nothing, so the term is zero there. Divided by the rank's KV capacity like the rest
//! of the cost, the queue weighs less on a larger rank though its wait is the same: on a fleet
//! of unequal capacities Dynamo's cost, in blocks, would send fewer requests behind a large
//! rank's queue. Equal capacities, the case measured, are unaffected.
//!
//! The fleet's dispatches add to the backlog (prefill tokens, decode blocks);
//! where the control plane measured a rank's foreign load, the decode backlog is that plus the
//! fleet's dispatches in flight instead (see [`RankBacklog::decode_backlog`]). A decode worker
//! that receives the request by hand-over is charged what will be left when it arrives
//! ([`RankBacklog::handover_decode_backlog`]).

use std::cmp::Ordering;
use std::time::{Duration, Instant};

use continuum_proto::model::{Capacity, Load, LoadSample};

use super::ledger::{LastDispatch, RankBacklog};
use super::{Few, Reason};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Phase {
    Prefill,
    Decode,
}

/// A cost as an exact fraction, so equal loads on equal capacities tie and rotate.
#[derive(Clone, Copy, Debug)]
pub(super) struct Cost {
    backlog: u64,
    /// Never zero.
    capacity: u64,
    /// The part of `backlog` the request itself adds (its decode blocks); not compared.
    own: u64,
    /// What the rank's KV cache would hold with the request (its decode backlog and the
    /// request's blocks; not the queued prefill's weight, which is time, not memory); not
    /// compared.
    held: u64,
}

impl Cost {
    /// The rank's cost before the request lands on it.
    fn before_request(self) -> Self {
        Self { backlog: self.backlog - self.own, own: 0, ..self }
    }

    /// Whether the rank's KV cache holds the request beside what it holds already.
    fn fits(self) -> bool {
        self.held <= self.capacity
    }

    /// Whether the rank, with the request, keeps [`TIE_HEADROOM`] of its KV cache free: what a
    /// rank busier than the best needs to tie with it (see [`contenders`]).
    fn keeps_headroom(self) -> bool {
        self.held <= self.capacity - self.capacity / TIE_HEADROOM
    }

    #[cfg(test)]
    pub(super) fn as_f64(self) -> f64 {
        self.backlog as f64 / self.capacity as f64
    }
}

impl PartialEq for Cost {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Cost {}

impl PartialOrd for Cost {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Cost {
    fn cmp(&self, other: &Self) -> Ordering {
        let left = u128::from(self.backlog) * u128::from(other.capacity);
        let right = u128::from(other.backlog) * u128::from(self.capacity);
        left.cmp(&right)
    }
}

/// What a rank's last sample says about one phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Standing {
    /// A sample younger than `max_staleness` carrying the phase's field: its backlog.
    Fresh(u64),
    /// Never published, or the last (stale) sample reported no backlog: idle.
    Quiet,
    /// Silent under load (stale sample with a backlog), or a fresh sample without the
    /// phase's field: no defined cost.
    Unknown,
}

pub(super) fn standing(phase: Phase, sample: Option<&LoadSample>, max_staleness: Duration, now: Instant) -> Standing {
    let Some(sample) = sample else {
        return Standing::Quiet;
    };
    if sample.age(now) < max_staleness {
        return phase_load(phase, &sample.load).map_or(Standing::Unknown, Standing::Fresh);
    }
    if sample.load.reports_backlog() { Standing::Unknown } else { Standing::Quiet }
}

/// The phase's backlog field; `active_decode_blocks` falls back to `kv_used_blocks` when nil
/// (dynamo.vllm and the mocker fill only the latter).
pub(super) fn phase_load(phase: Phase, load: &Load) -> Option<u64> {
    match phase {
        Phase::Prefill => load.active_prefill_tokens,
        Phase::Decode => load.decode_blocks(),
    }
}

/// The phase's field of a sample younger than `max_staleness`, if it carries it.
pub(super) fn fresh_load(
    phase: Phase,
    sample: Option<&LoadSample>,
    max_staleness: Duration,
    now: Instant,
) -> Option<u64> {
    sample.filter(|s| s.age(now) < max_staleness).and_then(|s| phase_load(phase, &s.load))
}

/// A configured weight made safe: a negative or non-finite value counts as 0 (the term drops).
pub(super) fn weight(x: f64) -> f64 {
    if x.is_finite() && x > 0.0 { x } else { 0.0 }
}

/// The inputs of one candidate's cost in one phase.
#[derive(Clone, Copy, Debug)]
pub(super) struct CostInputs<'a> {
    pub capacity: &'a Capacity,
    pub block_size: Option<u32>,
    pub prompt_tokens: u64,
    pub standing: Standing,
    pub dispatched: RankBacklog,
    /// The request reaches the rank by hand-over after a prefill elsewhere (a decode worker
    /// of a prefill/decode pair): dispatches expected to end by then do not count.
    pub handover: bool,
    /// For the decode phase: prompt tokens the rank must prefill before a request sent now
    /// starts its own (the fleet's queued dispatches and what a fresh sample shows beside
    /// them, [`RankBacklog::prefill_backlog`]); zero for a rank that prefills nothing.
    pub queued_prefill_tokens: u64,
    /// What a queued prefill block weighs against a decode block (`prefill_load_scale`,
    /// non-negative and finite).
    pub prefill_load_scale: f64,
}

/// The phase's cost, or `None` when undefined: no usable sample, or the card lacks the
/// capacity (or block size) the formula divides by.
pub(super) fn cost(phase: Phase, inputs: &CostInputs<'_>) -> Option<Cost> {
    let sampled = match inputs.standing {
        Standing::Fresh(backlog) => backlog,
        Standing::Quiet => 0,
        Standing::Unknown => return None,
    };
    match phase {
        Phase::Prefill => {
            let capacity = inputs.capacity.max_num_batched_tokens.filter(|n| *n > 0)?;
            let fresh = matches!(inputs.standing, Standing::Fresh(_)).then_some(sampled);
            let backlog = inputs.dispatched.prefill_backlog(fresh);
            Some(Cost { backlog, capacity, own: 0, held: backlog })
        }
        Phase::Decode => {
            let capacity = inputs.capacity.total_kv_blocks.filter(|n| *n > 0)?;
            let block_size = inputs.block_size.filter(|n| *n > 0)?;
            let request = inputs.prompt_tokens.div_ceil(u64::from(block_size));
            let dispatched = &inputs.dispatched;
            let backlog = if inputs.handover {
                dispatched.handover_decode_backlog(sampled)
            } else {
                dispatched.decode_backlog(sampled)
            };
            let queued = inputs.queued_prefill_tokens.div_ceil(u64::from(block_size));
            // Rounded so that equal queues still tie exactly; the cast saturates.
            let queued = (inputs.prefill_load_scale * queued as f64).round() as u64;
            let held = backlog.saturating_add(request);
            let backlog = backlog.saturating_add(queued);
            Some(Cost {
                backlog: backlog.saturating_add(request),
                capacity,
                own: request.min(u64::MAX - backlog),
                held,
            })
        }
    }
}

/// A rank busier than the best ties with it only while the request leaves it an eighth of its
/// KV cache free: the tie is one request wide, and a request that is a large part of a rank
/// (a long prompt) would otherwise tie a nearly full rank with an empty one and, the nearly
/// full one idle longer, fill it to its last blocks, where the engine preempts for the answer's.
pub(super) const TIE_HEADROOM: u64 = 8;

/// One candidate as the choice rule sees it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Scored {
    pub cost: Option<Cost>,
    /// Its cost comes from a fresh sample carrying the phase's field.
    pub fresh: bool,
    /// It has a sample younger than `max_staleness`, whatever the sample carries.
    pub heard: bool,
    pub stalled: bool,
    pub last_dispatch: LastDispatch,
}

/// The candidates (indices into `scored`) the phase's cursor rotates among, and why.
///
/// When a candidate has a fresh sample, the lowest defined cost wins and ties rotate; stalled
/// candidates are passed over while another has a cost. Otherwise the load stream tells
/// nothing of the phase's backlog, so every candidate rotates (stalled ones only while no
/// candidate has a fresh sample at all, [`passes_stalls`]): a round robin across the fleet's
/// replicas, since the candidates the fleet sent a dispatch longest ago go first (see below).
/// Empty input gives an empty set.
///
/// A tie is wider than equality: a rank whose cost without the request is no higher than
/// the best's with it (at most one request's blocks busier) ties with the best. The seed ties
/// equal costs only, so of two ranks a request apart the lighter at the last sample takes
/// the arrival, and the next, while it stays lighter. Each arrival's prefill stalls every
/// request decoding on its worker: rotating among ranks that close spreads those stalls as
/// round-robin does, instead of heaping them on one rank (on the benchmark's aggregated unique
/// prompts, the slowest hundredth saw 3.1 arrivals while they decoded against round-robin's
/// 2.4, and their e2e p99 was 6% above its; `docs/benchmark-notes.md`, "Arrivals in turn"). A
/// rank more than a request busier, counting its queued prefill at `prefill_load_scale`,
/// still loses; and so does one the request would take past its capacity while the best's
/// holds it (on unequal capacities "one request" weighs more on the smaller rank: a rank of
/// 2,000 blocks at half its capacity would tie with one of 10,000 at three quarters, and a
/// request of 1,500 blocks would overfill it); and a busier rank the request would leave with
/// less than [`TIE_HEADROOM`] of its cache free ties with none (an equal cost still does, and
/// so does every rank when the best has no room for the request either).
///
/// Of the tied, those that went longest without a dispatch from the fleet remain: two ranks
/// one request apart then take arrivals in turn, whichever replica sends them, where a
/// replica's own cursor would send two in a row to one rank half the time.
pub(super) fn contenders(scored: &[Scored]) -> (Reason, Few<usize>) {
    // Costs decide once some candidate has a fresh sample carrying the phase's field (even
    // one whose card lacks the capacity to cost it), if some candidate has a defined cost (a
    // quiet one's counts); with none anywhere there is nothing to compare.
    if !(scored.iter().any(|s| s.fresh) && scored.iter().any(|s| s.cost.is_some())) {
        return (Reason::RoundRobinStale, longest_idle(scored, passes_stalls(scored)));
    }
    let healthy_exists = scored.iter().any(|s| s.cost.is_some() && !s.stalled);
    let eligible = |s: &Scored| s.cost.filter(|_| !(s.stalled && healthy_exists));
    let Some(best) = scored.iter().filter_map(eligible).min() else {
        return (Reason::Load, Few::new());
    };
    // Whether a cheapest rank holds the request: any of them, as equal costs may differ in
    // what they hold, and the first of them found is the candidates' order, not a rule.
    let room_at_best = scored.iter().filter_map(eligible).any(|c| c == best && c.fits());
    let wide_tie = |c: Cost| c.before_request() <= best && (c.keeps_headroom() || !room_at_best);
    let ties = |c: Cost| (c == best || wide_tie(c)) && (c.fits() || !room_at_best);
    (Reason::Load, longest_idle(scored, |s| eligible(s).is_some_and(ties)))
}

/// Where costs do not decide: whether a rank takes part in the rotation. The seed ignores a
/// stall only when no worker has a fresh sample, since nothing could have answered then. A
/// fresh sample anywhere, even one without the phase's field (dynamo.vllm's prefill workers
/// publish no `active_prefill_tokens`), says the load stream is alive: a stalled rank sits out
/// while one that is not remains.
pub(super) fn passes_stalls(scored: &[Scored]) -> impl Fn(&Scored) -> bool {
    let healthy_exists = scored.iter().any(|s| s.heard) && scored.iter().any(|s| !s.stalled);
    move |s: &Scored| !(s.stalled && healthy_exists)
}

/// The indices of the candidates `among` selects that the fleet sent a dispatch longest ago.
fn longest_idle(scored: &[Scored], among: impl Fn(&Scored) -> bool) -> Few<usize> {
    LastDispatch::longest_idle(scored.iter().enumerate().filter(|(_, s)| among(s)).map(|(i, s)| (i, s.last_dispatch)))
}

#[cfg(test)]
mod tests;
