//! Loading: the embedded default, `${VAR}` substitution, unknown keys, type errors, syntax
//! errors and instance ids.

use super::{diagnostics, load, loaded};
use crate::config::{ConfigError, DiscoverySource, MASK, Severity, WorkerRole, embedded_default, load_file, load_str};

#[test]
fn embedded_default_validates_clean() {
    let loaded = loaded(crate::config::embedded_default_yaml());
    assert!(loaded.diagnostics.is_empty(), "{:?}", loaded.diagnostics);
    let config = embedded_default();
    assert_eq!(config, loaded.config);
    assert!(config.dynamo.enabled && config.disaggregated_serving.enabled);
    assert_eq!(config.dynamo.discovery.source, DiscoverySource::Simulator);
    let simulator = &config.dynamo.discovery.simulator;
    assert_eq!((simulator.namespace.as_str(), simulator.model.as_str()), ("dynamo", "tiny"));
    assert_eq!((simulator.prefill, simulator.decode, simulator.block_size), (2, 2, 16));
    assert_eq!(simulator.total_kv_blocks, 1024);
    assert_eq!(simulator.shim_listen.to_string(), "127.0.0.1:8000");
    assert_eq!(config.dynamo.shim.backends, vec!["demo-shim".to_owned()]);
    assert_eq!(config.backends[0].url, "http://127.0.0.1:8000");
}

#[test]
fn static_fleet_example_validates_clean() {
    let text = include_str!("../../../../deploy/examples/static-fleet.yaml");
    let loaded = loaded(text);
    assert!(loaded.diagnostics.is_empty(), "{:?}", loaded.diagnostics);
    let roles: Vec<Option<WorkerRole>> =
        loaded.config.dynamo.discovery.static_fleet.workers.iter().map(|w| w.role).collect();
    let (p, d) = (Some(WorkerRole::Prefill), Some(WorkerRole::Decode));
    assert_eq!(roles, vec![p, p, d, d]);
}

#[test]
fn moving_the_simulator_shim_moves_its_backend() {
    let mut config = embedded_default();
    let addr: std::net::SocketAddr = "127.0.0.1:18000".parse().unwrap_or_else(|e| panic!("{e}"));
    config.move_simulator_shim(addr);
    assert_eq!(config.dynamo.discovery.simulator.shim_listen, addr);
    assert_eq!(config.backends[0].url, "http://127.0.0.1:18000");
    assert!(config.validate().iter().all(|d| !d.is_error()));

    // A static fleet's shim at the simulator's default address is a real one: it stays.
    let mut config = loaded(include_str!("../../../../deploy/examples/static-fleet.yaml")).config;
    config.backends[0].url = "http://127.0.0.1:8000".into();
    config.move_simulator_shim(addr);
    assert_eq!(config.backends[0].url, "http://127.0.0.1:8000");
}

#[test]
fn substitution_fills_every_string_from_the_environment() {
    let yaml = "dynamo:\n  discovery:\n    etcd:\n      endpoints: ['${ETCD_HOST}:2379', 'b:2379']\n      auth: {username: router, password: '${ETCD_PASSWORD}'}\nadmin: {token: 'literal-$${NOT_A_VAR}-and-$5'}";
    let env = |name: &str| match name {
        "ETCD_HOST" => Some("etcd-0".to_owned()),
        "ETCD_PASSWORD" => Some("hunter2".to_owned()),
        _ => None,
    };
    let config = match load_str(yaml, &env) {
        Ok(loaded) => loaded.config,
        Err(error) => panic!("{error}"),
    };
    let etcd = &config.dynamo.discovery.etcd;
    assert_eq!(etcd.endpoints[0], "etcd-0:2379");
    assert_eq!(etcd.auth.as_ref().map(|a| a.password.expose()), Some("hunter2"));
    assert_eq!(config.admin.token.as_ref().map(|t| t.expose()), Some("literal-${NOT_A_VAR}-and-$5"));
}

