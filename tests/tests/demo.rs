//! The demo, end to end: the real control-plane binary on its embedded default (no
//! `--config`), whose simulated fleet publishes real ZMTP kv_metrics and kv-events frames and
//! serves a direct-mode shim, and a data-plane replica following it. A routed chat request
//! comes back 200 with the pins the replica chose echoed by the shim, the pinned workers' load
//! samples reach the replica's fleet view, a stream ends as the real frontend's does, and a
//! prompt sharing a prefix with an earlier one goes to the worker that cached it.

use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use continuum_data_plane::dispatch::DispatchSettings;
use continuum_data_plane::fleet::FleetClientConfig;
use continuum_data_plane::replica::Replica;
use continuum_proto::model::Role;
use continuum_tests::process::free_port;
use continuum_tests::{eventually, start_replicas, tools};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const WAIT: Duration = Duration::from_secs(20);

/// The control plane on its embedded default, every port free; killed when dropped. Returns
/// its gRPC URL and its admin address.
async fn embedded_default_control_plane() -> anyhow::Result<(Child, String, String)> {
    let (grpc, shim, admin) = (free_port()?, free_port()?, free_port()?);
    let mut child = Command::new(tools::binary("continuum-control-plane"))
        .args(["--grpc-listen", &grpc.to_string(), "--admin-listen", &admin.to_string()])
        .args(["--simulator-shim-listen", &shim.to_string()])
        .env_remove("CONTINUUM_CONFIG")
        // As scripts/demo does: a test run in a pod still runs the embedded default.
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    tokio::time::timeout(WAIT, lines.next_line())
        .await
        .context("the control plane printed nothing")??
        .context("the control plane exited before listening")?;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, format!("http://{grpc}"), admin.to_string()))
}

