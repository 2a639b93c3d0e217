//! Domain types of the fleet view: what a worker is, its load, and the configuration the data
//! plane needs. Both planes hold these; the wire types of `crate::pb` convert to and from them
//! only at the edge (`crate::convert`).

use std::collections::BTreeMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The smallest `kv_cache_block_size` the router hashes prompts for (a worker declaring another
/// is routed on load alone).
pub const MIN_BLOCK_SIZE: u32 = 16;
/// The largest `kv_cache_block_size` the router hashes prompts for.
pub const MAX_BLOCK_SIZE: u32 = 65_536;

/// A worker's identity across the fleet: its Dynamo namespace and instance id.
///
/// The instance id is the worker's etcd lease id. It is often above 2^53, so it is never
/// carried through an `f64` (JSON numbers in JavaScript, for instance).
///
/// Keys are compared, ordered and hashed on the request path (the views' ordered maps, the
/// ledger's hash maps), so all three start with the instance id: lease ids are random 64-bit
/// numbers, all but unique on their own, and the namespace is compared only when they match
/// (by pointer first: keys cloned from one worker share it). Maps of keys therefore iterate
/// in instance-id order, not grouped by namespace.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkerKey {
    pub namespace: Arc<str>,
    pub instance_id: u64,
}

impl PartialEq for WorkerKey {
    fn eq(&self, other: &Self) -> bool {
        self.instance_id == other.instance_id
            && (Arc::ptr_eq(&self.namespace, &other.namespace) || self.namespace == other.namespace)
    }
}

impl Eq for WorkerKey {}

impl Ord for WorkerKey {
    /// By instance id, then namespace: the fleet's ordered maps (workers, loads, backlogs)
    /// then settle almost every comparison on one integer instead of a string.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.instance_id.cmp(&other.instance_id).then_with(|| {
            if Arc::ptr_eq(&self.namespace, &other.namespace) {
                std::cmp::Ordering::Equal
            } else {
                self.namespace.cmp(&other.namespace)
            }
        })
    }
}

impl PartialOrd for WorkerKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Hash for WorkerKey {
    /// The instance id alone: equal keys have equal ids, and keys that differ only by
    /// namespace (the same lease id in two namespaces) merely share a bucket.
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.instance_id.hash(state);
    }
}

impl WorkerKey {
    pub fn new(namespace: impl Into<Arc<str>>, instance_id: u64) -> Self {
        Self { namespace: namespace.into(), instance_id }
    }
}

impl fmt::Display for WorkerKey {
    /// `namespace/hex`: the form Dynamo uses in etcd keys.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{:x}", self.namespace, self.instance_id)
    }
}

/// What a worker does in a disaggregated (or aggregated) Dynamo graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Prefill,
    Decode,
    Aggregated,
    /// An unrecognised `worker_type`: visible to operators, never routed to.
    Unknown,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Aggregated => "aggregated",
            Role::Unknown => "unknown",
        }
    }

    /// Whether a worker of this role makes its model servable: a decode or aggregated one, as
    /// dynamo.frontend lists models (prefill workers alone answer nothing).
    pub fn serves_model(self) -> bool {
        matches!(self, Role::Decode | Role::Aggregated)
    }
}

/// Capacities a worker's model card advertises; absent when the card does not say. Like
/// Dynamo's card, they are per data-parallel rank: a dp=2 worker with `total_kv_blocks: 24`
/// has 24 blocks on each rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Capacity {
    pub total_kv_blocks: Option<u64>,
    pub max_num_batched_tokens: Option<u64>,
    pub max_num_seqs: Option<u64>,
    pub context_length: Option<u64>,
}

/// One routable (or at least visible) worker: everything the pickers need.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Worker {
    pub key: WorkerKey,
    pub role: Role,
    pub model: String,
    pub component: String,
    pub endpoint: String,
    pub block_size: Option<u32>,
    pub capacity: Capacity,
    pub dp_start_rank: u32,
    /// 0 when the card declares no data parallelism; no rank header is sent then.
    pub dp_size: u32,
    pub disaggregated_endpoint: Option<String>,
    /// The card's tokenizer and template files; `None` when the card names none.
    pub artifacts: Option<Arc<ModelArtifacts>>,
}

/// A model card's CheckedFile: where a file is and the blake3 checksum it must have.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CheckedFile {
    /// A path, `file://`, `http(s)://` or `hf://` URI, as the card wrote it.
    pub uri: String,
    /// `blake3:<64 hex>`.
    pub checksum: String,
    pub size: u64,
}

