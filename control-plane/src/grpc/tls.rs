//! The Fleet service's TLS, renewed without a restart.
//!
//! Certificates in a cluster are short-lived: cert-manager renews them in place, and the kubelet
//! swaps a mounted Secret's files at once. So the files are read again every
//! [`RELOAD_INTERVAL`] and at every configuration reload. A certificate, key and client CA
//! that load together replace the running ones for the connections accepted from then on;
//! open connections keep the ones they were accepted with. Files that do not load together
//! (a certificate written before its key, say) are refused, counted and logged once, and the
//! running ones kept.
//!
//! The handshakes are this module's, not tonic's, because tonic's TLS is fixed when its server
//! starts: [`incoming`] accepts, shakes hands with whatever configuration is current, and hands
//! tonic the connections that completed.

use std::collections::VecDeque;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use prometheus::{IntCounterVec, IntGauge};
use ring::digest::{Context, SHA256};
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{AbortHandle, JoinSet};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Connected;

use crate::config::ListenerTlsConfig;
use crate::grpc::FleetConnection;
use crate::listen::{Guard, Guarded};
use crate::metrics::Metrics;

/// How often the certificate files are read again for a renewal.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);
/// How long a client may take over its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections whose handshake completed, waiting for tonic to take them.
const READY_QUEUE: usize = 64;
/// Handshakes under way at once; past it, the oldest is given up for the newest. A flood of
/// clients that never finish theirs holds this many tasks, and no more.
pub const MAX_HANDSHAKES: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("cert and key are both required")]
    Incomplete,
    #[error("{what} {path}: {reason}")]
    Pem { what: &'static str, path: PathBuf, reason: String },
    #[error("{0}")]
    Config(String),
}

/// The files' contents, read together so that they are checked as one set.
struct Files {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl Files {
    fn read(paths: &ListenerTlsConfig) -> Result<Self, TlsError> {
        let (Some(cert), Some(key)) = (&paths.cert, &paths.key) else { return Err(TlsError::Incomplete) };
        let read = |path: &Path| std::fs::read(path).map_err(|source| TlsError::Read { path: path.into(), source });
        let cert = read(cert)?;
        // The key's path is configured as a secret: an error names it masked.
        let key = std::fs::read(key.expose())
            .map_err(|source| TlsError::Read { path: PathBuf::from(crate::config::MASK), source })?;
        Ok(Self { cert, key, client_ca: paths.client_ca.as_deref().map(read).transpose()? })
    }

    /// When the served certificate (the first of `cert`) is valid from and until, if it parses.
    fn validity(&self) -> Option<Validity> {
        validity(&CertificateDer::pem_slice_iter(&self.cert).next()?.ok()?)
    }

    /// What tells one set of files from another, without keeping a copy of the key.
    fn digest(&self) -> [u8; 32] {
        Self::digest_of(&[Some(&self.cert), Some(&self.key), self.client_ca.as_ref()])
    }

    /// What tells one client CA from another (none included).
    fn trust(&self) -> [u8; 32] {
        Self::digest_of(&[self.client_ca.as_ref()])
    }

    fn digest_of(parts: &[Option<&Vec<u8>>]) -> [u8; 32] {
        let mut context = Context::new(&SHA256);
        for part in parts {
            let part = part.map_or(&[][..], Vec::as_slice);
            context.update(&(part.len() as u64).to_le_bytes());
            context.update(part);
        }
        let mut digest = [0; 32];
        digest.copy_from_slice(context.finish().as_ref());
        digest
    }

