//! Dialling a publisher's fleet-authored `tcp://host:port`: resolve the host once, keep only
//! the addresses `dynamo.load.direct_allow_cidrs` allows, and connect to one of those very
//! addresses, so DNS cannot change the answer between the policy check and the connection.
//! Resolution and connection share [`ZmtpLimits::connect_timeout`](super::zmtp::ZmtpLimits),
//! each address tried getting its share of what is left: one that swallows the handshake (a
//! firewall dropping the SYN) leaves time for the next.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use super::zmtp::{KEEPALIVE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES, UNACKNOWLEDGED_LIMIT};
use crate::config::Cidr;

#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("the publisher address is not tcp://host:port")]
    BadAddress,
    #[error("resolving the publisher's host: {0}")]
    Resolve(std::io::Error),
    #[error(
        "the publisher's host resolves to {0:?}, none inside dynamo.load.direct_allow_cidrs; add the worker Pod network"
    )]
    NotAllowed(Vec<IpAddr>),
    #[error(
        "the publisher's host resolves to {0:?}, which no connection reaches (an unspecified, multicast or broadcast address: a worker advertising the address it binds?)"
    )]
    Unroutable(Vec<IpAddr>),
    #[error("connecting: {0}")]
    Connect(std::io::Error),
    #[error("no connection within {0:?}")]
    Timeout(Duration),
}

/// `host` and `port` of `tcp://host:port` (`[v6]:port` too).
pub fn parse_tcp_address(address: &str) -> Result<(&str, u16), DialError> {
    let rest = address.strip_prefix("tcp://").ok_or(DialError::BadAddress)?;
    let (host, port) = rest.rsplit_once(':').ok_or(DialError::BadAddress)?;
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let port: u16 = port.parse().map_err(|_| DialError::BadAddress)?;
    if host.is_empty() || host == "*" || port == 0 {
        return Err(DialError::BadAddress);
    }
    Ok((host, port))
}

/// Whether `ip` may be dialled under `allow` (`None`: anything, the historical behaviour).
pub fn allowed(ip: IpAddr, allow: Option<&[Cidr]>) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    allow.is_none_or(|cidrs| cidrs.iter().any(|c| c.contains(ip)))
}

/// Whether a connection to `ip` can reach a publisher at all. Dynamo binds its PUB sockets on
/// `0.0.0.0`; a record that advertised that would have the control plane dial its own host.
fn routable(ip: IpAddr) -> bool {
    let broadcast = matches!(ip, IpAddr::V4(v4) if v4.is_broadcast());
    !(ip.is_unspecified() || ip.is_multicast() || broadcast)
}

/// Host names resolved at once, at most, by every subscription together.
const MAX_RESOLVING: usize = 16;

/// Room for [`MAX_RESOLVING`] resolutions; never closed.
static RESOLVING: Semaphore = Semaphore::const_new(MAX_RESOLVING);

/// `host`'s addresses with `port`. A name is resolved on the blocking pool, which the
/// resolver's thread holds until the system's resolver returns (tens of seconds for a name
/// nobody answers for), however long its caller waits: the room it takes in
/// [`MAX_RESOLVING`] is held as long, so a fleet's worth of such names (a thousand
/// subscriptions, redialling as they fail) takes a few of the pool's threads, not every one
/// the configuration reload and the TLS refresh also run on. An address needs no resolver.
async fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>, DialError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let room = RESOLVING.acquire().await.map_err(|closed| DialError::Resolve(std::io::Error::other(closed)))?;
    let host = host.to_string();
    let lookup = tokio::task::spawn_blocking(move || {
        let _room = room;
        (host.as_str(), port).to_socket_addrs().map(Iterator::collect)
    });
    lookup.await.map_err(|join| DialError::Resolve(std::io::Error::other(join)))?.map_err(DialError::Resolve)
}

