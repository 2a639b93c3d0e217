//! The KV-aware cost of one rank (upstream's `worker_logit`, as the seed states it), the rule
//! that turns a set of costs into contenders, softmax sampling above temperature 0, and
//! conditional disaggregation's per-request decision. Pure: no clock, no locks, no randomness
//! of its own (the sampler takes its uniform draw as an argument).
//!
//! For a rank holding `overlap_blocks` of an `isl`-token prompt in blocks of `bs` tokens, of
//! which its requests in flight hold `active_overlap_blocks`:
//!
//! ```text
//! cached_tokens         = min(overlap_blocks * bs, isl)
//! raw_prefill_tokens    = active_prefill_tokens + (isl - cached_tokens) + cached_tokens
//! raw_prefill_blocks    = raw_prefill_tokens / bs
//! overlap_credit_blocks = overlap_score_credit * overlap_blocks
//! adjusted_prefill      = max(0, raw_prefill_blocks - overlap_credit_blocks)
//! decode_cost_blocks    = active_decode_blocks + max(0, ceil(isl / bs) - active_overlap_blocks)
//! cost                  = prefill_load_scale * adjusted_prefill + decode_cost_blocks
//! ```
//!
//! `raw_prefill_tokens` is the seed's formula verbatim: the cached tokens cancel, so the prefix
//! earns its discount through `overlap_credit_blocks`.
//!
//! The scale weighs all of `adjusted_prefill`, the prefill already queued on the rank as well as
//! the request's own, as the seed states it: a request that lands behind a prefill waits for it
//! to finish, while requests decoding beside it barely delay its first token. The queue is the
//! fleet's prefill tokens less what the prefill under way should have done
//! ([`RankBacklog::queued_prefill_tokens`]): a request waits only for the rest of it. An
//! earlier build counted the queue once, like decode blocks, because the benchmark's
//! unique-prompt clients sent in lockstep and a worker still prefilling the start of a wave
//! looked busier than one holding more requests; without the lockstep, counting it once sent a
//! request behind a running prefill whenever the other worker decoded two requests more
//! (`docs/kv.md`).
//!
//! The decode term departs from the seed, which subtracts `overlap_blocks` there too, and
//! follows Dynamo's router (`ActiveSequences`: a request adds the blocks no request in flight
//! on the worker holds). A cached prefix nobody is using costs no prefill, but serving the
//! request makes all of it active memory again, so the seed's version credits such a prefix
//! twice. Same-run comparisons with Dynamo's router are in `docs/benchmark-notes.md`.
//!
//! The choice rule departs from the seed once more: a rank without room for the request
//! ([`over_capacity`]) sits out while another has room, however cheap its cached prefix makes
//! it. The formula prices memory linearly, but an engine queues a request that does not fit
//! until running requests end (`docs/kv.md`).

use std::cmp::Ordering;
use std::time::{Duration, Instant};

use continuum_proto::model::{LoadSample, PickerParams};

use super::super::Reason;
use super::super::cost::{self, Phase, Standing};
use super::super::ledger::{LastDispatch, RankBacklog};

/// `IslBoundingPolicy`'s default absolute bound (upstream `--router-conditional-disagg`): a
/// decode worker prefills locally only when fewer than this many prompt tokens are not
/// already in its cache…
pub const CONDITIONAL_EFF_ISL_THRESHOLD: u64 = 2048;
/// …and when those uncached tokens are less than this fraction of the prompt.
pub const CONDITIONAL_EFF_ISL_RATIO_THRESHOLD: f64 = 0.7;

/// The configured weights, made safe: a negative or non-finite value counts as 0 (a credit or
/// scale of 0 drops its term; a temperature of 0 picks the lowest cost).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Weights {
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    pub temperature: f64,
}

impl Weights {
    pub fn new(params: &PickerParams) -> Self {
        Self {
            overlap_score_credit: cost::weight(params.overlap_score_credit),
            prefill_load_scale: cost::weight(params.prefill_load_scale),
            temperature: cost::weight(params.router_temperature),
        }
    }
}

/// The request's prompt: its length and the block size everything is counted in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Prompt {
    pub isl: u64,
    /// Never zero.
    pub block_size: u64,
}

impl Prompt {
    /// A block size of 0 (never produced by the hasher) counts as 1 rather than dividing by 0.
    pub fn new(isl: u64, block_size: u32) -> Self {
        Self { isl, block_size: u64::from(block_size.max(1)) }
    }

    pub fn blocks(self) -> u64 {
        self.isl.div_ceil(self.block_size)
    }
}

