//! The KV-aware picker: the load-based picker's rank states, ledger, cursors and counters,
//! with the seed's overlap-credited formula choosing the worker that prefills the request.
//!
//! Which ranks prefill: in a namespace that pairs prefill and decode workers, its prefill
//! ranks; in any other namespace, its decode candidates (aggregated workers, or decode
//! workers without a prefill pool), which prefill their own requests. All of them compete on
//! the formula together (graph-local: prefill workers only where a decode worker can take
//! the hand-over). A prefill winner's decode worker is then chosen within its namespace by the
//! decode term less the overlap credit: a decode worker keeps the KV it receives in its prefix
//! cache, and the dispatch report credits the prompt's chain to it as to any pinned rank, so
//! requests sharing a prompt find their decode worker again, as Dynamo's router sends them
//! (the seed's load-only rule here left half the fleet's decode hits unused; docs/kv.md).
//! Under conditional disaggregation the decode worker may then prefill the request itself (a
//! bypass).
//!
//! Without a KV term ([`KvTerm::Unavailable`]) the load-based picker decides alone. Every
//! selection counts one `continuum_dynamo_kv_selection_total{result}`.

mod formula;
mod term;

use std::collections::BTreeSet;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use continuum_proto::model::Role;
use continuum_proto::view::FleetView;
use prometheus::IntCounterVec;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use self::formula::{Draw, Logit, Prompt, Scored, Weights};
pub use self::term::{IndexAnswer, KvSelectionResult, KvTerm, Overlaps, RankOverlap, Suggested};
use super::candidates::{Candidate, Pools};
use super::cost::Phase;
use super::ledger::DispatchLedger;
use super::load_based::{DECODE, LoadBasedPicker, PREFILL};
use super::{PickRequest, Picker, Reason, Selection};

/// Distinguishes the KV competitions' cursors from the load-based picker's.
const KV_CURSOR: &str = "kv";

#[derive(Debug)]
pub struct KvAwarePicker {
    load: LoadBasedPicker,
    /// `continuum_dynamo_kv_selection_total{result}`.
    kv_selections: IntCounterVec,
    /// Draws for softmax sampling above temperature 0.
    rng: Mutex<StdRng>,
}

/// One rank chosen by a KV competition.
struct Chosen<'c> {
    candidate: &'c Candidate,
    reason: Reason,
    /// The rank's full formula; `None` when its backlog was unknown.
    logit: Option<Logit>,
    /// The rank's backlog came from a fresh sample.
    fresh: bool,
    /// How many contenders it was chosen among by rotation (1 when sampled).
    rotated_among: usize,
}

/// What every rank of one request is scored against.
#[derive(Clone, Copy)]
struct Scoring<'a> {
    view: &'a FleetView,
    prompt: Prompt,
    block_size: u32,
    overlaps: &'a Overlaps,
    weights: Weights,
    /// The lookup's fleet-wide turn, when the control plane numbered it.
    turn: Option<u64>,
    now: Instant,
}

impl Scoring<'_> {
    /// The prompt in the rank's own blocks: its backlog and capacity are counted in them, and
    /// a model may be served in two block sizes (the lookup's is the majority's).
    fn prompt_for(&self, candidate: &Candidate) -> Prompt {
        Prompt::new(self.prompt.isl, candidate.worker.block_size.unwrap_or(self.block_size))
    }

    /// The rank's overlap; a rank whose card declares another block size cannot have matched
    /// hashes of this one.
    fn overlap(&self, candidate: &Candidate) -> u32 {
        if candidate.worker.block_size.is_some_and(|size| size != self.block_size) {
            return 0;
        }
        self.overlaps.get(candidate.worker.key.instance_id, candidate.rank)
    }

    /// The prompt tokens the rank holds: its overlap, in this lookup's block size.
    fn cached_tokens(&self, candidate: &Candidate) -> u64 {
        u64::from(self.overlap(candidate)) * u64::from(self.block_size)
    }

    /// Of the rank's overlap, the blocks its requests in flight hold.
    fn active_overlap(&self, candidate: &Candidate) -> u32 {
        if candidate.worker.block_size.is_some_and(|size| size != self.block_size) {
            return 0;
        }
        self.overlaps.active(candidate.worker.key.instance_id, candidate.rank)
    }
}

impl KvAwarePicker {
    /// `selections` must have the labels `role` and `reason`, `kv_selections` the label
    /// `result` (see `Metrics::selections` and `Metrics::kv_selections`).
    pub fn new(ledger: Arc<DispatchLedger>, selections: IntCounterVec, kv_selections: IntCounterVec) -> Self {
        Self { load: LoadBasedPicker::new(ledger, selections), kv_selections, rng: Mutex::new(StdRng::from_os_rng()) }
    }

