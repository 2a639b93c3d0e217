//! The rule table: each row is a document, the key path a diagnostic must name, its severity
//! and a fragment of its message.

use super::diagnostics;
use crate::config::Severity::{self, Error, Warning};

struct Row {
    name: &'static str,
    yaml: String,
    severity: Severity,
    path: &'static str,
    fragment: &'static str,
}

fn row(
    name: &'static str,
    yaml: impl Into<String>,
    severity: Severity,
    path: &'static str,
    fragment: &'static str,
) -> Row {
    Row { name, yaml: yaml.into(), severity, path, fragment }
}

/// A flow-style YAML list of `count` strings made by `item`.
fn list(count: usize, item: impl Fn(usize) -> String) -> String {
    let items: Vec<String> = (0..count).map(item).collect();
    format!("[{}]", items.join(", "))
}

fn etcd(body: &str) -> String {
    format!("dynamo: {{enabled: true, discovery: {{etcd: {body}}}}}")
}

fn kube_pods(body: &str) -> String {
    format!("dynamo: {{enabled: true, discovery: {{source: kubernetes_pods, kubernetes: {body}}}}}")
}

fn simulator(body: &str) -> String {
    format!("dynamo: {{enabled: true, discovery: {{source: simulator, simulator: {body}}}}}")
}

fn static_workers(workers: &str) -> String {
    format!("dynamo: {{enabled: true, discovery: {{source: static, static: {{workers: {workers}}}}}}}")
}

const SHIM_BACKEND: &str = "backends: [{name: shim-a, url: 'http://a:8000'}, {name: shim-b, url: 'http://b:8000'}]\n";

fn with_shim(dynamo_extra: &str, shim: &str) -> String {
    format!(
        "{SHIM_BACKEND}disaggregated_serving: {{enabled: true}}\ndynamo: {{enabled: true, discovery: {{etcd: {{endpoints: ['etcd:2379']{dynamo_extra}}}}}, shim: {shim}}}"
    )
}

fn event_bus(body: &str) -> String {
    format!("dynamo: {{event_bus: {body}}}")
}

const PIN: &str = "blake3:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
const TOKEN: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