    /// A rustls server configuration serving HTTP/2 with this certificate, asking for a client
    /// certificate signed by `client_ca` when there is one.
    fn server_config(&self, paths: &ListenerTlsConfig) -> Result<Arc<ServerConfig>, TlsError> {
        let path = |path: Option<&Path>| path.map(Path::to_path_buf).unwrap_or_default();
        let (cert_path, ca_path) = (path(paths.cert.as_deref()), path(paths.client_ca.as_deref()));
        let certs = certificates(&self.cert, "cert", &cert_path)?;
        if let Some(leaf) = certs.first() {
            in_validity(leaf, &cert_path)?;
        }
        let key = PrivateKeyDer::from_pem_slice(&self.key).map_err(|error| TlsError::Pem {
            what: "key",
            path: PathBuf::from(crate::config::MASK),
            reason: format!("holds no PEM private key ({error})"),
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|error| TlsError::Config(error.to_string()))?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in certificates(ca, "client_ca", &ca_path)? {
                    roots.add(cert).map_err(|error| TlsError::Pem {
                        what: "client_ca",
                        path: ca_path.clone(),
                        reason: format!("is not a usable CA certificate ({error})"),
                    })?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .map_err(|error| TlsError::Config(format!("client_ca: {error}")))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|error| TlsError::Config(format!("cert and key do not load as one pair: {error}")))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }
}

/// Whether the served certificate is within its validity period now. rustls loads an expired
/// (or not yet valid) certificate as readily as a current one, and no replica would accept it:
/// a rollback to an old Secret would otherwise replace a working certificate with a useless
/// one. A set refused for being early is taken at a later refresh, once it is valid.
fn in_validity(leaf: &CertificateDer<'_>, path: &Path) -> Result<(), TlsError> {
    let invalid = |reason: String| TlsError::Pem { what: "cert", path: path.to_path_buf(), reason };
    let (_, parsed) = x509_parser::parse_x509_certificate(leaf.as_ref())
        .map_err(|error| invalid(format!("is not an X.509 certificate ({error})")))?;
    let validity = parsed.validity();
    let now = x509_parser::time::ASN1Time::now();
    if now < validity.not_before {
        return Err(invalid(format!("is not valid before {}", validity.not_before)));
    }
    if now > validity.not_after {
        return Err(invalid(format!("expired at {}", validity.not_after)));
    }
    Ok(())
}

fn certificates(pem: &[u8], what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let invalid = |reason: String| TlsError::Pem { what, path: path.to_path_buf(), reason };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| invalid(format!("is not PEM ({error})")))?;
    if certs.is_empty() {
        return Err(invalid("holds no PEM certificate".into()));
    }
    Ok(certs)
}

/// A set of files read and built into a configuration, not served yet.
pub struct Prepared {
    paths: ListenerTlsConfig,
    digest: [u8; 32],
    trust: [u8; 32],
    config: Arc<ServerConfig>,
    validity: Option<Validity>,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared").field("paths", &self.paths).finish_non_exhaustive()
    }
}

/// Reads and builds `paths`' files: whether they make a working configuration, and the one to
/// serve ([`ServerTls::apply`]) if so.
pub fn prepare(paths: &ListenerTlsConfig) -> Result<Prepared, TlsError> {
    let files = Files::read(paths)?;
    let config = files.server_config(paths)?;
    let validity = files.validity();
    Ok(Prepared { paths: paths.clone(), digest: files.digest(), trust: files.trust(), config, validity })
}

/// The running TLS configuration and where its files are. Clones share it.
#[derive(Clone)]
pub struct ServerTls {
    state: Arc<Mutex<State>>,
    current: watch::Receiver<Arc<ServerConfig>>,
    reloads: IntCounterVec,
    handshakes_failed: IntCounterVec,
    /// `continuum_fleet_tls_certificate_not_after_seconds`.
    not_after: IntGauge,
}

struct State {
    paths: ListenerTlsConfig,
    digest: [u8; 32],
    /// The client CA's digest, and a count of its changes for the streams verified against an
    /// earlier one ([`ServerTls::trust_changes`]).
    trust: [u8; 32],
    trust_changes: watch::Sender<u64>,
    /// Bumped by every swap: a refresh that read its files before one is older than what it
    /// would replace.
    generation: u64,
    /// The last set of files refused, so that a set that keeps failing is reported once.
    refused: Option<Refused>,
    publish: watch::Sender<Arc<ServerConfig>>,
    /// When the served certificate is valid, and whether its expiry was warned of.
    validity: Option<Validity>,
    expiry_warned: bool,
}

#[derive(PartialEq, Eq)]
enum Refused {
    Files([u8; 32]),
    Unreadable(String),
}

/// How long before the served certificate expires the control plane warns of it.
pub const EXPIRY_WARNING: Duration = Duration::from_secs(24 * 60 * 60);

/// What a refresh did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refresh {
    Unchanged,
    Applied,
}