    /// The same picker with reproducible picks (tests): a seeded sampling sequence, and ties
    /// rotating from the first contender.
    #[cfg(test)]
    pub fn with_seed(self, seed: u64) -> Self {
        Self { load: self.load.from_first_contender(), rng: Mutex::new(StdRng::seed_from_u64(seed)), ..self }
    }

    /// The ledger the dispatch phase records this picker's pins in.
    #[cfg(test)]
    pub fn ledger(&self) -> &Arc<DispatchLedger> {
        self.load.ledger()
    }

    /// The ranks (instance id, dp rank) that would prefill `request`, for the lookup to name
    /// so the control plane can suggest one of them.
    pub fn prefill_contenders(&self, view: &FleetView, request: &PickRequest<'_>, now: Instant) -> Vec<(u64, u32)> {
        let pools = self.load.pools(view, request, now);
        prefilling(&pools).iter().map(|c| (c.worker.key.instance_id, c.rank)).collect()
    }

    /// Chooses the workers for `request`, or `None` when no routable worker serves the model.
    /// `request.prompt_tokens` is used only without a KV term; with one, `isl_tokens` is.
    pub fn pick(&self, view: &FleetView, request: &PickRequest<'_>, kv: KvTerm<'_>, now: Instant) -> Option<Selection> {
        let (isl_tokens, block_size, overlaps, answer) = match kv {
            KvTerm::Scored { isl_tokens, block_size, overlaps, answer } => (isl_tokens, block_size, overlaps, answer),
            KvTerm::Unavailable(result) => {
                let selection = self.load.pick(view, request, now)?;
                self.count_result(result);
                return Some(selection);
            }
        };
        let scoring = Scoring {
            view,
            prompt: Prompt::new(isl_tokens, block_size),
            block_size,
            overlaps,
            weights: Weights::new(&view.config().picker),
            turn: answer.turn(),
            now,
        };
        let request = PickRequest { prompt_tokens: isl_tokens, ..*request };
        let pools = self.load.pools(view, &request, now);
        let prefilling = prefilling(&pools);
        let cursor = (KV_CURSOR, Phase::Prefill, request.model);
        let suggested = answer.suggestion();
        let winner = self.compete(&scoring, &prefilling, cursor, suggested, |logit| logit.cost)?;
        let overlap = match answer {
            IndexAnswer::Answered { .. } => overlap_result(scoring.overlap(winner.candidate)),
            IndexAnswer::Recent => KvSelectionResult::IndexRecent,
            IndexAnswer::Missed(result) => result,
        };
        if winner.candidate.worker.role != Role::Prefill {
            let selection = Selection {
                namespace: Arc::clone(&winner.candidate.worker.key.namespace),
                model: request.model.to_string(),
                decode: winner.candidate.pin(),
                prefill: None,
                decode_reason: winner.reason,
                prefill_reason: Reason::NoPrefillPool,
                cached_tokens: scoring.cached_tokens(winner.candidate),
            };
            return Some(self.finish(selection, overlap));
        }
        let selection = self.pair(&scoring, &pools, &winner, &request)?;
        let bypassed = selection.prefill_reason == Reason::ConditionalBypass;
        Some(self.finish(selection, if bypassed { KvSelectionResult::Bypass } else { overlap }))
    }

    /// The decode worker for a prefill winner, within its namespace, by the decode term less
    /// the overlap credit; under conditional disaggregation possibly prefilling the request
    /// itself (a bypass: no prefill pin, reason `ConditionalBypass`).
    fn pair(
        &self,
        scoring: &Scoring<'_>,
        pools: &Pools,
        prefill: &Chosen<'_>,
        request: &PickRequest<'_>,
    ) -> Option<Selection> {
        let namespace = &prefill.candidate.worker.key.namespace;
        let decoders: Vec<Candidate> =
            pools.decode.iter().filter(|c| c.worker.key.namespace == *namespace).cloned().collect();
        let selection = |decode: &Candidate, decode_reason| Selection {
            namespace: Arc::clone(namespace),
            model: request.model.to_string(),
            decode: decode.pin(),
            prefill: Some(prefill.candidate.pin()),
            decode_reason,
            prefill_reason: prefill.reason,
            cached_tokens: scoring.cached_tokens(prefill.candidate),
        };
        let cursor = (KV_CURSOR, Phase::Decode, request.model, &**namespace);
        // The prefill tie took the turn modulo its contenders; the decode tie takes what is
        // left of it, so that over consecutive turns the pairs go through every combination.
        // Taken whole, the same turn would tie each prefill winner to one decode position:
        // with two namespaces of a prefill and two decode workers each, one decode worker of
        // each would never be chosen.
        let turn = scoring.turn.map(|turn| turn / prefill.rotated_among.max(1) as u64);
        let decode_scoring = Scoring { turn, ..*scoring };
        let decode = self.compete(&decode_scoring, &decoders, cursor, None, formula::conditional_decode_cost)?;
        if !scoring.view.config().picker.conditional_disaggregation || !self.bypasses(scoring, &decode) {
            return Some(selection(decode.candidate, decode.reason));
        }
        Some(Selection {
            prefill: None,
            prefill_reason: Reason::ConditionalBypass,
            cached_tokens: scoring.cached_tokens(decode.candidate),
            ..selection(decode.candidate, Reason::ConditionalBypass)
        })
    }