#[test]
fn unset_or_malformed_variables_are_errors_at_their_key_path() {
    let yaml = "dynamo: {discovery: {etcd: {auth: {username: r, password: '${ETCD_PASSWORD}'}, endpoints: ['${HOST']}}}\nadmin: {token: '${}'}";
    let found = diagnostics(yaml);
    let expect = [
        ("dynamo.discovery.etcd.auth.password", "`ETCD_PASSWORD` is not set"),
        ("dynamo.discovery.etcd.endpoints[0]", "unterminated"),
        ("admin.token", "not a variable reference"),
    ];
    for (path, fragment) in expect {
        assert!(found.iter().any(|d| d.path == path && d.message.contains(fragment)), "{path}: {found:?}");
    }
    // The emptied password is not reported a second time by the auth rule.
    assert_eq!(found.iter().filter(|d| d.path == "dynamo.discovery.etcd.auth.password").count(), 1);

    // A malformed reference inside a secret is reported without quoting it.
    let found = diagnostics("dynamo: {discovery: {etcd: {auth: {username: r, password: 'pa${ss-w}rd'}}}}");
    let password = found.iter().find(|d| d.path == "dynamo.discovery.etcd.auth.password");
    assert!(password.is_some_and(|d| d.message.contains("not a variable reference")), "{found:?}");
    assert!(!format!("{found:?}").contains("ss-w"), "{found:?}");
}

#[test]
fn a_mistyped_secret_is_reported_without_its_value() {
    let yaml = "dynamo: {discovery: {etcd: {endpoints: ['https://a:2379'], auth: {username: r, password: 20240101}}}}\nadmin: {token: 87654321}\ncontrol_plane: {token: t, previous_token: 13572468}";
    let found = diagnostics(yaml);
    for path in ["dynamo.discovery.etcd.auth.password", "admin.token", "control_plane.previous_token"] {
        assert!(found.iter().any(|d| d.path == path && d.message.contains("quote")), "{path}: {found:?}");
    }
    let shown = format!("{found:?}");
    for secret in ["20240101", "87654321", "13572468"] {
        assert!(!shown.contains(secret), "{secret}: {shown}");
    }
    // A whole credentials section given as a string is a secret too.
    let found = diagnostics("dynamo: {discovery: {etcd: {endpoints: ['https://a:2379'], auth: 'router:s3cret'}}}");
    assert!(!format!("{found:?}").contains("s3cret"), "{found:?}");
}

/// A backend URL with credentials is refused without quoting them.
#[test]
fn a_backend_url_with_credentials_is_refused_without_them() {
    // Whatever else is wrong with the URL: its other refusals quote it.
    let urls = [
        "http://user:s3cret@u:8000",
        "https://user:s3cret@u:8443",
        "ftp://user:s3cret@u",
        "user:s3cret@u",
        // A password holding what ends an authority: the `@` still gives it away.
        "http://user:s3#cret@u:8000",
        "http://user:s3?cret@u:8000",
        "https://user:s3/cret@u",
        "http://user:s3/cret@u:8000",
    ];
    for url in urls {
        let found = diagnostics(&format!("backends: [{{name: u, url: '{url}'}}]"));
        assert!(found.iter().any(|d| d.path == "backends[0].url" && d.message.contains("credentials")), "{found:?}");
        assert!(!format!("{found:?}").contains("cret"), "{url}: {found:?}");
    }
}

/// `config show` masks secrets; what it printed, loaded back, is refused at each secret rather
/// than deployed with `********` as its tokens.
#[test]
fn a_masked_readback_is_refused_at_every_secret() {
    let yaml = format!(
        "dynamo: {{discovery: {{etcd: {{endpoints: ['https://a:2379'], tls: {{ca_cert: /ca.pem, client_cert: /c.pem, client_key: '{MASK}'}}, auth: {{username: r, password: '{MASK}'}}}}}}}}\n\
         admin: {{token: '{MASK}'}}\n\
         control_plane: {{token: '{MASK}', previous_token: '{MASK}', tls: {{cert: /c.pem, key: '{MASK}'}}}}"
    );
    let found = diagnostics(&yaml);
    for path in [
        "dynamo.discovery.etcd.tls.client_key",
        "dynamo.discovery.etcd.auth.password",
        "admin.token",
        "control_plane.token",
        "control_plane.previous_token",
        "control_plane.tls.key",
    ] {
        assert!(found.iter().any(|d| d.path == path && d.message.contains("config show")), "{path}: {found:?}");
    }
}

