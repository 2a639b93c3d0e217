//! Worker selection for a shim dispatch: which decode (or aggregated) worker rank serves a
//! request and, in a disaggregated namespace, which prefill worker rank hands it over.
//!
//! A picker reads one immutable [`FleetView`] and the replica's [`DispatchLedger`] of requests
//! it pinned since the workers' last load samples; it performs no I/O. The dispatch phase
//! records each pin in the ledger when it sends the request and ends it when the request ends.

mod candidates;
mod cost;
mod estimate;
mod kv_aware;
mod ledger;
mod load_based;
mod outliers;
mod sizing;

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use continuum_proto::model::{LoadKey, WorkerKey};
use continuum_proto::view::FleetView;

pub use estimate::PromptText;
pub use kv_aware::{IndexAnswer, KvAwarePicker, KvSelectionResult, KvTerm, Overlaps, RankOverlap, Suggested};
pub use ledger::{
    DispatchId, DispatchLedger, LEDGER_CAPACITY, LastDispatch, NOT_REPORTED, Op, PromptChain, RankBacklog, Recorded,
    ReplayedLeg, STALL_AFTER, STALL_MIN_BLOCKS, UNANSWERED_FOR, dispatch_block_size, pin_block_size, reported_blocks,
};
pub use load_based::LoadBasedPicker;
pub use outliers::{EJECT_AFTER, EJECTION, Outliers};
pub use sizing::{PromptSizes, usage_prompt_tokens};

/// A pick's per-candidate scratch list: pools hold a handful of ranks, so these stay inline
/// (a pick used to allocate a dozen of them as vectors) and spill to the heap past eight.
pub type Few<T> = smallvec::SmallVec<[T; 8]>;

/// One worker rank to pin.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Pin {
    pub worker: WorkerKey,
    /// `Some(rank)` exactly when the worker declares data parallelism (`dp_size > 0`); the
    /// rank header is sent then, 0 included.
    pub dp_rank: Option<u32>,
}

impl Pin {
    /// The (worker, rank) its load and backlog are kept under: its rank, or 0 for a worker
    /// without data parallelism (which Dynamo serves as rank 0). Report dispatches under it.
    pub fn rank_key(&self) -> LoadKey {
        LoadKey { worker: self.worker.clone(), dp_rank: self.dp_rank.unwrap_or(0) }
    }
}

/// How many [`Reason`]s there are.
pub const REASONS: usize = Reason::ALL.len();

/// Why a worker was chosen: the `reason` label of `continuum_dynamo_selection_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The lowest defined cost, ties rotating.
    Load,
    /// No candidate had a fresh sample carrying the phase's load: plain rotation.
    RoundRobinStale,
    /// No prefill worker: an aggregated decode winner, or a namespace without a prefill pool.
    NoPrefillPool,
    /// The KV-aware formula (overlap credit plus load) chose the worker.
    KvAware,
    /// Conditional disaggregation: the chosen decode worker prefills the request itself, so no
    /// prefill worker is pinned.
    ConditionalBypass,
}

impl Reason {
    pub const ALL: [Reason; 5] =
        [Reason::Load, Reason::RoundRobinStale, Reason::NoPrefillPool, Reason::KvAware, Reason::ConditionalBypass];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Load => "load",
            Reason::RoundRobinStale => "round_robin_stale",
            Reason::NoPrefillPool => "no_prefill_pool",
            Reason::KvAware => "kv_aware",
            Reason::ConditionalBypass => "conditional_bypass",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The workers one request is pinned to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// The namespace of both pins; its shim pool serves the request.
    pub namespace: Arc<str>,
    /// The Dynamo model name the workers serve (after the model map).
    pub model: String,
    pub decode: Pin,
    /// `None` for an aggregated decode worker or a namespace without prefill workers.
    pub prefill: Option<Pin>,
    pub decode_reason: Reason,
    /// Why `prefill` is what it is: `NoPrefillPool` when it is `None`, or `ConditionalBypass`
    /// when the decode worker prefills locally (`prefill` is `None` too).
    pub prefill_reason: Reason,
    /// Prompt tokens the rank that prefills already holds (its overlap, in the block size the
    /// KV lookup counted it in; KV-aware picks only): the prefill rank of a pair, or else the
    /// decode rank. It prefills only the rest.
    pub cached_tokens: u64,
}

impl Selection {
    /// The prompt tokens the rank that prefills must still compute: those past the ones it
    /// holds. Dynamo's router counts a request's prefill load the same way.
    pub fn uncached_prompt_tokens(&self, prompt_tokens: u64) -> u64 {
        prompt_tokens.saturating_sub(self.cached_tokens)
    }
}

/// What the picker needs to know about one request.
#[derive(Clone, Copy, Debug)]
pub struct PickRequest<'a> {
    /// The Dynamo display name, already mapped through the model map.
    pub model: &'a str,
    /// Estimated from the prompt fields ([`PromptText`]).
    pub prompt_tokens: u64,
    /// Namespaces with a usable shim replica; `None` means all.
    pub namespaces: Option<&'a [String]>,
}

/// Chooses the workers for a request, or `None` when no routable worker serves the model.
pub trait Picker: Send + Sync + fmt::Debug {
    fn pick(&self, view: &FleetView, request: &PickRequest<'_>, now: Instant) -> Option<Selection>;

    /// Whether some worker serving `model` in one of `namespaces` could be picked, whatever the
    /// load: a request for which none could is not worth a render and a lookup. A picker that
    /// cannot tell cheaply says it could.
    fn serves(&self, _view: &FleetView, _model: &str, _namespaces: &[String]) -> bool {
        true
    }
}

#[cfg(test)]
mod tests;