    /// One of `candidates` by the seed's rules, each rank's formula reduced to a cost by `cost`;
    /// the `suggested` rank (instance id, dp rank) wins a tie as `formula::contenders` says.
    fn compete<'c>(
        &self,
        scoring: &Scoring<'_>,
        candidates: &'c [Candidate],
        cursor: impl Hash,
        suggested: Option<Suggested>,
        cost: impl Fn(&Logit) -> f64,
    ) -> Option<Chosen<'c>> {
        let max_staleness = scoring.view.config().picker.max_staleness;
        let ranks = self.load.ranks(scoring.view, candidates, scoring.now);
        // Prefill workers beside ranks that serve alone compete for the prefill: every rank is
        // judged on its prefill backlog then, so that with none fresh (dynamo.vllm publishes
        // none) all compete on overlap and size, as the seed says, and an aggregated rank's
        // fresh decode sample does not put the prefill workers out of the competition.
        let prefills = |c: &Candidate| c.worker.role == Role::Prefill;
        let mixed = candidates.iter().any(prefills) && !candidates.iter().all(prefills);
        let rated: Vec<(Option<Logit>, Scored)> = candidates
            .iter()
            .zip(ranks)
            .map(|(candidate, rank)| {
                let phase = if prefills(candidate) || mixed { Phase::Prefill } else { Phase::Decode };
                let handover = candidate.hands_over;
                let (load, fresh) =
                    formula::rank_load(phase, rank.sample, rank.dispatched, handover, max_staleness, scoring.now);
                let overlap = scoring.overlap(candidate);
                let active = scoring.active_overlap(candidate);
                let prompt = scoring.prompt_for(candidate);
                let logit = load.map(|load| formula::worker_logit(load, overlap, active, prompt, &scoring.weights));
                let stale_cost = formula::stale_cost(
                    overlap,
                    rank.dispatched.queued_prefill_tokens(),
                    scoring.prompt,
                    &scoring.weights,
                );
                // A prefill worker holds a prompt's KV only until the hand-over.
                let full = !prefills(candidate)
                    && formula::over_capacity(logit.as_ref(), candidate.worker.capacity.total_kv_blocks);
                let scored = Scored {
                    cost: logit.as_ref().map(&cost),
                    fresh,
                    heard: rank.sample.is_some_and(|sample| sample.age(scoring.now) < max_staleness),
                    stalled: rank.dispatched.stalled,
                    full,
                    stale_cost,
                    last_dispatch: rank.dispatched.last_dispatch,
                };
                (logit, scored)
            })
            .collect();
        let scored: Vec<Scored> = rated.iter().map(|(_, scored)| *scored).collect();
        let any_overlap = candidates.iter().any(|candidate| scoring.overlap(candidate) > 0);
        let tie = formula::tie_width(scoring.prompt, any_overlap);
        let suggestion = suggested.and_then(|suggested| {
            let (id, rank) = suggested.rank();
            let at = candidates.iter().position(|c| c.worker.key.instance_id == id && c.rank == rank)?;
            Some(match suggested {
                Suggested::Weighed { reserved_tokens, .. } => {
                    let reach = formula::Reach::of(reserved_tokens, scoring.prompt, &scoring.weights, any_overlap);
                    formula::Suggestion::Weighed { at, reach }
                }
                Suggested::TieBreak(_) => formula::Suggestion::TieBreak(at),
            })
        });
        let (reason, draw) = formula::contenders(&scored, scoring.weights.temperature, tie, suggestion);
        let (index, rotated_among) = match draw {
            Draw::Rotate(among) if among.is_empty() => return None,
            Draw::Rotate(among) => (among.get(self.rotation(scoring.turn, cursor, among.len())).copied()?, among.len()),
            Draw::Sample(entries) => {
                let costs: Vec<f64> = entries.iter().map(|(_, cost)| *cost).collect();
                let at = formula::softmax_sample_index(&costs, scoring.weights.temperature, self.draw());
                (entries.get(at).map(|(i, _)| *i)?, 1)
            }
        };
        if tracing::enabled!(tracing::Level::DEBUG) {
            explain(candidates, &rated, index, suggestion.map(formula::Suggestion::at));
        }
        let (logit, scored) = rated.get(index)?;
        Some(Chosen { candidate: candidates.get(index)?, reason, logit: *logit, fresh: scored.fresh, rotated_among })
    }

    /// Where among `len` tied contenders the rotation stands. With the lookup's fleet-wide turn,
    /// at the turn: picks through different replicas that see the same tie at once (each
    /// without the other's pick yet) take consecutive turns, so they split as one process's
    /// round-robin would, where cursors of their own agree as often as not. Without one (a
    /// recent answer or none), at the replica's cursor for the phase.
    fn rotation(&self, turn: Option<u64>, cursor: impl Hash, len: usize) -> usize {
        match turn {
            // The remainder is below `len`, so it fits.
            Some(turn) => usize::try_from(turn % len.max(1) as u64).unwrap_or(0),
            None => self.load.advance(cursor) % len.max(1),
        }
    }

    /// Whether the chosen decode worker should prefill the request itself: the ISL bound on
    /// its own overlap, then the busy-threshold veto on its projected decode blocks.
    fn bypasses(&self, scoring: &Scoring<'_>, decode: &Chosen<'_>) -> bool {
        if !formula::prefill_locally(scoring.prompt, scoring.overlap(decode.candidate)) {
            return false;
        }
        let projected = decode.logit.filter(|_| decode.fresh).map(|logit| logit.decode_cost_blocks);
        let threshold = scoring.view.config().picker.decode_busy_threshold;
        formula::decode_has_room(threshold, projected, decode.candidate.worker.capacity.total_kv_blocks)
    }

    fn draw(&self) -> f64 {
        self.rng.lock().unwrap_or_else(PoisonError::into_inner).random::<f64>()
    }

    fn finish(&self, selection: Selection, result: KvSelectionResult) -> Selection {
        self.load.count(DECODE, selection.decode_reason);
        self.load.count(PREFILL, selection.prefill_reason);
        self.count_result(result);
        selection
    }

    fn count_result(&self, result: KvSelectionResult) {
        // A counter built with other labels only loses the count; selection goes on.
        if let Ok(counter) = self.kv_selections.get_metric_with_label_values(&[result.as_str()]) {
            counter.inc();
        }
    }
}

