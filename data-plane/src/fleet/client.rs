//! Follows the control plane's Watch stream and turns it into the replica's one snapshot.
//!
//! Lifecycle: connect, say Hello, apply every update (ACK) or refuse it (NACK, state kept, the
//! control plane resyncs with a full snapshot), and on any loss reconnect with full-jitter
//! backoff. The last-known-good view stays in place the whole time the control plane is away:
//! workers are never dropped because the stream is quiet or gone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_proto::MAX_FLEET_MESSAGE_BYTES;
use continuum_proto::convert::{Update, update_from_wire};
use continuum_proto::model::ReportsFolded;
use continuum_proto::pb::{self, fleet_client::FleetClient, watch_request::Kind};
use continuum_proto::view::FleetView;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Endpoint;
use tonic::{Code, Status};

use super::backoff::Backoff;
use super::credentials::{ClientTls, Credentials, TlsFileError};
use super::handle::FleetHandle;
use super::reporter::{self, DispatchReporter, Reports};
use crate::metrics::Metrics;

/// Reconnect delays: the first retry is quick, a long outage settles at one attempt every few
/// seconds per replica.
pub const RECONNECT_INITIAL: Duration = Duration::from_millis(100);
pub const RECONNECT_MAX: Duration = Duration::from_secs(5);
/// A stream that stayed up this long resets the backoff to its floor.
pub const STABLE_SESSION: Duration = Duration::from_secs(30);
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Dispatch reports go out at most this often. Well under the control plane's backlog window
/// (2 ms), so a report still reaches the next publication of the fleet-wide backlogs.
pub const REPORT_INTERVAL: Duration = Duration::from_millis(1);
/// Replies waiting to be sent: an ack or nack per update received, and the dispatch reports,
/// at most one per [`REPORT_INTERVAL`]; a handful suffices.
const REPLY_QUEUE: usize = 8;
/// How long a reply (an ack, a report) may wait for room on the stream. A control plane whose
/// connection stays up (its HTTP/2 pings answered) but that reads nothing for this long is
/// treated as gone: the replica ends the stream, which drops the fleet-wide backlogs it can no
/// longer trust (they would keep finished requests weighing on their workers), and dials again.
/// A healthy control plane reads its streams within milliseconds.
pub const REPLY_STALL_LIMIT: Duration = Duration::from_secs(5);
/// How long the Watch call may take to be answered once connected: the control plane answers
/// as soon as it has read the replica's Hello, which it waits 10 s for at most.
const WATCH_OPEN_TIMEOUT: Duration = Duration::from_secs(15);

/// Where and as whom to follow the fleet.
#[derive(Clone)]
pub struct FleetClientConfig {
    pub control_plane: String,
    pub replica_id: String,
    pub credentials: Credentials,
    /// For an `https://` control plane: the CA to trust, and this replica's certificate when
    /// the control plane asks for one (see [`super::client_tls`] and [`ClientTls::Files`]).
    pub tls: Option<ClientTls>,
}

impl FleetClientConfig {
    /// Following `control_plane` as `replica_id`, with no token.
    pub fn new(control_plane: impl Into<String>, replica_id: impl Into<String>) -> Self {
        let (control_plane, replica_id) = (control_plane.into(), replica_id.into());
        Self { control_plane, replica_id, credentials: Credentials::default(), tls: None }
    }

    /// The control plane's endpoint, over TLS when configured. tonic would quietly speak
    /// plaintext to an `http://` URL whatever the TLS settings, so that pairing is refused.
    pub(super) fn endpoint(&self) -> Result<Endpoint, EndpointError> {
        let endpoint = Endpoint::from_shared(self.control_plane.clone()).map_err(EndpointError::Invalid)?;
        match &self.tls {
            Some(_) if endpoint.uri().scheme_str() != Some("https") => Err(EndpointError::TlsNeedsHttps),
            Some(tls) => {
                endpoint.tls_config(tls.config().map_err(EndpointError::TlsFiles)?).map_err(EndpointError::Invalid)
            }
            None => Ok(endpoint),
        }
    }
}

/// How long a (re)connect waits for its TLS files to be read.
pub const TLS_FILES_READ_WAIT: Duration = Duration::from_secs(5);

