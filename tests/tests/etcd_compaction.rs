//! etcd compacts past a watcher that fell behind: the control plane's watch is stalled behind a
//! paused proxy until etcd's server-side watch buffer overflows and the watcher turns slow
//! (unsynced), the fleet changes and etcd compacts to its head, then the proxy resumes. etcd
//! answers the slow watcher with a compacted watch response; the control plane must resync from
//! fresh range gets and end with exactly the fleet etcd holds.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use continuum_control_plane::app::{ControlPlane, ListenOverrides};
use continuum_control_plane::config;
use continuum_tests::etcd::{Etcd, decode_worker_records, delete_worker, discovery_yaml, lease, put_workers};
use continuum_tests::eventually;
use continuum_tests::proxy::Proxy;
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(15);

/// etcd's gauge of watchers that could not be sent their events and fell out of sync.
const SLOW_WATCHERS: &str = "etcd_debugging_mvcc_slow_watcher_total";

/// Each filler revision carries this much, so HTTP/2 windows and socket buffers fill in
/// a few hundred revisions on top of the 128 responses etcd buffers per watch stream.
const FILLER_BYTES: usize = 64 * 1024;

/// Far more filler than a stalled watch can absorb; reaching it means etcd never marked the
/// watcher slow and the test cannot prove anything.
const MAX_FILLER_REVISIONS: usize = 1_000;

/// The control plane's log lines, kept for assertions.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn install(&self) -> anyhow::Result<()> {
        let subscriber = tracing_subscriber::fmt().with_ansi(false).with_writer(self.clone()).finish();
        Ok(tracing::subscriber::set_global_default(subscriber)?)
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(buf);
        std::io::stderr().write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;

    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

fn worker_ids(control: &ControlPlane) -> Vec<u64> {
    control.publisher.current().view().workers().keys().map(|k| k.instance_id).collect()
}

fn resyncs(control: &ControlPlane) -> u64 {
    control.metrics.discovery_events.with_label_values(&["resync"]).get()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_compacted_past_while_stalled_resyncs_to_exactly_the_current_fleet() -> anyhow::Result<()> {
    let logs = Logs::default();
    logs.install()?;
    let dir = tempfile::tempdir()?;
    let etcd = Etcd::start(dir.path(), &[]).await?;
    let mut writer = etcd.client().await?;
    put_workers(&mut writer, (0..6).map(lease)).await?;
    let proxy = Proxy::start(etcd.client_addr()?).await?;
    let yaml = discovery_yaml(json!({"endpoints": [format!("http://{}", proxy.addr)]}));
    let loaded = config::load_str(&yaml, &|_| None).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let control = ControlPlane::start(loaded.config, ListenOverrides::default()).await?;
    let first: Vec<u64> = (0..6).map(lease).collect();
    eventually(CONVERGE, "the first six workers", || async { worker_ids(&control) == first }).await?;
    eventually(CONVERGE, "discovery connected", || async { control.metrics.discovery_connected.get() == 1 }).await?;
    // The watches start at the listing's revision, so etcd counts them slow until it has sent
    // that revision: wait for them to catch up, or the count below would be theirs.
    eventually(CONVERGE, "the watches caught up", || async {
        etcd.metric(SLOW_WATCHERS).await.is_ok_and(|slow| slow < 1.0)
    })
    .await?;
    let seeded = resyncs(&control);

    proxy.pause();
    // A worker's card, padded, rewritten until etcd gives up sending to the stalled watch.
    let (card_key, card) = decode_worker_records("dynamo", lease(99), "tiny").swap_remove(0);
    let mut padded: serde_json::Value = serde_json::from_str(&card)?;
    padded["pad"] = json!("x".repeat(FILLER_BYTES));
    let padded = padded.to_string();
    // The gauge is read every 16 puts, not every put: its page is large, and the pause must
    // end well within the control plane's 20 s of keep-alive (a 10 s ping, 10 s to answer) or
    // its connection drops and it resyncs without ever being told of the compaction.
    let mut filler = 0;
    while filler % 16 != 0 || etcd.metric(SLOW_WATCHERS).await? < 1.0 {
        anyhow::ensure!(filler < MAX_FILLER_REVISIONS, "etcd never marked the stalled watcher slow");
        writer.put(card_key.as_str(), padded.as_str(), None).await?;
        filler += 1;
    }
    tracing::info!(filler, "the stalled watcher is slow");
    // The fleet changes behind the watcher's back, and etcd forgets the history in between.
    writer.delete(card_key.as_str(), None).await?;
    delete_worker(&mut writer, lease(1)).await?;
    delete_worker(&mut writer, lease(4)).await?;
    put_workers(&mut writer, [lease(6), lease(7)]).await?;
    let head = writer.get("v1/", None).await?.header().map_or(0, |h| h.revision());
    writer.compact(head, None).await?;
    proxy.resume();

    let expected = [lease(0), lease(2), lease(3), lease(5), lease(6), lease(7)];
    eventually(CONVERGE, "exactly the current fleet", || async { worker_ids(&control) == expected }).await?;
    eventually(CONVERGE, "a resync after the compaction", || async { resyncs(&control) > seeded }).await?;
    eventually(CONVERGE, "discovery connected again", || async { control.metrics.discovery_connected.get() == 1 })
        .await?;
    let compacted = format!("etcd compacted past revision {head}");
    assert!(logs.text().contains(&compacted), "no compacted watch response was logged:\n{}", logs.text());
    control.shutdown().await;
    Ok(())
}
