//! The seed's failure semantics applied to the answers the real 1.6.1 frontend gives, replayed
//! byte for byte from the captured exchanges.

use anyhow::Context;
use axum::http::StatusCode;
use continuum_data_plane::dispatch::budget::{DEPOSIT_TENTHS, RESERVE_RETRIES};
use continuum_data_plane::dispatch::{MAX_BUFFERED_RESPONSE_BYTES, MAX_ERROR_BODY_BYTES};
use continuum_tests::shim_stub::{RefusingPort, Reply, StubShim, fixture_reply};
use continuum_tests::tools;
use serde_json::{Value, json};

use super::{Harness, MODEL, chat, config, disaggregated_fleet, error_of, sample};

/// A refusal that names the missing prefill id, as a release that puts 1.6.1's log diagnostic
/// (captured with `DYN_LOG=debug`) into the response body would send it.
fn named_prefill_refusal() -> anyhow::Result<Reply> {
    let path = tools::dynamo_fixtures().join("disagg/http-exchanges-with-diagnostics.jsonl");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let diagnostic = text
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|e| e["name"] == "no_headers_nonstream")
        .and_then(|e| e["frontend_log_diagnostics"][0].as_str().map(str::to_string))
        .context("no diagnostic for no_headers_nonstream")?;
    let body = json!({"message": diagnostic, "type": "Internal Server Error", "code": 500}).to_string();
    Ok(Reply::Fixed {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        content_type: Some("application/json".into()),
        body: body.into(),
    })
}

/// A refusal naming the prefill id past [`MAX_ERROR_BODY_BYTES`]: too large to read, so the
/// status alone decides.
fn oversized_refusal() -> anyhow::Result<Reply> {
    let Reply::Fixed { status, content_type, body } = named_prefill_refusal()? else {
        anyhow::bail!("not a fixed reply")
    };
    let mut padded = vec![b' '; MAX_ERROR_BODY_BYTES];
    padded.extend_from_slice(&body);
    Ok(Reply::Fixed { status, content_type, body: padded.into() })
}

fn refusal(status: u16, content_type: &str, body: &'static str) -> Reply {
    Reply::Fixed {
        status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
        content_type: Some(content_type.into()),
        body: body.into(),
    }
}

/// A refusal of the client's request whose explanation is too large to read.
fn unreadable_refusal() -> Reply {
    let body = vec![b' '; MAX_ERROR_BODY_BYTES + 1];
    Reply::Fixed { status: StatusCode::BAD_REQUEST, content_type: Some("text/plain".into()), body: body.into() }
}

fn oversized_completion() -> Reply {
    let body = vec![b' '; MAX_BUFFERED_RESPONSE_BYTES + 1];
    Reply::Fixed { status: StatusCode::OK, content_type: Some("application/json".into()), body: body.into() }
}

