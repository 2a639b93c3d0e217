//! Continuum's own listeners (gRPC, admin, event bus, the simulated shim) must not collide, and the admin API
//! and the Fleet service should not be reachable off-host without a token.

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
    let tokens = [
        ("admin.token", &config.admin.token, config.admin.listen, "read the fleet and configuration"),
        (
            "control_plane.token",
            &config.control_plane.token,
            config.control_plane.grpc_listen,
            "follow the fleet (worker and shim addresses), report dispatches and end replicas' streams",
        ),
    ];
    if let Some(tls) = &config.control_plane.tls {
        if tls.cert.is_none() {
            report
                .error("control_plane.tls.cert", "is required with control_plane.tls: the Fleet service's certificate");
        }
        if tls.key.is_none() {
            report.error("control_plane.tls.key", "is required with control_plane.tls: the certificate's private key");
        }
    }
    if config.control_plane.previous_token.is_some() && config.control_plane.token.is_none() {
        report.error(
            "control_plane.previous_token",
            "is accepted beside control_plane.token during a rotation; set token too",
        );
    }
    if let Some(previous) = &config.control_plane.previous_token
        && (previous.is_empty() || !previous.expose().bytes().all(|b| b.is_ascii_graphic()))
    {
        report.error("control_plane.previous_token", "must be visible ASCII without spaces, like control_plane.token");
    }
    for (path, token, listen, exposed) in tokens {
        match token {
            Some(token) if token.is_empty() => {
                report.error(path, "must not be empty; remove the key to serve without a token")
            }
            // Clients send it as one header token (`--control-plane-token` refuses the rest);
            // one ending in a newline (a Secret file's) could never be presented.
            Some(token) if !token.expose().bytes().all(|b| b.is_ascii_graphic()) => {
                report.error(path, "must be visible ASCII without spaces (it is sent as an authorization header)")
            }
            None if !listen.ip().is_loopback() => report.warning(
                path,
                format!("is unset while the listener is not a loopback address: anyone who reaches it can {exposed}"),
            ),
            _ => {}
        }
    }
}

/// Two binds collide on the same port when their addresses overlap; port 0 is ephemeral.
fn collide(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() != 0 && a.port() == b.port() && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}
