use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

fn closed() -> IntCounterVec {
    IntCounterVec::new(prometheus::Opts::new("closed", "closed"), &["listener", "reason"]).expect("counter")
}

async fn pair(listener: &TcpListener) -> io::Result<(TcpStream, TcpStream)> {
    let client = TcpStream::connect(listener.local_addr()?).await?;
    let (server, _) = listener.accept().await?;
    Ok((client, server))
}

/// A peer that keeps sending keeps its connection; one that falls silent loses it, counted.
#[tokio::test]
async fn a_silent_peer_is_closed_and_a_talking_one_is_not() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let counter = closed();
    // Writes every 150 ms for 3 s against a 2 s limit: a read that did not put the limit off
    // would time out while the peer talks, and a loaded machine's late timer cannot make a
    // talking peer look silent.
    let guard = Guard::new("test", 4, counter.clone()).silent_after(Duration::from_secs(2));
    let (mut client, server) = pair(&listener).await?;
    let mut server = guard.admit(server, LOCAL).expect("room");
    let mut buf = [0u8; 16];
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        client.write_all(b"ping").await?;
        assert_eq!(server.read(&mut buf).await?, 4, "talking: kept");
    }
    let silent = server.read(&mut buf).await;
    assert_eq!(silent.map_err(|e| e.kind()), Err(io::ErrorKind::TimedOut));
    assert_eq!(counter.with_label_values(&["test", "idle"]).get(), 1);
    Ok(())
}

/// A peer that reads nothing of what is written to it holds no slot for good: once writes
/// have found its window shut for as long as it may stay silent, they fail, counted.
#[tokio::test(start_paused = true)]
async fn a_peer_that_reads_nothing_is_let_go() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let counter = closed();
    let guard = Guard::new("test", 4, counter.clone()).silent_after(Duration::from_secs(30));
    let (_reads_nothing, server) = pair(&listener).await?;
    let mut server = guard.admit(server, LOCAL).expect("room");
    let chunk = vec![b'x'; 1 << 20];
    let started = tokio::time::Instant::now();
    let outcome = loop {
        if let Err(error) = server.write_all(&chunk).await {
            break error;
        }
    };
    assert_eq!(outcome.kind(), io::ErrorKind::TimedOut);
    assert!(started.elapsed() >= Duration::from_secs(30), "not before the limit: {:?}", started.elapsed());
    assert_eq!(counter.with_label_values(&["test", "unread"]).get(), 1);
    Ok(())
}

/// Reads until the peer closes (or resets) the connection; false if it is still open after
/// `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 64];
    let read = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(within, read).await.is_ok()
}

/// Both servers behind their guards: the Fleet gRPC one closes a connection that never
/// sends the HTTP/2 preface, the admin one a connection stuck inside its request head.
#[tokio::test]
async fn the_fleet_and_admin_servers_close_connections_that_say_nothing() -> anyhow::Result<()> {
    use std::sync::Arc;

    use continuum_proto::model::DataPlaneConfig;
    use tokio_util::sync::CancellationToken;

    use crate::fleet::FleetPublisher;
    use crate::grpc::{FleetService, Replicas};

    let (metrics, cancel) = (Metrics::new()?, CancellationToken::new());
    let silent = |reason: &str, listener: &str| metrics.connections_closed.with_label_values(&[listener, reason]).get();
    let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
    let service = FleetService::new(publisher, Replicas::default(), metrics.clone(), cancel.clone());
    let fleet = TcpListener::bind("127.0.0.1:0").await?;
    let fleet_addr = fleet.local_addr()?;
    let guard = Guard::fleet(&metrics).silent_after(Duration::from_millis(300));
    tokio::spawn(crate::grpc::serve((fleet, guard), service, None, cancel.clone()));
    let admin = TcpListener::bind("127.0.0.1:0").await?;
    let admin_addr = admin.local_addr()?;
    // A byte every 100 ms against a silence of 1.5 s: a stalled runtime cannot make the
    // trickling client below look silent before its head's own time (4 s) is up.
    let guard = Guard::admin(&metrics).silent_after(Duration::from_millis(1500));
    let router = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
    let heads = Duration::from_secs(4);
    tokio::spawn(GuardedListener::new(admin, guard).head_within(heads).serve(router, cancel.clone()));

    let mut mute = TcpStream::connect(fleet_addr).await?;
    assert!(closed_within(&mut mute, Duration::from_secs(5)).await, "no preface: closed");
    assert_eq!(silent("silent", "fleet"), 1);
    let mut stuck = TcpStream::connect(admin_addr).await?;
    stuck.write_all(b"GET / HTTP/1.1\r\n").await?;
    assert!(closed_within(&mut stuck, Duration::from_secs(5)).await, "a head never finished: closed");
    assert_eq!(silent("idle", "admin"), 1);
    // A head sent a byte at a time, each within the silence allowed, is not waited on past
    // the head's own time.
    let mut trickling = TcpStream::connect(admin_addr).await?;
    let started = Instant::now();
    let mut cut = false;
    for byte in b"GET / HTTP/1.1\r\nhost: cp\r\nx-slow: ".iter().cycle().take(200) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if trickling.write_all(&[*byte]).await.is_err() {
            cut = true;
            break;
        }
    }
    let cut = cut || closed_within(&mut trickling, Duration::from_millis(100)).await;
    assert!(cut && started.elapsed() < 4 * heads, "a trickled head is cut: {:?}", started.elapsed());
    // Counted as the server's task ends, a moment after the client sees the close.
    for _ in 0..100 {
        if silent("head_timeout", "admin") > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(silent("head_timeout", "admin"), 1, "counted as such");
    // A whole request is answered as ever.
    let mut asking = TcpStream::connect(admin_addr).await?;
    asking.write_all(b"GET / HTTP/1.1\r\nhost: cp\r\nconnection: close\r\n\r\n").await?;
    let mut answer = String::new();
    asking.read_to_string(&mut answer).await?;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    cancel.cancel();
    Ok(())
}