impl ServerTls {
    /// Loads `paths`' files, which must make a working configuration.
    pub fn load(paths: &ListenerTlsConfig, metrics: &Metrics) -> Result<Self, TlsError> {
        let Prepared { paths, digest, trust, config, validity } = prepare(paths)?;
        let (publish, current) = watch::channel(config);
        let trust_changes = watch::Sender::new(0);
        let state = State {
            paths,
            digest,
            trust,
            trust_changes,
            generation: 0,
            refused: None,
            publish,
            validity,
            expiry_warned: false,
        };
        let tls = Self {
            state: Arc::new(Mutex::new(state)),
            current,
            reloads: metrics.fleet_tls_reloads.clone(),
            handshakes_failed: metrics.fleet_tls_handshakes_failed.clone(),
            not_after: metrics.fleet_tls_certificate_not_after.clone(),
        };
        tls.note_expiry(&mut tls.state());
        Ok(tls)
    }

    /// Counts changes of the client CA: a connection verified against an earlier one may hold
    /// a certificate the new one does not trust (a replica revoked by rotating its CA out), so
    /// the Watch streams opened before a change end with it ([`crate::grpc::FleetService::with_trust`]).
    pub fn trust_changes(&self) -> watch::Receiver<u64> {
        self.state().trust_changes.subscribe()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reads the files again and serves them from the next connection on if they changed and
    /// load. A failure keeps the running configuration; each refused set of files is counted
    /// and logged once, however often it is read.
    pub fn refresh(&self) -> Result<Refresh, TlsError> {
        // Read without the lock: a read stalled on its volume must not hold up a reload that
        // moves the files elsewhere (which takes the lock to swap them in).
        let (paths, generation) = {
            let state = self.state();
            (state.paths.clone(), state.generation)
        };
        let read = Files::read(&paths);
        let mut state = self.state();
        self.note_expiry(&mut state);
        if state.generation != generation {
            // Swapped meanwhile (files moved, or renewed ones read by another refresh): what
            // this one read may be older than what is served. The next refresh reads again.
            return Ok(Refresh::Unchanged);
        }
        let (set, prepared) = match read {
            Err(error) => (Refused::Unreadable(error.to_string()), Err(error)),
            Ok(files) => {
                let digest = files.digest();
                if digest == state.digest {
                    state.refused = None;
                    return Ok(Refresh::Unchanged);
                }
                let (trust, validity) = (files.trust(), files.validity());
                let prepared =
                    files.server_config(&paths).map(|config| Prepared { paths, digest, trust, config, validity });
                (Refused::Files(digest), prepared)
            }
        };
        match prepared {
            Ok(prepared) => Ok(self.swap(&mut state, prepared)),
            Err(error) => {
                if state.refused.as_ref() != Some(&set) {
                    self.reloads.with_label_values(&["refused"]).inc();
                    tracing::warn!(%error, "control_plane.tls: the files do not load; keeping the running certificate");
                    state.refused = Some(set);
                }
                Err(error)
            }
        }
    }

    /// Shows when the served certificate expires, and warns once when that is less than
    /// [`EXPIRY_WARNING`] away, or a third of its lifetime for one issued for less (a mesh's
    /// hour-long certificates are renewed well before): files that stopped being renewed (an
    /// issuer down) are otherwise noticed only as replicas' handshakes start failing once it
    /// has expired.
    fn note_expiry(&self, state: &mut State) {
        let Some(Validity { from, until }) = state.validity else { return };
        let seconds = until.duration_since(std::time::UNIX_EPOCH).map_or(0, |since| since.as_secs());
        self.not_after.set(i64::try_from(seconds).unwrap_or(i64::MAX));
        let lifetime = until.duration_since(from).unwrap_or_default();
        let left = until.duration_since(std::time::SystemTime::now()).unwrap_or_default();
        if left < EXPIRY_WARNING.min(lifetime / 3) && !std::mem::replace(&mut state.expiry_warned, true) {
            let expires = humantime::format_rfc3339_seconds(until);
            tracing::warn!(%expires, "control_plane.tls: the served certificate expires soon and no renewed one has loaded");
        }
    }

    /// Serves `prepared` (files that moved, checked by [`prepare`]) from the next connection on.
    pub fn apply(&self, prepared: Prepared) -> Refresh {
        let mut state = self.state();
        if prepared.digest == state.digest && prepared.paths == state.paths {
            return Refresh::Unchanged;
        }
        self.swap(&mut state, prepared)
    }

    fn swap(&self, state: &mut State, Prepared { paths, digest, trust, config, validity }: Prepared) -> Refresh {
        state.publish.send_replace(config);
        (state.paths, state.digest, state.refused) = (paths, digest, None);
        (state.validity, state.expiry_warned) = (validity, false);
        self.note_expiry(state);
        if std::mem::replace(&mut state.trust, trust) != trust {
            tracing::warn!(
                "control_plane.tls: the client CA changed; ending the Watch streams verified against the old one"
            );
            state.trust_changes.send_modify(|changes| *changes += 1);
        }
        state.generation += 1;
        self.reloads.with_label_values(&["applied"]).inc();
        tracing::info!("control_plane.tls: serving the renewed certificate to new connections");
        Refresh::Applied
    }

    /// Refreshes every `interval` until `cancel`, reading the files on the blocking pool: a
    /// stalled volume must not hold a runtime thread (and the Fleet streams on it).
    pub async fn follow_files(self, interval: Duration, cancel: CancellationToken) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = ticks.tick() => {
                    // Refusals are logged and counted by `refresh`; the running files stay. A
                    // read stalled on its volume is left behind when the control plane stops.
                    let tls = self.clone();
                    let refresh = tokio::task::spawn_blocking(move || tls.refresh());
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        _ = refresh => {}
                    }
                }
            }
        }
    }
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").field("paths", &self.state().paths).finish_non_exhaustive()
    }
}

