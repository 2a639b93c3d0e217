//! What leaves for the shim: the picker's pins in decimal, the client's model id, and nothing a
//! client sent about routing; and what comes back: no pin, unless the client asked.

use std::time::Duration;

use continuum_proto::model::Role;
use continuum_tests::shim_stub::StubShim;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{CLIENT_MODEL, DECODE_ID, Harness, MODEL, PREFILL_ID, chat, config, disaggregated_fleet, sample, worker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pins_leave_in_decimal_and_the_body_keeps_the_client_model() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;

    let response = harness.post(&chat(CLIENT_MODEL, false)).await?;
    assert_eq!(response.status(), 200);
    let headers = response.headers().clone();
    let completion: Value = response.json().await?;
    assert_eq!(completion["nvext"]["worker_id"]["decode_worker_id"], DECODE_ID);
    assert_eq!(completion["nvext"]["worker_id"]["prefill_worker_id"], PREFILL_ID);
    assert!(
        headers
            .keys()
            .all(|name| !name.as_str().starts_with("x-dynamo-") && !name.as_str().starts_with("x-continuum-"))
    );

    let received = shim.received();
    let [request] = received.as_slice() else { anyhow::bail!("the shim received {} requests", received.len()) };
    assert_eq!(request.header("x-dynamo-worker-instance-id"), Some(DECODE_ID.to_string().as_str()));
    assert_eq!(request.header("x-dynamo-prefill-instance-id"), Some(PREFILL_ID.to_string().as_str()));
    assert_eq!(request.header("x-dynamo-dp-rank"), None, "no rank for a worker without data parallelism");
    assert_eq!(request.body["model"], CLIENT_MODEL, "the model map is for picking only");
    assert_eq!(request.body["messages"], chat(CLIENT_MODEL, false)["messages"]);
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoofed_client_pins_never_reach_the_shim() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let spoofed = [
        "X-Dynamo-Worker-Instance-Id",
        "x-dynamo-prefill-instance-id",
        "X-DYNAMO-DP-RANK",
        "x-dynamo-prefill-dp-rank",
        "X-Dynamo-Anything-Else",
        "X-Worker-Instance-Id",
        "x-prefill-instance-id",
        "X-Dp-Rank",
        "x-data-parallel-rank",
        "X-PREFILL-DP-RANK",
    ];
    let mut body = chat(MODEL, false);
    body["nvext"] = json!({
        "backend_instance_id": 12345, "prefill_worker_id": 12345, "decode_worker_id": 12345,
        "token_data": [1, 2, 3], "extra_fields": ["worker_id", "timing"],
    });
    for stream in [false, true] {
        body["stream"] = json!(stream);
        // Over a raw socket, so each name goes on the wire in the case written here (an HTTP
        // client library would lowercase them), each twice.
        let body = serde_json::to_vec(&body)?;
        let mut head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n",
            body.len()
        );
        for name in spoofed {
            head.push_str(&format!("{name}: 12345\r\n{name}: 0x3039\r\n"));
        }
        let mut client = TcpStream::connect(harness.replica.local_addr).await?;
        client.write_all(&[head.as_bytes(), b"\r\n", &body].concat()).await?;
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), client.read_to_end(&mut answer)).await??;
        assert!(answer.starts_with(b"HTTP/1.1 200 "), "{}", String::from_utf8_lossy(&answer));
    }

    let expected = [
        ("x-dynamo-prefill-instance-id".to_string(), PREFILL_ID.to_string()),
        ("x-dynamo-worker-instance-id".to_string(), DECODE_ID.to_string()),
    ];
    let received = shim.received();
    assert_eq!(received.len(), 2);
    for request in received {
        let mut routing: Vec<(String, String)> = request
            .headers
            .iter()
            .filter(|(name, _)| name.as_str().starts_with("x-"))
            .map(|(name, value)| (name.to_string(), value.to_str().unwrap_or("?").to_string()))
            .collect();
        routing.sort();
        assert_eq!(routing, expected, "only the picker's pins, once each");
        assert_eq!(
            request.body["nvext"],
            json!({"extra_fields": ["timing"]}),
            "routing fields stripped, and the pins' echo without x-backend; the rest kept"
        );
    }
    harness.stop().await;
    Ok(())
}