#[test]
fn a_section_written_as_a_string_is_reported_without_its_value() {
    // The space after `token:` missing makes `admin` (or `control_plane`, `…tls`, the whole
    // document) one string, which substitution has already filled with the secret.
    let env = |name: &str| (name == "TOKEN").then(|| "s3cret-token".to_owned());
    let documents = [
        ("admin:\n  token:${TOKEN}", "admin"),
        ("control_plane: 'token:${TOKEN}'", "control_plane"),
        ("control_plane: {tls: 'key:${TOKEN}'}", "control_plane.tls"),
        ("'token: ${TOKEN}'", ""),
    ];
    for (yaml, path) in documents {
        let found = match load_str(yaml, &env) {
            Err(ConfigError::Invalid(found)) => found,
            other => panic!("{yaml}: expected diagnostics, got {other:?}"),
        };
        assert!(!format!("{found:?}").contains("s3cret"), "{yaml}: {found:?}");
        let said = found.iter().find(|d| d.path == path);
        assert!(said.is_some_and(|d| d.message.contains("space missing after a colon")), "{yaml}: {found:?}");
    }
    // A string where a plain value belongs is still quoted: it helps, and holds no secret.
    let found = diagnostics("dynamo: {discovery: {simulator: {prefill: two}}}");
    let prefill = found.iter().find(|d| d.path == "dynamo.discovery.simulator.prefill");
    assert!(prefill.is_some_and(|d| d.message.contains("\"two\"")), "{found:?}");
}

/// Keys are substituted too, so a key written beside a variable (`token:${TOKEN}:`, a space
/// missing and a colon too many) holds the secret once substituted. Reported unknown (or of
/// the wrong type), it is named as written.
#[test]
fn a_key_that_substitution_filled_is_reported_as_written() {
    let env = |name: &str| (name == "TOKEN").then(|| "s3cret-token".to_owned());
    for yaml in [
        "admin:\n  token:${TOKEN}:\n",
        // Reported by the substitution itself: the value's variable is not set.
        "admin: {\"token:${TOKEN}\": \"${UNSET}\"}",
        "dynamo: {discovery: {etcd: {auth: {username: u, \"password:${TOKEN}\": x}}}}",
        "control_plane: {tls: {\"key ${TOKEN}\": {}}}",
    ] {
        let found = match load_str(yaml, &env) {
            Err(ConfigError::Invalid(found)) => found,
            other => panic!("{yaml}: expected diagnostics, got {other:?}"),
        };
        assert!(!format!("{found:?}").contains("s3cret"), "{yaml}: {found:?}");
        assert!(found.iter().any(|d| d.path.ends_with("${TOKEN}")), "{yaml}: named as written: {found:?}");
    }
    // Only the substituted key's own reports are rewritten: a short key's text elsewhere stays.
    let env = |name: &str| (name == "M").then(|| "a".to_owned());
    let yaml = "dynamo: {shim: {model_map: {\"${M}\": 7}}}\nadmin: {listen: nowhere-at-all}";
    let Err(ConfigError::Invalid(found)) = load_str(yaml, &env) else { panic!("expected diagnostics") };
    let listen = found.iter().find(|d| d.path == "admin.listen").expect("the listen report");
    assert!(!listen.message.contains("${M}") && listen.message.contains("address"), "{listen:?}");
    assert!(found.iter().any(|d| d.path == "dynamo.shim.model_map.${M}"), "{found:?}");
}

#[test]
fn a_mapping_key_that_is_not_a_string_is_reported_under_its_section_and_checking_goes_on() {
    let found = diagnostics("dynamo: {shim: {model_map: {1: Qwen/Qwen3-32B}}}\nadmin: {listen: nowhere}");
    let model_map = found.iter().find(|d| d.path == "dynamo.shim.model_map");
    assert!(model_map.is_some_and(|d| d.message.contains("not a string")), "{found:?}");
    // The rest of the document is still checked.
    assert!(found.iter().any(|d| d.path == "admin.listen"), "{found:?}");
}

