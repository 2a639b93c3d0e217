//! Socket options the data plane sets on both sides of a proxied request.

use std::io;
use std::time::Duration;

/// Has the kernel probe `stream` once it has been idle for `idle`, every `interval` after (three
/// probes), and fail it when bytes written to it go unacknowledged for `unacknowledged`: a
/// peer gone without a FIN or a reset (its host lost, a NAT's mapping expired) is found in
/// seconds instead of the kernel's quarter of an hour.
pub fn probe_idle(
    stream: &tokio::net::TcpStream,
    idle: Duration,
    interval: Duration,
    unacknowledged: Duration,
) -> io::Result<()> {
    let socket = socket2::SockRef::from(stream);
    let keepalive = socket2::TcpKeepalive::new().with_time(idle).with_interval(interval).with_retries(3);
    socket.set_tcp_keepalive(&keepalive)?;
    socket.set_tcp_user_timeout(Some(unacknowledged))
}