/// The files a replica needs to render and tokenize prompts the way the workers do.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelArtifacts {
    /// `tokenizer.hf_tokenizer_json`.
    pub tokenizer: Option<CheckedFile>,
    /// `prompt_formatter.hf_tokenizer_config_json`: the chat template and special tokens.
    pub tokenizer_config: Option<CheckedFile>,
    /// `chat_template_file.*`, when the template lives in its own file.
    pub chat_template: Option<CheckedFile>,
    /// How the frontend shapes a request before the template sees it.
    pub defaults: PromptDefaults,
}

impl ModelArtifacts {
    /// Whether the card names any file to render with.
    pub fn has_files(&self) -> bool {
        self.tokenizer.is_some() || self.tokenizer_config.is_some() || self.chat_template.is_some()
    }
}

/// What a card's `runtime_config` asks the frontend to do to a request before its template
/// renders it; Dynamo's defaults when the card says nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PromptDefaults {
    /// `exclude_tools_when_tool_choice_none: false`: a body's tools reach the template even
    /// with `tool_choice: "none"`.
    pub keep_tools_when_tool_choice_none: bool,
    /// `runtime_data.default_thinking_mode`: the thinking switch for requests that set none.
    pub default_thinking: Option<bool>,
}

impl Worker {
    /// The dp ranks this worker serves: one candidate per rank, or rank 0 alone when it
    /// declares no data parallelism (a start rank without a size means nothing then: Dynamo
    /// serves it as rank 0, and pins it with no rank at all).
    pub fn dp_ranks(&self) -> std::ops::Range<u32> {
        if self.dp_size == 0 {
            return 0..1;
        }
        let start = self.dp_start_rank;
        start..start.saturating_add(self.dp_size)
    }

    /// Whether `dp_rank` is one of this worker's ranks.
    pub fn serves_rank(&self, dp_rank: u32) -> bool {
        self.dp_ranks().contains(&dp_rank)
    }
}

/// One (worker, dp rank): the unit that load samples and KV overlap are kept for.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct LoadKey {
    pub worker: WorkerKey,
    pub dp_rank: u32,
}

/// A worker rank's ActiveLoad as published; `None` where the publisher sent nil.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Load {
    pub active_decode_blocks: Option<u64>,
    pub active_prefill_tokens: Option<u64>,
    pub kv_used_blocks: Option<u64>,
}

impl Load {
    /// The decode backlog: `active_decode_blocks`, or `kv_used_blocks` when that is nil
    /// (dynamo.vllm and the mocker fill only the latter).
    pub fn decode_blocks(&self) -> Option<u64> {
        self.active_decode_blocks.or(self.kv_used_blocks)
    }

    /// Whether the sample reports a backlog in either phase, the seed's test of a worker that
    /// fell silent under load rather than idle. Blocks merely held in cache (`kv_used_blocks`
    /// beside an `active_decode_blocks` of zero) are no backlog.
    pub fn reports_backlog(&self) -> bool {
        self.active_prefill_tokens.is_some_and(|t| t > 0) || self.decode_blocks().is_some_and(|b| b > 0)
    }
}

/// A load sample and when it was received, so staleness can be judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadSample {
    pub load: Load,
    pub received_at: Instant,
}

impl LoadSample {
    pub fn age(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.received_at)
    }
}

/// Dispatches in flight on one rank, summed over every replica: prefill tokens of those no
/// load sample has answered yet, decode blocks of all until they end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Backlog {
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    pub dispatches: u32,
    /// Decode blocks the rank's last sample showed beyond the dispatches in flight when it
    /// arrived: load the fleet did not send. `None` without a sample carrying decode blocks.
    /// When present, a rank's decode backlog is this plus `decode_blocks`.
    pub foreign_decode_blocks: Option<u64>,
    /// Of `decode_blocks`, those of dispatches expected to end before a request dispatched
    /// now reaches the rank by hand-over from a prefill worker.
    pub ending_decode_blocks: u64,
    /// Of `prefill_tokens`, those the rank is expected to have prefilled already: its oldest
    /// dispatch awaiting a first token is part way through its prefill, and a request sent
    /// now waits only for the rest of it.
    pub prefilled_tokens: u64,
    /// The order, among every dispatch the control plane folded since it started, of the
    /// rank's newest: larger is more recent, 0 none.
    pub last_dispatch: u64,
    /// Prompt tokens the rank's last sample showed queued or prefilling beyond the fleet's
    /// dispatches awaiting their first token when it arrived. `None` without a sample carrying
    /// `active_prefill_tokens`. When present, a rank's prefill backlog is this plus the
    /// fleet's queued `prefill_tokens`: the sample's own count of them is not added again.
    pub foreign_prefill_tokens: Option<u64>,
    /// A dispatch of some replica has gone unanswered on the rank long enough to take it for
    /// stalled ([`crate::STALL_AFTER`]).
    pub stalled: bool,
}