#[test]
fn mapping_keys_are_substituted_too() {
    let yaml = "dynamo: {shim: {model_map: {'${CLIENT_MODEL}': Qwen/Qwen3-32B}}}";
    let env = |name: &str| (name == "CLIENT_MODEL").then(|| "qwen".to_owned());
    let config = match load_str(yaml, &env) {
        Ok(loaded) => loaded.config,
        Err(error) => panic!("{error}"),
    };
    assert_eq!(config.dynamo.shim.model_map.get("qwen").map(String::as_str), Some("Qwen/Qwen3-32B"));
    // An unset variable in a key is an error at that key, as in a value.
    let found = diagnostics(yaml);
    let said = found.iter().find(|d| d.path == "dynamo.shim.model_map.${CLIENT_MODEL}");
    assert!(said.is_some_and(|d| d.message.contains("`CLIENT_MODEL` is not set")), "{found:?}");
}

#[test]
fn unknown_keys_are_all_reported_with_suggestions() {
    let yaml = "dynamo:\n  discovery:\n    etcd: {endpoint: ['a:2379'], namepsace: x}\n    static: {workers: [{instance_id: 1, rol: decode, model: m}]}\nbackend: []\nadmin: {zzz: 1}\ncontrol_plane: {tls: {cert: /c, key: /k, clinet_ca: /ca}}";
    let found = diagnostics(yaml);
    let expect = [
        ("dynamo.discovery.etcd.endpoint", "unknown key `endpoint`; did you mean `endpoints`?"),
        ("dynamo.discovery.etcd.namepsace", "did you mean `namespace`?"),
        ("dynamo.discovery.static.workers[0].rol", "did you mean `role`?"),
        ("backend", "did you mean `backends`?"),
        ("admin.zzz", "unknown key `zzz`; known keys here: listen, token"),
        ("control_plane.tls.clinet_ca", "did you mean `client_ca`?"),
    ];
    for (path, fragment) in expect {
        let hit = found.iter().any(|d| d.severity == Severity::Error && d.path == path && d.message.contains(fragment));
        assert!(hit, "{path} ~ {fragment}: {found:?}");
    }
}

#[test]
fn type_errors_are_all_reported_not_just_the_first() {
    let yaml = "dynamo:\n  load: {max_staleness: soon}\n  event_bus: {max_sessions: many}\n  discovery:\n    etcd: {endpoints: ['a:2379', 42]}\n    static: {workers: [{instance_id: 1, role: decode, model: m}, {instance_id: -4, role: x, model: m}]}\nadmin: {token: ''}";
    let found = diagnostics(yaml);
    let paths = [
        "dynamo.load.max_staleness",
        "dynamo.event_bus.max_sessions",
        "dynamo.discovery.etcd.endpoints[1]",
        "dynamo.discovery.static.workers[1].instance_id",
        "dynamo.discovery.static.workers[1].role",
        "admin.token",
    ];
    for path in paths {
        assert!(found.iter().any(|d| d.is_error() && d.path == path), "{path}: {found:?}");
    }
}

#[test]
fn syntax_errors_carry_a_position() {
    match load("dynamo:\n  enabled: [true\n") {
        Err(ConfigError::Syntax { line, column, .. }) => assert!(line > 0 && column > 0),
        other => panic!("expected a syntax error, got {other:?}"),
    }
}

#[test]
fn an_empty_document_is_the_default_configuration() {
    let loaded = loaded("");
    assert_eq!(loaded.config, crate::config::Config::default());
    assert!(loaded.diagnostics.is_empty(), "{:?}", loaded.diagnostics);
}

#[test]
fn load_file_reads_and_reports_missing_files() {
    let dir = match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(error) => panic!("{error}"),
    };
    let path = dir.path().join("continuum.yaml");
    assert!(matches!(load_file(&path), Err(ConfigError::Read { .. })));
    if let Err(error) = std::fs::write(&path, "admin: {listen: '127.0.0.1:9999'}\n") {
        panic!("{error}");
    }
    match load_file(&path) {
        Ok(loaded) => assert_eq!(loaded.config.admin.listen.port(), 9999),
        Err(error) => panic!("{error}"),
    }
}