/// [`FleetClientConfig::endpoint`] for each (re)connect. TLS files, read at every one, are read
/// on the blocking pool, so a stalled volume holds no runtime thread while the control plane
/// flaps; and a read that takes longer than its wait ([`TLS_FILES_READ_WAIT`], a secrets
/// volume stalled) is waited on no longer: the endpoint the files last made serves meanwhile,
/// and the read goes on, one at a time, its outcome taken by a later connect. Without it, a replica whose control plane restarted
/// while its volume stalled would stay disconnected for as long, routing without the fleet's
/// backlogs, on files it had read before.
struct Endpoints {
    wait: Duration,
    last_read: Option<Endpoint>,
    reading: Option<tokio::task::JoinHandle<Result<Endpoint, EndpointError>>>,
    /// Reads started so far.
    #[cfg(test)]
    reads_started: usize,
}

impl Endpoints {
    fn new(wait: Duration) -> Self {
        Self {
            wait,
            last_read: None,
            reading: None,
            #[cfg(test)]
            reads_started: 0,
        }
    }

    async fn next(&mut self, config: &FleetClientConfig) -> Result<Endpoint, EndpointError> {
        if !matches!(config.tls, Some(ClientTls::Files(_))) {
            return config.endpoint();
        }
        // A read that ended since the last connect gave files that may have changed since:
        // kept as the last read if they made an endpoint, and read anew.
        if let Some(ended) = self.reading.take_if(|reading| reading.is_finished())
            && let Ok(Ok(endpoint)) = ended.await
        {
            self.last_read = Some(endpoint);
        }
        let mut reading = self.reading.take().unwrap_or_else(|| {
            #[cfg(test)]
            {
                self.reads_started += 1;
            }
            let config = config.clone();
            tokio::task::spawn_blocking(move || config.endpoint())
        });
        match tokio::time::timeout(self.wait, &mut reading).await {
            Ok(read) => {
                let endpoint = read.unwrap_or_else(|error| Err(EndpointError::Unread(error.to_string())))?;
                self.last_read = Some(endpoint.clone());
                Ok(endpoint)
            }
            Err(_) => {
                self.reading = Some(reading);
                let wait = self.wait;
                let last = self.last_read.clone();
                if last.is_some() {
                    tracing::warn!(
                        ?wait,
                        "the --control-plane TLS files were not read in time; connecting with those read last"
                    );
                }
                last.ok_or_else(|| EndpointError::Unread(format!("the TLS files were not read within {wait:?}")))
            }
        }
    }
}

/// Why [`FleetClientConfig`] names no endpoint to follow.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("{}", crate::error_chain(.0))]
    /// Its text carries the whole cause chain, so it names no source of its own.
    Invalid(tonic::transport::Error),
    #[error("TLS settings need an https:// control-plane URL; over http:// they would be ignored")]
    TlsNeedsHttps,
    #[error("TLS: {0}")]
    TlsFiles(TlsFileError),
    #[error("TLS files not read: {0}")]
    Unread(String),
}

#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("cannot use the control-plane endpoint: {0}")]
    Endpoint(EndpointError),
    #[error("cannot reach the control plane: {0}")]
    Connect(#[source] tonic::transport::Error),
    /// A status that ended the stream: the control plane's refusal, or the connection breaking
    /// under the stream, which tonic reports as a status carrying the transport's error
    /// ([`stream_ended`]).
    #[error("{}", stream_ended(.0))]
    Status(Status),
    #[error(
        "the dispatch report queue filled (the control plane reads too slowly); reconnecting to report whole again"
    )]
    ReportsDropped,
    #[error("control plane stopped reading replies")]
    RepliesClosed,
    #[error("control plane read no reply for {REPLY_STALL_LIMIT:?}; leaving its stream")]
    RepliesStalled,
    #[error(
        "control plane sent no update for {REPLY_STALL_LIMIT:?} after dispatches were reported; leaving its stream"
    )]
    UpdatesStalled,
    #[error("control plane accepted the connection but opened no Watch stream within {WATCH_OPEN_TIMEOUT:?}")]
    NotOpened,
}

impl From<Status> for SessionError {
    fn from(status: Status) -> Self {
        SessionError::Status(status)
    }
}

/// What ended a stream with `status`: a connection that broke under it (a control plane
/// killed, a proxy between that reset it) as its transport error's cause chain, rather than
/// as a refusal with tonic's debug print of that error; a refusal as its message and code.
fn stream_ended(status: &Status) -> String {
    match std::error::Error::source(status) {
        Some(cause) => format!("the fleet stream broke: {}", crate::error_chain(cause)),
        None => format!("control plane refused the stream: {} ({:?})", status.message(), status.code()),
    }
}

