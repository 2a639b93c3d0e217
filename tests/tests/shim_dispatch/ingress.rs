//! The ingress phase: OpenAI errors for what cannot be routed, the body limit, and `/v1/models`.

use continuum_control_plane::fleet::FleetChange;
use continuum_data_plane::ingress::MAX_REQUEST_BODY_BYTES;
use continuum_proto::model::{Backend, Role, WorkerKey};
use continuum_tests::shim_stub::StubShim;
use serde_json::{Value, json};

use super::{
    CLIENT_MODEL, DECODE_ID, Harness, MODEL, NAMESPACE, chat, config, disaggregated_fleet, error_of, sample, worker,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_cannot_be_routed_get_openai_errors() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let url = harness.url("/v1/chat/completions");
    let send = |body: Vec<u8>| harness.http.post(&url).header("content-type", "application/json").body(body).send();

    assert_eq!(error_of(send(b"{key}".to_vec()).await?).await?, (400, "invalid_request".into()));
    assert_eq!(error_of(send(br#"{"model":"tiny"}"#.to_vec()).await?).await?, (400, "invalid_request".into()));
    let mut huge = chat(MODEL, false);
    huge["messages"][0]["content"] = json!("x".repeat(MAX_REQUEST_BODY_BYTES));
    assert_eq!(error_of(send(serde_json::to_vec(&huge)?).await?).await?, (413, "request_too_large".into()));
    assert_eq!(error_of(harness.post(&chat("no-such-model", false)).await?).await?, (404, "model_not_found".into()));

    // Only the prefill worker is left: as dynamo.frontend 1.6.1 drops the model with its last
    // decode worker, the model is no longer served (and no unified backend lists it).
    harness
        .change(FleetChange { remove: vec![WorkerKey::new(NAMESPACE, DECODE_ID)], ..FleetChange::default() })
        .await?;
    assert_eq!(error_of(harness.post(&chat(MODEL, false)).await?).await?, (404, "model_not_found".into()));
    assert!(shim.received().is_empty(), "nothing unroutable reached the shim");
    // Each refusal the replica made itself is counted under its code (the 413 is the server's,
    // counted before any chat handling as `continuum_http_requests_refused_total`).
    let metrics = harness.metrics().await?;
    let refused = |code: &str| sample(&metrics, &format!("continuum_chat_refusals_total{{code=\"{code}\"}}"));
    assert_eq!((refused("invalid_request"), refused("model_not_found")), (Some(2.0), Some(2.0)), "{metrics}");
    harness.stop().await;
    Ok(())
}

/// A body refused as its outbound copy is made (its `nvext` must go, and its numbers, written
/// short, would come out long enough to more than double it) is refused before the pick:
/// nothing is picked, recorded, reported or sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_whose_rewrite_would_grow_past_its_bound_is_refused_before_the_pick() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let pad = vec!["1e15"; 2000].join(",");
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"nvext":{{"backend_instance_id":1}},"pad":[{pad}]}}"#
    );
    let url = harness.url("/v1/chat/completions");
    let refused = harness.http.post(&url).header("content-type", "application/json").body(body).send().await?;
    assert_eq!(error_of(refused).await?, (413, "request_too_large".into()));
    let metrics = harness.metrics().await?;
    let picked: f64 = metrics
        .lines()
        .filter(|line| line.starts_with("continuum_dynamo_selection_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(picked, 0.0, "nothing was picked: {metrics}");
    assert!(harness.replica.ledger.is_empty() && shim.received().is_empty());
    // The same request without the padding is routed.
    assert_eq!(harness.post(&chat(MODEL, false)).await?.status(), 200);
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_those_of_routable_workers_under_client_ids() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let mut workers = disaggregated_fleet();
    workers.push(worker(11, Role::Aggregated, "plain", 0));
    workers.push(worker(12, Role::Unknown, "ghost", 0));
    workers.push(worker(14, Role::Prefill, "prefill-only", 0));
    // A decode worker whose card was not read yet: no model name, nothing to list.
    workers.push(worker(15, Role::Decode, "", 0));
    let mut unpooled = (*worker(13, Role::Aggregated, "elsewhere", 0)).clone();
    unpooled.key = WorkerKey::new("no-pool", 13);
    workers.push(unpooled.into());
    let mut config = config(&[("shim-a", shim.url())]);
    // A backend outside the shim pools takes, unpinned, a model the fleet does not serve.
    let unified = Backend { name: "unified".into(), url: shim.url(), models: vec!["solo".into()] };
    config.backends.push(unified);
    let harness = Harness::start(workers, config).await?;

    let models: Value = harness.http.get(harness.url("/v1/models")).send().await?.json().await?;
    assert_eq!(models["object"], "list");
    let ids: Vec<&str> = models["data"].as_array().into_iter().flatten().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(
        ids,
        ["plain", "solo", CLIENT_MODEL],
        "mapped names under their client id, and unified backends' models; unknown roles, prefill-only \
         models, workers without a model name and unpooled namespaces left out"
    );
    assert_eq!(harness.post(&chat("solo", false)).await?.status(), 200, "a model listed is routed");
    assert!(models["data"].as_array().into_iter().flatten().all(|m| m["object"] == "model"));
    // Each listed model is retrieved by its id (OpenAI's `models.retrieve`), slashes and all;
    // one not listed is not found.
    for id in ids {
        let model: Value = harness.http.get(harness.url(&format!("/v1/models/{id}"))).send().await?.json().await?;
        assert_eq!((model["id"].as_str(), model["object"].as_str()), (Some(id), Some("model")), "{model}");
    }
    for unlisted in ["prefill-only", "ghost", "no/such/model"] {
        let answer = harness.http.get(harness.url(&format!("/v1/models/{unlisted}"))).send().await?;
        assert_eq!(answer.status(), 404, "{unlisted}");
        let error: Value = answer.json().await?;
        assert_eq!(error["error"]["code"], "model_not_found", "{unlisted}");
    }
    harness.stop().await;
    Ok(())
}
