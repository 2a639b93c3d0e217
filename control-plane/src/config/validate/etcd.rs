//! `dynamo.discovery.etcd`: endpoints, scheme consistency, namespaces, TLS, auth and backoff.

use std::net::{IpAddr, Ipv6Addr};

use super::Report;
use super::names::{check_backoff, check_namespace, check_namespace_list, dynamo_namespace_message};
use crate::config::Config;
use crate::config::discovery::{DEFAULT_DYNAMO_NAMESPACE, DiscoverySource, EtcdConfig};
use crate::config::signals::LoadTransport;

/// etcd endpoints one watcher may be given.
pub const MAX_ETCD_ENDPOINTS: usize = 16;

const BASE: &str = "dynamo.discovery.etcd";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scheme {
    Http,
    Https,
}

pub(super) fn check(config: &Config, report: &mut Report) {
    let etcd = &config.dynamo.discovery.etcd;
    let active = config.dynamo.discovery.source == DiscoverySource::Etcd;
    if active && config.dynamo.enabled && etcd.endpoints.is_empty() {
        report.error(format!("{BASE}.endpoints"), "must list at least one etcd endpoint when dynamo.enabled is true");
    }
    let endpoints = check_endpoints(etcd, report);
    let schemes: Vec<Scheme> = endpoints.iter().map(|(_, scheme, _)| *scheme).collect();
    check_transport_security(etcd, &schemes, active, report);
    if active && config.dynamo.enabled && config.dynamo.load.transport == LoadTransport::Direct {
        warn_external(&endpoints, report);
    }
    check_namespaces(etcd, report);
    check_backoff(report, &format!("{BASE}.watch_reconnect_backoff"), &etcd.watch_reconnect_backoff);
}

/// Checks every endpoint and returns the valid ones: index, scheme and host.
fn check_endpoints<'e>(etcd: &'e EtcdConfig, report: &mut Report) -> Vec<(usize, Scheme, &'e str)> {
    if etcd.endpoints.len() > MAX_ETCD_ENDPOINTS {
        report.error(
            format!("{BASE}.endpoints"),
            format!("lists {} endpoints; at most {MAX_ETCD_ENDPOINTS} are supported", etcd.endpoints.len()),
        );
    }
    let mut valid = Vec::new();
    for (index, endpoint) in etcd.endpoints.iter().enumerate() {
        match parse_endpoint(endpoint) {
            Ok((scheme, host)) => valid.push((index, scheme, host)),
            Err(problem) => report.error(format!("{BASE}.endpoints[{index}]"), problem),
        }
    }
    valid
}

/// Direct mode dials the workers' publishers on the Pod network, so it assumes the router runs
/// in the cluster (the seed: startup warns when the etcd endpoints appear external). An
/// endpoint given as a public IP address says it does not; a name cannot be judged unresolved.
fn warn_external(endpoints: &[(usize, Scheme, &str)], report: &mut Report) {
    for (index, _, host) in endpoints {
        if host.parse::<IpAddr>().is_ok_and(appears_external) {
            report.warning(
                format!("{BASE}.endpoints[{index}]"),
                format!(
                    "`{host}` is a public address, so the router may run outside the cluster, yet dynamo.load.transport is direct: \
                     it dials the workers' publishers on the Pod network; run it in the cluster (transport: broker, for a \
                     router outside it, has no broker to relay through in this build); clusters whose Pods have public \
                     addresses can ignore this"
                ),
            );
        }
    }
}

/// Whether `ip` lies outside every loopback, private, shared (CGNAT), link-local, unique-local
/// and unspecified range: an address a cluster-internal etcd would not have.
fn appears_external(ip: IpAddr) -> bool {
    match continuum_proto::net::unmapped(ip) {
        IpAddr::V4(v4) => {
            let shared = v4.octets()[0] == 100 && (v4.octets()[1] & 0xc0) == 64;
            !(v4.is_loopback() || v4.is_private() || v4.is_link_local() || v4.is_unspecified() || shared)
        }
        IpAddr::V6(v6) => {
            let first = v6.segments()[0];
            let unique_local = first & 0xfe00 == 0xfc00;
            let link_local = first & 0xffc0 == 0xfe80;
            !(v6.is_loopback() || v6.is_unspecified() || unique_local || link_local)
        }
    }
}

