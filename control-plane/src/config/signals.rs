//! `dynamo.load`, `dynamo.shim` and `dynamo.kv`: how load signals are fetched, which shim
//! replicas requests are pinned through, and the KV-overlap-aware picker's knobs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::values::{Cidr, duration};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadConfig {
    /// How old a worker's last ActiveLoad sample may be and still count as fresh.
    #[serde(with = "duration")]
    pub max_staleness: Duration,
    /// Networks a direct-mode publisher may be dialled in; `None` allows any (the historical
    /// behaviour). Kept as text so every bad entry is reported at its index; see
    /// [`LoadConfig::allow_cidrs`].
    pub direct_allow_cidrs: Option<Vec<String>>,
    pub transport: LoadTransport,
}

impl Default for LoadConfig {
    fn default() -> Self {
        Self { max_staleness: Duration::from_secs(3), direct_allow_cidrs: None, transport: LoadTransport::Direct }
    }
}

impl LoadConfig {
    /// The parsed dial allow-list; `None` when unset. Entries that do not parse are left out
    /// (validation has already refused such a configuration).
    pub fn allow_cidrs(&self) -> Option<Vec<Cidr>> {
        let cidrs = self.direct_allow_cidrs.as_ref()?;
        Some(cidrs.iter().filter_map(|cidr| cidr.parse().ok()).collect())
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadTransport {
    /// Dial worker publishers' Pod IPs (in-cluster placement).
    #[default]
    Direct,
    /// Reach publishers through event-bus broker sessions.
    Broker,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ShimConfig {
    /// Names of `backends[]` that are direct-mode shim replicas (single namespace).
    pub backends: Vec<String>,
    /// One pool per Dynamo namespace, instead of `backends`.
    pub pools: Vec<ShimPoolConfig>,
    /// Client model id -> Dynamo display_name.
    pub model_map: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ShimPoolConfig {
    pub namespace: String,
    pub backends: Vec<String>,
}

/// `dynamo.kv.provisional_ttl` by default: a few times the usual dispatch-to-`stored`-event
/// delay (prefill of a long prompt plus the engine's event batch), short enough that a pin the
/// worker never honoured stops attracting requests quickly.
pub const DEFAULT_PROVISIONAL_TTL: Duration = Duration::from_secs(2);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvConfig {
    pub enabled: bool,
    pub allow_http_artifacts: bool,
    pub allow_hf_artifacts: bool,
    /// `blake3:<64 hex>` checksums of reviewed tokenizer and template artifacts.
    pub pinned_artifacts: Vec<String>,
    pub artifact_cache_dir: PathBuf,
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    pub router_temperature: f64,
    pub send_token_data: bool,
    /// How long a pinned request's prefix counts as held by the rank that prefills it, before
    /// that rank's kv-events confirm it; zero turns the provisional credit off (see
    /// `kv::provisional`).
    #[serde(with = "duration")]
    pub provisional_ttl: Duration,
    pub conditional_disaggregation: ConditionalDisaggregationConfig,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            allow_http_artifacts: true,
            allow_hf_artifacts: false,
            pinned_artifacts: Vec::new(),
            artifact_cache_dir: PathBuf::from("/var/cache/continuum/kv-artifacts"),
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            router_temperature: 0.0,
            send_token_data: false,
            provisional_ttl: DEFAULT_PROVISIONAL_TTL,
            conditional_disaggregation: ConditionalDisaggregationConfig::default(),
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ConditionalDisaggregationConfig {
    pub enabled: bool,
    /// Fraction of `total_kv_blocks` a decode worker may hold and still prefill locally.
    pub decode_busy_threshold: Option<f64>,
}