/// Why a handshake did not complete: the `reason` of `continuum_fleet_tls_handshakes_failed_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandshakeFailure {
    /// The peer closed before finishing: a TCP probe or a port scan, usually.
    Closed,
    /// It took longer than [`HANDSHAKE_TIMEOUT`].
    Timeout,
    /// Its slot went to a newer connection while [`MAX_HANDSHAKES`] were under way, or it
    /// completed while its queue of connections waiting for the server (64) was full.
    Evicted,
    /// TLS refused it: no client certificate the CA signed, no common protocol, garbage.
    Refused,
}

impl HandshakeFailure {
    pub const ALL: [Self; 4] = [Self::Closed, Self::Timeout, Self::Evicted, Self::Refused];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Timeout => "timeout",
            Self::Evicted => "evicted",
            Self::Refused => "refused",
        }
    }
}

/// The TLS connections made on `listener`, each shaken hands with the configuration current
/// when it was accepted, until `shutdown` or until the stream is dropped (either ends the
/// handshakes under way too).
///
/// A failed or slow handshake is counted and dropped; it never holds up the others. Accepting
/// never pauses: past [`MAX_HANDSHAKES`] under way the oldest is given up. A replica completes
/// its handshake in a round trip or two, so a crowd of idle connections can delay it by no more
/// than it takes them to be evicted, not lock it out.
pub fn incoming(
    (listener, guard): (TcpListener, Guard),
    tls: &ServerTls,
    shutdown: CancellationToken,
) -> ReceiverStream<io::Result<Verified>> {
    incoming_within((listener, guard), tls, MAX_HANDSHAKES, shutdown)
}

