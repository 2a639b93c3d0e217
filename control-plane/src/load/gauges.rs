//! Per-rank load gauges: one series per (namespace, worker, dp rank) and field the publisher
//! set. A nil field exports no series, and a dropped sample (a departed worker, a reconnect, a
//! gap) takes its series with it, so the label sets stay bounded by the live fleet.

use continuum_proto::model::{Load, LoadKey};
use prometheus::{IntGaugeVec, Opts};

const LABELS: [&str; 3] = ["namespace", "worker", "dp_rank"];

#[derive(Clone, Debug)]
pub struct LoadGauges {
    pub active_decode_blocks: IntGaugeVec,
    pub active_prefill_tokens: IntGaugeVec,
    pub kv_used_blocks: IntGaugeVec,
}

impl LoadGauges {
    pub fn new() -> Result<Self, prometheus::Error> {
        let gauge = |name: &str, help: &str| IntGaugeVec::new(Opts::new(name, help), &LABELS);
        Ok(Self {
            active_decode_blocks: gauge(
                "continuum_dynamo_worker_active_decode_blocks",
                "Active decode blocks in the rank's last ActiveLoad sample",
            )?,
            active_prefill_tokens: gauge(
                "continuum_dynamo_worker_active_prefill_tokens",
                "Active prefill tokens in the rank's last ActiveLoad sample",
            )?,
            kv_used_blocks: gauge(
                "continuum_dynamo_worker_kv_used_blocks",
                "KV blocks in use in the rank's last ActiveLoad sample",
            )?,
        })
    }

    fn fields(&self, load: &Load) -> [(&IntGaugeVec, Option<u64>); 3] {
        [
            (&self.active_decode_blocks, load.active_decode_blocks),
            (&self.active_prefill_tokens, load.active_prefill_tokens),
            (&self.kv_used_blocks, load.kv_used_blocks),
        ]
    }

    pub fn set(&self, key: &LoadKey, load: &Load) {
        let (worker, rank) = (format!("{:x}", key.worker.instance_id), key.dp_rank.to_string());
        let labels = [key.worker.namespace.as_ref(), worker.as_str(), rank.as_str()];
        for (gauge, value) in self.fields(load) {
            match value {
                Some(v) => gauge.with_label_values(&labels).set(i64::try_from(v).unwrap_or(i64::MAX)),
                // Absent when the series never existed; nothing to remove then.
                None => {
                    let _ = gauge.remove_label_values(&labels);
                }
            }
        }
    }

    pub fn remove(&self, key: &LoadKey) {
        self.set(key, &Load::default());
    }
}