/// A client's tracing headers reach the frontend as they came, buffered or streamed, and its
/// `x-request-id` comes back on the answer, a refusal's too; the frontend's own request-id
/// header is the router's to send, and is stripped like every `x-dynamo-*` header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_tracing_headers_reach_the_frontend_and_its_request_id_comes_back() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let send = |body: &serde_json::Value, id: &str| {
        let request = harness.http.post(harness.url("/v1/chat/completions")).json(body);
        request
            .header("x-request-id", id)
            .header("traceparent", parent)
            .header("x-dynamo-request-id", "0af76519-16cd-43dd-8448-eb211c80319c")
            .send()
    };
    for (stream, id) in [(false, "req-buffered"), (true, "req-streamed")] {
        let mut body = chat(MODEL, stream);
        body["stream"] = json!(stream);
        let answer = send(&body, id).await?;
        assert_eq!(answer.status(), 200);
        assert_eq!(answer.headers().get("x-request-id").and_then(|v| v.to_str().ok()), Some(id), "echoed");
    }
    let refused = send(&json!({"model": MODEL}), "req-refused").await?;
    assert_eq!(refused.status(), 400);
    assert_eq!(refused.headers().get("x-request-id").and_then(|v| v.to_str().ok()), Some("req-refused"));
    let received = shim.received();
    assert_eq!(received.len(), 2, "the refused request reached no shim");
    for (request, id) in received.iter().zip(["req-buffered", "req-streamed"]) {
        assert_eq!(request.header("x-request-id"), Some(id));
        assert_eq!(request.header("traceparent"), Some(parent));
        assert_eq!(request.header("x-dynamo-request-id"), None, "the client's is stripped");
    }
    let attempts = r#"continuum_shim_attempts_total{backend="shim-a",outcome="success"}"#;
    assert_eq!(sample(&harness.metrics().await?, attempts), Some(2.0), "two sends, and no attempt for the refusal");
    harness.stop().await;
    Ok(())
}