fn incoming_within(
    (listener, guard): (TcpListener, Guard),
    tls: &ServerTls,
    max_handshakes: usize,
    shutdown: CancellationToken,
) -> ReceiverStream<io::Result<Verified>> {
    let (ready, incoming) = mpsc::channel(READY_QUEUE);
    let (current, failed, trust) = (tls.current.clone(), tls.handshakes_failed.clone(), tls.trust_changes());
    tokio::spawn(async move {
        let mut handshakes = JoinSet::new();
        let mut oldest_first: VecDeque<AbortHandle> = VecDeque::new();
        loop {
            let stream = tokio::select! {
                () = shutdown.cancelled() => return,
                () = ready.closed() => return,
                (stream, _) = guard.accept(&listener) => stream,
            };
            while handshakes.try_join_next().is_some() {}
            oldest_first.retain(|handshake| !handshake.is_finished());
            if oldest_first.len() >= max_handshakes
                && let Some(oldest) = oldest_first.pop_front()
            {
                oldest.abort();
                failed.with_label_values(&[HandshakeFailure::Evicted.as_str()]).inc();
            }
            // Marked before the acceptor is taken: a change of the client CA from here on (the
            // handshake verifying against the old one) revokes the connection; at worst one
            // verified against the new CA is revoked too, and its replica dials again.
            let mut trust = trust.clone();
            trust.mark_unchanged();
            let acceptor = TlsAcceptor::from(Arc::clone(&current.borrow()));
            let (ready, failed) = (ready.clone(), failed.clone());
            oldest_first.push_back(handshakes.spawn(async move {
                let peer = stream.get_ref().peer_addr().ok();
                let failure = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    // Handed over without waiting, so a completed handshake is never among
                    // those under way (which may be evicted). tonic takes each connection as it
                    // comes: a full queue means it is far behind, and the connection is dropped.
                    Ok(Ok(stream)) => match ready.try_send(Ok(Verified::new(stream, trust))) {
                        Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => return,
                        Err(mpsc::error::TrySendError::Full(_)) => HandshakeFailure::Evicted,
                    },
                    Ok(Err(error)) if error.kind() == io::ErrorKind::UnexpectedEof => HandshakeFailure::Closed,
                    Ok(Err(error)) => {
                        // Warned of (within a budget): a replica with the wrong client CA or
                        // certificate shows here first.
                        continuum_proto::warn_limited!(?peer, %error, "a Fleet client's TLS handshake failed");
                        HandshakeFailure::Refused
                    }
                    Err(_) => HandshakeFailure::Timeout,
                };
                failed.with_label_values(&[failure.as_str()]).inc();
            }));
        }
    });
    ReceiverStream::new(incoming)
}

/// A Fleet connection that reads nothing more once the client CA it was verified against has
/// changed, or the client certificate it was verified with has expired: the calls on it (a
/// replica's lookups, its Watch stream) end with it, and the replica dials again, to be
/// verified anew. (A replica's connection never goes quiet, its pings answered every 10 s, so
/// without this a certificate checked once would be good for as long as the connection
/// lasted.) Writes go on, so the status that ends its Watch stream still reaches it.
#[derive(Debug)]
pub struct Verified {
    inner: TlsStream<Guarded<TcpStream>>,
    trust: watch::Receiver<u64>,
    /// When the client's certificate expires (`None`: no client certificate).
    expiry: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Verified {
    fn new(inner: TlsStream<Guarded<TcpStream>>, trust: watch::Receiver<u64>) -> Self {
        let leaf = inner.get_ref().1.peer_certificates().and_then(<[CertificateDer<'_>]>::first);
        let expiry = leaf.and_then(validity).map(|Validity { until, .. }| {
            let left = until.duration_since(std::time::SystemTime::now()).unwrap_or_default();
            Box::pin(tokio::time::sleep(left))
        });
        Self { inner, trust, expiry }
    }
}

/// When a certificate is valid: from, and until.
#[derive(Clone, Copy, Debug)]
struct Validity {
    from: std::time::SystemTime,
    until: std::time::SystemTime,
}

/// A certificate's validity, if it parses.
fn validity(cert: &CertificateDer<'_>) -> Option<Validity> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let time = |at: x509_parser::time::ASN1Time| {
        std::time::UNIX_EPOCH.checked_add(Duration::from_secs(u64::try_from(at.timestamp()).ok()?))
    };
    let from = time(parsed.validity().not_before).unwrap_or(std::time::UNIX_EPOCH);
    Some(Validity { from, until: time(parsed.validity().not_after)? })
}

impl AsyncRead for Verified {
    fn poll_read(self: Pin<&mut Self>, cx: &mut TaskContext<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.trust.has_changed().unwrap_or(false) {
            let revoked = "the client CA this connection was verified against changed";
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionAborted, revoked)));
        }
        if let Some(expiry) = &mut this.expiry
            && expiry.as_mut().poll(cx).is_ready()
        {
            let expired = "the client certificate this connection was verified with expired";
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionAborted, expired)));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Verified {
    fn poll_write(self: Pin<&mut Self>, cx: &mut TaskContext<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The connection's own, under the TLS session: the lookup budget finds it as on a plaintext
/// connection.
impl Connected for Verified {
    type ConnectInfo = FleetConnection;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.get_ref().0.connect_info()
    }
}

#[cfg(test)]
mod tests;