/// A Fleet connection that makes no call the token admits (a health check asks for none)
/// is closed once its window is out, however it answers pings; one that made one stays.
#[tokio::test]
async fn a_fleet_connection_without_an_admitted_call_is_closed() -> anyhow::Result<()> {
    use std::sync::Arc;

    use continuum_proto::model::DataPlaneConfig;
    use continuum_proto::pb::GetSnapshotRequest;
    use continuum_proto::pb::fleet_client::FleetClient;
    use tokio_util::sync::CancellationToken;
    use tonic::transport::Channel;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    use crate::fleet::FleetPublisher;
    use crate::grpc::{FleetService, Replicas};

    let (metrics, cancel) = (Metrics::new()?, CancellationToken::new());
    let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
    let (_set, tokens) = tokio::sync::watch::channel(vec![crate::bearer::Token::new("s3cret")]);
    let service = FleetService::new(publisher, Replicas::default(), metrics.clone(), cancel.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let window = Duration::from_millis(300);
    let guard = Guard::fleet(&metrics).calls_within(window);
    tokio::spawn(crate::grpc::serve((listener, guard), service.with_tokens(tokens), None, cancel.clone()));
    let no_call = || metrics.connections_closed.with_label_values(&["fleet", "no_call"]).get();

    // Kept open (the channel held) after its check, as a health checker's connection is.
    let mut probe = HealthClient::new(Channel::from_shared(url.clone())?.connect().await?);
    probe.check(HealthCheckRequest { service: String::new() }).await?;
    let replica = Channel::from_shared(url)?.connect().await?;
    let with_token = |mut request: tonic::Request<()>| {
        request.metadata_mut().insert("authorization", "Bearer s3cret".parse().expect("ascii"));
        Ok(request)
    };
    let mut fleet = FleetClient::with_interceptor(replica, with_token);
    fleet.get_snapshot(GetSnapshotRequest {}).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while no_call() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(no_call(), 1, "the health checker's connection, closed");
    tokio::time::sleep(2 * window).await;
    assert_eq!(no_call(), 1, "the replica's connection made a call: kept");
    fleet.get_snapshot(GetSnapshotRequest {}).await?;
    drop(probe);
    cancel.cancel();
    Ok(())
}

/// The admin server's head timer also runs while a connection waits for a request, and
/// runs out before the guard's silence: what it closes is counted by where the connection
/// stood, a keep-alive one between requests as idle and one that never spoke as silent.
#[tokio::test]
async fn the_admin_server_counts_what_its_head_timer_closes_by_where_it_stood() -> anyhow::Result<()> {
    let (metrics, cancel) = (Metrics::new()?, tokio_util::sync::CancellationToken::new());
    let closed = |reason: &str| metrics.connections_closed.with_label_values(&["admin", reason]).get();
    let admin = TcpListener::bind("127.0.0.1:0").await?;
    let admin_addr = admin.local_addr()?;
    let guard = Guard::admin(&metrics).silent_after(Duration::from_secs(60));
    let router = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
    let listener = GuardedListener::new(admin, guard).head_within(Duration::from_millis(300));
    tokio::spawn(listener.serve(router, cancel.clone()));

    let mut kept_alive = TcpStream::connect(admin_addr).await?;
    kept_alive.write_all(b"GET / HTTP/1.1\r\nhost: cp\r\n\r\n").await?;
    let mut answer = [0u8; 12];
    kept_alive.read_exact(&mut answer).await?;
    assert_eq!(&answer, b"HTTP/1.1 200");
    let mut mute = TcpStream::connect(admin_addr).await?;
    assert!(closed_within(&mut kept_alive, Duration::from_secs(10)).await, "closed between requests");
    assert!(closed_within(&mut mute, Duration::from_secs(10)).await, "closed having said nothing");
    let counted = async {
        while (closed("idle"), closed("silent")) != (1, 1) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), counted).await?;
    assert_eq!(closed("head_timeout"), 0, "neither was part way through a head");
    cancel.cancel();
    Ok(())
}