#[rustfmt::skip]
fn discovery_rows() -> Vec<Row> {
    vec![
        row("etcd endpoints required when enabled", "dynamo: {enabled: true}", Error, "dynamo.discovery.etcd.endpoints", "at least one"),
        row("etcd endpoints bounded", etcd(&format!("{{endpoints: {}}}", list(17, |i| format!("'etcd-{i}:2379'")))), Error, "dynamo.discovery.etcd.endpoints", "at most 16"),
        row("etcd endpoint with user:pass", etcd("{endpoints: ['http://user:pass@etcd:2379']}"), Error, "dynamo.discovery.etcd.endpoints[0]", "credentials"),
        row("bare etcd endpoint with user@", etcd("{endpoints: ['etcd:2379', 'user@etcd:2379']}"), Error, "dynamo.discovery.etcd.endpoints[1]", "credentials"),
        row("etcd endpoint with empty query", etcd("{endpoints: ['http://etcd:2379?']}"), Error, "dynamo.discovery.etcd.endpoints[0]", "query"),
        row("etcd endpoint with empty fragment", etcd("{endpoints: ['http://etcd:2379#']}"), Error, "dynamo.discovery.etcd.endpoints[0]", "fragment"),
        row("etcd endpoint with path", etcd("{endpoints: ['http://etcd:2379/v3']}"), Error, "dynamo.discovery.etcd.endpoints[0]", "path"),
        row("etcd endpoint with other scheme", etcd("{endpoints: ['grpc://etcd:2379']}"), Error, "dynamo.discovery.etcd.endpoints[0]", "scheme"),
        row("etcd endpoint without port", etcd("{endpoints: ['etcd']}"), Error, "dynamo.discovery.etcd.endpoints[0]", "port"),
        row("etcd endpoint with unbracketed IPv6", etcd("{endpoints: ['::1:2379']}"), Error, "dynamo.discovery.etcd.endpoints[0]", "bracketed"),
        row("etcd endpoints mixing schemes", etcd("{endpoints: ['http://a:2379', 'https://b:2379']}"), Error, "dynamo.discovery.etcd.endpoints", "mix"),
        row("etcd tls with http", etcd("{endpoints: ['http://a:2379'], tls: {ca_cert: /ca.pem}}"), Error, "dynamo.discovery.etcd.tls", "http://"),
        row("etcd client cert without key", etcd("{endpoints: ['https://a:2379'], tls: {client_cert: /c.pem}}"), Error, "dynamo.discovery.etcd.tls.client_key", "together"),
        row("etcd https without tls", etcd("{endpoints: ['https://a:2379']}"), Error, "dynamo.discovery.etcd.tls.ca_cert", "https://"),
        row("etcd endpoint scheme in upper case", etcd("{endpoints: ['HTTP://etcd:2379']}"), Error, "dynamo.discovery.etcd.endpoints[0]", "lower case"),
        row("etcd tls without a CA", etcd("{endpoints: ['https://a:2379'], tls: {server_name: etcd}}"), Error, "dynamo.discovery.etcd.tls.ca_cert", "required"),
        row("etcd at a public address in direct mode", etcd("{endpoints: ['etcd:2379', 'http://34.1.2.3:2379']}"), Warning, "dynamo.discovery.etcd.endpoints[1]", "outside the cluster"),
        row("etcd at a public IPv6 address in direct mode", etcd("{endpoints: ['[2600:1f18::5]:2379']}"), Warning, "dynamo.discovery.etcd.endpoints[0]", "transport: broker"),
        row("etcd auth over plaintext", etcd("{endpoints: ['a:2379'], auth: {username: r, password: p}}"), Warning, "dynamo.discovery.etcd.auth", "cleartext"),
        row("etcd auth without password", etcd("{endpoints: ['https://a:2379'], auth: {username: r}}"), Error, "dynamo.discovery.etcd.auth.password", "must not be empty"),
        row("namespace with slash", etcd("{endpoints: ['a:2379'], namespace: 'a/b'}"), Error, "dynamo.discovery.etcd.namespace", "`/`"),
        row("namespace with whitespace", etcd("{endpoints: ['a:2379'], namespaces: ['ok', 'not ok']}"), Error, "dynamo.discovery.etcd.namespaces[1]", "whitespace"),
        row("duplicate namespaces", etcd("{endpoints: ['a:2379'], namespaces: [prod, prod]}"), Error, "dynamo.discovery.etcd.namespaces[1]", "duplicates"),
        row("namespaces bounded", etcd(&format!("{{endpoints: ['a:2379'], namespaces: {}}}", list(17, |i| format!("ns{i}")))), Error, "dynamo.discovery.etcd.namespaces", "at most 16"),
        row("namespace exclusive with namespaces", etcd("{endpoints: ['a:2379'], namespace: prod, namespaces: [canary]}"), Error, "dynamo.discovery.etcd.namespace", "mutually exclusive"),
        row("backoff too short", etcd("{endpoints: ['a:2379'], watch_reconnect_backoff: {initial: 1ns, max: 1s}}"), Error, "dynamo.discovery.etcd.watch_reconnect_backoff.initial", "at least 10ms"),
        row("backoff max below initial", etcd("{endpoints: ['a:2379'], watch_reconnect_backoff: {initial: 5s, max: 1s}}"), Error, "dynamo.discovery.etcd.watch_reconnect_backoff.max", ">= initial"),
        row("backoff max past an hour", etcd("{endpoints: ['a:2379'], watch_reconnect_backoff: {initial: 1s, max: 100y}}"), Error, "dynamo.discovery.etcd.watch_reconnect_backoff.max", "at most 1h"),
        row("kubernetes namespace not a DNS label", kube_pods("{namespace: Dynamo_NS, model: m}"), Error, "dynamo.discovery.kubernetes.namespace", "DNS-1123"),
        row("kubernetes dynamo_namespace empty", kube_pods("{namespace: dynamo, dynamo_namespace: '', model: m}"), Error, "dynamo.discovery.kubernetes.dynamo_namespace", "label value"),
        row("kubernetes dynamo_namespaces exclusive", kube_pods("{namespace: d, dynamo_namespace: x, dynamo_namespaces: [a, b], models: [{component: c, model: m, dynamo_namespace: a}]}"), Error, "dynamo.discovery.kubernetes.dynamo_namespace", "mutually exclusive"),
        row("kubernetes_pods needs a model", kube_pods("{namespace: dynamo}"), Error, "dynamo.discovery.kubernetes.model", "needs model"),
        row("kubernetes_pods model and models", kube_pods("{namespace: dynamo, model: m, models: [{component: c, model: m}]}"), Error, "dynamo.discovery.kubernetes.models", "exactly one"),
        row("kubernetes_pods model with whitespace", kube_pods("{namespace: dynamo, model: 'solar pro'}"), Error, "dynamo.discovery.kubernetes.model", "whitespace"),
        row("kubernetes_pods duplicate component", kube_pods("{namespace: dynamo, models: [{component: c, model: a}, {component: c, model: b}]}"), Error, "dynamo.discovery.kubernetes.models[1].component", "duplicates"),
        row("kubernetes_pods models bounded", kube_pods(&format!("{{namespace: dynamo, models: {}}}", list(257, |i| format!("{{component: c{i}, model: m}}")))), Error, "dynamo.discovery.kubernetes.models", "at most 256"),
        row("kubernetes_pods one namespace named or not", kube_pods("{namespace: d, dynamo_namespaces: [a], models: [{component: c, model: m}, {component: c, model: n, dynamo_namespace: a}]}"), Error, "dynamo.discovery.kubernetes.models[1].component", "duplicates"),
        row("kubernetes_pods models need dynamo_namespace", kube_pods("{namespace: d, dynamo_namespaces: [a, b], models: [{component: c, model: m}]}"), Error, "dynamo.discovery.kubernetes.models[0].dynamo_namespace", "required"),
        row("kubernetes sources refused as the binary refuses them", kube_pods("{namespace: dynamo, model: m}"), Error, "dynamo.discovery.source", "not available in this build"),
        row("kubernetes_pods has no load signals", kube_pods("{namespace: dynamo, model: m}"), Warning, "dynamo.discovery.source", "round-robin"),
        row("kubernetes metadata ignores model", "dynamo: {discovery: {source: kubernetes, kubernetes: {namespace: dynamo, model: m}}}", Warning, "dynamo.discovery.kubernetes.model", "ignored"),
        row("static ranks past the last", static_workers("[{instance_id: 7, role: decode, model: m, dp_start_rank: 4294967295, dp_size: 2}]"), Error, "dynamo.discovery.static.workers[0].dp_start_rank", "past the last"),
        row("static namespaces bounded", static_workers(&format!("[{}]", (1..=17).map(|i| format!("{{instance_id: {i}, role: decode, model: m, namespace: ns{i}}}")).collect::<Vec<_>>().join(", "))), Error, "dynamo.discovery.static.workers[16].namespace", "at most 16"),
        row("static duplicate identity", static_workers("[{instance_id: 7, role: decode, model: m}, {instance_id: '0x7', role: decode, model: m}]"), Error, "dynamo.discovery.static.workers[1].instance_id", "duplicates dynamo.discovery.static.workers[0]"),
        row("static instance id in two namespaces", static_workers("[{instance_id: 7, role: decode, model: m}, {namespace: other, instance_id: 7, role: decode, model: m}]"), Error, "dynamo.discovery.static.workers[1].instance_id", "unique across namespaces"),
        row("static instance_id zero", static_workers("[{instance_id: 0, role: decode, model: m}]"), Error, "dynamo.discovery.static.workers[0].instance_id", "must not be 0"),
        row("static role required", static_workers("[{instance_id: 1, model: m}]"), Error, "dynamo.discovery.static.workers[0].role", "required"),
        row("static role unknown", static_workers("[{instance_id: 1, role: prefil, model: m}]"), Error, "dynamo.discovery.static.workers[0].role", "unknown variant"),
        row("static model required", static_workers("[{instance_id: 1, role: prefill}]"), Error, "dynamo.discovery.static.workers[0].model", "model"),
        row("static dp_size bounded", static_workers("[{instance_id: 1, role: decode, model: m, dp_size: 1025}]"), Error, "dynamo.discovery.static.workers[0].dp_size", "at most 1024"),
        row("static workers bounded", static_workers(&list(16_385, |i| format!("{{instance_id: {}, role: decode, model: m}}", i + 1))), Error, "dynamo.discovery.static.workers", "at most 16384"),
        row("static workers ignored by other sources", "dynamo: {discovery: {static: {workers: [{instance_id: 1, role: decode, model: m}]}}}", Warning, "dynamo.discovery.static.workers", "ignored"),
        row("instance_id negative", static_workers("[{instance_id: -5, role: decode, model: m}]"), Error, "dynamo.discovery.static.workers[0].instance_id", "negative"),
        row("instance_id not hex", static_workers("[{instance_id: 'worker-1', role: decode, model: m}]"), Error, "dynamo.discovery.static.workers[0].instance_id", "hex"),
        row("simulator model required", simulator("{model: ''}"), Error, "dynamo.discovery.simulator.model", "model"),
        row("simulator needs decode workers", simulator("{decode: 0}"), Error, "dynamo.discovery.simulator.decode", "at least 1"),
        row("simulator workers bounded", simulator("{prefill: 65}"), Error, "dynamo.discovery.simulator.prefill", "at most 64"),
        row("simulator kv blocks bounded", simulator("{total_kv_blocks: 1099511627776}"), Error, "dynamo.discovery.simulator.total_kv_blocks", "at most 1048576"),
        row("simulator block_size zero", simulator("{block_size: 0}"), Error, "dynamo.discovery.simulator.block_size", "must be 16 to 65536"),
        row("simulator block_size below hashing", simulator("{block_size: 8}"), Error, "dynamo.discovery.simulator.block_size", "is 8; must be 16 to 65536"),
        row("simulator block_size above hashing", simulator("{block_size: 65537}"), Error, "dynamo.discovery.simulator.block_size", "must be 16 to 65536"),
        row("simulator total_kv_blocks zero", simulator("{total_kv_blocks: 0}"), Error, "dynamo.discovery.simulator.total_kv_blocks", "greater than zero"),
        row("simulator namespace with slash", simulator("{namespace: 'a/b'}"), Error, "dynamo.discovery.simulator.namespace", "`/`"),
        row("simulator shim_listen not an address", simulator("{shim_listen: 'port 8000'}"), Error, "dynamo.discovery.simulator.shim_listen", "address"),
        row("simulator shim without a backend", simulator("{shim_listen: '127.0.0.1:8001'}"), Warning, "dynamo.discovery.simulator.shim_listen", "no entry of `backends`"),
        row("simulator shim off loopback", simulator("{shim_listen: '0.0.0.0:8001'}"), Warning, "dynamo.discovery.simulator.shim_listen", "reachable off-host"),
        row("simulator shim on port 0", simulator("{shim_listen: '127.0.0.1:0'}"), Error, "dynamo.discovery.simulator.shim_listen", "must name a port"),
        row("simulator shim on the admin port", simulator("{shim_listen: '127.0.0.1:9090'}"), Error, "dynamo.discovery.simulator.shim_listen", "collides with admin.listen"),
    ]
}