/// What a rank already carries: its sample's backlog and the fleet's dispatches on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct RankLoad {
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
}

/// Every step of one rank's cost, kept so tests (and logs) can check each term.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Logit {
    pub overlap_blocks: u64,
    /// Of `overlap_blocks`, those the rank's requests in flight hold.
    pub shared_blocks: u64,
    pub cached_tokens: u64,
    pub raw_prefill_tokens: u64,
    pub raw_prefill_blocks: f64,
    pub overlap_credit_blocks: f64,
    pub adjusted_prefill: f64,
    pub decode_cost_blocks: u64,
    pub cost: f64,
}

pub(super) fn worker_logit(
    load: RankLoad,
    overlap_blocks: u32,
    active_overlap_blocks: u32,
    prompt: Prompt,
    weights: &Weights,
) -> Logit {
    let overlap_blocks = u64::from(overlap_blocks);
    let shared_blocks = u64::from(active_overlap_blocks).min(overlap_blocks);
    let cached_tokens = overlap_blocks.saturating_mul(prompt.block_size).min(prompt.isl);
    let raw_prefill_tokens =
        load.active_prefill_tokens.saturating_add(prompt.isl - cached_tokens).saturating_add(cached_tokens);
    let raw_prefill_blocks = raw_prefill_tokens as f64 / prompt.block_size as f64;
    let overlap_credit_blocks = weights.overlap_score_credit * overlap_blocks as f64;
    let adjusted_prefill = (raw_prefill_blocks - overlap_credit_blocks).max(0.0);
    let decode_cost_blocks = load.active_decode_blocks.saturating_add(prompt.blocks().saturating_sub(shared_blocks));
    let cost = weights.prefill_load_scale * adjusted_prefill + decode_cost_blocks as f64;
    Logit {
        overlap_blocks,
        shared_blocks,
        cached_tokens,
        raw_prefill_tokens,
        raw_prefill_blocks,
        overlap_credit_blocks,
        adjusted_prefill,
        decode_cost_blocks,
        cost,
    }
}

/// The cost when no rank has a fresh backlog (workers that publish no `active_prefill_tokens`,
/// as the 1.6.1 mocker's and dynamo.vllm's prefill workers): overlap and request size, as the
/// seed states it, plus the fleet's own prefill dispatches in flight on the rank.
///
/// The seed leaves load out here, so a prefix's rank takes every request for it however long its
/// queue: on the prefill/decode shared-prefix benchmark one prefill worker took twice the other's
/// requests, and 23% of prefills waited behind another (Dynamo's router, which counts its own
/// dispatches: 9%).
///
/// The tokens are the queue less what the prefill under way should have done
/// ([`RankBacklog::queued_prefill_tokens`]), so they count whole: what is left to prefill is
/// what a request sent there waits for. Two prefill workers each prefilling one prompt
/// otherwise tie, and the cursor, not the prefill that began first, broke the tie: on the
/// prefill/decode unique-prompt benchmark 29 of 56 such requests per run went behind the
/// prefill that began later (round-robin, which never sends to the worker it used last: 0 of
/// 62). Before that discount existed the tokens weighed half, since a dispatch counts until its
/// first token, about twice the prefill; with it, half weight discounted the prefill under way
/// twice and sent requests behind it while the other worker was idle (measured in
/// `docs/benchmark-notes.md`, session 28).
pub(super) fn stale_cost(overlap_blocks: u32, queued_prefill_tokens: u64, prompt: Prompt, weights: &Weights) -> f64 {
    let tokens = prompt.isl.saturating_add(queued_prefill_tokens) as f64;
    tokens / prompt.block_size as f64 - weights.overlap_score_credit * f64::from(overlap_blocks)
}

/// Whether a rank that decodes would have to wait for KV memory: its projected decode blocks
/// (backlog, the fleet's dispatches and the request's blocks no request in flight holds) exceed
/// the blocks its card declares. Such a request is not admitted until running requests end,
/// and in the meantime the blocks they allocate evict the idle cached prefix it was sent for.
/// Unknown capacity never counts as full.
pub(super) fn over_capacity(logit: Option<&Logit>, total_kv_blocks: Option<u64>) -> bool {
    match (logit, total_kv_blocks.filter(|n| *n > 0)) {
        (Some(logit), Some(total)) => logit.decode_cost_blocks > total,
        _ => false,
    }
}

/// A decode worker's cost under conditional disaggregation: its decode term less the credit
/// for the prefix it would not have to prefill.
pub(super) fn conditional_decode_cost(logit: &Logit) -> f64 {
    (logit.decode_cost_blocks as f64 - logit.overlap_credit_blocks).max(0.0)
}

