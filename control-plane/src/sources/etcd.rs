//! The etcd discovery source: the effectful shell around the pure `discovery::Reducer`.
//!
//! Read-only by construction: this module issues range gets and watches and nothing else (no
//! put, delete, lease grant or keep-alive). One pass connects, range-gets the four prefixes of
//! every watched namespace, folds them as a resync, opens a watch on each prefix at its get's
//! revision + 1 (gapless), and folds every event until a stream ends. Then it waits a bounded,
//! jittered backoff and starts over from scratch, which also recovers from compaction.

use std::time::{Duration, Instant, SystemTime};

use etcd_client::{Certificate, Client, ConnectOptions, GetOptions, Identity, TlsOptions, WatchClient, WatchOptions};
use futures::StreamExt;
use futures::stream::SelectAll;
use tokio_util::sync::CancellationToken;

use super::registry::Registry;
use crate::config::EtcdConfig;
use crate::discovery::{Applied, KeyValue, Reducer, WatchEvent, keys};
use crate::metrics::Metrics;

/// Dial, authenticate and range-get must finish within this; the watches after it are unbounded.
pub const SEED_TIMEOUT: Duration = Duration::from_secs(30);

/// The largest etcd response accepted. Above `MAX_RECORD_BYTES` (16 MiB), so an oversized
/// record reaches the reducer to be refused and counted instead of breaking the stream for
/// every record beside it; and enough for a range get of a full keyspace of ordinary records.
pub const MAX_ETCD_MESSAGE_BYTES: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("connecting and seeding took longer than {SEED_TIMEOUT:?}")]
    SeedTimeout,
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("reading TLS material {path}: {source}")]
    Tls { path: String, source: std::io::Error },
    #[error("etcd cancelled the watch: {0}")]
    Cancelled(String),
    #[error("etcd compacted past revision {0}; resyncing")]
    Compacted(i64),
    #[error("a watch stream ended")]
    Ended,
    #[error("a full discovery keyspace has room again; listing it anew for the keys it refused")]
    RoomFreed,
}

/// The prefixes watched for one Dynamo namespace: instances, model cards, event channels, and
/// the event sources that map a kv-events publisher to its worker and dp rank.
pub fn prefixes(namespace: &str) -> [String; 4] {
    let ns = keys::encode_segment(namespace);
    [
        format!("v1/instances/{namespace}/"),
        format!("v1/mdc/{namespace}/"),
        format!("v1/event_channels/namespace/{ns}/"),
        format!("v1/event_sources/namespace/{ns}/"),
    ]
}

/// Runs passes until `cancel` fires. The reducer lives across passes, so `first_seen` survives.
pub async fn run(
    config: EtcdConfig,
    namespaces: Vec<String>,
    registry: Registry,
    metrics: Metrics,
    cancel: CancellationToken,
) {
    let mut reducer = Reducer::new(namespaces.clone());
    let backoff = &config.watch_reconnect_backoff;
    let mut delay = backoff.initial;
    loop {
        let mut watching_since = None;
        let outcome = tokio::select! {
            () = cancel.cancelled() => return,
            outcome = pass(&config, &namespaces, &mut reducer, &registry, &metrics, &mut watching_since) => outcome,
        };
        metrics.discovery_connected.set(0);
        let sleep = match outcome {
            // Planned, not a failure: the relist waits only the backoff's floor (so churn on a
            // full keyspace cannot loop on relists) and leaves the failure backoff as it was.
            Err(PassError::RoomFreed) => backoff.initial,
            outcome => {
                if let Err(error) = outcome {
                    tracing::warn!(%error, "etcd discovery pass ended; resyncing after backoff");
                }
                // The floor comes back only after the watches held for a whole backoff ceiling,
                // so an etcd (or proxy) that serves gets but drops watches cannot drive a
                // reconnect storm.
                if watching_since.is_some_and(|since: Instant| since.elapsed() >= backoff.max) {
                    delay = backoff.initial;
                }
                let sleep = delay.mul_f64(0.5 + rand::random::<f64>() / 2.0);
                delay = delay.saturating_mul(2).min(backoff.max);
                sleep
            }
        };
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(sleep) => {}
        }
    }
}

