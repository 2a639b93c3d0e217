//! Outputs: the masked readback, the data-plane view and the configured namespaces.

use std::time::Duration;

use continuum_proto::model::{Backend, ShimPool};

use super::loaded;
use crate::config::{Cidr, MASK, embedded_default};

const SECRETS: &str = "
admin: {token: admin-s3cret}
control_plane: {token: grpc-s3cret}
dynamo:
  discovery:
    etcd:
      endpoints: ['https://etcd:2379']
      tls: {ca_cert: /etc/etcd/ca.pem, client_cert: /etc/etcd/client.pem, client_key: /etc/etcd/key-s3cret.pem}
      auth: {username: router, password: etcd-s3cret}
  event_bus:
    tls: {cert: /bus/tls.crt, key: /bus/key-s3cret.pem}
";

#[test]
fn masked_yaml_never_shows_a_secret() {
    let config = loaded(SECRETS).config;
    let shown = config.to_masked_yaml();
    let debug = format!("{config:?}");
    for text in [&shown, &debug] {
        assert!(!text.contains("s3cret"), "{text}");
    }
    assert_eq!(shown.matches(MASK).count(), 5, "{shown}");
    for readable in ["/etc/etcd/ca.pem", "/etc/etcd/client.pem", "username: router", "/bus/tls.crt"] {
        assert!(shown.contains(readable), "{readable} missing from:\n{shown}");
    }
    assert_eq!(config.admin.token.as_ref().map(|t| t.expose()), Some("admin-s3cret"));
    assert_eq!(config.control_plane.token.as_ref().map(|t| t.expose()), Some("grpc-s3cret"));
}

#[test]
fn masked_yaml_is_the_effective_configuration_and_loads_back() {
    let config = embedded_default();
    let shown = config.to_masked_yaml();
    for default in [
        "max_staleness: 3s",
        "initial: 500ms",
        "max: 30s",
        "grpc_listen: 127.0.0.1:50051",
        "shim_listen: 127.0.0.1:8000",
    ] {
        assert!(shown.contains(default), "{default} missing from:\n{shown}");
    }
    assert_eq!(loaded(&shown).config, config);
}

#[test]
fn data_plane_config_maps_backends_pools_and_picker() {
    let yaml = "
backends:
  - {name: shim-a, url: 'http://a:8000', models: [m]}
  - {name: shim-b, url: 'http://b:8000', internal: true}
  - {name: off, url: 'http://c:8000', enabled: false}
  - {name: prefill-engine, url: 'http://p:8000', role: prefill, models: [m]}
disaggregated_serving: {enabled: true, fallback_to_unified: true}
dynamo:
  enabled: true
  discovery: {etcd: {endpoints: ['etcd:2379'], namespace: prod}}
  load: {max_staleness: 2s, direct_allow_cidrs: ['10.0.0.0/8']}
  shim: {backends: [shim-a, shim-b], model_map: {qwen: Qwen/Qwen3-32B}}
  kv: {enabled: true, pinned_artifacts: [], overlap_score_credit: 0.5, router_temperature: 0.25, send_token_data: true}
";
    let config = loaded(yaml).config.data_plane_config();
    let backend = Backend { name: "shim-a".into(), url: "http://a:8000".into(), models: vec!["m".into()] };
    assert_eq!(config.backends, vec![backend], "a one-phase engine outside the pools gets no plain requests");
    assert_eq!(config.shim_pools, vec![ShimPool { namespace: "prod".into(), backends: vec!["shim-a".into()] }]);
    assert_eq!(config.model_map.get("qwen").map(String::as_str), Some("Qwen/Qwen3-32B"));
    assert_eq!(config.picker.max_staleness, Duration::from_secs(2));
    assert!(config.picker.kv_enabled && config.picker.send_token_data);
    assert_eq!((config.picker.overlap_score_credit, config.picker.router_temperature), (0.5, 0.25));
    assert!(config.disaggregated_serving.enabled && config.disaggregated_serving.fallback_to_unified);
}