#[rustfmt::skip]
fn dynamo_rows() -> Vec<Row> {
    vec![
        row("max_staleness floor", "dynamo: {load: {max_staleness: 50ms}}", Error, "dynamo.load.max_staleness", "between 100ms and 5m"),
        row("max_staleness ceiling", "dynamo: {load: {max_staleness: 10m}}", Error, "dynamo.load.max_staleness", "between 100ms and 5m"),
        row("max_staleness finer than ms", "dynamo: {load: {max_staleness: 2s 500us}}", Error, "dynamo.load.max_staleness", "whole number of milliseconds"),
        row("max_staleness not a duration", "dynamo: {load: {max_staleness: soon}}", Error, "dynamo.load.max_staleness", "invalid duration"),
        row("max_staleness a bare number", "dynamo: {load: {max_staleness: 3}}", Error, "dynamo.load.max_staleness", "write \"3s\" or \"3ms\""),
        row("direct_allow_cidrs entry", "dynamo: {load: {direct_allow_cidrs: ['10.0.0.0/8', '10.0.0.0/33']}}", Error, "dynamo.load.direct_allow_cidrs[1]", "prefix length"),
        row("direct_allow_cidrs bounded", format!("dynamo: {{load: {{direct_allow_cidrs: {}}}}}", list(65, |i| format!("'10.{i}.0.0/16'"))), Error, "dynamo.load.direct_allow_cidrs", "at most 64"),
        row("direct_allow_cidrs unset", etcd("{endpoints: ['a:2379']}"), Warning, "dynamo.load.direct_allow_cidrs", "Pod CIDRs"),
        row("broker transport without event bus", "dynamo: {enabled: true, discovery: {etcd: {endpoints: ['a:2379']}}, load: {transport: broker}}", Error, "dynamo.load.transport", "cannot carry"),
        row("broker transport with event bus", format!("dynamo: {{enabled: true, discovery: {{etcd: {{endpoints: ['a:2379']}}}}, load: {{transport: broker}}, event_bus: {{enabled: true, tls: {{cert: /c, key: /k}}, brokers: [{{id: b, token_hash: '{TOKEN}', namespaces: [dynamo]}}]}}}}"), Error, "dynamo.load.transport", "no event-bus listener"),
        row("unknown transport", "dynamo: {load: {transport: zmq}}", Error, "dynamo.load.transport", "unknown variant"),
        row("shim replica not a backend", with_shim("", "{backends: [nope]}"), Error, "dynamo.shim.backends[0]", "not a configured"),
        row("shim replica listed twice", with_shim("", "{backends: [shim-a, shim-a]}"), Error, "dynamo.shim.backends[1]", "duplicates"),
        row("shim replicas bounded", with_shim("", &format!("{{backends: {}}}", list(65, |i| format!("s{i}")))), Error, "dynamo.shim.backends", "at most 64"),
        row("shim replica over https", "backends: [{name: s, url: 'https://s:8443'}]\ndynamo: {shim: {backends: [s]}}", Error, "backends[0].url", "plain http://"),
        row("unified backend over https", "backends: [{name: u, url: 'https://u:8443', models: [m]}]", Error, "backends[0].url", "plain http://"),
        row("backend url with credentials", "backends: [{name: u, url: 'http://user:s3cret@u:8000'}]", Error, "backends[0].url", "credentials"),
        row("backend url with a query", "backends: [{name: u, url: 'http://u:8000?x=1'}]", Error, "backends[0].url", "query string"),
        row("backend url with a fragment", "backends: [{name: u, url: 'http://u:8000/v#x'}]", Error, "backends[0].url", "fragment"),
        row("shim replica disabled", "backends: [{name: s, url: 'http://s:8000', enabled: false}]\ndynamo: {shim: {backends: [s]}}", Warning, "dynamo.shim.backends[0]", "enabled: false"),
        row("shim while dynamo disabled", format!("{SHIM_BACKEND}dynamo: {{shim: {{backends: [shim-a]}}}}"), Warning, "dynamo.shim", "dynamo.enabled"),
        row("pinning on with no shim replica", "dynamo: {enabled: true, discovery: {etcd: {endpoints: ['a:2379']}}}\ndisaggregated_serving: {enabled: true}", Warning, "dynamo.shim.backends", "no request can be pinned"),
        row("several namespaces need pools", with_shim(", namespaces: [prod, canary]", "{backends: [shim-a]}"), Error, "dynamo.shim.backends", "shim.pools"),
        row("several namespaces and no shim at all", with_shim(", namespaces: [prod, canary]", "{}"), Error, "dynamo.shim.pools", "is required"),
        row("namespace without pool", with_shim(", namespaces: [prod, canary]", "{pools: [{namespace: prod, backends: [shim-a]}]}"), Error, "dynamo.shim.pools", "`canary` has no pool"),
        row("replica in two pools", with_shim(", namespaces: [prod, canary]", "{pools: [{namespace: prod, backends: [shim-a]}, {namespace: canary, backends: [shim-a]}]}"), Error, "dynamo.shim.pools[1].backends[0]", "already belongs"),
        row("pool for an unwatched namespace", with_shim("", "{pools: [{namespace: other, backends: [shim-a]}]}"), Error, "dynamo.shim.pools[0].namespace", "not a configured"),
        row("model_map empty target", with_shim("", "{backends: [shim-a], model_map: {qwen: ''}}"), Error, "dynamo.shim.model_map.qwen", "display_name"),
        row("model_map bounded", format!("dynamo: {{shim: {{model_map: {{{}}}}}}}", (0..1025).map(|i| format!("m{i}: d")).collect::<Vec<_>>().join(", ")), Error, "dynamo.shim.model_map", "at most 1024"),
        row("backend names unique", "backends: [{name: a, url: 'http://a'}, {name: a, url: 'http://b'}]", Error, "backends[1].name", "duplicates"),
        row("backend url scheme", "backends: [{name: a, url: 'ftp://a'}]", Error, "backends[0].url", "http://"),
        row("backend wire", "backends: [{name: a, type: anthropic, url: 'http://a'}]", Error, "backends[0].type", "OpenAI wire"),
        row("one-phase backend serving models", "backends: [{name: p, role: prefill, url: 'http://p:8000', models: [m]}]", Warning, "backends[0].role", "no plain requests"),
        row("pinned artifact format", format!("dynamo: {{kv: {{pinned_artifacts: ['{PIN}', 'blake3:ABC']}}}}"), Error, "dynamo.kv.pinned_artifacts[1]", "64 lowercase hex"),
        row("kv enabled with nothing pinned", "dynamo: {kv: {enabled: true}}", Warning, "dynamo.kv.pinned_artifacts", "pinned"),
        row("conditional disaggregation warns", "dynamo: {kv: {conditional_disaggregation: {enabled: true}}}", Warning, "dynamo.kv.conditional_disaggregation.enabled", "503"),
        row("decode_busy_threshold range", "dynamo: {kv: {conditional_disaggregation: {decode_busy_threshold: 1.5}}}", Error, "dynamo.kv.conditional_disaggregation.decode_busy_threshold", "between 0.0 and 1.0"),
        row("negative overlap credit", "dynamo: {kv: {overlap_score_credit: -1.0}}", Error, "dynamo.kv.overlap_score_credit", ">= 0"),
        row("pin under another algorithm", format!("dynamo: {{kv: {{pinned_artifacts: ['{TOKEN}']}}}}"), Error, "dynamo.kv.pinned_artifacts[0]", "blake3:"),
        row("pin with a short digest", "dynamo: {kv: {pinned_artifacts: ['blake3:0123abcd']}}", Error, "dynamo.kv.pinned_artifacts[0]", "64 lowercase hex"),
        row("kv enabled with an empty pin list", "dynamo: {kv: {enabled: true, pinned_artifacts: []}}", Warning, "dynamo.kv.pinned_artifacts", "is empty"),
        row("conditional disaggregation names the 1.5.x refusal", "dynamo: {kv: {conditional_disaggregation: {enabled: true}}}", Warning, "dynamo.kv.conditional_disaggregation.enabled", "without a prefill id"),
        row("negative decode_busy_threshold", "dynamo: {kv: {conditional_disaggregation: {decode_busy_threshold: -0.1}}}", Error, "dynamo.kv.conditional_disaggregation.decode_busy_threshold", "between 0.0 and 1.0"),
        row("NaN decode_busy_threshold", "dynamo: {kv: {conditional_disaggregation: {decode_busy_threshold: .nan}}}", Error, "dynamo.kv.conditional_disaggregation.decode_busy_threshold", "between 0.0 and 1.0"),
        row("infinite overlap credit", "dynamo: {kv: {overlap_score_credit: .inf}}", Error, "dynamo.kv.overlap_score_credit", "finite"),
        row("negative prefill_load_scale", "dynamo: {kv: {prefill_load_scale: -0.5}}", Error, "dynamo.kv.prefill_load_scale", ">= 0"),
        row("NaN prefill_load_scale", "dynamo: {kv: {prefill_load_scale: .nan}}", Error, "dynamo.kv.prefill_load_scale", "finite"),
        row("negative router_temperature", "dynamo: {kv: {router_temperature: -1}}", Error, "dynamo.kv.router_temperature", ">= 0"),
        row("infinite router_temperature", "dynamo: {kv: {router_temperature: .inf}}", Error, "dynamo.kv.router_temperature", "finite"),
        row("provisional_ttl ceiling", "dynamo: {kv: {provisional_ttl: 61s}}", Error, "dynamo.kv.provisional_ttl", "at most 60s"),
        row("provisional_ttl not a duration", "dynamo: {kv: {provisional_ttl: brief}}", Error, "dynamo.kv.provisional_ttl", "invalid duration"),
    ]
}