/// A backlog with every field set, none to its default (tests).
#[cfg(test)]
pub(crate) fn every_field_backlog() -> Backlog {
    Backlog {
        prefill_tokens: 100,
        decode_blocks: 7,
        dispatches: 2,
        foreign_decode_blocks: Some(4),
        ending_decode_blocks: 3,
        prefilled_tokens: 60,
        last_dispatch: 9,
        foreign_prefill_tokens: Some(20),
        stalled: true,
    }
}

/// Which of one replica's reported operations the fleet-wide backlogs hold: `first_op`
/// through `last_op`. A replica numbers its operations (a dispatch recorded, its first token,
/// its end) in the order it performs them; those outside the range are its own to add.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReportsFolded {
    pub first_op: u64,
    pub last_op: u64,
}

/// An OpenAI-wire backend the data plane may dispatch to (a direct-mode shim replica).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Backend {
    pub name: String,
    pub url: String,
    pub models: Vec<String>,
}

/// The shim replicas that serve one Dynamo namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ShimPool {
    pub namespace: String,
    pub backends: Vec<String>,
}

/// Picker and staleness parameters.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PickerParams {
    pub max_staleness: Duration,
    pub kv_enabled: bool,
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    pub router_temperature: f64,
    pub send_token_data: bool,
    /// `kv.conditional_disaggregation.enabled`: a decode worker may prefill locally.
    pub conditional_disaggregation: bool,
    /// Fraction of `total_kv_blocks` a decode worker may hold and still prefill locally.
    pub decode_busy_threshold: Option<f64>,
}

impl Default for PickerParams {
    fn default() -> Self {
        Self {
            max_staleness: Duration::from_secs(3),
            kv_enabled: false,
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            router_temperature: 0.0,
            send_token_data: false,
            conditional_disaggregation: false,
            decode_busy_threshold: None,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DisaggregatedServing {
    pub enabled: bool,
    pub fallback_to_unified: bool,
}

/// The part of the control plane's configuration that the data plane needs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DataPlaneConfig {
    pub backends: Vec<Backend>,
    pub shim_pools: Vec<ShimPool>,
    pub model_map: BTreeMap<String, String>,
    pub picker: PickerParams,
    pub disaggregated_serving: DisaggregatedServing,
    pub kv_artifacts: KvArtifactPolicy,
}

/// `dynamo.kv`'s artifact policy: what a replica may fetch, cache and load.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvArtifactPolicy {
    /// Checksums (`blake3:<64 hex>`) the operator reviewed; nothing else is loaded.
    pub pinned: Vec<String>,
    pub allow_http: bool,
    pub allow_hf: bool,
    pub cache_dir: String,
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn worker_keys_compare_by_namespace_and_id_whatever_their_allocation() {
        let a = WorkerKey::new("dynamo", 7);
        assert_eq!(a, WorkerKey::new(String::from("dynamo"), 7), "equal content in another Arc");
        assert_ne!(a, WorkerKey::new("other", 7), "the same lease id in another namespace");
        assert_ne!(a, WorkerKey::new("dynamo", 8));
        let mut map = HashMap::new();
        map.insert(a.clone(), 1);
        map.insert(WorkerKey::new("other", 7), 2);
        map.insert(WorkerKey::new(String::from("dynamo"), 7), 3);
        assert_eq!(map.len(), 2, "keys sharing an id share a bucket, not an entry");
        assert_eq!(map[&a], 3);
        assert_eq!(map[&WorkerKey::new("other", 7)], 2);
    }

    #[test]
    fn worker_keys_order_by_instance_id_then_namespace() {
        assert!(WorkerKey::new("b", 1) < WorkerKey::new("a", 2));
        assert!(WorkerKey::new("a", 7) < WorkerKey::new("b", 7));
        assert_eq!(WorkerKey::new("a", 7).cmp(&WorkerKey::new(String::from("a"), 7)), std::cmp::Ordering::Equal);
    }
}