/// Sessions in a row ended over a refused snapshot after which reconnecting slows to the
/// backoff's longest delay.
const REFUSED_SNAPSHOTS_BEFORE_SLOWEST: u32 = 3;

/// Sessions in a row ended over a refused snapshot, after one that ended with `outcome`
/// (`snapshot_applied`: it applied one), `before` such sessions.
fn refused_in_a_row(before: u32, snapshot_applied: bool, outcome: &Result<(), SessionError>) -> u32 {
    let refused = !snapshot_applied && outcome.as_ref().is_err_and(SessionError::ends_refused_updates);
    if refused { before.saturating_add(1) } else { 0 }
}

impl SessionError {
    /// The control plane ended the stream over updates this replica refused (its
    /// `FAILED_PRECONDITION`): a snapshot, or deltas refused twice in a row.
    fn ends_refused_updates(&self) -> bool {
        matches!(self, SessionError::Status(status) if status.code() == Code::FailedPrecondition)
    }

    /// Failures that an immediate retry will not fix get the longest delay. `ABORTED`: a newer
    /// stream of this replica's id replaced this one, which, this replica having opened none,
    /// is another replica configured with the same id; the two would otherwise end each
    /// other's stream at the shortest delay.
    fn is_persistent(&self) -> bool {
        match self {
            SessionError::Endpoint(_) => true,
            SessionError::Status(status) => matches!(
                status.code(),
                Code::Unimplemented
                    | Code::Aborted
                    | Code::InvalidArgument
                    | Code::PermissionDenied
                    | Code::Unauthenticated
                    | Code::OutOfRange
            ),
            SessionError::Connect(_)
            | SessionError::ReportsDropped
            | SessionError::RepliesClosed
            | SessionError::RepliesStalled
            | SessionError::UpdatesStalled
            | SessionError::NotOpened => false,
        }
    }
}

/// Never prints the TLS identity's key (tonic's own Debug would).
impl std::fmt::Debug for FleetClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetClientConfig")
            .field("control_plane", &self.control_plane)
            .field("replica_id", &self.replica_id)
            .field("credentials", &self.credentials)
            .field("tls", &self.tls)
            .finish()
    }
}