fn disagg(name: &str) -> anyhow::Result<Reply> {
    fixture_reply("disagg", name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_frontend_refusals_reach_the_client_as_specified() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    const DECODE_FAILED: Option<&str> = Some("disaggregated_decode_failed");
    const PREFILL_REFUSED: Option<&str> = Some("disaggregated_prefill_decode_unavailable");
    const RELAYED: Option<&str> = None;
    const WITHHELD: Option<&str> = Some("backend_refused");
    const PROXY_PAGE: &str = "<html><body><h1>413 Request Entity Too Large</h1><hr>ingress-7f9c.internal</body></html>";
    const OPENAI_SHAPED: &str =
        r#"{"error":{"message":"max_tokens must be at least 1","type":"invalid_request_error","code":null}}"#;
    const NAMES_HOST: &str = r#"{"message":"upstream 10.4.0.12:8000 rejected the body","code":400}"#;
    // A key written twice: JSON readers take one copy or the other, so only the checked one goes.
    const TWICE: &str = r#"{"error":{"message":"upstream 10.4.0.12:8000 refused","message":"max_tokens must be at least 1","type":"invalid_request_error"}}"#;
    let dead = "after_decode_sigkill_pinned_to_dead_decode";
    // (case, shim answer, streaming, status the client sees, error code or relayed as is)
    let rows: Vec<(&str, Reply, bool, u16, Option<&str>)> = vec![
        ("generic 500", disagg("no_headers_nonstream")?, false, 502, DECODE_FAILED),
        ("generic 500, streaming", disagg("no_headers_stream")?, true, 502, DECODE_FAILED),
        ("prefill id without decode id", disagg("prefill_only_header_nonstream")?, false, 502, DECODE_FAILED),
        ("unknown worker id", disagg("unknown_decode_id")?, false, 502, DECODE_FAILED),
        // A refused pin is the router's mistake, not the client's: never relayed as its 400.
        ("unknown worker id, streaming", disagg("unknown_decode_id")?, true, 502, DECODE_FAILED),
        ("dp rank out of range, streaming", disagg("decode_dp_rank_out_of_range")?, true, 502, DECODE_FAILED),
        // 1.6.1's own shape, `{"message","type","code":400}`: its words, in OpenAI's.
        ("the client's body refused, streaming", disagg("malformed_json")?, true, 400, WITHHELD),
        ("refused in OpenAI's shape, streaming", refusal(400, "application/json", OPENAI_SHAPED), true, 400, RELAYED),
        ("refused past what is read, streaming", unreadable_refusal(), true, 400, Some("backend_refused")),
        // What answers in the frontend's place may speak HTML, or name hosts: never relayed.
        ("refused by a proxy's page, streaming", refusal(413, "text/html", PROXY_PAGE), true, 413, WITHHELD),
        ("refusal naming an address, streaming", refusal(400, "application/json", NAMES_HOST), true, 400, WITHHELD),
        ("a key written twice, streaming", refusal(400, "application/json", TWICE), true, 400, RELAYED),
        ("dead worker, live lease", disagg(dead)?, false, 503, DECODE_FAILED),
        ("dead worker, streaming", disagg(dead)?, true, 503, DECODE_FAILED),
        // The router's view was stale: its pinned worker left the frontend's. Not the client's
        // model named wrongly, so not the frontend's 404.
        ("model gone", disagg("after_lease_expiry_pinned_to_dead_decode")?, false, 502, DECODE_FAILED),
        ("names the prefill id", named_prefill_refusal()?, false, 503, PREFILL_REFUSED),
        // The seed's 503 for a stream's non-2xx head too.
        ("names the prefill id, streaming", named_prefill_refusal()?, true, 503, PREFILL_REFUSED),
        ("refusal too large to read", oversized_refusal()?, false, 502, DECODE_FAILED),
        ("completion too large to relay", oversized_completion(), false, 502, DECODE_FAILED),
    ];
    let rows_len = rows.len();
    for (case, reply, stream, status, code) in rows {
        let relayed = match &reply {
            Reply::Fixed { body, .. } => body.clone(),
            _ => Default::default(),
        };
        shim.push(reply);
        let response = harness.post(&chat(MODEL, stream)).await?;
        match code {
            Some(code) => {
                let (seen, body) = (response.status().as_u16(), response.text().await?);
                assert!(!body.contains("10.4.0.12") && !body.contains("ingress-7f9c"), "{case}: {body}");
                let body: Value = serde_json::from_str(&body).with_context(|| format!("{case}: {body}"))?;
                assert_eq!((seen, &body["error"]["code"]), (status, &json!(code)), "{case}: {body}");
                assert!(body["error"]["message"].as_str().is_some_and(|m| m.len() > 20), "{case}: {body}");
                // The frontend refusing the router's own pins is no fault of the request; a
                // failing worker is no stale view.
                let message = body["error"]["message"].as_str().unwrap_or_default();
                let refused_pins = ["unknown worker id", "dp rank out of range", "prefill id without decode id"]
                    .iter()
                    .any(|refusal| case.starts_with(refusal));
                assert!(!refused_pins || !message.contains("check the request"), "{case}: {message}");
                assert_eq!(refused_pins, message.contains("behind the frontend's"), "{case}: {message}");
                if case == "the client's body refused, streaming" {
                    assert!(message.contains("Failed to deserialize the JSON body"), "its own words: {message}");
                }
            }
            None => {
                assert_eq!(response.status().as_u16(), status, "{case}");
                let body = response.bytes().await?;
                assert!(!String::from_utf8_lossy(&body).contains("10.4.0.12"), "{case}: {body:?}");
                let (seen, sent): (Value, Value) = (serde_json::from_slice(&body)?, serde_json::from_slice(&relayed)?);
                assert_eq!(seen, sent, "{case}: relayed as the router read it");
            }
        }
    }
    assert_eq!(shim.received().len(), rows_len, "no refusal is retried or re-picked");
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"disaggregated_errors_total{phase="orchestration"}"#), Some(2.0));
    assert_eq!(sample(&metrics, r#"disaggregated_errors_total{phase="decode"}"#), Some(11.0));
    assert_eq!(sample(&metrics, r#"disaggregated_requests_total{routing_path="disaggregated"}"#), Some(19.0));
    for (body, count) in [("relayed", 3.0), ("unreadable", 1.0), ("withheld", 2.0)] {
        let series = format!(r#"continuum_backend_refusals_total{{body="{body}"}}"#);
        assert_eq!(sample(&metrics, &series), Some(count), "{series}");
    }
    assert!(harness.replica.ledger.is_empty(), "every refused dispatch has ended");
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_pinned_request_falls_back_unpinned_to_the_models_unified_backends_when_configured()
-> anyhow::Result<()> {
    let (shim, unified) = (StubShim::start().await?, StubShim::start().await?);
    let mut config = config(&[("shim-a", shim.url())]);
    config.disaggregated_serving.fallback_to_unified = true;
    // No backend serves the model unpinned yet: there is nowhere to fall back to. The pool's
    // shim lists the model, as the seed's example configuration does, but a direct-mode
    // frontend refuses every request without pins.
    config.backends[0].models = vec![MODEL.into()];
    let harness = Harness::start(disaggregated_fleet(), config.clone()).await?;
    shim.push(disagg("no_headers_nonstream")?);
    let (status, code) = error_of(harness.post(&chat(MODEL, false)).await?).await?;
    assert_eq!((status, code.as_str()), (502, "disaggregated_decode_failed"));
    assert_eq!(shim.received().len(), 1, "not resent to the pool");
    harness.stop().await;

    config.backends.push(continuum_proto::model::Backend {
        name: "unified".into(),
        url: unified.url(),
        models: vec![MODEL.into()],
    });
    let harness = Harness::start(disaggregated_fleet(), config).await?;
    shim.push(disagg("no_headers_nonstream")?);
    let request = harness.http.post(harness.url("/v1/chat/completions")).header("x-backend", "");
    let response = request.json(&chat(MODEL, false)).send().await?;
    assert_eq!(response.status(), 200, "the unified backend answered");
    let disclosed = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    assert_eq!(disclosed("x-continuum-backend").as_deref(), Some("unified"), "the backend that answered");
    assert_eq!(disclosed("x-continuum-decode-worker"), None, "no worker served it pinned");
    assert!(shim.received()[1].header("x-dynamo-worker-instance-id").is_some());
    assert_eq!(shim.received().len(), 2, "the pool saw only the pinned send");
    let resent = unified.received();
    assert_eq!(resent.len(), 1);
    assert!(resent[0].headers.keys().all(|name| !name.as_str().starts_with("x-dynamo-")), "no pins");

    shim.push(named_prefill_refusal()?);
    let (status, code) = error_of(harness.post(&chat(MODEL, false)).await?).await?;
    assert_eq!((status, code.as_str()), (503, "disaggregated_prefill_decode_unavailable"));
    assert_eq!(unified.received().len(), 1, "a prefill refusal never falls back");

    shim.push(disagg("no_headers_nonstream")?);
    unified.push(disagg("no_headers_nonstream")?);
    let (status, code) = error_of(harness.post(&chat(MODEL, false)).await?).await?;
    assert_eq!((status, code.as_str()), (502, "disaggregated_decode_failed"), "both sends failed");

    // A streamed request whose fallback is refused (a 4xx that would be relayed, were it the
    // answer): the client gets the router's failure, and no refusal is counted as passed on.
    shim.push(disagg("no_headers_nonstream")?);
    unified.push(disagg("malformed_json")?);
    let (status, code) = error_of(harness.post(&chat(MODEL, true)).await?).await?;
    assert_eq!((status, code.as_str()), (502, "disaggregated_decode_failed"));

    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"disaggregated_requests_total{routing_path="unified_fallback"}"#), Some(3.0));
    for body in ["relayed", "unreadable", "withheld"] {
        let series = format!(r#"continuum_backend_refusals_total{{body="{body}"}}"#);
        assert_eq!(sample(&metrics, &series), Some(0.0), "{series}: the client saw none");
    }
    harness.stop().await;
    Ok(())
}

/// Fallbacks are paid from the retry budget: a pool failing every request resends only some
/// of them to the unified backends, the rest failing as with no fallback, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallbacks_to_the_unified_backends_stop_when_the_retry_budget_is_spent() -> anyhow::Result<()> {
    const REQUESTS: usize = 40;
    let (shim, unified) = (StubShim::start().await?, StubShim::start().await?);
    let mut config = config(&[("shim-a", shim.url())]);
    config.disaggregated_serving.fallback_to_unified = true;
    config.backends.push(continuum_proto::model::Backend {
        name: "unified".into(),
        url: unified.url(),
        models: vec![MODEL.into()],
    });
    let harness = Harness::start(disaggregated_fleet(), config).await?;
    let mut statuses = Vec::new();
    for _ in 0..REQUESTS {
        shim.push(disagg("no_headers_nonstream")?);
        statuses.push(harness.post(&chat(MODEL, false)).await?.status().as_u16());
    }
    let fell_back = statuses.iter().filter(|s| **s == 200).count();
    assert!(statuses[..RESERVE_RETRIES as usize].iter().all(|s| *s == 200), "the budget's reserve: {statuses:?}");
    // Each request pays into the budget once, its fallback's send included: the reserve and
    // a fifth of a retry a request, no more.
    let earned = RESERVE_RETRIES as usize + REQUESTS * DEPOSIT_TENTHS as usize / 10;
    assert_eq!(fell_back, earned, "{statuses:?}");
    assert!(statuses.iter().all(|s| matches!(s, 200 | 502)), "{statuses:?}");
    assert_eq!(unified.received().len(), fell_back);
    let metrics = harness.metrics().await?;
    let refused = sample(&metrics, "continuum_unified_fallbacks_refused_total");
    assert_eq!(refused, Some((REQUESTS - fell_back) as f64));
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_of_the_clients_request_ejects_no_worker_but_a_refusal_of_the_pins_does() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let ejected = || harness.replica.ledger.outliers().any_ejected(std::time::Instant::now());

    // The frontend refuses the body: the client's fault, however often it comes.
    for (stream, expected) in [(false, 502), (true, 400), (false, 502)] {
        shim.push(disagg("malformed_json")?);
        let status = harness.post(&chat(MODEL, stream)).await?.status();
        // Relayed to a streaming client; a buffered one gets the decode arm's failure.
        assert_eq!(status, expected, "stream {stream}");
    }
    assert!(!ejected(), "three refused bodies in a row eject nobody");
    // Nor does an answer too large to relay buffered: the request's length, not the workers.
    for _ in 0..2 {
        shim.push(oversized_completion());
        let (status, code) = error_of(harness.post(&chat(MODEL, false)).await?).await?;
        assert_eq!((status, code.as_str()), (502, "disaggregated_decode_failed"));
    }
    assert!(!ejected(), "two oversized answers eject nobody");

    // It no longer knows the pinned worker: twice in a row ejects the pair, streaming too.
    for _ in 0..2 {
        shim.push(disagg("unknown_decode_id")?);
        let (status, code) = error_of(harness.post(&chat(MODEL, true)).await?).await?;
        assert_eq!(
            (status, code.as_str()),
            (502, "disaggregated_decode_failed"),
            "the router's failure, not the client's"
        );
    }
    assert!(ejected(), "two refused pins in a row eject the pinned ranks");
    harness.stop().await;
    Ok(())
}

/// The seed's request flow: a model no Dynamo worker serves, or served only where no shim replica
/// is usable, falls through to unified routing when a backend outside the pools serves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_fleet_cannot_take_falls_through_to_the_models_unified_backends() -> anyhow::Result<()> {
    let unified = StubShim::start().await?;
    // The pool's one shim is gone: nothing listens on its port (held, so that nothing can).
    let gone = RefusingPort::reserve()?;
    let mut config = config(&[("shim-a", gone.url())]);
    config.backends[0].models = vec![MODEL.into(), "elsewhere".into()];
    config.backends.push(continuum_proto::model::Backend {
        name: "unified".into(),
        url: unified.url(),
        models: vec![MODEL.into(), "elsewhere".into()],
    });
    let harness = Harness::start(disaggregated_fleet(), config).await?;

    // No Dynamo worker serves it: unified at once, never to the pooled shim listing it too.
    assert_eq!(harness.post(&chat("elsewhere", false)).await?.status(), 200);
    assert_eq!(unified.received().len(), 1);

    // The fleet serves the model, but its shim fails until its breaker (or its probe) takes
    // it out; from then on the picker has no namespace to pick in, and the request falls
    // through. (Fallback is off: this is not the decode arm.)
    let mut statuses = Vec::new();
    for _ in 0..20 {
        let status = harness.post(&chat(MODEL, false)).await?.status().as_u16();
        statuses.push(status);
        if status == 200 {
            break;
        }
    }
    assert_eq!(statuses.last(), Some(&200), "{statuses:?}");
    assert!(
        statuses.iter().all(|s| [503, 200].contains(s)),
        "the dead shim's failures, then the fall-through: {statuses:?}"
    );
    let fell_through = unified.received();
    assert_eq!(fell_through.len(), 2);
    assert!(fell_through[1].headers.keys().all(|name| !name.as_str().starts_with("x-dynamo-")), "no pins");
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"disaggregated_requests_total{routing_path="unified"}"#), Some(2.0));
    harness.stop().await;
    Ok(())
}

/// A client that gives up before its pinned answer arrives is counted under the routing path
/// all the same: slow generations are the ones clients leave, and the count is per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_request_whose_client_leaves_is_counted_under_its_routing_path() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    // The answer never comes.
    let held = shim.push_stream();
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let impatient = reqwest::Client::builder().timeout(std::time::Duration::from_millis(500)).build()?;
    let gave_up = impatient.post(harness.url("/v1/chat/completions")).json(&chat(MODEL, false)).send().await;
    assert!(gave_up.is_err_and(|error| error.is_timeout()), "the client gave up waiting");
    let series = r#"disaggregated_requests_total{routing_path="disaggregated"}"#;
    continuum_tests::eventually(super::CONVERGE, "the abandoned request counted", || async {
        harness.metrics().await.is_ok_and(|metrics| sample(&metrics, series) == Some(1.0))
    })
    .await?;
    drop(held);
    harness.stop().await;
    shim.stop();
    Ok(())
}