#[rustfmt::skip]
fn listener_rows() -> Vec<Row> {
    vec![
        row("event bus not built", event_bus(&format!("{{enabled: true, tls: {{cert: /c, key: /k}}, brokers: [{{id: b, token_hash: '{TOKEN}', namespaces: [dynamo]}}]}}")), Warning, "dynamo.event_bus.enabled", "nothing listens"),
        row("event bus buffer floor", event_bus("{max_streams_per_session: 1024, max_session_buffer_bytes: 1048576}"), Error, "dynamo.event_bus.max_session_buffer_bytes", "64 KiB"),
        row("event bus needs tls", event_bus(&format!("{{enabled: true, tls: {{key: /k.pem}}, brokers: [{{id: b, token_hash: '{TOKEN}'}}]}}")), Error, "dynamo.event_bus.tls.cert", "required"),
        row("event bus token hash format", event_bus("{brokers: [{id: b, token_hash: 'sha256:XYZ'}]}"), Error, "dynamo.event_bus.brokers[0].token_hash", "sha256:"),
        row("event bus credential required", event_bus("{brokers: [{id: b, namespaces: [dynamo]}]}"), Error, "dynamo.event_bus.brokers[0].token_hash", "client_ca"),
        row("event bus broker id lowercase", event_bus(&format!("{{brokers: [{{id: Broker-A, token_hash: '{TOKEN}'}}]}}")), Error, "dynamo.event_bus.brokers[0].id", "lowercase"),
        row("event bus broker ids unique", event_bus(&format!("{{brokers: [{{id: b, token_hash: '{TOKEN}'}}, {{id: b, token_hash: '{TOKEN}'}}]}}")), Error, "dynamo.event_bus.brokers[1].id", "duplicates"),
        row("event bus broker allowlist empty", event_bus(&format!("{{brokers: [{{id: b, token_hash: '{TOKEN}'}}]}}")), Warning, "dynamo.event_bus.brokers[0].namespaces", "any Dynamo namespace"),
        row("event bus kv_listener namespaces", event_bus(&format!("{{brokers: [{{id: l, role: kv_listener, token_hash: '{TOKEN}', namespaces: [dynamo], backends: [v]}}]}}")), Error, "dynamo.event_bus.brokers[0].namespaces", "role: broker"),
        row("event bus idle timeout", event_bus("{heartbeat_interval: 30s, idle_timeout: 30s}"), Error, "dynamo.event_bus.idle_timeout", "heartbeat_interval"),
        row("event bus idle timeout bounded", event_bus("{idle_timeout: 500000000000y}"), Error, "dynamo.event_bus.idle_timeout", "at most 3600s"),
        row("event bus listen collides", format!("admin: {{listen: '0.0.0.0:7443'}}\n{}", event_bus(&format!("{{enabled: true, tls: {{cert: /c, key: /k}}, brokers: [{{id: b, token_hash: '{TOKEN}', namespaces: [dynamo]}}]}}"))), Error, "dynamo.event_bus.listen", "collides with admin.listen"),
        row("admin collides with grpc", "control_plane: {grpc_listen: '127.0.0.1:9000'}\nadmin: {listen: '0.0.0.0:9000', token: t}", Error, "admin.listen", "collides with control_plane.grpc_listen"),
        row("admin off-host without token", "admin: {listen: '0.0.0.0:9090'}", Warning, "admin.token", "not a loopback"),
        row("admin token empty", "admin: {token: ''}", Error, "admin.token", "must not be empty"),
        row("admin token ending in a newline", "admin: {token: \"t\\n\"}", Error, "admin.token", "visible ASCII"),
        row("admin listen not an address", "admin: {listen: localhost}", Error, "admin.listen", "socket address"),
        row("grpc off-host without token", "control_plane: {grpc_listen: '0.0.0.0:50051'}", Warning, "control_plane.token", "end replicas' streams"),
        row("grpc token empty", "control_plane: {token: ''}", Error, "control_plane.token", "must not be empty"),
        row("grpc token not a header value", "control_plane: {token: 'two words'}", Error, "control_plane.token", "visible ASCII"),
        row("grpc tls needs a key", "control_plane: {tls: {cert: /c.pem}}", Error, "control_plane.tls.key", "private key"),
        row("grpc tls needs a cert", "control_plane: {tls: {key: /k.pem}}", Error, "control_plane.tls.cert", "certificate"),
        row("grpc previous token alone", "control_plane: {previous_token: old}", Error, "control_plane.previous_token", "set token too"),
        row("grpc previous token not a header value", "control_plane: {token: new, previous_token: ''}", Error, "control_plane.previous_token", "visible ASCII"),
    ]
}