/// Follows the control plane until `cancel` fires.
pub async fn run(
    config: FleetClientConfig,
    handle: Arc<FleetHandle>,
    reporter: Arc<DispatchReporter>,
    metrics: Metrics,
    cancel: CancellationToken,
) {
    let mut backoff = Backoff::new(RECONNECT_INITIAL, RECONNECT_MAX);
    let Some(mut reports) = reporter.take_receiver() else {
        tracing::error!("the dispatch reporter is already followed by another fleet client");
        return;
    };
    // Sessions in a row the control plane ended for a snapshot this replica refused.
    let mut refused_snapshots = 0u32;
    let mut endpoints = Endpoints::new(TLS_FILES_READ_WAIT);
    loop {
        let started = Instant::now();
        let mut snapshot_applied = false;
        let outcome = tokio::select! {
            () = cancel.cancelled() => {
                // Operations after this (the last answers of a drain) are not queued for a
                // stream no one follows, nor counted as reports dropped.
                reporter::detach(&mut reports);
                return;
            }
            outcome = follow((&config, &mut endpoints), &handle, &reporter, &mut reports, &metrics, &mut snapshot_applied) => outcome,
        };
        reporter::detach(&mut reports);
        handle.detach();
        metrics.stream_connected.set(0);
        // Before any view, there is none to keep: the replica refuses chat completions.
        let kept = match handle.view() {
            Some(_) => "keeping the last-known-good view",
            None => "no fleet view yet, so chat completions are refused (503 fleet_unavailable) until one arrives",
        };
        match &outcome {
            Ok(()) => tracing::warn!("control plane closed the fleet stream; {kept}"),
            Err(error) => {
                let error = crate::error_chain(error);
                tracing::warn!(%error, "no fleet stream; {kept}");
            }
        }
        if started.elapsed() >= STABLE_SESSION {
            backoff.reset();
        }
        // A snapshot refused again and again (a version this replica cannot read) would be
        // sent again, megabytes each time, at the backoff's pace: after a few, at its slowest.
        refused_snapshots = refused_in_a_row(refused_snapshots, snapshot_applied, &outcome);
        if outcome.as_ref().is_err_and(SessionError::is_persistent)
            || refused_snapshots >= REFUSED_SNAPSHOTS_BEFORE_SLOWEST
        {
            backoff.saturate();
        }
        metrics.reconnects.inc();
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

/// One stream: Hello, then apply updates and send dispatch reports until the stream ends.
async fn follow(
    (config, endpoints): (&FleetClientConfig, &mut Endpoints),
    handle: &FleetHandle,
    reporter: &DispatchReporter,
    reports: &mut Reports,
    metrics: &Metrics,
    snapshot_applied: &mut bool,
) -> Result<(), SessionError> {
    let endpoint = endpoints
        .next(config)
        .await
        .map_err(SessionError::Endpoint)?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10));
    let channel = endpoint.connect().await.map_err(SessionError::Connect)?;
    let (replies, rx) = mpsc::channel(REPLY_QUEUE);
    let hello = pb::Hello { replica_id: config.replica_id.clone(), version: handle.resume_from() };
    replies.send(request(Kind::Hello(hello))).await.map_err(|_| SessionError::RepliesClosed)?;
    let mut client = FleetClient::with_interceptor(channel, config.credentials.clone())
        .max_decoding_message_size(MAX_FLEET_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_FLEET_MESSAGE_BYTES);
    let watch = client.watch(ReceiverStream::new(rx));
    // Bounded: a peer (or a proxy in front of it) that answers HTTP/2 pings but never opens the
    // stream would otherwise hold the replica here, reconnecting never.
    let mut updates =
        tokio::time::timeout(WATCH_OPEN_TIMEOUT, watch).await.map_err(|_| SessionError::NotOpened)??.into_inner();
    let replayed = reporter.attach(reports);
    if replayed > 0 {
        tracing::info!(replayed, "reported the dispatches in flight again on the new fleet stream");
    }
    metrics.dispatches_replayed.inc_by(replayed as u64);
    let mut last_report = Instant::now();
    // Since when a report of dispatch starts has gone unanswered by any update. The control
    // plane folds every report and publishes within milliseconds (the sums it moved, or
    // which reports it folded when it moved none), so none for [`REPLY_STALL_LIMIT`] after
    // one is a control plane that stopped (its connection up, its pings answered, reading
    // what little this replica sends): left as one that reads nothing is, rather than routed
    // on its frozen backlogs for as long. Only while the stream's latest update says it folds
    // this session's reports (`folding`): a control plane whose book gave up (it withdrew the
    // ranges) reads none by design, nor does it fold a session whose start it refused for room,
    // and leaving either every few seconds would replay every dispatch for nothing.
    let (mut unanswered_since, mut folding): (Option<tokio::time::Instant>, bool) = (None, false);
    // An operation that found the report queue full ends the stream at once, whatever the loop
    // waits on: most likely a send to a control plane reading slowly, how the queue filled.
    let detached = reports.detached();
    // Every stream starts with a full snapshot: until one is applied, the view held is the
    // last stream's, stripped of its fleet-wide sums, and no delta can be known to fit it.
    loop {
        if !reports.attached() {
            // An operation found the report queue full: the stream's reports are no longer
            // whole. A new stream starts both sides over with a replay.
            return Err(SessionError::ReportsDropped);
        }
        let answer_due = unanswered_since.map(|since| since + REPLY_STALL_LIMIT);
        let reply = tokio::select! {
            update = updates.message() => match update? {
                Some(update) => {
                    unanswered_since = None;
                    folding = update.reports_folded.is_some();
                    apply(handle, update, snapshot_applied, metrics).await
                }
                None => return Ok(()),
            },
            () = tokio::time::sleep_until(answer_due.unwrap_or_else(tokio::time::Instant::now)), if answer_due.is_some() => {
                return Err(SessionError::UpdatesStalled);
            }
            () = detached.wait() => return Err(SessionError::ReportsDropped),
            Some(operation) = reports.recv() => {
                // At most one report per interval: under load the events of a whole interval
                // share one message (and one wake-up of the control plane).
                let since = last_report.elapsed();
                if since < REPORT_INTERVAL {
                    tokio::time::sleep(REPORT_INTERVAL - since).await;
                }
                last_report = Instant::now();
                let report = reporter::batch(operation, reports);
                if report.started.is_empty() && report.ended.is_empty() && report.prefilled.is_empty() {
                    continue;
                }
                if !report.started.is_empty() && folding {
                    unanswered_since.get_or_insert_with(tokio::time::Instant::now);
                }
                Kind::Dispatches(report)
            }
        };
        tokio::select! {
            sent = tokio::time::timeout(REPLY_STALL_LIMIT, replies.send(request(reply))) => match sent {
                Ok(sent) => sent.map_err(|_| SessionError::RepliesClosed)?,
                Err(_) => return Err(SessionError::RepliesStalled),
            },
            () = detached.wait() => return Err(SessionError::ReportsDropped),
        }
    }
}