/// A rank's load for the formula, and whether it comes from a fresh sample carrying the
/// backlog of the rank's phase (prefill tokens for a prefill worker, decode blocks for a
/// worker that decodes). `None` when that backlog is unknown (see [`Standing::Unknown`]); the
/// other phase's field is added when a fresh sample carries it. A decode worker of a pair
/// (`handover`) receives the request after its prefill, so dispatches expected to end by
/// then do not count ([`RankBacklog::handover_decode_backlog`]), as in the load-only rule.
pub(super) fn rank_load(
    phase: Phase,
    sample: Option<&LoadSample>,
    dispatched: RankBacklog,
    handover: bool,
    max_staleness: Duration,
    now: Instant,
) -> (Option<RankLoad>, bool) {
    let standing = cost::standing(phase, sample, max_staleness, now);
    let backlog = match standing {
        Standing::Fresh(n) => n,
        Standing::Quiet => 0,
        Standing::Unknown => return (None, false),
    };
    let other_phase = match phase {
        Phase::Prefill => Phase::Decode,
        Phase::Decode => Phase::Prefill,
    };
    let other = cost::fresh_load(other_phase, sample, max_staleness, now);
    let fresh = matches!(standing, Standing::Fresh(_));
    // The prefill queue a fresh sample shows, if one does: it may count dispatches the fleet
    // counts too, which `prefill_backlog` takes out where the control plane measured them.
    let (prefill, decode) = match phase {
        Phase::Prefill => (fresh.then_some(backlog), other.unwrap_or(0)),
        Phase::Decode => (other, backlog),
    };
    let load = RankLoad {
        active_prefill_tokens: dispatched.prefill_backlog(prefill),
        active_decode_blocks: if handover {
            dispatched.handover_decode_backlog(decode)
        } else {
            dispatched.decode_backlog(decode)
        },
    };
    (Some(load), fresh)
}

/// One candidate as the choice rule sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Scored {
    /// The full formula; `None` when the rank's backlog is unknown.
    pub cost: Option<f64>,
    pub fresh: bool,
    /// It has a sample younger than `max_staleness`, whatever the sample carries.
    pub heard: bool,
    pub stalled: bool,
    /// The rank's KV memory cannot hold the request beside its backlog ([`over_capacity`]).
    pub full: bool,
    /// Overlap and request size alone, for when no rank is fresh.
    pub stale_cost: f64,
    pub last_dispatch: LastDispatch,
}

/// How the winner is drawn from the contenders (indices into the scored slice).
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Draw {
    /// The phase's cursor rotates among these.
    Rotate(Vec<usize>),
    /// Softmax sampling over these costs.
    Sample(Vec<(usize, f64)>),
}