fn header(response: &reqwest::Response, name: &str) -> anyhow::Result<u64> {
    let value = response.headers().get(name).with_context(|| format!("no {name} header"))?;
    Ok(value.to_str()?.parse()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_routes_through_the_simulated_shim_and_streams_its_load() -> anyhow::Result<()> {
    let (_control_plane, url, admin) = embedded_default_control_plane().await?;
    let replicas = start_replicas(1, &url).await?;
    let replica = &replicas[0];
    eventually(WAIT, "four simulated workers in the replica's view", || async {
        replica.fleet.view().is_some_and(|v| v.workers().len() == 4)
    })
    .await?;

    let client = reqwest::Client::new();
    let request = json!({"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                         "nvext": {"extra_fields": ["worker_id"]}});
    let response = client
        .post(format!("http://{}/v1/chat/completions", replica.local_addr))
        .header("x-backend", "show")
        .json(&request)
        .send()
        .await?;
    assert_eq!(response.status(), 200);
    let (decode, prefill) =
        (header(&response, "x-continuum-decode-worker")?, header(&response, "x-continuum-prefill-worker")?);
    let body: Value = response.json().await?;
    let echoed = &body["nvext"]["worker_id"];
    assert_eq!(echoed["decode_worker_id"].as_u64(), Some(decode), "{body}");
    assert_eq!(echoed["prefill_worker_id"].as_u64(), Some(prefill), "{body}");

    let view = replica.fleet.view().context("no fleet view")?;
    let role = |id: u64| view.workers().values().find(|w| w.key.instance_id == id).map(|w| w.role);
    assert_eq!((role(prefill), role(decode)), (Some(Role::Prefill), Some(Role::Decode)));

    assert_eq!((echoed["prefill_dp_rank"].as_u64(), echoed["decode_dp_rank"].as_u64()), (Some(0), Some(0)), "{body}");
    assert!(decode > 1 << 53 && prefill > 1 << 53, "simulated ids look like real lease ids");

    // As 1.6.1 mockers, the simulated workers publish with their first request and on change,
    // never while idle: the decode worker's rise and fall reach the view, the idle workers
    // have published nothing. (A prefill worker publishes once, with its first request, and
    // a subscription that connected after that misses it, as with a real mocker.)
    eventually(WAIT, "the decode worker's load sample", || async {
        replica.fleet.view().is_some_and(|v| v.loads().keys().any(|key| key.worker.instance_id == decode))
    })
    .await?;
    // Its first sample (sequence 0) came as the request arrived; the rise (its blocks taken) and
    // the fall (given back when the answer ended) followed.
    eventually(WAIT, "the decode worker's fall back to no blocks after its rise", || async {
        let Ok(loads) = admin_loads(&admin).await else { return false };
        let store = loads["store"].as_array().cloned().unwrap_or_default();
        store.iter().any(|s| {
            let worker = s["worker_id"].as_str().and_then(|id| id.parse::<u64>().ok());
            worker == Some(decode) && s["sequence"].as_u64() >= Some(2) && s["kv_used_blocks"] == 0
        })
    })
    .await?;
    let view = replica.fleet.view().context("no fleet view")?;
    let idle = view.loads().keys().filter(|key| ![prefill, decode].contains(&key.worker.instance_id)).count();
    assert_eq!(idle, 0, "no sample from a worker no request reached");
    let view = replica.fleet.view().context("no fleet view")?;
    assert!(!view.loads().is_empty(), "the replica holds the samples of the workers that served");
    assert!(view.loads().iter().all(|(key, sample)| key.dp_rank == 0 && sample.load.kv_used_blocks.is_some()));

    // A stream ends as the frontend's: a finish chunk with an empty delta, the usage it asked
    // for in a chunk without choices, then [DONE].
    let streamed = json!({"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "stream": true,
                          "stream_options": {"include_usage": true}});
    let response =
        client.post(format!("http://{}/v1/chat/completions", replica.local_addr)).json(&streamed).send().await?;
    assert_eq!(response.status(), 200);
    let text = response.text().await?;
    let events: Vec<&str> = text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).collect();
    let [.., finish, usage, done] = events.as_slice() else { anyhow::bail!("too few events: {text}") };
    let (finish, usage): (Value, Value) = (serde_json::from_str(finish)?, serde_json::from_str(usage)?);
    assert_eq!(
        (&finish["choices"][0]["delta"], &finish["choices"][0]["finish_reason"]),
        (&json!({}), &json!("length"))
    );
    assert_eq!((&usage["choices"], usage["usage"]["completion_tokens"].as_u64()), (&json!([]), Some(16)));
    assert_eq!(*done, "[DONE]");
    Ok(())
}

/// The control plane's `/admin/dynamo/loads`: the samples it holds and those it published.
async fn admin_loads(admin: &str) -> anyhow::Result<Value> {
    Ok(reqwest::get(format!("http://{admin}/admin/dynamo/loads")).await?.json().await?)
}

/// The control plane's `/admin/dynamo/workers`: workers, subscriptions and the KV index's size.
async fn admin_workers(admin: &str) -> anyhow::Result<Value> {
    Ok(reqwest::get(format!("http://{admin}/admin/dynamo/workers")).await?.json().await?)
}

/// kv-events the control plane's index applied (its `/metrics`).
async fn kv_events_applied(admin: &str) -> anyhow::Result<u64> {
    let text = reqwest::get(format!("http://{admin}/metrics")).await?.text().await?;
    let series = "continuum_dynamo_kv_events_total{result=\"applied\"} ";
    let line = text.lines().find_map(|line| line.strip_prefix(series)).context("no applied kv-events")?;
    Ok(line.trim().parse()?)
}

/// The control plane's kv-events subscriptions that are connected.
async fn kv_events_subscriptions_connected(admin: &str) -> anyhow::Result<usize> {
    let listing = admin_workers(admin).await?;
    let subscriptions = listing["subscriptions"].as_array().context("no subscriptions")?;
    Ok(subscriptions.iter().filter(|s| s["family"] == "kv-events" && s["state"] == "connected").count())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_routes_a_shared_prefix_to_the_worker_whose_kv_events_announced_it() -> anyhow::Result<()> {
    let (_control_plane, url, admin) = embedded_default_control_plane().await?;
    // A lookup past its 2 ms deadline scores without overlap: on a machine busy with other
    // tests that is a lost race, not the routing under test.
    let follow = FleetClientConfig::new(url, "demo-kv");
    let replica = &Replica::start_full("127.0.0.1:0", follow, DispatchSettings::default(), WAIT).await?;
    let loaded = replica.metrics.kv_artifacts.with_label_values(&["loaded"]);
    eventually(WAIT, "the simulated fleet's tokenizer, fetched from its shim and pinned", || async {
        loaded.get() > 0
    })
    .await?;

    // A PUB socket keeps nothing: the first prompt's kv-events reach only subscriptions open
    // then. Each simulated prefill worker (as in 1.6.1, decode workers publish no kv-events)
    // starts over (`cleared`) as its subscriber joins; once both are applied, no late one can
    // wipe the first prompt's blocks.
    eventually(WAIT, "the control plane subscribed to every prefill worker's kv-events", || async {
        kv_events_subscriptions_connected(&admin).await.is_ok_and(|connected| connected == 2)
    })
    .await?;
    eventually(WAIT, "each worker's cleared cache applied to the index", || async {
        kv_events_applied(&admin).await.is_ok_and(|applied| applied >= 2)
    })
    .await?;

    let client = reqwest::Client::new();
    let system = "You answer questions about foxes, dogs and rivers in the valley, briefly and kindly. ".repeat(3);
    let ask = |question: &str| {
        let request = json!({"model": "tiny", "max_tokens": 2,
                             "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]});
        client
            .post(format!("http://{}/v1/chat/completions", replica.local_addr))
            .header("x-backend", "show")
            .json(&request)
    };
    let first = ask("Why does the fox jump?").send().await?;
    assert_eq!(first.status(), 200);
    let holder = header(&first, "x-continuum-prefill-worker")?;
    let body: Value = first.json().await?;
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{body}");

    // The prefill worker's kv-events reach the control plane's index over real ZMTP: its
    // blocks (at least 4: the second prompt finds 64 tokens of them cached), one node each.
    eventually(WAIT, "the first prompt's blocks in the control plane's index", || async {
        admin_workers(&admin).await.is_ok_and(|listing| listing["kv_index"]["ownerships"].as_u64() >= Some(4))
    })
    .await?;
    let second = ask("Where does the river go?").send().await?;
    assert_eq!(second.status(), 200);
    assert_eq!(header(&second, "x-continuum-prefill-worker")?, holder, "the worker holding the prefix");
    let body: Value = second.json().await?;
    let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or_default();
    assert!(cached >= 64, "the shared system prompt's blocks were cached there: {body}");
    let overlap = replica.metrics.kv_selections.with_label_values(&["overlap"]).get();
    assert!(overlap >= 1, "picked for its overlap");
    Ok(())
}

/// A simulated worker killed the way a real one dies (`kill -9`: its lease outlives it): the
/// shim refuses requests pinned to it as 1.6.1 does, the replica answers each such request with
/// a clear error and never hangs, routes around it, and drops it from its view once the lease
/// expires. With every decode worker gone the model is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_simulated_worker_is_routed_around_and_deregistered_when_its_lease_expires() -> anyhow::Result<()> {
    use continuum_control_plane::app::{ControlPlane, ListenOverrides};
    use continuum_control_plane::config;
    use continuum_control_plane::sources::simulator::FIRST_WORKER_ID;

    let mut config = config::embedded_default();
    let shim = free_port()?;
    config.move_simulator_shim(shim);
    config.control_plane.grpc_listen = "127.0.0.1:0".parse()?;
    config.admin.listen = "127.0.0.1:0".parse()?;
    config.dynamo.kv.enabled = false;
    // Long enough that the dead worker is still discovered, and picked, on a loaded machine.
    config.dynamo.discovery.simulator.lease_ttl = Duration::from_secs(4);
    let control = ControlPlane::start(config, ListenOverrides::default()).await?;
    let replicas = start_replicas(1, &format!("http://{}", control.grpc_addr)).await?;
    let replica = &replicas[0];
    let workers = || replica.fleet.view().map_or(0, |view| view.workers().len());
    eventually(WAIT, "four simulated workers in the replica's view", || async { workers() == 4 }).await?;

    let client = reqwest::Client::builder().timeout(WAIT).build()?;
    let kill = |id: String| client.post(format!("http://{shim}/simulator/workers/{id}/kill")).send();
    let (first_decode, second_decode) = (FIRST_WORKER_ID + 2, FIRST_WORKER_ID + 3);
    assert_eq!(kill(first_decode.to_string()).await?.status(), 200);
    assert_eq!(kill(first_decode.to_string()).await?.status(), 409, "killed already");
    assert_eq!(kill("7".into()).await?.status(), 404, "no such worker");

    let ask = || {
        let request = json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]});
        client
            .post(format!("http://{}/v1/chat/completions", replica.local_addr))
            .header("x-backend", "show")
            .json(&request)
    };
    let mut answered = Vec::new();
    for _ in 0..12 {
        let response = ask().send().await.context("every request is answered, none hangs")?;
        let status = response.status().as_u16();
        let decode = header(&response, "x-continuum-decode-worker").ok();
        let body: Value = response.json().await?;
        if status == 200 {
            assert_eq!(decode, Some(second_decode), "only the living decode worker answers");
        } else {
            assert_eq!(body["error"]["code"], "disaggregated_decode_failed", "says what happened: {status} {body}");
        }
        answered.push(status);
    }
    // Two idle decode workers tie and take turns, so the dead one is picked, until its
    // failures eject it.
    assert!(answered.contains(&503), "the dead worker was picked and its refusal answered: {answered:?}");
    assert!(answered.iter().rev().take(4).all(|&s| s == 200), "routed around the dead worker: {answered:?}");

    eventually(WAIT, "the killed worker deregistered once its lease expired", || async { workers() == 3 }).await?;
    let view = replica.fleet.view().context("a view")?;
    assert!(view.workers().values().all(|w| w.key.instance_id != first_decode));
    assert_eq!(ask().send().await?.status(), 200);

    // The last decode worker gone, the model is gone (its prefill workers alone serve no
    // answer): the shim answers as 1.6.1 does, and the replica refuses with its own error
    // without dispatching.
    assert_eq!(kill(second_decode.to_string()).await?.status(), 200);
    eventually(WAIT, "the last decode worker deregistered", || async { workers() == 2 }).await?;
    let direct = client
        .post(format!("http://{shim}/v1/chat/completions"))
        .header("x-dynamo-worker-instance-id", second_decode.to_string())
        .header("x-dynamo-prefill-instance-id", FIRST_WORKER_ID.to_string())
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await?;
    assert_eq!(direct.status(), 404);
    assert_eq!(direct.text().await?, "", "the model is gone: no body");
    let listed: Value = client.get(format!("http://{shim}/v1/models")).send().await?.json().await?;
    assert_eq!(listed["data"], json!([]));
    let refused = ask().send().await?;
    let status = refused.status().as_u16();
    let body: Value = refused.json().await?;
    assert_eq!((status, body["error"]["code"].as_str()), (404, Some("model_not_found")), "{body}");

    for replica in replicas {
        replica.shutdown().await;
    }
    control.shutdown().await;
    Ok(())
}