/// dynamo.frontend salts a request's KV blocks with its `x-tenant-id` header over the body's
/// salt: a client header a shim request carries, as the frontend would read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_tenant_reaches_the_frontend_and_its_body_goes_as_sent() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let mut body = chat(MODEL, false);
    body["nvext"] = json!({"cache_salt": "from-body"});
    for stream in [false, true] {
        body["stream"] = json!(stream);
        // The header as the client sent it: repeated, the last padded (the frontend trims).
        let request = harness.http.post(harness.url("/v1/chat/completions")).json(&body);
        let request = request.header("x-tenant-id", "tenant-z").header("x-tenant-id", " tenant-a ");
        assert_eq!(request.send().await?.status(), 200);
    }
    assert_eq!(harness.post(&body).await?.status(), 200);
    let received = shim.received();
    let tenants: Vec<Option<&str>> =
        received.iter().map(|r| r.headers.get("x-tenant-id").and_then(|v| v.to_str().ok())).collect();
    assert_eq!(tenants, [Some("tenant-a"), Some("tenant-a"), None], "once, trimmed, and only when sent");
    for request in &received {
        assert_eq!(request.body["nvext"], json!({"cache_salt": "from-body"}), "the body's salt untouched");
    }
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aggregated_worker_is_pinned_alone_with_its_rank() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let aggregated = worker(7_668_682_560_356_784_048, Role::Aggregated, MODEL, 2);
    let harness = Harness::start(vec![aggregated], config(&[("shim-a", shim.url())])).await?;
    let mut ranks = Vec::new();
    for _ in 0..4 {
        assert_eq!(harness.post(&chat(MODEL, false)).await?.status(), 200);
    }
    for received in shim.received() {
        assert_eq!(received.header("x-dynamo-worker-instance-id"), Some("7668682560356784048"));
        assert_eq!(
            received.header("x-dynamo-prefill-instance-id"),
            None,
            "never a prefill pin beside an aggregated worker"
        );
        ranks.push(received.header("x-dynamo-dp-rank").map(str::to_string));
    }
    ranks.sort();
    ranks.dedup();
    assert_eq!(ranks, [Some("0".to_string()), Some("1".to_string())], "both ranks are used");
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chosen_backend_and_workers_are_disclosed_only_on_x_backend() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let response = harness
        .http
        .post(harness.url("/v1/chat/completions"))
        .header("x-backend", "")
        .json(&chat(MODEL, true))
        .send()
        .await?;
    assert_eq!(response.status(), 200);
    let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    assert_eq!(header("x-continuum-backend").as_deref(), Some("shim-a"));
    assert_eq!(header("x-continuum-decode-worker"), Some(DECODE_ID.to_string()));
    assert_eq!(header("x-continuum-prefill-worker"), Some(PREFILL_ID.to_string()));
    assert!(response.headers().keys().all(|name| !name.as_str().starts_with("x-dynamo-")));
    assert!(response.text().await?.ends_with("data: [DONE]\n\n"));
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_disaggregated_serving_off_requests_go_unpinned_to_backends_listing_the_model() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let mut config = config(&[("shim-a", shim.url())]);
    config.disaggregated_serving.enabled = false;
    config.backends[0].models = vec![MODEL.to_string()];
    let harness = Harness::start(disaggregated_fleet(), config).await?;
    let models: serde_json::Value = harness.http.get(harness.url("/v1/models")).send().await?.json().await?;
    assert_eq!(models["data"][0]["id"], MODEL, "the models listed are those routed: {models}");
    assert_eq!(models["data"].as_array().map(Vec::len), Some(1), "{models}");
    assert_eq!(harness.post(&chat(MODEL, false)).await?.status(), 200);
    let received = shim.received();
    assert!(received[0].headers.keys().all(|name| !name.as_str().starts_with("x-dynamo-")));
    let (status, code) = super::error_of(harness.post(&chat(CLIENT_MODEL, false)).await?).await?;
    assert_eq!((status, code.as_str()), (404, "model_not_found"), "no backend lists the client id");

    // The backend's refusal of the client's request is relayed; its own failure is not, whose
    // words may name its hosts.
    let fixed = |status: u16, body: &str| continuum_tests::shim_stub::Reply::Fixed {
        status: axum::http::StatusCode::from_u16(status).expect("a status"),
        content_type: Some("application/json".into()),
        body: bytes::Bytes::from(body.to_owned()),
    };
    shim.push(fixed(400, r#"{"message":"max_tokens is too large","type":"Bad Request","code":400}"#));
    let refused = harness.post(&chat(MODEL, false)).await?;
    assert_eq!(refused.status(), 400);
    assert!(refused.text().await?.contains("max_tokens is too large"), "the client's to fix");
    // Unless that refusal names an address: its status is kept, its words are not.
    shim.push(fixed(413, r#"{"message":"decode-0.dynamo.svc:8000 takes at most 1 MiB","code":413}"#));
    let withheld = harness.post(&chat(MODEL, false)).await?;
    assert_eq!(withheld.status(), 413);
    let body = withheld.text().await?;
    assert!(!body.contains("decode-0"), "no internal address: {body}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&body)?["error"]["code"], "backend_refused", "{body}");
    shim.push(fixed(500, r#"{"message":"connect to 10.1.2.3:9345 failed","code":500}"#));
    let failed = harness.post(&chat(MODEL, false)).await?;
    assert_eq!(failed.status(), 502);
    let body = failed.text().await?;
    assert!(!body.contains("10.1.2.3"), "no internal address: {body}");
    let body: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(body["error"]["code"], "backend_failed", "{body}");
    // Nor is a redirect, whose page may name hosts too, and which no chat completion expects.
    shim.push(fixed(302, r#"<a href="http://10.1.2.3/login">moved</a>"#));
    let (status, code) = super::error_of(harness.post(&chat(MODEL, false)).await?).await?;
    assert_eq!((status, code.as_str()), (502, "backend_failed"));
    let metrics = harness.metrics().await?;
    assert_eq!(super::sample(&metrics, r#"disaggregated_requests_total{routing_path="unified"}"#), Some(5.0));
    assert_eq!(super::sample(&metrics, r#"continuum_backend_refusals_total{body="relayed"}"#), Some(1.0));
    assert_eq!(super::sample(&metrics, r#"continuum_backend_refusals_total{body="withheld"}"#), Some(1.0));
    harness.stop().await;
    Ok(())
}