/// A static fleet of no workers names no namespace; its shim backends stay a pool's members
/// (plain requests never go to a direct-mode shim unpinned).
#[test]
fn a_static_fleet_of_no_workers_keeps_its_shim_backends_in_a_pool() {
    let yaml = "
backends: [{name: frontend, url: 'http://f:8000', models: [m]}]
disaggregated_serving: {enabled: true}
dynamo:
  enabled: true
  discovery: {source: static, static: {workers: []}}
  shim: {backends: [frontend]}
";
    let pools = loaded(yaml).config.data_plane_config().shim_pools;
    assert_eq!(pools, vec![ShimPool { namespace: "dynamo".into(), backends: vec!["frontend".into()] }]);
}

#[test]
fn data_plane_config_takes_pools_per_namespace() {
    let yaml = "
backends: [{name: p, url: 'http://p:8000'}, {name: c, url: 'http://c:8000'}]
disaggregated_serving: {enabled: true}
dynamo:
  enabled: true
  discovery: {etcd: {endpoints: ['etcd:2379'], namespaces: [prod, canary]}}
  load: {direct_allow_cidrs: ['10.0.0.0/8']}
  shim: {pools: [{namespace: prod, backends: [p]}, {namespace: canary, backends: [c]}]}
";
    let config = loaded(yaml).config;
    assert_eq!(config.namespaces(), vec!["prod".to_owned(), "canary".to_owned()]);
    let pools = config.data_plane_config().shim_pools;
    let pool = |ns: &str, backend: &str| ShimPool { namespace: ns.into(), backends: vec![backend.into()] };
    assert_eq!(pools, vec![pool("prod", "p"), pool("canary", "c")]);
}

#[test]
fn embedded_default_gives_one_pool_in_namespace_dynamo() {
    let config = embedded_default().data_plane_config();
    assert_eq!(config.shim_pools, vec![ShimPool { namespace: "dynamo".into(), backends: vec!["demo-shim".into()] }]);
    assert_eq!(config.backends.len(), 1);
    assert!(config.disaggregated_serving.enabled);
}

#[test]
fn namespaces_follow_the_discovery_source() {
    let cases = [
        ("{}", vec!["dynamo"]),
        ("{etcd: {namespace: prod}}", vec!["prod"]),
        ("{source: kubernetes, kubernetes: {namespace: k, dynamo_namespaces: [a, b]}}", vec!["a", "b"]),
        ("{source: kubernetes_pods, kubernetes: {namespace: k, dynamo_namespace: solo, model: m}}", vec!["solo"]),
        (
            "{source: static, static: {workers: [{namespace: x, instance_id: 1, role: decode, model: m}, {namespace: y, instance_id: 3, role: decode, model: m}, {namespace: x, instance_id: 2, role: decode, model: m}]}}",
            vec!["x", "y"],
        ),
    ];
    for (discovery, expected) in cases {
        let config = loaded(&format!("dynamo: {{discovery: {discovery}}}")).config;
        assert_eq!(config.namespaces(), expected, "{discovery}");
    }
}

#[test]
fn cidrs_match_addresses_in_their_network() {
    let cases = [
        ("10.0.0.0/8", "10.255.1.2", true),
        ("10.0.0.0/8", "11.0.0.1", false),
        ("0.0.0.0/0", "192.168.1.1", true),
        ("fd00::/8", "fd12::1", true),
        ("fd00::/8", "fe80::1", false),
        ("::/0", "::1", true),
        ("10.0.0.0/8", "::ffff:10.0.0.1", false),
    ];
    for (cidr, ip, expected) in cases {
        let cidr: Cidr = match cidr.parse() {
            Ok(cidr) => cidr,
            Err(error) => panic!("{error}"),
        };
        let ip = match ip.parse() {
            Ok(ip) => ip,
            Err(error) => panic!("{error}"),
        };
        assert_eq!(cidr.contains(ip), expected, "{cidr} contains {ip}");
    }
}
