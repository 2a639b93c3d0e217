//! Conversions between the `continuum.fleet.v1` wire types and the domain types, at the edge.
//!
//! Decoding is strict: anything a replica could not route with (a worker without a key, an
//! unspecified role, a delta without a body) is an error the replica NACKs, never a default.
//! Load sample ages travel as milliseconds and become receipt instants against `now`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::model::{
    Backend, Backlog, Capacity, CheckedFile, DataPlaneConfig, DisaggregatedServing, KvArtifactPolicy, Load, LoadKey,
    LoadSample, ModelArtifacts, PickerParams, PromptDefaults, ReportsFolded, Role, ShimPool, Worker, WorkerKey,
};
use crate::view::{ApplyError, FleetDelta, FleetView};
use crate::{MAX_DATA_PARALLEL_SIZE, MAX_STALENESS, pb};

/// Why a wire message cannot become a domain value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("{0} is missing")]
    Missing(&'static str),
    #[error("worker {0}: role is unspecified")]
    RoleUnspecified(WorkerKey),
    #[error("worker key has an empty namespace")]
    EmptyNamespace,
    #[error("invalid picker parameter {field}: {value}")]
    InvalidPicker { field: &'static str, value: String },
    #[error("worker {key}: {dp_size} data-parallel ranks, more than {MAX_DATA_PARALLEL_SIZE}")]
    TooManyRanks { key: WorkerKey, dp_size: u32 },
    #[error("worker {key}: {dp_size} data-parallel ranks from {dp_start_rank} run past the last rank number")]
    RanksOutOfRange { key: WorkerKey, dp_start_rank: u32, dp_size: u32 },
    #[error(transparent)]
    Apply(#[from] ApplyError),
}

/// A decoded `FleetUpdate` body.
#[derive(Debug)]
pub enum Update {
    Snapshot(FleetView),
    Delta(FleetDelta),
}

impl TryFrom<pb::WorkerKey> for WorkerKey {
    type Error = DecodeError;

    fn try_from(key: pb::WorkerKey) -> Result<Self, DecodeError> {
        if key.namespace.is_empty() {
            return Err(DecodeError::EmptyNamespace);
        }
        Ok(WorkerKey::new(key.namespace, key.instance_id))
    }
}

impl From<&WorkerKey> for pb::WorkerKey {
    fn from(key: &WorkerKey) -> Self {
        pb::WorkerKey { namespace: key.namespace.to_string(), instance_id: key.instance_id }
    }
}

fn role_from_wire(role: i32, key: &WorkerKey) -> Result<Role, DecodeError> {
    match pb::Role::try_from(role) {
        Ok(pb::Role::Prefill) => Ok(Role::Prefill),
        Ok(pb::Role::Decode) => Ok(Role::Decode),
        Ok(pb::Role::Aggregated) => Ok(Role::Aggregated),
        // A role from a newer control plane is unknown to this replica: visible, never routed.
        Ok(pb::Role::Unknown) | Err(_) => Ok(Role::Unknown),
        Ok(pb::Role::Unspecified) => Err(DecodeError::RoleUnspecified(key.clone())),
    }
}

fn role_to_wire(role: Role) -> pb::Role {
    match role {
        Role::Prefill => pb::Role::Prefill,
        Role::Decode => pb::Role::Decode,
        Role::Aggregated => pb::Role::Aggregated,
        Role::Unknown => pb::Role::Unknown,
    }
}

impl TryFrom<pb::Worker> for Worker {
    type Error = DecodeError;

    fn try_from(worker: pb::Worker) -> Result<Self, DecodeError> {
        let key = WorkerKey::try_from(worker.key.ok_or(DecodeError::Missing("worker.key"))?)?;
        if worker.dp_size > MAX_DATA_PARALLEL_SIZE {
            return Err(DecodeError::TooManyRanks { key, dp_size: worker.dp_size });
        }
        if worker.dp_start_rank.checked_add(worker.dp_size.max(1)).is_none() {
            let (dp_start_rank, dp_size) = (worker.dp_start_rank, worker.dp_size);
            return Err(DecodeError::RanksOutOfRange { key, dp_start_rank, dp_size });
        }
        let capacity = worker.capacity.unwrap_or_default();
        Ok(Worker {
            role: role_from_wire(worker.role, &key)?,
            key,
            model: worker.model,
            component: worker.component,
            endpoint: worker.endpoint,
            block_size: worker.block_size,
            capacity: Capacity {
                total_kv_blocks: capacity.total_kv_blocks,
                max_num_batched_tokens: capacity.max_num_batched_tokens,
                max_num_seqs: capacity.max_num_seqs,
                context_length: capacity.context_length,
            },
            dp_start_rank: worker.dp_start_rank,
            dp_size: worker.dp_size,
            disaggregated_endpoint: worker.disaggregated_endpoint,
            artifacts: worker.artifacts.map(|a| Arc::new(artifacts_from_wire(a))),
        })
    }
}

impl From<&Worker> for pb::Worker {
    fn from(worker: &Worker) -> Self {
        let c = worker.capacity;
        pb::Worker {
            key: Some((&worker.key).into()),
            role: role_to_wire(worker.role).into(),
            model: worker.model.clone(),
            component: worker.component.clone(),
            endpoint: worker.endpoint.clone(),
            block_size: worker.block_size,
            capacity: Some(pb::Capacity {
                total_kv_blocks: c.total_kv_blocks,
                max_num_batched_tokens: c.max_num_batched_tokens,
                max_num_seqs: c.max_num_seqs,
                context_length: c.context_length,
            }),
            dp_start_rank: worker.dp_start_rank,
            dp_size: worker.dp_size,
            // Never sent: for an SGLang prefill worker it is its bootstrap host and port, an
            // internal address, and no replica reads it (the admin API shows its path only).
            disaggregated_endpoint: None,
            artifacts: worker.artifacts.as_deref().map(artifacts_to_wire),
        }
    }
}

fn artifacts_from_wire(a: pb::ModelArtifacts) -> ModelArtifacts {
    let file = |f: pb::CheckedFile| CheckedFile { uri: f.uri, checksum: f.checksum, size: f.size };
    ModelArtifacts {
        tokenizer: a.tokenizer.map(file),
        tokenizer_config: a.tokenizer_config.map(file),
        chat_template: a.chat_template.map(file),
        defaults: PromptDefaults {
            keep_tools_when_tool_choice_none: a.keep_tools_when_tool_choice_none,
            default_thinking: a.default_thinking,
        },
    }
}

fn artifacts_to_wire(a: &ModelArtifacts) -> pb::ModelArtifacts {
    let file = |f: &CheckedFile| pb::CheckedFile { uri: f.uri.clone(), checksum: f.checksum.clone(), size: f.size };
    pb::ModelArtifacts {
        tokenizer: a.tokenizer.as_ref().map(file),
        tokenizer_config: a.tokenizer_config.as_ref().map(file),
        chat_template: a.chat_template.as_ref().map(file),
        keep_tools_when_tool_choice_none: a.defaults.keep_tools_when_tool_choice_none,
        default_thinking: a.defaults.default_thinking,
    }
}

impl TryFrom<pb::LoadKey> for LoadKey {
    type Error = DecodeError;

    fn try_from(key: pb::LoadKey) -> Result<Self, DecodeError> {
        let worker = WorkerKey::try_from(key.worker.ok_or(DecodeError::Missing("load_key.worker"))?)?;
        Ok(LoadKey { worker, dp_rank: key.dp_rank })
    }
}

impl From<&LoadKey> for pb::LoadKey {
    fn from(key: &LoadKey) -> Self {
        pb::LoadKey { worker: Some((&key.worker).into()), dp_rank: key.dp_rank }
    }
}

fn load_from_wire(sample: pb::LoadSample, now: Instant) -> Result<(LoadKey, LoadSample), DecodeError> {
    let key = LoadKey::try_from(sample.key.ok_or(DecodeError::Missing("load_sample.key"))?)?;
    let load = Load {
        active_decode_blocks: sample.active_decode_blocks,
        active_prefill_tokens: sample.active_prefill_tokens,
        kv_used_blocks: sample.kv_used_blocks,
    };
    let received_at = instant_before(now, Duration::from_millis(sample.age_ms));
    Ok((key, LoadSample { load, received_at }))
}

/// Samples older than this are stale under any `max_staleness` (at most 5 minutes), so a
/// larger age carries no more meaning.
const MAX_MEANINGFUL_AGE: Duration = Duration::from_secs(3600);

/// `now - age`, clamped so that a monotonic clock that started recently (shortly after boot)
/// still yields the oldest instant it can represent instead of panicking.
fn instant_before(now: Instant, age: Duration) -> Instant {
    let mut age = age.min(MAX_MEANINGFUL_AGE);
    loop {
        match now.checked_sub(age) {
            Some(instant) => return instant,
            None if age.is_zero() => return now,
            None => age /= 2,
        }
    }
}

fn load_to_wire(key: &LoadKey, sample: &LoadSample, now: Instant) -> pb::LoadSample {
    pb::LoadSample {
        key: Some(key.into()),
        active_decode_blocks: sample.load.active_decode_blocks,
        active_prefill_tokens: sample.load.active_prefill_tokens,
        kv_used_blocks: sample.load.kv_used_blocks,
        age_ms: u64::try_from(sample.age(now).as_millis()).unwrap_or(u64::MAX),
    }
}

impl TryFrom<pb::DataPlaneConfig> for DataPlaneConfig {
    type Error = DecodeError;

    fn try_from(config: pb::DataPlaneConfig) -> Result<Self, DecodeError> {
        let picker = config.picker.unwrap_or_default();
        for (field, value) in [
            ("overlap_score_credit", picker.overlap_score_credit),
            ("prefill_load_scale", picker.prefill_load_scale),
            ("router_temperature", picker.router_temperature),
        ] {
            if !value.is_finite() || value < 0.0 {
                return Err(DecodeError::InvalidPicker { field, value: value.to_string() });
            }
        }
        if let Some(threshold) = picker.decode_busy_threshold
            && (!threshold.is_finite() || threshold < 0.0)
        {
            return Err(DecodeError::InvalidPicker { field: "decode_busy_threshold", value: threshold.to_string() });
        }
        let staleness = Duration::from_millis(picker.max_staleness_ms);
        if staleness.is_zero() || staleness > MAX_STALENESS {
            let value = picker.max_staleness_ms.to_string();
            return Err(DecodeError::InvalidPicker { field: "max_staleness_ms", value });
        }
        let disagg = config.disaggregated_serving.unwrap_or_default();
        let kv = config.kv_artifacts.unwrap_or_default();
        Ok(DataPlaneConfig {
            backends: config
                .backends
                .into_iter()
                .map(|b| Backend { name: b.name, url: b.url, models: b.models })
                .collect(),
            shim_pools: config
                .shim_pools
                .into_iter()
                .map(|p| ShimPool { namespace: p.namespace, backends: p.backends })
                .collect(),
            model_map: config.model_map.into_iter().collect(),
            picker: PickerParams {
                max_staleness: Duration::from_millis(picker.max_staleness_ms),
                kv_enabled: picker.kv_enabled,
                overlap_score_credit: picker.overlap_score_credit,
                prefill_load_scale: picker.prefill_load_scale,
                router_temperature: picker.router_temperature,
                send_token_data: picker.send_token_data,
                conditional_disaggregation: picker.conditional_disaggregation,
                decode_busy_threshold: picker.decode_busy_threshold,
            },
            disaggregated_serving: DisaggregatedServing {
                enabled: disagg.enabled,
                fallback_to_unified: disagg.fallback_to_unified,
            },
            kv_artifacts: KvArtifactPolicy {
                pinned: kv.pinned,
                allow_http: kv.allow_http,
                allow_hf: kv.allow_hf,
                cache_dir: kv.cache_dir,
            },
        })
    }
}

impl From<&DataPlaneConfig> for pb::DataPlaneConfig {
    fn from(config: &DataPlaneConfig) -> Self {
        let p = config.picker;
        pb::DataPlaneConfig {
            backends: config
                .backends
                .iter()
                .map(|b| pb::Backend { name: b.name.clone(), url: b.url.clone(), models: b.models.clone() })
                .collect(),
            shim_pools: config
                .shim_pools
                .iter()
                .map(|p| pb::ShimPool { namespace: p.namespace.clone(), backends: p.backends.clone() })
                .collect(),
            model_map: config.model_map.clone().into_iter().collect(),
            picker: Some(pb::Picker {
                max_staleness_ms: u64::try_from(p.max_staleness.as_millis()).unwrap_or(u64::MAX),
                kv_enabled: p.kv_enabled,
                overlap_score_credit: p.overlap_score_credit,
                prefill_load_scale: p.prefill_load_scale,
                router_temperature: p.router_temperature,
                send_token_data: p.send_token_data,
                conditional_disaggregation: p.conditional_disaggregation,
                decode_busy_threshold: p.decode_busy_threshold,
            }),
            disaggregated_serving: Some(pb::DisaggregatedServing {
                enabled: config.disaggregated_serving.enabled,
                fallback_to_unified: config.disaggregated_serving.fallback_to_unified,
            }),
            kv_artifacts: Some(pb::KvArtifacts {
                pinned: config.kv_artifacts.pinned.clone(),
                allow_http: config.kv_artifacts.allow_http,
                allow_hf: config.kv_artifacts.allow_hf,
                cache_dir: config.kv_artifacts.cache_dir.clone(),
            }),
        }
    }
}

fn backlog_to_wire(key: &LoadKey, backlog: &Backlog) -> pb::Backlog {
    pb::Backlog {
        key: Some(key.into()),
        prefill_tokens: backlog.prefill_tokens,
        decode_blocks: backlog.decode_blocks,
        dispatches: backlog.dispatches,
        foreign_decode_blocks: backlog.foreign_decode_blocks,
        ending_decode_blocks: backlog.ending_decode_blocks,
        prefilled_tokens: backlog.prefilled_tokens,
        last_dispatch: backlog.last_dispatch,
        foreign_prefill_tokens: backlog.foreign_prefill_tokens,
        stalled: backlog.stalled,
    }
}

fn backlog_from_wire(backlog: pb::Backlog) -> Result<(LoadKey, Backlog), DecodeError> {
    let key = LoadKey::try_from(backlog.key.ok_or(DecodeError::Missing("backlog.key"))?)?;
    Ok((
        key,
        Backlog {
            prefill_tokens: backlog.prefill_tokens,
            decode_blocks: backlog.decode_blocks,
            dispatches: backlog.dispatches,
            foreign_decode_blocks: backlog.foreign_decode_blocks,
            ending_decode_blocks: backlog.ending_decode_blocks,
            prefilled_tokens: backlog.prefilled_tokens,
            last_dispatch: backlog.last_dispatch,
            foreign_prefill_tokens: backlog.foreign_prefill_tokens,
            stalled: backlog.stalled,
        },
    ))
}

impl From<ReportsFolded> for pb::ReportsFolded {
    fn from(folded: ReportsFolded) -> Self {
        Self { first_op: folded.first_op, last_op: folded.last_op }
    }
}

impl From<pb::ReportsFolded> for ReportsFolded {
    fn from(folded: pb::ReportsFolded) -> Self {
        Self { first_op: folded.first_op, last_op: folded.last_op }
    }
}

impl pb::DispatchStarted {
    /// The rank this start names: its own `rank`, else its place in its report's `ranks`;
    /// `None` for neither (an index past the table's end).
    pub fn rank_in<'a>(&'a self, ranks: &'a [pb::LoadKey]) -> Option<&'a pb::LoadKey> {
        self.rank.as_ref().or_else(|| ranks.get(usize::try_from(self.rank_index).ok()?))
    }
}

fn decode_backlogs(backlogs: Vec<pb::Backlog>) -> Result<Vec<(LoadKey, Backlog)>, DecodeError> {
    backlogs.into_iter().map(backlog_from_wire).collect()
}

/// Encodes a whole view; load ages are measured against `now`.
pub fn snapshot_to_wire(view: &FleetView, now: Instant) -> pb::Snapshot {
    pb::Snapshot {
        version: view.version(),
        workers: view.workers().values().map(|w| pb::Worker::from(w.as_ref())).collect(),
        loads: view.loads().iter().map(|(k, s)| load_to_wire(k, s, now)).collect(),
        config: Some(view.config().as_ref().into()),
        backlogs: view.backlogs().iter().map(|(k, b)| backlog_to_wire(k, b)).collect(),
    }
}

/// Decodes a whole view; the snapshot must be self-consistent (every sample for a known rank).
fn snapshot_from_wire(snapshot: pb::Snapshot, now: Instant) -> Result<FleetView, DecodeError> {
    let config = DataPlaneConfig::try_from(snapshot.config.ok_or(DecodeError::Missing("snapshot.config"))?)?;
    let workers = decode_workers(snapshot.workers)?;
    let loads = decode_loads(snapshot.loads, now)?;
    let backlogs = decode_backlogs(snapshot.backlogs)?;
    Ok(FleetView::new(snapshot.version, workers, loads, Arc::new(config))?.with_backlogs(backlogs)?)
}

pub fn delta_to_wire(delta: &FleetDelta, now: Instant) -> pb::Delta {
    pb::Delta {
        base_version: delta.base_version,
        upserted: delta.upserted.iter().map(|w| pb::Worker::from(w.as_ref())).collect(),
        removed: delta.removed.iter().map(pb::WorkerKey::from).collect(),
        loads: delta.loads.iter().map(|(k, s)| load_to_wire(k, s, now)).collect(),
        loads_removed: delta.loads_removed.iter().map(pb::LoadKey::from).collect(),
        config: delta.config.as_deref().map(pb::DataPlaneConfig::from),
        backlogs: delta.backlogs.iter().map(|(k, b)| backlog_to_wire(k, b)).collect(),
        backlogs_removed: delta.backlogs_removed.iter().map(pb::LoadKey::from).collect(),
    }
}

fn delta_from_wire(version: u64, delta: pb::Delta, now: Instant) -> Result<FleetDelta, DecodeError> {
    Ok(FleetDelta {
        base_version: delta.base_version,
        version,
        upserted: decode_workers(delta.upserted)?,
        removed: delta.removed.into_iter().map(WorkerKey::try_from).collect::<Result<_, _>>()?,
        loads: decode_loads(delta.loads, now)?,
        loads_removed: delta.loads_removed.into_iter().map(LoadKey::try_from).collect::<Result<_, _>>()?,
        config: delta.config.map(DataPlaneConfig::try_from).transpose()?.map(Arc::new),
        backlogs: decode_backlogs(delta.backlogs)?,
        backlogs_removed: delta.backlogs_removed.into_iter().map(LoadKey::try_from).collect::<Result<_, _>>()?,
    })
}

/// Decodes the body of a `FleetUpdate`.
pub fn update_from_wire(update: pb::FleetUpdate, now: Instant) -> Result<Update, DecodeError> {
    match update.body.ok_or(DecodeError::Missing("fleet_update.body"))? {
        pb::fleet_update::Body::Snapshot(snapshot) => Ok(Update::Snapshot(snapshot_from_wire(snapshot, now)?)),
        pb::fleet_update::Body::Delta(delta) => Ok(Update::Delta(delta_from_wire(update.version, delta, now)?)),
    }
}

fn decode_workers(workers: Vec<pb::Worker>) -> Result<Vec<Arc<Worker>>, DecodeError> {
    workers.into_iter().map(|w| Worker::try_from(w).map(Arc::new)).collect()
}

fn decode_loads(loads: Vec<pb::LoadSample>, now: Instant) -> Result<Vec<(LoadKey, LoadSample)>, DecodeError> {
    loads.into_iter().map(|s| load_from_wire(s, now)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker's disaggregation endpoint (an SGLang prefill worker's bootstrap host and port)
    /// is an internal address: the control plane knows it, the wire never carries it.
    #[test]
    fn a_workers_disaggregation_endpoint_stays_off_the_wire() {
        let worker = Worker {
            key: WorkerKey::new("dynamo", 7),
            role: Role::Prefill,
            model: "m".into(),
            component: "prefill".into(),
            endpoint: "generate".into(),
            block_size: Some(16),
            capacity: Capacity::default(),
            dp_start_rank: 0,
            dp_size: 0,
            disaggregated_endpoint: Some("10.0.0.4:8998".into()),
            artifacts: None,
        };
        let wire = pb::Worker::from(&worker);
        assert_eq!(wire.disaggregated_endpoint, None);
        assert_eq!(wire.key.map(|k| k.instance_id), Some(7), "the rest goes as it is");
    }

    /// Every field of a backlog crosses the wire, the fleet-wide stall among them.
    #[test]
    fn a_backlog_crosses_the_wire_whole() {
        let key = LoadKey { worker: WorkerKey::new("dynamo", 7), dp_rank: 1 };
        let backlog = crate::model::every_field_backlog();
        assert_eq!(backlog_from_wire(backlog_to_wire(&key, &backlog)), Ok((key, backlog)));
    }

    /// Picker parameters a conforming control plane never sends are refused, not used: a
    /// weight that is not a finite non-negative number, a staleness of zero or past the bound
    /// (sample ages are clamped at an hour, so a longer one would read an ancient sample fresh).
    #[test]
    fn picker_parameters_out_of_their_bounds_are_refused() {
        let config =
            |picker: pb::Picker| pb::DataPlaneConfig { picker: Some(picker), ..pb::DataPlaneConfig::default() };
        let picker = |max_staleness_ms| pb::Picker { max_staleness_ms, ..pb::Picker::default() };
        let staleness = u64::try_from(MAX_STALENESS.as_millis()).unwrap_or(u64::MAX);
        assert!(DataPlaneConfig::try_from(config(picker(staleness))).is_ok());
        for refused in [
            picker(0),
            picker(staleness + 1),
            picker(7_200_000),
            pb::Picker { prefill_load_scale: f64::NAN, ..picker(1000) },
            pb::Picker { prefill_load_scale: f64::INFINITY, ..picker(1000) },
            pb::Picker { router_temperature: -1.0, ..picker(1000) },
            pb::Picker { overlap_score_credit: -0.5, ..picker(1000) },
            pb::Picker { overlap_score_credit: f64::NEG_INFINITY, ..picker(1000) },
            pb::Picker { decode_busy_threshold: Some(f64::NAN), ..picker(1000) },
            pb::Picker { decode_busy_threshold: Some(-1.0), ..picker(1000) },
        ] {
            let decoded = DataPlaneConfig::try_from(config(refused));
            assert!(matches!(decoded, Err(DecodeError::InvalidPicker { .. })), "{refused:?}: {decoded:?}");
        }
    }

    /// Ranks that would run past `u32::MAX` are refused, not cut short to fewer (or none).
    #[test]
    fn a_worker_whose_ranks_run_past_the_last_rank_number_is_refused() {
        let wire = |dp_start_rank, dp_size| pb::Worker {
            key: Some(pb::WorkerKey { namespace: "dynamo".into(), instance_id: 7 }),
            role: pb::Role::Decode.into(),
            dp_start_rank,
            dp_size,
            ..pb::Worker::default()
        };
        assert!(Worker::try_from(wire(u32::MAX - 2, 2)).is_ok());
        for (start, size) in [(u32::MAX, 0), (u32::MAX - 1, 2), (u32::MAX, 1024)] {
            let refused = Worker::try_from(wire(start, size));
            assert!(matches!(refused, Err(DecodeError::RanksOutOfRange { .. })), "{start} + {size}: {refused:?}");
        }
    }
}