#[test]
fn every_rule_reports_at_its_key_path() {
    let rows: Vec<Row> = [discovery_rows(), dynamo_rows(), listener_rows()].into_iter().flatten().collect();
    assert!(rows.len() >= 30);
    let mut failures = Vec::new();
    for row in &rows {
        let found = diagnostics(&row.yaml);
        let hit =
            found.iter().any(|d| d.severity == row.severity && d.path == row.path && d.message.contains(row.fragment));
        let typo = found.iter().find(|d| d.message.starts_with("unknown key"));
        if !hit || typo.is_some() {
            let listed: Vec<String> = found.iter().map(ToString::to_string).collect();
            failures.push(format!(
                "{}: want {:?} at {} ~ {:?}; got:\n    {}",
                row.name,
                row.severity,
                row.path,
                row.fragment,
                listed.join("\n    ")
            ));
        }
    }
    assert!(failures.is_empty(), "{} of {} rows failed:\n{}", failures.len(), rows.len(), failures.join("\n"));
}

/// Each bound admits exactly its limit: the rows above show one past it is refused.
#[rustfmt::skip]
#[test]
fn values_at_each_bound_are_accepted() {
    let cases = [
        (etcd(&format!("{{endpoints: {}}}", list(16, |i| format!("'etcd-{i}:2379'")))), "dynamo.discovery.etcd.endpoints"),
        (etcd(&format!("{{endpoints: ['a:2379'], namespaces: {}}}", list(16, |i| format!("ns{i}")))), "dynamo.discovery.etcd.namespaces"),
        (kube_pods(&format!("{{namespace: dynamo, models: {}}}", list(256, |i| format!("{{component: c{i}, model: m}}")))), "dynamo.discovery.kubernetes.models"),
        (static_workers(&list(16_384, |i| format!("{{instance_id: {}, role: decode, model: m}}", i + 1))), "dynamo.discovery.static.workers"),
        (simulator("{prefill: 64, decode: 64}"), "dynamo.discovery.simulator.prefill"),
        (simulator("{prefill: 64, decode: 64}"), "dynamo.discovery.simulator.decode"),
        (with_shim("", &format!("{{backends: {}}}", list(64, |i| format!("s{i}")))), "dynamo.shim.backends"),
        (format!("dynamo: {{shim: {{model_map: {{{}}}}}}}", (0..1024).map(|i| format!("m{i}: d")).collect::<Vec<_>>().join(", ")), "dynamo.shim.model_map"),
        (format!("dynamo: {{load: {{direct_allow_cidrs: {}}}}}", list(64, |i| format!("'10.{i}.0.0/16'"))), "dynamo.load.direct_allow_cidrs"),
        ("dynamo: {load: {max_staleness: 100ms}}".to_owned(), "dynamo.load.max_staleness"),
        ("dynamo: {load: {max_staleness: 5m}}".to_owned(), "dynamo.load.max_staleness"),
        ("dynamo: {kv: {conditional_disaggregation: {decode_busy_threshold: 0.0}}}".to_owned(), "dynamo.kv.conditional_disaggregation.decode_busy_threshold"),
        ("dynamo: {kv: {conditional_disaggregation: {decode_busy_threshold: 1.0}}}".to_owned(), "dynamo.kv.conditional_disaggregation.decode_busy_threshold"),
        ("dynamo: {kv: {overlap_score_credit: 0.0, prefill_load_scale: 0.0, router_temperature: 0.0}}".to_owned(), "dynamo.kv.overlap_score_credit"),
        ("dynamo: {kv: {overlap_score_credit: 0.0, prefill_load_scale: 0.0, router_temperature: 0.0}}".to_owned(), "dynamo.kv.prefill_load_scale"),
        ("dynamo: {kv: {overlap_score_credit: 0.0, prefill_load_scale: 0.0, router_temperature: 0.0}}".to_owned(), "dynamo.kv.router_temperature"),
        (event_bus("{max_streams_per_session: 1024, max_session_buffer_bytes: 67108864}"), "dynamo.event_bus.max_session_buffer_bytes"),
        // One namespace listed: a model's is that one, so it may go unsaid (the seed asks for it with several).
        (kube_pods("{namespace: d, dynamo_namespaces: [a], models: [{component: c, model: m}]}"), "dynamo.discovery.kubernetes.models[0].dynamo_namespace"),
    ];
    for (yaml, path) in cases {
        let refused: Vec<_> = diagnostics(&yaml).into_iter().filter(|d| d.is_error() && d.path == path).collect();
        assert!(refused.is_empty(), "{path}: {refused:?}");
    }
}