/// The seed's selection rules over one phase's candidates.
///
/// When a rank has a fresh sample carrying its phase's backlog, the fresh and the quiet ranks
/// compete on the full formula and the others sit out; stalled ranks are passed over while a
/// healthy one competes, and full ranks while one with room does. Otherwise every rank
/// competes on overlap and request size, and the cursor rotates (`round_robin_stale`) only
/// among ties. Temperature 0 takes the lowest cost, ties (costs at most `tie` above it) going
/// to the ranks the fleet sent a dispatch longest ago and rotating among those; above 0 the
/// contenders are sampled.
///
/// At temperature 0 the rank the control plane suggested wins: a weighed suggestion whenever
/// its cost is within the suggestion's reach of the lowest, even where the rules' own ties are
/// narrower; a tie-break when it is among the ties left after the rules above, before the
/// rotation.
pub(super) fn contenders(
    scored: &[Scored],
    temperature: f64,
    tie: f64,
    suggestion: Option<Suggestion>,
) -> (Reason, Draw) {
    let sampling = temperature > 0.0;
    let (weighed, tie_break) = match suggestion.filter(|_| !sampling) {
        Some(Suggestion::Weighed { at, reach }) => (Some((at, reach)), None),
        Some(Suggestion::TieBreak(at)) => (None, Some(at)),
        None => (None, None),
    };
    // The tie-break, when it is among the ranks the rules left to rotate among.
    let broken = |among: Vec<usize>| match tie_break.filter(|at| among.contains(at)) {
        Some(at) => vec![at],
        None => among,
    };
    // As the load-only picker: costs decide once a rank is fresh and some rank has one.
    if scored.iter().any(|s| s.fresh) && scored.iter().any(|s| s.cost.is_some()) {
        let healthy_exists = scored.iter().any(|s| s.cost.is_some() && !s.stalled);
        let healthy = |s: &&Scored| !(s.stalled && healthy_exists);
        let room_exists = scored.iter().filter(healthy).any(|s| s.cost.is_some() && !s.full);
        let eligible: Vec<(usize, f64)> = scored
            .iter()
            .enumerate()
            .filter(|(_, s)| healthy(s) && !(s.full && room_exists))
            .filter_map(|(i, s)| s.cost.map(|cost| (i, cost)))
            .collect();
        if let Some(at) = weighed.and_then(|(at, reach)| within(&eligible, at, reach.formula)) {
            return (Reason::KvAware, Draw::Rotate(vec![at]));
        }
        let draw = match lowest_or_sampled(eligible, temperature, tie) {
            Draw::Rotate(ties) => Draw::Rotate(broken(longest_idle(ties, scored))),
            sampled => sampled,
        };
        return (Reason::KvAware, draw);
    }
    // Stalled ranks sit out while the load stream is alive, as in the load-only picker.
    let healthy_exists = scored.iter().any(|s| s.heard) && scored.iter().any(|s| !s.stalled);
    let all: Vec<(usize, f64)> = scored
        .iter()
        .enumerate()
        .filter(|(_, s)| !(s.stalled && healthy_exists))
        .map(|(i, s)| (i, s.stale_cost))
        .collect();
    if let Some(at) = weighed.and_then(|(at, reach)| within(&all, at, reach.stale)) {
        return (Reason::RoundRobinStale, Draw::Rotate(vec![at]));
    }
    let uniform = all.windows(2).all(|pair| matches!(pair, [(_, a), (_, b)] if a.total_cmp(b) == Ordering::Equal));
    if uniform {
        return (Reason::RoundRobinStale, Draw::Rotate(broken(all.iter().map(|(i, _)| *i).collect())));
    }
    match lowest_or_sampled(all, temperature, TIE_TOLERANCE) {
        Draw::Rotate(ties) if ties.len() > 1 => (Reason::RoundRobinStale, Draw::Rotate(broken(ties))),
        draw => (Reason::KvAware, draw),
    }
}

/// A rank the control plane suggested, as an index into the scored ranks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Suggestion {
    /// Taken when its cost is within `reach` of the lowest.
    Weighed { at: usize, reach: Reach },
    /// Taken among the ties the rules leave.
    TieBreak(usize),
}

impl Suggestion {
    pub fn at(self) -> usize {
        match self {
            Suggestion::Weighed { at, .. } | Suggestion::TieBreak(at) => at,
        }
    }
}

/// How far a replica's costs can be behind the control plane's weighing: what the prompt
/// tokens its recent lookups reserved add to a rank's cost. Those lookups' picks are the ones
/// this replica may not count yet (`RecentLookups` in the control plane says why), so a
/// suggestion within that much of the cheapest may well be the cheapest. Half a block more
/// covers prompts a few tokens apart. With a prefix cached anywhere, only a tie: the control
/// plane weighs load, not caches, and a cached prefix is never traded for a suggestion.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Reach {
    /// On the full formula: the tokens' prefill, scaled, and their decode blocks.
    pub formula: f64,
    /// On the stale cost: the tokens, in blocks.
    pub stale: f64,
}

impl Reach {
    pub fn of(reserved_tokens: u64, prompt: Prompt, weights: &Weights, any_overlap: bool) -> Self {
        if any_overlap {
            return Self { formula: TIE_TOLERANCE, stale: TIE_TOLERANCE };
        }
        let blocks = reserved_tokens as f64 / prompt.block_size as f64 + TIE_TOLERANCE;
        Self { formula: (weights.prefill_load_scale + 1.0) * blocks, stale: blocks }
    }
}

/// Costs at most this far above the lowest tie with it. Costs count KV blocks, and the queues
/// they weigh are estimates (the prefill under way is interpolated from the time it has run),
/// so half a block is no difference the formula can resolve. The pick log of a burst through
/// two replicas showed both taking the same worker because it was one token of queued prefill
/// ahead (6,090 against 6,091): as a tie, the lookups' fleet-wide turns split it.
pub(super) const TIE_TOLERANCE: f64 = 0.5;

/// How far above the lowest cost a rank ties with it. With nothing to reuse on any rank, the
/// formula is a load-only cost and ties are one request wide, as the load-only picker's
/// (`cost::contenders` says why); else [`TIE_TOLERANCE`], so that a rank's cached prefix is
/// never traded for a rotation.
pub(super) fn tie_width(prompt: Prompt, any_overlap: bool) -> f64 {
    if any_overlap { TIE_TOLERANCE } else { (prompt.blocks() as f64).max(TIE_TOLERANCE) }
}