async fn pass(
    config: &EtcdConfig,
    namespaces: &[String],
    reducer: &mut Reducer,
    registry: &Registry,
    metrics: &Metrics,
    watching_since: &mut Option<Instant>,
) -> Result<(), PassError> {
    let prefixes: Vec<String> = namespaces.iter().flat_map(|ns| prefixes(ns)).collect();
    let (mut watcher, records, revisions) =
        tokio::time::timeout(SEED_TIMEOUT, seed(config, &prefixes)).await.map_err(|_| PassError::SeedTimeout)??;
    fold(reducer, WatchEvent::Resync(records), registry, metrics);

    let mut streams = SelectAll::new();
    for (prefix, revision) in prefixes.iter().zip(revisions) {
        let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let stream = watcher.watch(prefix.as_str(), Some(options)).await?;
        // `SelectAll` drops a stream that ends and goes on with the others; one prefix's
        // watch ending must end the pass, or that prefix would go unwatched.
        let ended = futures::stream::once(std::future::ready(Err(PassError::Ended)));
        streams.push(stream.map(|response| response.map_err(PassError::from)).chain(ended));
    }
    metrics.discovery_connected.set(1);
    *watching_since = Some(Instant::now());
    while let Some(response) = streams.next().await {
        let response = response?;
        if response.compact_revision() > 0 {
            return Err(PassError::Compacted(response.compact_revision()));
        }
        if response.canceled() {
            return Err(PassError::Cancelled(response.cancel_reason().to_string()));
        }
        let now = SystemTime::now();
        let mut changed = false;
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            let folded = match event.event_type() {
                etcd_client::EventType::Put => WatchEvent::Put(record(kv)),
                etcd_client::EventType::Delete => WatchEvent::Delete { key: kv.key().to_vec() },
            };
            let applied = reducer.apply(folded, now);
            changed |= applied.fleet_changed();
            count(&applied, metrics);
            if applied.relist_wanted() {
                registry.publish(reducer.fleet());
                return Err(PassError::RoomFreed);
            }
        }
        // Heartbeat re-puts change nothing; only a changed fleet is rebuilt and published.
        if changed {
            registry.publish(reducer.fleet());
        }
    }
    Err(PassError::Ended)
}

/// Connects and range-gets every prefix, recording each response's revision.
async fn seed(config: &EtcdConfig, prefixes: &[String]) -> Result<(WatchClient, Vec<KeyValue>, Vec<i64>), PassError> {
    let client = Client::connect(&config.endpoints, Some(connect_options(config)?)).await?;
    let mut kv = client.kv_client().max_decoding_message_size(MAX_ETCD_MESSAGE_BYTES);
    let watcher = client.watch_client().max_decoding_message_size(MAX_ETCD_MESSAGE_BYTES);
    let mut records = Vec::new();
    let mut revisions = Vec::with_capacity(prefixes.len());
    for prefix in prefixes {
        let response = kv.get(prefix.as_str(), Some(GetOptions::new().with_prefix())).await?;
        revisions.push(response.header().map_or(0, |h| h.revision()));
        records.extend(response.kvs().iter().map(record));
    }
    Ok((watcher, records, revisions))
}

fn record(kv: &etcd_client::KeyValue) -> KeyValue {
    KeyValue::new(kv.key(), kv.value()).with_lease(u64::try_from(kv.lease()).unwrap_or(0))
}

fn connect_options(config: &EtcdConfig) -> Result<ConnectOptions, PassError> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(10))
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(10));
    if let Some(auth) = &config.auth {
        options = options.with_user(auth.username.clone(), auth.password.expose());
    }
    if let Some(tls) = &config.tls {
        let mut tls_options = TlsOptions::new();
        if let Some(ca) = &tls.ca_cert {
            tls_options = tls_options.ca_certificate(Certificate::from_pem(read(ca)?));
        }
        if let (Some(cert), Some(key)) = (&tls.client_cert, &tls.client_key) {
            // The key's path is configured as a secret: an error names it masked.
            let key = std::fs::read(key.expose())
                .map_err(|source| PassError::Tls { path: crate::config::MASK.to_string(), source })?;
            tls_options = tls_options.identity(Identity::from_pem(read(cert)?, key));
        }
        if let Some(name) = &tls.server_name {
            tls_options = tls_options.domain_name(name.clone());
        }
        options = options.with_tls(tls_options);
    }
    Ok(options)
}

fn read(path: &std::path::Path) -> Result<Vec<u8>, PassError> {
    std::fs::read(path).map_err(|source| PassError::Tls { path: path.display().to_string(), source })
}

fn fold(reducer: &mut Reducer, event: WatchEvent, registry: &Registry, metrics: &Metrics) {
    let applied = reducer.apply(event, SystemTime::now());
    count(&applied, metrics);
    registry.publish(reducer.fleet());
}

fn count(applied: &Applied, metrics: &Metrics) {
    for (kind, n) in applied.iter() {
        metrics.discovery_events.with_label_values(&[kind.as_str()]).inc_by(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_percent_encode_the_event_channel_namespace_only() {
        assert_eq!(
            prefixes("ns.one"),
            [
                "v1/instances/ns.one/".to_string(),
                "v1/mdc/ns.one/".to_string(),
                "v1/event_channels/namespace/ns%2Eone/".to_string(),
                "v1/event_sources/namespace/ns%2Eone/".to_string(),
            ]
        );
    }
}