/// The longest refusal reason sent or logged: one built from a peer's strings (a namespace,
/// say) is cut rather than sent whole.
const MAX_REASON_CHARS: usize = 512;

/// Updates larger than this (encoded) are turned into a view on the blocking pool: a large
/// fleet's snapshot takes milliseconds to convert and build, which on a runtime thread every
/// connection beside it would wait out (all of them on a one-thread runtime).
const ON_THE_RUNTIME_UPDATE_BYTES: usize = 1 << 20;

/// Applies one update to the handle, or explains why not; returns the reply to send.
async fn apply(handle: &FleetHandle, update: pb::FleetUpdate, snapshot_applied: &mut bool, metrics: &Metrics) -> Kind {
    let (version, nonce) = (update.version, update.nonce.clone());
    let before = handle.view();
    let held = before.clone().filter(|_| *snapshot_applied);
    let next = if prost::Message::encoded_len(&update) > ON_THE_RUNTIME_UPDATE_BYTES {
        let build = move || next_view(held.as_deref(), update);
        tokio::task::spawn_blocking(build)
            .await
            .unwrap_or_else(|error| Err(format!("building the view failed: {error}")))
    } else {
        // A fault in building it refuses the update, as on the blocking pool, rather than
        // ending the stream's task and leaving the replica on a view it no longer follows.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| next_view(held.as_deref(), update)))
            .unwrap_or_else(|_| Err("building the view failed: it panicked".to_string()))
    };
    match next {
        Ok((view, snapshot)) => {
            if let Some(before) = before.as_ref().filter(|before| snapshot && before.version() > view.version()) {
                tracing::info!(held = before.version(), received = view.version(), "fleet version went backwards");
            }
            metrics.updates.with_label_values(&["applied"]).inc();
            metrics.stream_connected.set(1);
            handle.store(view);
            // A snapshot shares nothing with the view it replaces, which this may hold last:
            // freed here, a large fleet's would hold up every connection on this runtime.
            if snapshot && let Some(before) = before {
                crate::memory::free_off_the_runtime(before);
            }
            *snapshot_applied |= snapshot;
            Kind::Ack(pb::Ack { version, nonce })
        }
        Err(mut reason) => {
            if let Some((cut, _)) = reason.char_indices().nth(MAX_REASON_CHARS - 1) {
                reason.truncate(cut);
                reason.push('…');
            }
            metrics.updates.with_label_values(&["refused"]).inc();
            tracing::warn!(version, %reason, "refusing a fleet update; keeping the current view");
            Kind::Nack(pb::Nack { version, nonce, reason })
        }
    }
}

/// The view after `update`, and whether it was a snapshot: a snapshot replaces, a delta must
/// fit `held`, the view this stream's updates built (none before its first snapshot). Its
/// backlogs hold the reported operations the update names, and no others. The update's
/// version must be the one its body brings the view to, the version its ack will name. A
/// snapshot older than `held` is refused: within one stream, one control plane's versions only
/// grow (a restarted one opens a new stream, whose first snapshot may be older than the view
/// held), so an older one is a replayed or misrouted message, and would bring back workers
/// since removed.
fn next_view(held: Option<&FleetView>, update: pb::FleetUpdate) -> Result<(FleetView, bool), String> {
    let (version, folded) = (update.version, update.reports_folded.map(ReportsFolded::from));
    let (view, snapshot) = match update_from_wire(update, Instant::now()).map_err(|e| e.to_string())? {
        Update::Snapshot(view) => {
            if let Some(held) = held.filter(|held| view.version() < held.version()) {
                return Err(format!(
                    "a snapshot at version {} is older than version {}, which this stream brought already",
                    view.version(),
                    held.version()
                ));
            }
            (view, true)
        }
        Update::Delta(delta) => match held {
            Some(held) => (held.apply(&delta).map_err(|e| e.to_string())?, false),
            None => {
                return Err(format!(
                    "delta based on version {} arrived before this stream's snapshot",
                    delta.base_version
                ));
            }
        },
    };
    if view.version() != version {
        return Err(format!("the update names version {version} but brings the view to {}", view.version()));
    }
    Ok((view.with_reports_folded(folded), snapshot))
}