/// Of `ties`, those the fleet sent a dispatch longest ago (see `cost::contenders`).
fn longest_idle(ties: Vec<usize>, scored: &[Scored]) -> Vec<usize> {
    LastDispatch::longest_idle(ties.iter().filter_map(|&i| Some((i, scored.get(i)?.last_dispatch)))).into_vec()
}

/// `at`, when it is among `entries` with a cost at most `tie` above the lowest.
fn within(entries: &[(usize, f64)], at: usize, tie: f64) -> Option<usize> {
    let best = entries.iter().map(|(_, cost)| *cost).min_by(f64::total_cmp)?;
    let (_, cost) = entries.iter().find(|(i, _)| *i == at)?;
    (cost.total_cmp(&(best + tie)) != Ordering::Greater).then_some(at)
}

fn lowest_or_sampled(entries: Vec<(usize, f64)>, temperature: f64, tie: f64) -> Draw {
    if temperature > 0.0 && entries.len() > 1 {
        return Draw::Sample(entries);
    }
    let Some(best) = entries.iter().map(|(_, cost)| *cost).min_by(f64::total_cmp) else {
        return Draw::Rotate(Vec::new());
    };
    let ties = entries.iter().filter(|(_, cost)| cost.total_cmp(&(best + tie)) != Ordering::Greater);
    Draw::Rotate(ties.map(|(i, _)| *i).collect())
}

/// Upstream's `softmax_sample_index` normalisation: costs are rescaled to `[0, 1]` by their
/// range before dividing by the temperature, so the temperature means the same for any
/// fleet size or load. Weights are `exp(-(cost - min) / ((max - min) * temperature))`; equal
/// (or non-finite-range) costs are equally likely. `sample` is a uniform draw in `[0, 1)`.
/// Returns an index into `costs` (0 when empty).
pub(super) fn softmax_sample_index(costs: &[f64], temperature: f64, sample: f64) -> usize {
    let (lo, hi) = costs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), c| (lo.min(*c), hi.max(*c)));
    let (range, scale) = (hi - lo, (hi - lo) * temperature);
    let weights: Vec<f64> = if !(range > 0.0 && range.is_finite() && temperature > 0.0) {
        vec![1.0; costs.len()]
    } else if scale > 0.0 {
        costs.iter().map(|c| (-(c - lo) / scale).exp()).collect()
    } else {
        // A temperature so small that the scale underflows: the lowest cost, as at zero (the
        // lowest's weight would be 0/0 otherwise, and the draw fall to the last index).
        costs.iter().map(|c| if *c == lo { 1.0 } else { 0.0 }).collect()
    };
    let total: f64 = weights.iter().sum();
    let target = sample.clamp(0.0, 1.0) * total;
    let mut cumulative = 0.0;
    for (i, weight) in weights.iter().enumerate() {
        cumulative += weight;
        if target < cumulative {
            return i;
        }
    }
    costs.len().saturating_sub(1)
}

/// Upstream's `IslBoundingPolicy`: the decode worker prefills the request itself when the
/// tokens it does not hold are both few (< [`CONDITIONAL_EFF_ISL_THRESHOLD`]) and a small part
/// of the prompt (< [`CONDITIONAL_EFF_ISL_RATIO_THRESHOLD`]).
pub(super) fn prefill_locally(prompt: Prompt, decode_overlap_blocks: u32) -> bool {
    let cached = u64::from(decode_overlap_blocks).saturating_mul(prompt.block_size);
    let uncached = prompt.isl.saturating_sub(cached);
    let ratio = uncached as f64 / prompt.isl.max(1) as f64;
    uncached < CONDITIONAL_EFF_ISL_THRESHOLD && ratio < CONDITIONAL_EFF_ISL_RATIO_THRESHOLD
}

/// The `decode_busy_threshold` veto: with a threshold, the decode worker's projected decode
/// blocks (its backlog, the fleet's dispatches and this request's uncached blocks) must
/// be at or below `threshold * total_kv_blocks`; without a fresh sample or a capacity the
/// answer is no. Without a threshold there is nothing to veto.
pub(super) fn decode_has_room(
    threshold: Option<f64>,
    projected_blocks: Option<u64>,
    total_kv_blocks: Option<u64>,
) -> bool {
    let Some(threshold) = threshold else {
        return true;
    };
    match (projected_blocks, total_kv_blocks.filter(|n| *n > 0)) {
        (Some(projected), Some(total)) => projected as f64 <= threshold * total as f64,
        _ => false,
    }
}

#[cfg(test)]
mod tests;