/// Accepts `http(s)://host:port` and bare `host:port` (which means `http://`); returns the
/// scheme and the host (an IPv6 one without its brackets).
fn parse_endpoint(endpoint: &str) -> Result<(Scheme, &str), String> {
    let (scheme, rest) = match endpoint.split_once("://") {
        // Lower case only: the etcd client recognises no other spelling and would take
        // `HTTP://etcd:2379` for a bare host named `HTTP`.
        Some(("http", rest)) => (Scheme::Http, rest),
        Some(("https", rest)) => (Scheme::Https, rest),
        Some((name, _)) if name.eq_ignore_ascii_case("http") || name.eq_ignore_ascii_case("https") => {
            return Err(format!("scheme `{name}://` must be written in lower case"));
        }
        Some((name, _)) => return Err(format!("scheme `{name}://` is not supported; use http:// or https://")),
        None => (Scheme::Http, endpoint),
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    if authority.contains('@') {
        return Err("must not embed credentials (user:pass@host); use dynamo.discovery.etcd.auth".to_owned());
    }
    match tail.chars().next() {
        Some('/') => return Err("must not have a path; give only scheme://host:port".to_owned()),
        Some('?') => return Err("must not have a query string; give only scheme://host:port".to_owned()),
        Some('#') => return Err("must not have a fragment; give only scheme://host:port".to_owned()),
        _ => {}
    }
    let host = check_host_port(authority)?;
    Ok((scheme, host))
}

fn check_host_port(authority: &str) -> Result<&str, String> {
    let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']').ok_or("has an unclosed `[` in its IPv6 host")?;
        if host.parse::<Ipv6Addr>().is_err() {
            return Err(format!("`[{host}]` is not an IPv6 address"));
        }
        (host, after.strip_prefix(':').ok_or("must give a port, e.g. [::1]:2379")?)
    } else {
        let (host, port) = authority.rsplit_once(':').ok_or("must give a port, e.g. etcd:2379")?;
        if host.contains(':') {
            return Err("IPv6 hosts must be bracketed, e.g. [::1]:2379".to_owned());
        }
        (host, port)
    };
    if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("must name a host without whitespace".to_owned());
    }
    match port.parse::<u16>() {
        Ok(port) if port != 0 => Ok(host),
        _ => Err(format!("port `{port}` must be 1-65535")),
    }
}

fn check_transport_security(etcd: &EtcdConfig, schemes: &[Scheme], active: bool, report: &mut Report) {
    let plaintext = schemes.contains(&Scheme::Http);
    if plaintext && schemes.contains(&Scheme::Https) {
        report.error(format!("{BASE}.endpoints"), "must not mix http:// and https:// endpoints");
    }
    if etcd.tls.is_none() && schemes.contains(&Scheme::Https) {
        // The etcd client trusts no system roots: without a CA no handshake could succeed.
        report.error(
            format!("{BASE}.tls.ca_cert"),
            "is required with https:// endpoints: name the CA that signed etcd's certificate",
        );
    }
    if let Some(tls) = &etcd.tls {
        if plaintext {
            report.error(format!("{BASE}.tls"), "cannot be combined with http:// endpoints; use https:// endpoints");
        }
        if tls.ca_cert.is_none() {
            // The etcd client trusts no system roots: without a CA nothing would verify.
            report.error(
                format!("{BASE}.tls.ca_cert"),
                "is required with tls: name the CA that signed etcd's certificate",
            );
        }
        match (&tls.client_cert, &tls.client_key) {
            (Some(_), None) => report.error(format!("{BASE}.tls.client_key"), "must be set together with client_cert"),
            (None, Some(_)) => report.error(format!("{BASE}.tls.client_cert"), "must be set together with client_key"),
            _ => {}
        }
    }
    let Some(auth) = &etcd.auth else { return };
    if auth.username.is_empty() {
        report.error(format!("{BASE}.auth.username"), "must not be empty");
    }
    if auth.password.is_empty() {
        report.error(format!("{BASE}.auth.password"), "must not be empty; e.g. password: \"${ETCD_PASSWORD}\"");
    }
    if active && plaintext && etcd.tls.is_none() {
        report.warning(
            format!("{BASE}.auth"),
            "is sent over plaintext http://: etcd's Authenticate RPC and session token travel in cleartext; use https://",
        );
    }
}

fn check_namespaces(etcd: &EtcdConfig, report: &mut Report) {
    check_namespace(report, &format!("{BASE}.namespace"), &etcd.namespace);
    if etcd.namespaces.is_empty() {
        return;
    }
    check_namespace_list(report, &format!("{BASE}.namespaces"), &etcd.namespaces, dynamo_namespace_message);
    if etcd.namespace != DEFAULT_DYNAMO_NAMESPACE {
        report.error(
            format!("{BASE}.namespace"),
            "is mutually exclusive with namespaces; list every namespace under namespaces",
        );
    }
}