/// Resolves `address` once and connects to the first allowed address that answers.
pub async fn dial(address: &str, allow: Option<&[Cidr]>, timeout: Duration) -> Result<TcpStream, DialError> {
    let (host, port) = parse_tcp_address(address)?;
    let deadline = tokio::time::Instant::now() + timeout;
    let attempt = async {
        let resolved = resolve(host, port).await?;
        let ips = || resolved.iter().map(SocketAddr::ip).collect();
        if resolved.is_empty() {
            return Err(DialError::Resolve(std::io::Error::other(format!("{host} resolved to no address"))));
        }
        let routable: Vec<SocketAddr> = resolved.iter().copied().filter(|a| routable(a.ip())).collect();
        if routable.is_empty() {
            return Err(DialError::Unroutable(ips()));
        }
        let permitted: Vec<SocketAddr> = routable.into_iter().filter(|a| allowed(a.ip(), allow)).collect();
        if permitted.is_empty() {
            return Err(DialError::NotAllowed(ips()));
        }
        connect_first(&permitted, deadline).await
    };
    tokio::time::timeout_at(deadline, attempt).await.unwrap_or(Err(DialError::Timeout(timeout)))
}

/// The first of `addresses` to accept a connection by `deadline`, each given its share of the
/// time left when it is tried.
async fn connect_first(addresses: &[SocketAddr], deadline: tokio::time::Instant) -> Result<TcpStream, DialError> {
    let mut last = None;
    for (tried, addr) in addresses.iter().enumerate() {
        let left = u32::try_from(addresses.len() - tried).unwrap_or(u32::MAX);
        let share = deadline.saturating_duration_since(tokio::time::Instant::now()) / left;
        let connected = tokio::time::timeout(share, TcpStream::connect(addr)).await;
        match connected.unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())).and_then(keep_alive) {
            Ok(stream) => return Ok(stream),
            Err(error) => last = Some(error),
        }
    }
    Err(DialError::Connect(last.unwrap_or_else(|| std::io::ErrorKind::NotConnected.into())))
}

