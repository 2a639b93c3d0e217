use super::*;
use crate::config::Secret;

/// Writes a fresh self-signed certificate for `name` and its key over `dir`'s cert.pem and
/// key.pem.
fn write_pair(dir: &Path, name: &str) {
    let pair = rcgen::generate_simple_self_signed(vec![name.to_owned()]).expect("a certificate");
    std::fs::write(dir.join("cert.pem"), pair.cert.pem()).expect("written");
    std::fs::write(dir.join("key.pem"), pair.signing_key.serialize_pem()).expect("written");
}

fn paths(dir: &Path) -> ListenerTlsConfig {
    ListenerTlsConfig {
        cert: Some(dir.join("cert.pem")),
        key: Some(Secret::new(dir.join("key.pem").display().to_string())),
        client_ca: None,
    }
}

fn counted(tls: &ServerTls, result: &str) -> u64 {
    tls.reloads.with_label_values(&[result]).get()
}

/// Waits until a thread of this process is blocked opening a FIFO nobody writes (the kernel's
/// `wait_for_partner`): a fixed sleep would not know that the refresh got there.
fn until_a_thread_waits_on_a_fifo() {
    let waiting = || {
        std::fs::read_dir("/proc/self/task").is_ok_and(|tasks| {
            tasks.flatten().any(|task| {
                std::fs::read_to_string(task.path().join("wchan"))
                    .is_ok_and(|w| w.starts_with("wait_for_partner") || w.starts_with("fifo_open"))
            })
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !waiting() {
        assert!(std::time::Instant::now() < deadline, "no thread blocked on the FIFO within 10 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A refresh whose read stalls on its volume (here a FIFO nobody writes: opening it
/// blocks) holds no lock: the reload that moves the files elsewhere goes through.
#[test]
fn a_stalled_read_does_not_hold_up_moving_the_files() {
    let (stalled, healthy) = (tempfile::tempdir().expect("a directory"), tempfile::tempdir().expect("a directory"));
    write_pair(stalled.path(), "one.test");
    write_pair(healthy.path(), "two.test");
    let metrics = Metrics::new().expect("metrics");
    let tls = Arc::new(ServerTls::load(&paths(stalled.path()), &metrics).expect("loads"));
    let cert = stalled.path().join("cert.pem");
    std::fs::remove_file(&cert).expect("removed");
    let made = std::process::Command::new("mkfifo").arg(&cert).status().expect("mkfifo runs");
    assert!(made.success());
    let refreshing = Arc::clone(&tls);
    let stuck = std::thread::spawn(move || refreshing.refresh().is_ok());
    until_a_thread_waits_on_a_fifo();
    let prepared = prepare(&paths(healthy.path())).expect("the healthy files load");
    let (done, applied) = std::sync::mpsc::channel();
    let moving = Arc::clone(&tls);
    std::thread::spawn(move || {
        let _ = done.send(moving.apply(prepared));
    });
    let outcome = applied.recv_timeout(Duration::from_secs(5));
    // Let the stalled read go: a writer opens the FIFO and closes it at once (without
    // blocking, should the refresh never have opened it).
    use std::os::unix::fs::OpenOptionsExt;
    drop(std::fs::OpenOptions::new().write(true).custom_flags(0o4000).open(&cert));
    assert!(matches!(outcome, Ok(Refresh::Applied)), "the move waited on the stalled read: {outcome:?}");
    assert!(stuck.join().expect("the refresh ends"), "the moved files are what is served");
}

/// A refresh whose read began before a renewal another refresh served does not put back
/// what it read (nor count it as refused): the newer files stay.
#[test]
fn a_refresh_that_read_before_a_renewal_leaves_the_renewed_files_served() {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = tempfile::tempdir().expect("a directory");
    write_pair(dir.path(), "one.test");
    let metrics = Metrics::new().expect("metrics");
    let tls = Arc::new(ServerTls::load(&paths(dir.path()), &metrics).expect("loads"));
    // The slow read: the certificate is a FIFO the first refresh waits on.
    let (cert, slow) = (dir.path().join("cert.pem"), dir.path().join("slow.pem"));
    std::fs::remove_file(&cert).expect("removed");
    assert!(std::process::Command::new("mkfifo").arg(&cert).status().expect("mkfifo runs").success());
    let slow_refresh = Arc::clone(&tls);
    let stuck = std::thread::spawn(move || slow_refresh.refresh());
    until_a_thread_waits_on_a_fifo();
    // The renewal lands where the FIFO was and another refresh serves it.
    std::fs::rename(&cert, &slow).expect("moved aside");
    write_pair(dir.path(), "two.test");
    assert!(matches!(tls.refresh(), Ok(Refresh::Applied)));
    let renewed = Arc::clone(&tls.current.borrow());
    drop(std::fs::OpenOptions::new().write(true).custom_flags(0o4000).open(&slow));
    assert!(matches!(stuck.join().expect("the refresh ends"), Ok(Refresh::Unchanged)));
    assert!(Arc::ptr_eq(&renewed, &tls.current.borrow()), "the renewed files are still served");
    assert_eq!(counted(&tls, "refused"), 0, "what the slow refresh read is no refusal");
}

#[test]
fn renewed_files_are_served_and_a_broken_set_is_refused_once_while_the_running_one_stays() {
    let dir = tempfile::tempdir().expect("a directory");
    write_pair(dir.path(), "one.test");
    let metrics = Metrics::new().expect("metrics");
    let tls = ServerTls::load(&paths(dir.path()), &metrics).expect("loads");
    let first = Arc::clone(&tls.current.borrow());
    assert_eq!(tls.refresh().expect("reads"), Refresh::Unchanged);

    // Mid-rotation: the certificate is new and the key still the old one's.
    let old_key = std::fs::read(dir.path().join("key.pem")).expect("read");
    write_pair(dir.path(), "two.test");
    std::fs::write(dir.path().join("key.pem"), &old_key).expect("written");
    for _ in 0..3 {
        let error = tls.refresh().expect_err("a certificate and a key of two pairs");
        assert!(error.to_string().contains("do not load as one pair"), "{error}");
    }
    assert_eq!(counted(&tls, "refused"), 1, "one refusal per broken set, however often it is read");
    assert!(Arc::ptr_eq(&first, &tls.current.borrow()), "the running certificate stays");

    write_pair(dir.path(), "three.test");
    assert_eq!(tls.refresh().expect("a whole pair"), Refresh::Applied);
    assert_eq!(counted(&tls, "applied"), 1);
    assert!(!Arc::ptr_eq(&first, &tls.current.borrow()), "new connections get the renewed one");
    assert_eq!(tls.refresh().expect("reads"), Refresh::Unchanged);
}

/// Writes a self-signed pair valid only between the two years given.
fn write_dated_pair(dir: &Path, (from, until): (i32, i32)) {
    let mut params = rcgen::CertificateParams::new(vec!["dated.test".to_owned()]).expect("params");
    params.not_before = rcgen::date_time_ymd(from, 1, 1);
    params.not_after = rcgen::date_time_ymd(until, 1, 1);
    let key = rcgen::KeyPair::generate().expect("a key");
    let cert = params.self_signed(&key).expect("a certificate");
    std::fs::write(dir.join("cert.pem"), cert.pem()).expect("written");
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).expect("written");
}

/// A certificate no replica would accept, because it expired or is not valid yet, is
/// refused like a broken set: at start, and at a refresh, which keeps the running one.
#[test]
fn a_certificate_outside_its_validity_period_is_refused_and_the_running_one_stays() {
    let dir = tempfile::tempdir().expect("a directory");
    write_dated_pair(dir.path(), (2000, 2001));
    let metrics = Metrics::new().expect("metrics");
    let error = ServerTls::load(&paths(dir.path()), &metrics).map(drop).expect_err("expired").to_string();
    assert!(error.contains("cert.pem") && error.contains("expired at"), "{error}");
    write_pair(dir.path(), "one.test");
    let tls = ServerTls::load(&paths(dir.path()), &metrics).expect("loads");
    let first = Arc::clone(&tls.current.borrow());
    for (years, says) in [((2000, 2001), "expired at"), ((2999, 3000), "is not valid before")] {
        write_dated_pair(dir.path(), years);
        let error = tls.refresh().expect_err("outside its validity").to_string();
        assert!(error.contains(says), "{error}");
        assert!(Arc::ptr_eq(&first, &tls.current.borrow()), "the running certificate stays");
    }
    write_pair(dir.path(), "two.test");
    assert_eq!(tls.refresh().expect("a current pair"), Refresh::Applied);
}

/// The served certificate's expiry shows on a gauge, and one less than a day away is warned
/// of once: files no longer renewed are otherwise noticed only as handshakes fail.
#[test]
fn the_served_certificates_expiry_shows_and_a_near_one_is_warned_of_once() {
    use crate::test_logs::{captured, warnings};
    let dir = tempfile::tempdir().expect("a directory");
    write_pair(dir.path(), "far.test");
    let metrics = Metrics::new().expect("metrics");
    let (tls, logged) = captured(|| ServerTls::load(&paths(dir.path()), &metrics).expect("loads"));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_secs();
    let shown = || u64::try_from(metrics.fleet_tls_certificate_not_after.get()).expect("positive");
    assert!(shown() > now + 365 * 24 * 3600, "far off: {}", shown());
    assert_eq!(warnings(&logged), 0);

    let expires = now + 3600;
    let write = |name: &str, issued: u64| {
        let mut params = rcgen::CertificateParams::new(vec![name.to_owned()]).expect("params");
        params.not_before = rcgen::date_time_ymd(1970, 1, 1) + Duration::from_secs(issued);
        params.not_after = rcgen::date_time_ymd(1970, 1, 1) + Duration::from_secs(expires);
        let key = rcgen::KeyPair::generate().expect("a key");
        std::fs::write(dir.path().join("cert.pem"), params.self_signed(&key).expect("signed").pem()).expect("written");
        std::fs::write(dir.path().join("key.pem"), key.serialize_pem()).expect("written");
    };
    // Issued for an hour a minute ago, as a mesh's are: a third of its lifetime is left
    // well after this, so nothing to warn of.
    write("hourly.test", now - 60);
    let (refreshed, logged) = captured(|| tls.refresh());
    assert_eq!(refreshed.expect("renewed"), Refresh::Applied);
    assert_eq!((shown(), warnings(&logged)), (expires, 0), "{logged}");
    // Issued years ago and an hour from expiring: no renewal came.
    write("near.test", now - 3 * 365 * 24 * 3600);
    let (refreshed, logged) = captured(|| tls.refresh());
    assert_eq!(refreshed.expect("renewed"), Refresh::Applied);
    assert_eq!(shown(), expires);
    assert_eq!(warnings(&logged), 1, "{logged}");
    let (_, logged) = captured(|| tls.refresh());
    assert_eq!(warnings(&logged), 0, "once");
}

#[test]
fn files_that_do_not_load_say_which_and_why() {
    let dir = tempfile::tempdir().expect("a directory");
    let metrics = Metrics::new().expect("metrics");
    let error = ServerTls::load(&paths(dir.path()), &metrics).expect_err("no files").to_string();
    assert!(error.contains("cert.pem"), "{error}");
    write_pair(dir.path(), "one.test");
    std::fs::write(dir.path().join("ca.pem"), "not a certificate").expect("written");
    let with_ca = ListenerTlsConfig { client_ca: Some(dir.path().join("ca.pem")), ..paths(dir.path()) };
    let error = prepare(&with_ca).map(drop).expect_err("no CA certificate").to_string();
    assert!(error.contains("client_ca") && error.contains("holds no PEM certificate"), "{error}");
    std::fs::write(dir.path().join("key.pem"), "not a key").expect("written");
    let error = prepare(&paths(dir.path())).map(drop).expect_err("no key").to_string();
    assert!(error.contains("key") && error.contains("holds no PEM private key"), "{error}");
    // The key's path is a secret: named masked, whether unreadable or not a key.
    assert!(!error.contains("key.pem") && error.contains(crate::config::MASK), "{error}");
    std::fs::remove_file(dir.path().join("key.pem")).expect("removed");
    let error = prepare(&paths(dir.path())).map(drop).expect_err("no key file").to_string();
    assert!(!error.contains("key.pem") && error.contains(crate::config::MASK), "{error}");
}

/// A TLS client trusting `dir`'s self-signed certificate for `name`.
async fn handshake(addr: std::net::SocketAddr, dir: &Path, name: &'static str) -> io::Result<()> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(dir.join("cert.pem"))?;
    for cert in CertificateDer::pem_slice_iter(&pem) {
        roots.add(cert.map_err(io::Error::other)?).map_err(io::Error::other)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(io::Error::other)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let stream = TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from(name).map_err(io::Error::other)?;
    tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, stream).await.map(drop)
}

#[tokio::test]
async fn idle_connections_never_lock_a_client_out_and_probes_are_told_from_refusals() {
    use tokio_stream::StreamExt;

    let dir = tempfile::tempdir().expect("a directory");
    write_pair(dir.path(), "fleet.test");
    let metrics = Metrics::new().expect("metrics");
    let tls = ServerTls::load(&paths(dir.path()), &metrics).expect("loads");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bound");
    let addr = listener.local_addr().expect("an address");
    let shutdown = CancellationToken::new();
    let guard = Guard::fleet(&metrics);
    let mut incoming = incoming_within((listener, guard), &tls, 2, shutdown.clone());
    let failed = |reason: HandshakeFailure| tls.handshakes_failed.with_label_values(&[reason.as_str()]).get();

    // Two connections that never say a word fill every handshake slot...
    let idle = [TcpStream::connect(addr).await.expect("connects"), TcpStream::connect(addr).await.expect("connects")];
    // ...and a client still completes its handshake: the oldest idle one gives way.
    handshake(addr, dir.path(), "fleet.test").await.expect("a completed handshake");
    let accepted = tokio::time::timeout(Duration::from_secs(5), incoming.next()).await.expect("handed over");
    assert!(accepted.is_some_and(|stream| stream.is_ok()));
    assert_eq!(failed(HandshakeFailure::Evicted), 1);

    // A TCP probe that connects and leaves is not a refused client.
    drop(idle);
    drop(TcpStream::connect(addr).await.expect("connects"));
    // A client that does not trust the certificate fails its handshake; the server sees a refusal.
    let other = tempfile::tempdir().expect("a directory");
    write_pair(other.path(), "fleet.test");
    handshake(addr, other.path(), "fleet.test").await.expect_err("an unknown issuer");
    let settled = async {
        while failed(HandshakeFailure::Closed) < 2 || failed(HandshakeFailure::Refused) < 1 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), settled).await.expect("each counted by its reason");
    assert_eq!(failed(HandshakeFailure::Timeout), 0);
    shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn the_files_are_followed_without_a_reload() {
    let dir = tempfile::tempdir().expect("a directory");
    write_pair(dir.path(), "one.test");
    let metrics = Metrics::new().expect("metrics");
    let tls = ServerTls::load(&paths(dir.path()), &metrics).expect("loads");
    let mut current = tls.current.clone();
    let cancel = CancellationToken::new();
    let following = tokio::spawn(tls.clone().follow_files(RELOAD_INTERVAL, cancel.clone()));
    write_pair(dir.path(), "two.test");
    let started = tokio::time::Instant::now();
    tokio::time::timeout(2 * RELOAD_INTERVAL, current.changed()).await.expect("renewed").expect("open");
    assert!(started.elapsed() >= RELOAD_INTERVAL, "at the next poll, not before");
    cancel.cancel();
    following.await.expect("stopped");
}