/// The warning about a router outside the cluster fires for public addresses only: not for
/// names, loopback, private, shared, link-local or unique-local addresses, nor in broker mode.
#[test]
fn only_a_public_etcd_address_in_direct_mode_draws_the_outside_warning() {
    let outside = |yaml: &str| {
        diagnostics(yaml)
            .into_iter()
            .filter(|d| d.message.contains("outside the cluster"))
            .map(|d| d.path)
            .collect::<Vec<_>>()
    };
    let internal = "['etcd:2379', 'etcd.dynamo.svc.cluster.local:2379', '127.0.0.1:2379', '10.0.0.5:2379', '172.16.3.4:2379', \
                    '192.168.1.2:2379', '100.64.1.1:2379', '169.254.1.1:2379', '[::1]:2379', '[fd00::5]:2379', '[fe80::1]:2379', \
                    '[::ffff:10.1.2.3]:2379', '[64:ff9b::a00:5]:2379']";
    assert_eq!(outside(&etcd(&format!("{{endpoints: {internal}}}"))), Vec::<String>::new());
    let public = "{endpoints: ['100.128.0.1:2379', '[::ffff:34.1.2.3]:2379', '[64:ff9b::2201:203]:2379']}";
    assert_eq!(
        outside(&etcd(public)),
        [
            "dynamo.discovery.etcd.endpoints[0]",
            "dynamo.discovery.etcd.endpoints[1]",
            "dynamo.discovery.etcd.endpoints[2]"
        ]
    );
    let broker = format!("dynamo: {{enabled: true, load: {{transport: broker}}, discovery: {{etcd: {public}}}}}");
    assert_eq!(outside(&broker), Vec::<String>::new(), "broker mode is how a router outside the cluster runs");
}