/// Turns TCP keepalive on: a publisher may stay silent for hours by design, and without probes
/// a connection whose peer vanished (a partition, an expired NAT entry) would look alive forever.
fn keep_alive(stream: TcpStream) -> std::io::Result<TcpStream> {
    let probes =
        TcpKeepalive::new().with_time(KEEPALIVE).with_interval(KEEPALIVE_INTERVAL).with_retries(KEEPALIVE_PROBES);
    let socket = SockRef::from(&stream);
    socket.set_tcp_keepalive(&probes)?;
    socket.set_tcp_user_timeout(Some(UNACKNOWLEDGED_LIMIT))?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_addresses_parse_and_everything_else_is_refused() {
        assert_eq!(parse_tcp_address("tcp://127.0.0.1:37331").ok(), Some(("127.0.0.1", 37331)));
        assert_eq!(parse_tcp_address("tcp://[fd00::7]:41000").ok(), Some(("fd00::7", 41000)));
        assert_eq!(parse_tcp_address("tcp://worker-0.dynamo:5555").ok(), Some(("worker-0.dynamo", 5555)));
        for bad in
            ["udp://1.2.3.4:5", "tcp://1.2.3.4", "tcp://:5", "tcp://*:5555", "tcp://h:0", "tcp://h:99999", "ipc:///x"]
        {
            assert!(parse_tcp_address(bad).is_err(), "{bad}");
        }
    }

    /// Names are resolved a bounded number at a time, whoever waits for them: with every
    /// place taken (resolutions stuck in the system's resolver), another name waits out its
    /// dial's timeout, while an address literal, which needs no resolver, is dialled at once.
    #[tokio::test]
    async fn names_are_resolved_a_bounded_number_at_a_time_and_literals_need_none() {
        let held = RESOLVING.acquire_many(MAX_RESOLVING as u32).await.expect("room");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("listener");
        let literal = format!("tcp://127.0.0.1:{}", listener.local_addr().expect("address").port());
        assert!(dial(&literal, None, Duration::from_secs(5)).await.is_ok(), "no resolver for an address");
        let named = format!("tcp://localhost:{}", listener.local_addr().expect("address").port());
        let waited = dial(&named, None, Duration::from_millis(100)).await;
        assert!(matches!(waited, Err(DialError::Timeout(_))), "{waited:?}");
        drop(held);
        assert!(dial(&named, None, Duration::from_secs(5)).await.is_ok(), "resolved once there is room");
    }

    /// An address that swallows the handshake (here a listener whose queue is full, so the
    /// kernel drops the SYN) takes only its share of the time: the next address is dialled.
    #[tokio::test]
    async fn an_address_that_swallows_the_handshake_leaves_time_for_the_next() {
        let swallowing = tokio::net::TcpSocket::new_v4().unwrap();
        swallowing.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let swallowing = swallowing.listen(1).unwrap();
        let black_hole = swallowing.local_addr().unwrap();
        let mut queued = Vec::new();
        loop {
            match tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(black_hole)).await {
                Ok(connected) => queued.push(connected.unwrap()),
                Err(_) => break,
            }
            assert!(queued.len() < 64, "the listener's queue never filled");
        }
        let answering = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
        let dialled = connect_first(&[black_hole, answering.local_addr().unwrap()], deadline).await;
        assert_eq!(dialled.unwrap().peer_addr().unwrap(), answering.local_addr().unwrap());
        assert!(tokio::time::Instant::now() < deadline, "within the dial's time");
    }

    #[test]
    fn the_allow_list_admits_only_its_networks() {
        let allow: Vec<Cidr> = ["10.0.0.0/8", "fd00::/8"].iter().filter_map(|c| c.parse().ok()).collect();
        assert!(allowed("10.1.2.3".parse().unwrap(), Some(&allow)));
        assert!(allowed("fd00::1".parse().unwrap(), Some(&allow)));
        assert!(allowed("::ffff:10.0.0.1".parse().unwrap(), Some(&allow)), "v4-mapped v6 is judged as v4");
        assert!(!allowed("127.0.0.1".parse().unwrap(), Some(&allow)));
        assert!(!allowed("192.168.0.1".parse().unwrap(), Some(&[])), "an empty list allows nothing");
        assert!(allowed("192.168.0.1".parse().unwrap(), None), "no list allows anything");
    }

    /// What a worker binds (`0.0.0.0`) rather than what reaches it is never dialled, whatever
    /// the allow list: on Linux it would reach the control plane's own host.
    #[tokio::test]
    async fn an_unspecified_or_multicast_address_is_never_dialled() {
        let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let everything: Vec<Cidr> = vec!["0.0.0.0/0".parse().unwrap()];
        for host in ["0.0.0.0", "[::]", "224.0.0.1", "255.255.255.255"] {
            for allow in [None, Some(everything.as_slice())] {
                let refused = dial(&format!("tcp://{host}:{port}"), allow, Duration::from_secs(2)).await;
                assert!(matches!(refused, Err(DialError::Unroutable(_))), "{host}: {refused:?}");
            }
        }
        let accepted = tokio::time::timeout(Duration::from_millis(50), listener.accept()).await;
        assert!(accepted.is_err(), "nothing reached the host's own listener");
    }

    #[tokio::test]
    async fn a_hostname_resolving_outside_the_list_is_never_dialled() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let allow: Vec<Cidr> = vec!["10.0.0.0/8".parse().unwrap()];
        let refused = dial(&format!("tcp://localhost:{port}"), Some(&allow), Duration::from_secs(2)).await;
        assert!(matches!(refused, Err(DialError::NotAllowed(_))), "{refused:?}");
        let loopback: Vec<Cidr> = vec!["127.0.0.0/8".parse().unwrap()];
        let dialled = dial(&format!("tcp://127.0.0.1:{port}"), Some(&loopback), Duration::from_secs(2)).await.unwrap();
        let (_accepted, _) = listener.accept().await.unwrap();
        let socket = SockRef::from(&dialled);
        assert!(socket.keepalive().unwrap(), "a silent publisher's connection is probed");
        assert_eq!(socket.tcp_keepalive_time().unwrap(), KEEPALIVE);
        assert_eq!(socket.tcp_user_timeout().unwrap(), Some(UNACKNOWLEDGED_LIMIT), "unacknowledged bytes end it");
    }
}