#[test]
fn instance_ids_parse_from_integers_and_hex_strings() {
    let cases = [
        ("18446744073709551557", 18_446_744_073_709_551_557_u64),
        ("0x1a7f2b", 0x1a7f2b),
        ("'0x1a7f2b'", 0x1a7f2b),
        ("'1a7f2b'", 0x1a7f2b),
        ("'FFFFFFFFFFFFFFC5'", 18_446_744_073_709_551_557),
        ("7465265302745285", 7_465_265_302_745_285),
    ];
    for (written, expected) in cases {
        let yaml = format!(
            "dynamo: {{discovery: {{source: static, static: {{workers: [{{instance_id: {written}, role: decode, model: m}}]}}}}}}"
        );
        let config = loaded(&yaml).config;
        assert_eq!(config.dynamo.discovery.static_fleet.workers[0].instance_id, expected, "{written}");
    }
}

#[test]
fn an_instance_id_beyond_64_bits_is_refused_with_its_path() {
    // The YAML layer refuses integers past u64 before typed parsing, so this is a syntax error.
    let yaml = "dynamo: {discovery: {static: {workers: [{instance_id: 18446744073709551616}]}}}";
    match load(yaml) {
        Err(error @ ConfigError::Syntax { .. }) => {
            assert!(error.to_string().contains("workers[0].instance_id"), "{error}");
        }
        other => panic!("expected a syntax error, got {other:?}"),
    }
}

#[test]
fn a_large_instance_id_survives_a_show_round_trip_exactly() {
    let yaml = "dynamo: {discovery: {source: static, static: {workers: [{instance_id: 18446744073709551557, role: decode, model: m}]}}}";
    let shown = loaded(yaml).config.to_masked_yaml();
    assert!(shown.contains("instance_id: 18446744073709551557"), "{shown}");
    let again = loaded(&shown).config;
    assert_eq!(again.dynamo.discovery.static_fleet.workers[0].instance_id, 18_446_744_073_709_551_557);
}

#[test]
fn static_component_defaults_by_role() {
    let yaml = "dynamo: {discovery: {source: static, static: {workers: [{instance_id: 1, role: prefill, model: m}, {instance_id: 2, role: decode, model: m}, {instance_id: 3, role: aggregated, model: m, component: vllm}]}}}";
    let config = loaded(yaml).config;
    let components: Vec<Option<&str>> =
        config.dynamo.discovery.static_fleet.workers.iter().map(|w| w.component.as_deref()).collect();
    assert_eq!(components, vec![Some("prefill"), Some("backend"), Some("vllm")]);
}

/// A backend URL is refused unless the data plane would dial it as written: a host, and a
/// port from 1 to 65535 when one is written (none is port 80), and the URL is not quoted.
#[test]
fn a_backend_url_is_refused_unless_it_is_dialled_as_written() {
    for url in
        ["http://10.0.0.5:80000", "http://shim:8O00", "http://shim:0", "http://shim:8000:9000", "http://[fd00::1"]
    {
        let found = diagnostics(&format!("backends: [{{name: u, url: '{url}'}}]"));
        assert!(found.iter().any(|d| d.path == "backends[0].url"), "{url}: {found:?}");
        assert!(!format!("{found:?}").contains(url), "not quoted: {found:?}");
    }
    for url in
        ["http://shim:8000", "http://shim", "http://[fd00::1]:8000", "http://[fd00::1]", "http://10.0.0.5:8000/v1/"]
    {
        let found = diagnostics(&format!("backends: [{{name: u, url: '{url}'}}]"));
        assert!(!found.iter().any(|d| d.path == "backends[0].url"), "{url}: {found:?}");
    }
    let found = diagnostics("backends: [{name: u, url: 'http://llm:8000/v1?api_key=sk-live-123'}]");
    assert!(
        found.iter().any(|d| d.path == "backends[0].url") && !format!("{found:?}").contains("sk-live"),
        "{found:?}"
    );
}