/// Past its bound a listener closes new connections at once, counted; a slot comes back
/// when its connection is dropped.
#[tokio::test]
async fn a_full_listener_closes_new_connections_until_one_leaves() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let counter = closed();
    let guard = Guard::new("test", 2, counter.clone());
    let mut held = Vec::new();
    for _ in 0..2 {
        let (_client, server) = pair(&listener).await?;
        held.push(guard.admit(server, LOCAL).expect("room"));
    }
    let (mut refused_client, server) = pair(&listener).await?;
    assert!(guard.admit(server, LOCAL).is_none());
    assert_eq!(refused_client.read(&mut [0u8; 1]).await?, 0, "closed at once");
    assert_eq!(counter.with_label_values(&["test", "full"]).get(), 1);
    held.pop();
    let (_client, server) = pair(&listener).await?;
    assert!(guard.admit(server, LOCAL).is_some(), "a slot given back");
    Ok(())
}

/// Every replica may reach the Fleet listener through one address (a mesh's sidecar
/// connects from 127.0.0.6), yet that address cannot fill the listener: past its share,
/// others still get in.
#[tokio::test]
async fn one_address_fronts_every_replica_but_cannot_fill_the_fleet_listener() -> anyhow::Result<()> {
    let metrics = Metrics::new()?;
    let guard = Guard::fleet(&metrics);
    let (one, other) = (IpAddr::from([127, 0, 0, 6]), IpAddr::from([10, 0, 0, 2]));
    let every_session: Vec<_> = (0..2 * MAX_WATCH_SESSIONS).filter_map(|_| guard.admit((), one)).collect();
    assert_eq!(every_session.len(), 2 * MAX_WATCH_SESSIONS, "each session's Watch and lookups");
    let held: Vec<_> = (every_session.len()..MAX_FLEET_CONNECTIONS).map_while(|_| guard.admit((), one)).collect();
    assert_eq!(every_session.len() + held.len(), MAX_FLEET_CONNECTIONS_PER_PEER);
    assert!(
        guard.slots.available_permits() > MAX_FLEET_CONNECTIONS / 2,
        "stopped by its share, far short of the listener"
    );
    assert!(guard.admit((), one).is_none(), "its share is taken");
    assert!(guard.admit((), other).is_some(), "a replica elsewhere still gets in");
    Ok(())
}

#[tokio::test]
async fn one_peer_cannot_take_a_per_peer_listener() {
    let counter = closed();
    let guard = Guard::new("test", 16, counter.clone()).per_peer(2);
    let other: IpAddr = [10, 0, 0, 9].into();
    let first = guard.admit((), LOCAL);
    let second = guard.admit((), LOCAL);
    assert!(first.is_some() && second.is_some());
    let (refused, logged) = crate::test_logs::captured(|| [guard.admit((), LOCAL), guard.admit((), LOCAL)]);
    assert!(refused.iter().all(Option::is_none), "its share is taken");
    assert_eq!(counter.with_label_values(&["test", "peer_full"]).get(), 2, "each counted");
    assert_eq!(crate::test_logs::warnings(&logged), 1, "warned of once:\n{logged}");
    assert!(logged.contains("127.0.0.1"), "naming the address:\n{logged}");
    assert!(guard.admit((), other).is_some(), "another address still gets in");
    drop(first);
    let again = guard.admit((), LOCAL);
    assert!(again.is_some(), "a closed connection gives its share back");

    // One IPv6 host holds its /64 whole: its addresses count as one peer.
    let host = |last: u16| IpAddr::from([0x2001, 0xdb8, 0, 1, 0, 0, 0, last]);
    let held = [guard.admit((), host(1)), guard.admit((), host(2))];
    assert!(held.iter().all(Option::is_some));
    assert!(guard.admit((), host(3)).is_none(), "the same /64");
    assert!(guard.admit((), IpAddr::from([0x2001, 0xdb8, 0, 2, 0, 0, 0, 1])).is_some(), "another /64");
    let mapped = IpAddr::V6(std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped());
    assert!(guard.admit((), mapped).is_none(), "an IPv4-mapped address is its IPv4 address");
}

const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