/// The ranks that would prefill the request: the prefill ranks of namespaces that pair prefill
/// with decode workers, and the decode candidates of every other namespace.
fn prefilling(pools: &Pools) -> Vec<Candidate> {
    let paired: BTreeSet<&Arc<str>> = pools
        .decode
        .iter()
        .filter(|c| c.worker.role == Role::Decode && pools.prefill.contains_key(&c.worker.key.namespace))
        .map(|c| &c.worker.key.namespace)
        .collect();
    let serving_alone = pools.decode.iter().filter(|c| !paired.contains(&c.worker.key.namespace)).cloned();
    let prefill = paired.iter().filter_map(|namespace| pools.prefill.get(*namespace)).flatten().cloned();
    serving_alone.chain(prefill).collect()
}

/// Logs one competition: each rank's formula terms, the winner (`*`) and the control plane's
/// suggestion (`^`), at debug level.
fn explain(candidates: &[Candidate], rated: &[(Option<Logit>, Scored)], winner: usize, suggested: Option<usize>) {
    use std::fmt::Write;
    let mut ranks = String::new();
    for (i, (candidate, (logit, scored))) in candidates.iter().zip(rated).enumerate() {
        let mark = match (i == winner, suggested == Some(i)) {
            (true, true) => "*^",
            (true, false) => "*",
            (false, true) => "^",
            (false, false) => "",
        };
        let _ = write!(ranks, " {mark}{}/{}", candidate.worker.key.instance_id, candidate.rank);
        let _ = match logit {
            Some(l) => write!(
                ranks,
                "[overlap {} in flight {} prefill {} decode {} cost {:.1} last {:?}{}{}]",
                l.overlap_blocks,
                l.shared_blocks,
                l.raw_prefill_tokens.saturating_sub(l.cached_tokens),
                l.decode_cost_blocks,
                l.cost,
                scored.last_dispatch,
                if scored.fresh { "" } else { " not fresh" },
                if scored.full { " full" } else { "" }
            ),
            None => write!(ranks, "[no fresh backlog: cost {:.1} last {:?}]", scored.stale_cost, scored.last_dispatch),
        };
    }
    tracing::debug!(target: "continuum_data_plane::routing::pick", "{ranks}");
}

fn overlap_result(overlap: u32) -> KvSelectionResult {
    if overlap > 0 { KvSelectionResult::Overlap } else { KvSelectionResult::NoOverlap }
}

#[cfg(test)]
mod tests;
