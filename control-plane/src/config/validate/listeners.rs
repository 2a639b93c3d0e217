//! Continuum's own listeners (gRPC, admin, event bus, the simulated shim) must not collide, and the admin API
//! should not be reachable off-host without a token.

use std::net::SocketAddr;

use super::Report;
use crate::config::Config;
use crate::config::discovery::DiscoverySource;

pub(super) fn check(config: &Config, report: &mut Report) {
    let mut listeners =
        vec![("control_plane.grpc_listen", config.control_plane.grpc_listen), ("admin.listen", config.admin.listen)];
    if config.dynamo.event_bus.enabled {
        listeners.push(("dynamo.event_bus.listen", config.dynamo.event_bus.listen));
    }
    if config.dynamo.enabled && config.dynamo.discovery.source == DiscoverySource::Simulator {
        listeners.push(("dynamo.discovery.simulator.shim_listen", config.dynamo.discovery.simulator.shim_listen));
    }
    for (index, (path, addr)) in listeners.iter().enumerate() {
        if let Some((other, _)) = listeners[..index].iter().find(|(_, earlier)| collide(*earlier, *addr)) {
            report.error(*path, format!("{addr} collides with {other}; give each listener its own port"));
        }
    }
    match &config.admin.token {
        Some(token) if token.is_empty() => {
            report.error("admin.token", "must not be empty; remove the key to serve admin without a token")
        }
        None if !config.admin.listen.ip().is_loopback() => report.warning(
            "admin.token",
            "is unset while admin.listen is not a loopback address: anyone who reaches it can read the fleet and configuration",
        ),
        _ => {}
    }
}

/// Two binds collide on the same port when their addresses overlap; port 0 is ephemeral.
fn collide(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() != 0 && a.port() == b.port() && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}