fn request(kind: Kind) -> pb::WatchRequest {
    pb::WatchRequest { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use continuum_proto::convert::{delta_to_wire, snapshot_to_wire};
    use continuum_proto::model::DataPlaneConfig;
    use continuum_proto::pb::fleet_update::Body;
    use continuum_proto::view::FleetDelta;

    use super::*;

    fn view(version: u64) -> FleetView {
        FleetView::new(version, [], [], Arc::new(DataPlaneConfig::default())).expect("a view")
    }

    /// A TLS file that cannot be read in time (a stalled volume: here a FIFO no one writes)
    /// costs a reconnect no more than the wait: the files read last serve, the read goes on
    /// alone (a second connect starts no second one), and its outcome is taken once it ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tls_files_stalled_on_a_reconnect_are_not_waited_on_past_the_wait() -> anyhow::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;

        let dir = tempfile::tempdir()?;
        let ca = dir.path().join("ca.crt");
        let pem = rcgen::generate_simple_self_signed(vec!["localhost".into()])?.cert.pem();
        std::fs::write(&ca, &pem)?;
        let mut config = FleetClientConfig::new("https://127.0.0.1:1", "stalled");
        config.tls = Some(ClientTls::Files(crate::fleet::TlsFiles { ca: ca.clone(), identity: None }));
        let wait = Duration::from_millis(200);
        let mut endpoints = Endpoints::new(wait);
        // Nothing read yet and nothing to fall back on: the stall is an error, in time.
        std::fs::rename(&ca, dir.path().join("aside.crt"))?;
        anyhow::ensure!(std::process::Command::new("mkfifo").arg(&ca).status()?.success(), "mkfifo");
        // Each call is bounded by the wait; a call that waited on the stall would never end.
        async fn within<T>(call: impl Future<Output = T>) -> T {
            tokio::time::timeout(Duration::from_secs(60), call).await.expect("not waited on the stall")
        }
        assert!(matches!(within(endpoints.next(&config)).await, Err(EndpointError::Unread(_))));
        // Released (its read ends with nothing read) and the file back: a connect reads it,
        // once the stalled read's outcome is out of the way.
        let release = || std::fs::OpenOptions::new().write(true).custom_flags(0o4000).open(&ca);
        drop(release()?);
        std::fs::remove_file(&ca)?;
        std::fs::write(&ca, &pem)?;
        let mut read = false;
        for _ in 0..3 {
            read |= endpoints.next(&config).await.is_ok();
        }
        assert!(read, "the files read again");
        // Read, then stalled: the files read last serve, and one read at a time goes on.
        std::fs::remove_file(&ca)?;
        anyhow::ensure!(std::process::Command::new("mkfifo").arg(&ca).status()?.success(), "mkfifo");
        let before = endpoints.reads_started;
        for _ in 0..3 {
            assert!(within(endpoints.next(&config)).await.is_ok(), "the last read's endpoint");
        }
        // The first call may start the read (or find the last one still running, and start it
        // on the next), and the read stalls: no call after it starts another.
        assert!(endpoints.reads_started - before <= 1, "{} reads started", endpoints.reads_started - before);
        assert!(endpoints.reading.is_some(), "the stalled read goes on");
        drop(release()?);
        Ok(())
    }

    /// A stream whose connection broke (tonic's status carrying the transport's error) is told
    /// as broken, with its cause once; a status the control plane sent, as a refusal.
    #[test]
    fn a_broken_stream_is_told_by_its_cause_and_a_refusal_by_its_words() {
        let mut broken = Status::unknown("h2 protocol error: error reading a body from connection");
        broken.set_source(Arc::new(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset")));
        assert_eq!(crate::error_chain(&SessionError::from(broken)), "the fleet stream broke: connection reset");
        let refused = SessionError::from(Status::failed_precondition("refused snapshot"));
        assert_eq!(
            crate::error_chain(&refused),
            "control plane refused the stream: refused snapshot (FailedPrecondition)"
        );
    }

    /// Only sessions that ended over refused updates before any snapshot was applied count
    /// toward the slowest reconnects; any other session starts the count over.
    #[test]
    fn sessions_ending_over_a_refused_snapshot_are_counted_in_a_row() {
        let refused = || Err(SessionError::Status(Status::failed_precondition("refused snapshot")));
        let mut count = 0;
        for _ in 0..REFUSED_SNAPSHOTS_BEFORE_SLOWEST {
            count = refused_in_a_row(count, false, &refused());
        }
        assert_eq!(count, REFUSED_SNAPSHOTS_BEFORE_SLOWEST);
        assert_eq!(refused_in_a_row(count, true, &refused()), 0, "deltas refused after a snapshot applied");
        assert_eq!(refused_in_a_row(count, false, &Err(SessionError::NotOpened)), 0);
        assert_eq!(refused_in_a_row(count, false, &Err(SessionError::Status(Status::unavailable("gone")))), 0);
        assert_eq!(refused_in_a_row(count, false, &Ok(())), 0);
    }

    fn update(version: u64, body: Body) -> pb::FleetUpdate {
        pb::FleetUpdate { version, nonce: "n".into(), body: Some(body), reports_folded: None }
    }

    fn snapshot(version: u64, of: u64) -> pb::FleetUpdate {
        update(version, Body::Snapshot(snapshot_to_wire(&view(of), Instant::now())))
    }

    fn delta(version: u64, base: u64) -> pb::FleetUpdate {
        let delta = FleetDelta { base_version: base, version, ..FleetDelta::default() };
        update(version, Body::Delta(delta_to_wire(&delta, Instant::now())))
    }

    /// A snapshot past the runtime's share is built on the blocking pool, and applied the same.
    #[tokio::test(flavor = "current_thread")]
    async fn a_large_snapshot_is_built_off_the_runtime_and_applied() {
        use continuum_proto::model::{Capacity, Role, Worker, WorkerKey};
        let worker = |id: u64| {
            Arc::new(Worker {
                key: WorkerKey::new("dynamo", id),
                role: Role::Decode,
                model: format!("a-model-with-a-rather-long-name-{id:0>64}"),
                component: "backend".into(),
                endpoint: "generate".into(),
                block_size: Some(16),
                capacity: Capacity::default(),
                dp_start_rank: 0,
                dp_size: 0,
                disaggregated_endpoint: None,
                artifacts: None,
            })
        };
        let large =
            FleetView::new(7, (1..=10_000).map(worker), [], Arc::new(DataPlaneConfig::default())).expect("a view");
        let update = update(7, Body::Snapshot(snapshot_to_wire(&large, Instant::now())));
        assert!(prost::Message::encoded_len(&update) > ON_THE_RUNTIME_UPDATE_BYTES);
        let (handle, metrics, mut applied) = (FleetHandle::default(), Metrics::new().expect("metrics"), false);
        let reply = apply(&handle, update, &mut applied, &metrics).await;
        assert!(matches!(reply, Kind::Ack(pb::Ack { version: 7, .. })), "{reply:?}");
        assert!(applied);
        assert_eq!(handle.view().map(|view| view.workers().len()), Some(10_000));
    }

    #[test]
    fn a_stream_starts_with_a_snapshot_and_every_update_brings_the_version_it_names() {
        let (held, applied) = next_view(None, snapshot(5, 5)).expect("a snapshot applies");
        assert!(applied);
        let (next, applied) = next_view(Some(&held), delta(6, 5)).expect("a delta on it");
        assert_eq!((next.version(), applied), (6, false));

        let early = next_view(None, delta(6, 5)).expect_err("no snapshot yet on this stream");
        assert!(early.contains("before this stream's snapshot"), "{early}");
        // A delta's target is its update's version; a snapshot carries its own as well.
        let refused = next_view(Some(&next), snapshot(20, 19)).expect_err("the versions disagree");
        assert!(refused.contains("names version 20 but brings the view to 19"), "{refused}");
        // Within the stream, a snapshot older than the view it built is refused; one as new or
        // newer replaces it.
        let older = next_view(Some(&next), snapshot(5, 5)).expect_err("older than the stream's view");
        assert!(older.contains("older than version 6"), "{older}");
        let (same, applied) = next_view(Some(&next), snapshot(6, 6)).expect("as new");
        assert_eq!((same.version(), applied), (6, true));
    }
}
