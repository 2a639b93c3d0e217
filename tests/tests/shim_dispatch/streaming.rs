//! SSE relay: event by event as frames arrive, an error event (never a hang) when the shim's
//! stream breaks or goes silent, and the dispatch ended however the stream ends.

use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use continuum_data_plane::dispatch::DispatchSettings;
use continuum_data_plane::dispatch::relay::{AFTER_DONE_GRACE, MAX_PARTIAL_EVENT_BYTES};
use continuum_proto::model::{LoadKey, WorkerKey};
use continuum_tests::eventually;
use continuum_tests::shim_stub::{Frame, Reply, StubShim};
use serde_json::Value;
use tokio::sync::mpsc;

use super::{DECODE_ID, Harness, MODEL, NAMESPACE, PREFILL_ID, chat, config, disaggregated_fleet, sample};

const FIRST: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"one\"}}]}\n\n";
const SECOND: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"two\"}}]}\n\n";
const DONE: &str = "data: [DONE]\n\n";

async fn next_text(response: &mut reqwest::Response) -> anyhow::Result<Option<String>> {
    Ok(response.chunk().await?.map(|chunk| String::from_utf8_lossy(&chunk).into_owned()))
}

/// The OpenAI error `code` carried by an SSE error event.
fn event_code(event: &str) -> Option<String> {
    let data: Value = serde_json::from_str(event.strip_prefix("data: ")?.trim()).ok()?;
    data["error"]["code"].as_str().map(str::to_string)
}

/// A streamed chat request through a replica to a stub shim whose frames the test sends
/// through `gate`.
struct Streaming {
    harness: Harness,
    gate: mpsc::Sender<Frame>,
    response: reqwest::Response,
    _shim: StubShim,
}

async fn streaming(settings: DispatchSettings) -> anyhow::Result<Streaming> {
    let shim = StubShim::start().await?;
    let harness = Harness::start_with(disaggregated_fleet(), config(&[("shim-a", shim.url())]), settings).await?;
    let gate = shim.push_stream();
    let response = harness.post(&chat(MODEL, true)).await?;
    Ok(Streaming { harness, gate, response, _shim: shim })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_frames_are_relayed_one_at_a_time() -> anyhow::Result<()> {
    let Streaming { harness, gate, mut response, .. } = streaming(DispatchSettings::default()).await?;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    assert_eq!(harness.replica.ledger.len(), 1, "the dispatch is in flight while the stream is open");

    // Each frame is read by the client before the shim is allowed to send the next.
    let first_events =
        async || anyhow::Ok(sample(&harness.metrics().await?, "continuum_stream_first_event_seconds_count"));
    assert_eq!(first_events().await?, Some(0.0), "no answer event yet");
    for frame in [FIRST, SECOND, DONE] {
        gate.send(Ok(Bytes::from(frame))).await?;
        assert_eq!(next_text(&mut response).await?.as_deref(), Some(frame));
    }
    drop(gate);
    assert_eq!(next_text(&mut response).await?, None);
    assert!(harness.replica.ledger.is_empty(), "the dispatch ended with the stream");
    assert_eq!(first_events().await?, Some(1.0), "the first answer event's wait, observed once");
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_breaks_midway_ends_with_an_error_event() -> anyhow::Result<()> {
    let Streaming { harness, gate, mut response, .. } = streaming(DispatchSettings::default()).await?;
    gate.send(Ok(Bytes::from(FIRST))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST));
    gate.send(Err("engine died".into())).await?;
    let event = next_text(&mut response).await?.unwrap_or_default();
    assert_eq!(event_code(&event).as_deref(), Some("stream_interrupted"), "{event}");
    assert_eq!(next_text(&mut response).await?, None, "the stream ends after the error event");
    assert!(harness.replica.ledger.is_empty());
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"disaggregated_errors_total{phase="decode"}"#), Some(1.0));
    harness.stop().await;
    Ok(())
}

/// A stream whose body ends cleanly between two events, short of its closing `[DONE]` (a
/// close-delimited answer whose connection dropped there, a proxy's cut), was cut off: the
/// client is told, as for any break, and it counts as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_ends_before_its_closing_marker_ends_with_an_error_event() -> anyhow::Result<()> {
    let Streaming { harness, gate, mut response, .. } = streaming(DispatchSettings::default()).await?;
    gate.send(Ok(Bytes::from(FIRST))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST));
    drop(gate);
    let event = next_text(&mut response).await?.unwrap_or_default();
    assert_eq!(event_code(&event).as_deref(), Some("stream_interrupted"), "{event}");
    assert_eq!(next_text(&mut response).await?, None, "the stream ends after the error event");
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"disaggregated_errors_total{phase="decode"}"#), Some(1.0));
    harness.stop().await;
    Ok(())
}

/// A request no Dynamo worker serves streams from its unified backend; when that stream breaks
/// the client gets the same error event, and it is counted apart from the pinned ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpinned_stream_that_breaks_midway_is_counted_apart() -> anyhow::Result<()> {
    let (shim, unified) = (StubShim::start().await?, StubShim::start().await?);
    let mut config = config(&[("shim-a", shim.url())]);
    config.backends.push(continuum_proto::model::Backend {
        name: "unified".into(),
        url: unified.url(),
        models: vec!["elsewhere".into()],
    });
    let harness = Harness::start(disaggregated_fleet(), config).await?;
    let gate = unified.push_stream();
    let mut response = harness.post(&chat("elsewhere", true)).await?;
    gate.send(Ok(Bytes::from(FIRST))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST));
    gate.send(Err("backend died".into())).await?;
    let event = next_text(&mut response).await?.unwrap_or_default();
    assert_eq!(event_code(&event).as_deref(), Some("stream_interrupted"), "{event}");
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, "continuum_unpinned_stream_failures_total"), Some(1.0));
    assert_eq!(sample(&metrics, r#"disaggregated_errors_total{phase="decode"}"#), Some(0.0));
    assert_eq!(sample(&metrics, "continuum_stream_first_event_seconds_count"), Some(1.0), "its first event's wait");
    assert!(shim.received().is_empty(), "the pool's shim took no part");
    harness.stop().await;
    Ok(())
}

/// An event split across frames reaches the client whole, once its end arrives; one that
/// breaks off is never sent: a blank line would deliver its half as an event of its own, and
/// a client would fail on its JSON before it read the error after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_whole_events_reach_the_client_so_a_break_inside_one_sends_the_error_alone() -> anyhow::Result<()> {
    let Streaming { harness, gate, mut response, .. } = streaming(DispatchSettings::default()).await?;
    let (head, tail) = FIRST.split_at(FIRST.len() / 2);
    gate.send(Ok(Bytes::from(head))).await?;
    gate.send(Ok(Bytes::from(format!("{tail}{}", &SECOND[..10])))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST), "the first event, whole, and no more");
    gate.send(Err("engine died".into())).await?;
    let mut rest = String::new();
    while let Some(text) = next_text(&mut response).await? {
        rest.push_str(&text);
    }
    assert!(rest.starts_with("data: {\"error\""), "nothing of the broken event: {rest:?}");
    assert_eq!(event_code(&rest).as_deref(), Some("stream_interrupted"), "{rest:?}");
    harness.stop().await;
    Ok(())
}

const FRONTEND_503: &str = "data: {\"error\":{\"message\":\"Service temporarily unavailable\",\"type\":\"service_unavailable\",\"code\":503}}\n\n";

/// A streamed request whose shim sends its first event, then `end` (a frame, or a break), then
/// closes; read to its end.
async fn stream_ending(harness: &Harness, shim: &StubShim, end: Frame) -> anyhow::Result<()> {
    let gate = shim.push_stream();
    let mut response = harness.post(&chat(MODEL, true)).await?;
    gate.send(Ok(Bytes::from(FIRST))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST));
    gate.send(end).await?;
    drop(gate);
    while next_text(&mut response).await?.is_some() {}
    Ok(())
}

/// A stream whose engine fails (1.6.1 says so in the stream, with an error event) blames its
/// workers: two in a row take them out of picking; one that ends whole acquits them. A stream
/// whose connection breaks, or closes inside an event, is the shim's failure (or the
/// network's): it is charged to the shim's breaker and blames no worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_streams_blame_their_workers_and_broken_ones_their_shim() -> anyhow::Result<()> {
    use continuum_data_plane::dispatch::BreakerSettings;
    let shim = StubShim::start().await?;
    let breaker = BreakerSettings { failure_threshold: 2, cooldown: Duration::from_secs(60) };
    let settings = DispatchSettings { breaker, ..DispatchSettings::default() };
    let failed = || Ok(Bytes::from(FRONTEND_503));
    let broken = || Err("connection reset".into());
    let cut = || Ok(Bytes::from("data: {\"choi"));
    let shim_state = |metrics: &str| sample(metrics, r#"continuum_shim_replica_state{backend="shim-a"}"#);

    let harness = Harness::start_with(disaggregated_fleet(), config(&[("shim-a", shim.url())]), settings).await?;
    let outliers = harness.replica.ledger.outliers();
    stream_ending(&harness, &shim, failed()).await?;
    stream_ending(&harness, &shim, Ok(Bytes::from(DONE))).await?;
    stream_ending(&harness, &shim, failed()).await?;
    assert!(!outliers.any_ejected(std::time::Instant::now()), "a whole stream between two failures started them over");
    stream_ending(&harness, &shim, broken()).await?;
    stream_ending(&harness, &shim, failed()).await?;
    assert!(outliers.any_ejected(std::time::Instant::now()), "two failures, with only a broken stream between");
    assert_eq!(shim_state(&harness.metrics().await?), Some(0.0), "one break is not two in a row");
    harness.stop().await;

    // A shim that goes down under its open streams breaks them together: its breaker takes the
    // breaks (two in a row open it here), and no worker takes a strike.
    let harness = Harness::start_with(disaggregated_fleet(), config(&[("shim-a", shim.url())]), settings).await?;
    let mut open = Vec::new();
    for _ in 0..2 {
        let gate = shim.push_stream();
        let mut response = harness.post(&chat(MODEL, true)).await?;
        gate.send(Ok(Bytes::from(FIRST))).await?;
        assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST));
        open.push((gate, response));
    }
    for ((gate, mut response), end) in open.into_iter().zip([broken(), cut()]) {
        gate.send(end).await?;
        drop(gate);
        while next_text(&mut response).await?.is_some() {}
    }
    assert!(harness.replica.ledger.outliers().is_empty(), "no strike against the pinned workers");
    assert_eq!(shim_state(&harness.metrics().await?), Some(2.0), "open after two broken streams in a row");
    harness.stop().await;
    Ok(())
}

/// A connection that breaks under a stream, or a body that ends inside an event, is the shim's
/// failure even after an error event counted the stream's: two such streams in a row open the
/// shim's breaker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_break_after_an_error_event_is_still_charged_to_the_shim() -> anyhow::Result<()> {
    use continuum_data_plane::dispatch::BreakerSettings;
    let shim = StubShim::start().await?;
    let breaker = BreakerSettings { failure_threshold: 2, cooldown: Duration::from_secs(60) };
    let settings = DispatchSettings { breaker, ..DispatchSettings::default() };
    let harness = Harness::start_with(disaggregated_fleet(), config(&[("shim-a", shim.url())]), settings).await?;
    for broken in [Err("connection reset".to_string()), Ok(Bytes::from_static(b"data: {\"choices\""))] {
        let gate = shim.push_stream();
        let mut response = harness.post(&chat(MODEL, true)).await?;
        for frame in [FIRST, FRONTEND_503] {
            gate.send(Ok(Bytes::from(frame))).await?;
            assert_eq!(next_text(&mut response).await?.as_deref(), Some(frame));
        }
        // The connection reset, or the body ended (its last chunk sent) half an event in.
        gate.send(broken).await?;
        drop(gate);
        while next_text(&mut response).await?.is_some() {}
    }
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"continuum_shim_replica_state{backend="shim-a"}"#), Some(2.0), "open");
    assert_eq!(sample(&metrics, r#"disaggregated_errors_total{phase="decode"}"#), Some(2.0), "once each");
    harness.stop().await;
    Ok(())
}

/// A connection that breaks after the closing `[DONE]` (before its last chunk) cut nothing the
/// client needed: the stream ends as it came, counted whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_break_after_the_closing_done_cuts_nothing() -> anyhow::Result<()> {
    let Streaming { harness, gate, mut response, .. } = streaming(DispatchSettings::default()).await?;
    for frame in [FIRST, DONE] {
        gate.send(Ok(Bytes::from(frame))).await?;
        assert_eq!(next_text(&mut response).await?.as_deref(), Some(frame));
    }
    gate.send(Err("connection reset".into())).await?;
    drop(gate);
    assert_eq!(next_text(&mut response).await?, None, "no error event after [DONE]");
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"disaggregated_errors_total{phase="decode"}"#), Some(0.0));
    assert!(harness.replica.ledger.is_empty());
    harness.stop().await;
    Ok(())
}

/// A shim (or a proxy in front of it) that holds its body's end back after the closing
/// `[DONE]`: the client's stream ends whole once [`AFTER_DONE_GRACE`] has passed, not at the
/// idle timeout, and nothing is counted against anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_end_is_held_back_after_done_ends_whole_soon_after() -> anyhow::Result<()> {
    let Streaming { harness, gate, mut response, .. } = streaming(DispatchSettings::default()).await?;
    gate.send(Ok(Bytes::from(FIRST))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST));
    // The marker, and the start of something after it that never ends: not for the client.
    gate.send(Ok(Bytes::from(format!("{DONE}data: {{\"x\"")))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(DONE));
    // The gate stays open: the shim never sends its last chunk.
    let after = AFTER_DONE_GRACE + Duration::from_secs(5);
    let end = tokio::time::timeout(after, next_text(&mut response)).await;
    assert!(matches!(end, Ok(Ok(None))), "ended whole, well before the idle timeout: {end:?}");
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"disaggregated_errors_total{phase="decode"}"#), Some(0.0));
    assert_eq!(sample(&metrics, r#"continuum_shim_replica_state{backend="shim-a"}"#), Some(0.0));
    assert!(harness.replica.ledger.is_empty());
    assert!(harness.replica.ledger.outliers().is_empty(), "no strike");
    drop(gate);
    harness.stop().await;
    Ok(())
}

/// A later frontend's error event, named `error` with its words in comments, reaches the client
/// as an error event OpenAI's clients read: unnamed, a JSON error in its data, saying the
/// engine's words, the tokens before it and the closing marker as they came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_event_named_with_words_in_comments_reaches_the_client_as_a_json_error() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness =
        Harness::start_with(disaggregated_fleet(), config(&[("shim-a", shim.url())]), DispatchSettings::default())
            .await?;
    let gate = shim.push_stream();
    let mut response = harness.post(&chat(MODEL, true)).await?;
    let token = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
    gate.send(Ok(Bytes::from(format!("{token}event: error\n: Stream ended before generation completed\n\n{DONE}"))))
        .await?;
    drop(gate);
    let mut text = String::new();
    while let Some(frame) = next_text(&mut response).await? {
        text.push_str(&frame);
    }
    assert!(text.starts_with(token) && text.ends_with(DONE), "{text}");
    assert!(!text.contains("event:") && !text.contains("\n:"), "nothing a client cannot read: {text}");
    let error = text.lines().filter_map(|line| line.strip_prefix("data: ")).find(|data| data.contains("\"error\""));
    let error: serde_json::Value = serde_json::from_str(error.unwrap_or("{}"))?;
    assert_eq!(error["error"]["code"], "backend_failed", "{text}");
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("Stream ended before generation completed"), "{message}");
    harness.stop().await;
    Ok(())
}

/// An error event before any token is no first token: the prompt may never have been
/// prefilled, so both workers are suspects (two such streams take both out of picking), and
/// the frontend's end after it, with its closing `[DONE]` or without, adds no error event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_event_before_any_token_blames_the_prefill_worker_too() -> anyhow::Result<()> {
    use continuum_data_plane::routing::picker::EJECT_AFTER;
    let shim = StubShim::start().await?;
    let harness =
        Harness::start_with(disaggregated_fleet(), config(&[("shim-a", shim.url())]), DispatchSettings::default())
            .await?;
    let ends = [FRONTEND_503.to_string(), format!("{FRONTEND_503}{DONE}")];
    assert_eq!(ends.len() as u32, EJECT_AFTER);
    for end in ends {
        let gate = shim.push_stream();
        let mut response = harness.post(&chat(MODEL, true)).await?;
        gate.send(Ok(Bytes::from(end.clone()))).await?;
        assert_eq!(next_text(&mut response).await?, Some(end));
        drop(gate);
        assert_eq!(next_text(&mut response).await?, None, "the engine's error event was the stream's end");
    }
    let outliers = harness.replica.ledger.outliers();
    let now = std::time::Instant::now();
    for id in [PREFILL_ID, DECODE_ID] {
        assert!(outliers.ejected(&rank(id), now), "worker {id} is out");
    }
    let metrics = harness.metrics().await?;
    assert_eq!(
        sample(&metrics, "continuum_stream_first_event_seconds_count"),
        Some(0.0),
        "an error event is no answer"
    );
    assert_eq!(
        sample(&metrics, r#"continuum_shim_replica_state{backend="shim-a"}"#),
        Some(0.0),
        "the shim served them"
    );
    harness.stop().await;
    Ok(())
}

/// A stream silent for its idle timeout strikes its workers as a head that never came does:
/// only those that answered nothing else since it was sent. Workers serving other requests
/// meanwhile (a long prompt, a burst timing out together) stay in; silent ones go out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_strikes_only_workers_that_answered_nothing_meanwhile() -> anyhow::Result<()> {
    use continuum_data_plane::routing::picker::EJECT_AFTER;
    let shim = StubShim::start().await?;
    // Long enough for the request answered meanwhile to end before the first stream's timeout
    // on a loaded machine.
    let settings = DispatchSettings { stream_idle_timeout: Duration::from_secs(2), ..DispatchSettings::default() };
    let harness = Harness::start_with(disaggregated_fleet(), config(&[("shim-a", shim.url())]), settings).await?;
    let outliers = harness.replica.ledger.outliers();
    let silent_streams = |answer_meanwhile: bool| {
        let (harness, shim) = (&harness, &shim);
        async move {
            let mut open = Vec::new();
            for _ in 0..EJECT_AFTER {
                let gate = shim.push_stream();
                open.push((gate, harness.post(&chat(MODEL, true)).await?));
            }
            if answer_meanwhile {
                // The same two workers answer another request whole.
                let answered = harness.post(&chat(MODEL, false)).await?;
                anyhow::ensure!(answered.status() == 200, "{}", answered.status());
            }
            for (gate, mut response) in open {
                let event = next_text(&mut response).await?.unwrap_or_default();
                anyhow::ensure!(event_code(&event).as_deref() == Some("stream_timeout"), "{event}");
                drop(gate);
            }
            anyhow::Ok(())
        }
    };
    silent_streams(true).await?;
    assert!(outliers.is_empty(), "workers that answered since are not struck");
    silent_streams(false).await?;
    let now = std::time::Instant::now();
    for id in [PREFILL_ID, DECODE_ID] {
        assert!(outliers.ejected(&rank(id), now), "worker {id} answered nothing: out");
    }
    harness.stop().await;
    Ok(())
}

fn rank(id: u64) -> LoadKey {
    LoadKey { worker: WorkerKey::new(NAMESPACE, id), dp_rank: 0 }
}

/// A request holds the fleet view it was picked on only while it picks: one in flight for
/// minutes (a buffered answer is read whole before it is relayed) would otherwise keep an old
/// view alive for each of the hundreds the control plane publishes meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_holds_no_fleet_view() -> anyhow::Result<()> {
    use continuum_control_plane::fleet::FleetChange;
    let shim = StubShim::start().await?;
    let harness = std::sync::Arc::new(
        Harness::start_with(disaggregated_fleet(), config(&[("shim-a", shim.url())]), DispatchSettings::default())
            .await?,
    );
    let picked_on = harness.replica.fleet.view().ok_or_else(|| anyhow::anyhow!("no view"))?;
    // A buffered request whose answer comes in two parts: in flight until the second.
    let gate = shim.push_stream();
    let client = std::sync::Arc::clone(&harness);
    let request =
        tokio::spawn(async move { client.post(&chat(MODEL, false)).await?.text().await.map_err(anyhow::Error::from) });
    gate.send(Ok(Bytes::from(r#"{"id":"x","choices":[{"#))).await?;
    eventually(Duration::from_secs(5), "the request reached the shim", || {
        std::future::ready(shim.received().len() == 1)
    })
    .await?;
    // A newer view replaces the one it was picked on.
    let another = super::worker(DECODE_ID + 3, continuum_proto::model::Role::Decode, MODEL, 0);
    harness.change(FleetChange { upsert: vec![another], ..FleetChange::default() }).await?;
    // The fleet client may still hold the old view a moment after it stored the new one; the
    // request, still in flight, must not hold it at all.
    eventually(Duration::from_secs(5), "only this test holds the old view", || {
        std::future::ready(std::sync::Arc::strong_count(&picked_on) == 1)
    })
    .await?;
    gate.send(Ok(Bytes::from(r#""index":0,"message":{"role":"assistant","content":"hi"}}]}"#))).await?;
    drop(gate);
    let answer = request.await??;
    assert!(answer.contains("\"content\":\"hi\""), "{answer}");
    Ok(())
}

/// An event that never ends is held back only so far: past the bound the stream breaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_event_past_the_bound_ends_the_stream_with_an_error() -> anyhow::Result<()> {
    let Streaming { harness, gate, mut response, .. } = streaming(DispatchSettings::default()).await?;
    gate.send(Ok(Bytes::from(FIRST))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST));
    let endless = format!("data: {}", "x".repeat(MAX_PARTIAL_EVENT_BYTES / 2));
    for _ in 0..3 {
        gate.send(Ok(Bytes::from(endless.clone()))).await?;
    }
    let event = next_text(&mut response).await?.unwrap_or_default();
    assert_eq!(event_code(&event).as_deref(), Some("stream_interrupted"), "{event:.80}");
    assert_eq!(next_text(&mut response).await?, None);
    assert!(harness.replica.ledger.is_empty());
    harness.stop().await;
    Ok(())
}

/// A body that ends cleanly inside an event (as a close-delimited answer whose connection
/// dropped does) ends with an error event: SSE would drop the half without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ending_inside_an_event_ends_with_an_error() -> anyhow::Result<()> {
    let Streaming { harness, gate, mut response, .. } = streaming(DispatchSettings::default()).await?;
    gate.send(Ok(Bytes::from(FIRST))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST));
    gate.send(Ok(Bytes::from_static(b"data: {\"choices\":[{\"delta\""))).await?;
    drop(gate);
    let event = next_text(&mut response).await?.unwrap_or_default();
    assert_eq!(event_code(&event).as_deref(), Some("stream_interrupted"), "{event}");
    assert_eq!(next_text(&mut response).await?, None);
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"disaggregated_errors_total{phase="decode"}"#), Some(1.0));
    assert!(harness.replica.ledger.is_empty());
    harness.stop().await;
    Ok(())
}

/// Dynamo 1.6.1 ends a stream whose decode worker died with an error event and `[DONE]`: it is
/// relayed as it came, and the stream counts as failed, its workers blamed, not acquitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_event_in_the_stream_is_relayed_and_counted_as_a_failure() -> anyhow::Result<()> {
    let Streaming { harness, gate, mut response, .. } = streaming(DispatchSettings::default()).await?;
    for frame in [FIRST, FRONTEND_503, DONE] {
        gate.send(Ok(Bytes::from(frame))).await?;
        assert_eq!(next_text(&mut response).await?.as_deref(), Some(frame), "relayed as it came");
    }
    drop(gate);
    assert_eq!(next_text(&mut response).await?, None);
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"disaggregated_errors_total{phase="decode"}"#), Some(1.0));
    assert!(!harness.replica.ledger.outliers().is_empty(), "the pinned workers took a strike");
    assert!(harness.replica.ledger.is_empty());
    harness.stop().await;
    Ok(())
}

/// The closing `[DONE]` short of its blank line is completed, not reported as a break.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closing_done_without_its_blank_line_is_completed() -> anyhow::Result<()> {
    let Streaming { harness, gate, mut response, .. } = streaming(DispatchSettings::default()).await?;
    gate.send(Ok(Bytes::from(FIRST))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST));
    gate.send(Ok(Bytes::from_static(b"data: [DONE]\n"))).await?;
    drop(gate);
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(DONE));
    assert_eq!(next_text(&mut response).await?, None);
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"disaggregated_errors_total{phase="decode"}"#), Some(0.0));
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_ends_with_a_timeout_event() -> anyhow::Result<()> {
    let settings = DispatchSettings { stream_idle_timeout: Duration::from_millis(300), ..DispatchSettings::default() };
    let Streaming { harness, gate, mut response, .. } = streaming(settings).await?;
    gate.send(Ok(Bytes::from(FIRST))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST));
    // The gate stays open and silent: the relay must give up on its own.
    let event = next_text(&mut response).await?.unwrap_or_default();
    assert_eq!(event_code(&event).as_deref(), Some("stream_timeout"), "{event}");
    assert_eq!(next_text(&mut response).await?, None);
    assert!(harness.replica.ledger.is_empty());
    drop(gate);
    harness.stop().await;
    Ok(())
}

/// Pieces of an event that never ends are not progress either: a byte now and then would hold
/// the stream, and its dispatch on its ranks, for as long as the sender liked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_trickling_in_without_an_end_does_not_keep_a_stream_open() -> anyhow::Result<()> {
    let settings = DispatchSettings { stream_idle_timeout: Duration::from_millis(300), ..DispatchSettings::default() };
    let Streaming { harness, gate, mut response, .. } = streaming(settings).await?;
    gate.send(Ok(Bytes::from(FIRST))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST));
    let trickle = gate.clone();
    let trickling = tokio::spawn(async move {
        let _ = trickle.send(Ok(Bytes::from_static(b"data: {\"a\""))).await;
        while trickle.send(Ok(Bytes::from_static(b"x"))).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let ended = tokio::time::timeout(Duration::from_secs(5), next_text(&mut response)).await??.unwrap_or_default();
    assert_eq!(event_code(&ended).as_deref(), Some("stream_timeout"), "{ended}");
    assert!(harness.replica.ledger.is_empty());
    trickling.abort();
    drop(gate);
    harness.stop().await;
    Ok(())
}

/// A frontend may keep an idle stream open with SSE comments. They reach the client, but they
/// are not the answer starting (the prompt keeps loading its prefill rank), nor progress: a
/// stalled engine behind them still ends the stream at the idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_comments_neither_begin_the_answer_nor_keep_a_stalled_stream_open() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    // Long enough for the prefill leg's report and the half second below on a loaded machine.
    let settings = DispatchSettings { stream_idle_timeout: Duration::from_secs(4), ..DispatchSettings::default() };
    let harness = Harness::start_with(disaggregated_fleet(), config(&[("shim-a", shim.url())]), settings).await?;
    let prefill = LoadKey { worker: WorkerKey::new(NAMESPACE, PREFILL_ID), dp_rank: 0 };
    let prefilling = || {
        harness
            .replica
            .fleet
            .view()
            .and_then(|v| v.backlogs().get(&prefill).copied())
            .is_some_and(|b| b.prefill_tokens > 0)
    };
    let gate = shim.push_stream();
    let mut response = harness.post(&chat(MODEL, true)).await?;
    let beat = gate.clone();
    let heartbeat = tokio::spawn(async move {
        while beat.send(Ok(Bytes::from_static(b":\n\n"))).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(":\n\n"), "comments are relayed");
    eventually(Duration::from_secs(10), "the prefill leg reported", || async { prefilling() }).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(prefilling(), "half a second of comments did not end the prefill leg");
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match next_text(&mut response).await? {
                Some(text) if text.starts_with(':') => continue,
                other => return anyhow::Ok(other.unwrap_or_default()),
            }
        }
    })
    .await??;
    assert_eq!(event_code(&ended).as_deref(), Some("stream_timeout"), "{ended}");
    assert!(harness.replica.ledger.is_empty());
    heartbeat.abort();
    drop(gate);
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_ends_its_dispatch() -> anyhow::Result<()> {
    let Streaming { harness, gate, mut response, .. } = streaming(DispatchSettings::default()).await?;
    gate.send(Ok(Bytes::from(FIRST))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST));
    assert_eq!(harness.replica.ledger.len(), 1);
    drop(response);
    let ledger = &harness.replica.ledger;
    eventually(Duration::from_secs(10), "the cancelled stream's dispatch to end", || async { ledger.is_empty() })
        .await?;
    drop(gate);
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_stream_loads_its_ranks_fleet_wide_until_it_ends() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let rank = |id| LoadKey { worker: WorkerKey::new(NAMESPACE, id), dp_rank: 0 };
    let backlog = |id| harness.replica.fleet.view().and_then(|v| v.backlogs().get(&rank(id)).copied());
    let gate = shim.push_stream();
    let mut response = harness.post(&chat(MODEL, true)).await?;

    // The control plane folds the report into the view it streams back to every replica.
    eventually(Duration::from_secs(10), "both legs reported", || async {
        backlog(PREFILL_ID).is_some_and(|b| b.prefill_tokens > 0 && b.decode_blocks == 0)
            && backlog(DECODE_ID).is_some_and(|b| b.decode_blocks > 0 && b.prefill_tokens == 0)
    })
    .await?;
    // The first token: the prompt is prefilled, so the prefill leg is over (it no longer loads
    // the prefill rank at all); the request's blocks stay on the decode rank until it ends.
    gate.send(Ok(Bytes::from(FIRST))).await?;
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(FIRST));
    eventually(Duration::from_secs(10), "the prefill leg ended", || async {
        backlog(PREFILL_ID).is_none_or(|b| b.prefill_tokens == 0 && b.dispatches == 0)
            && backlog(DECODE_ID).is_some_and(|b| b.decode_blocks > 0 && b.dispatches == 1)
    })
    .await?;
    gate.send(Ok(Bytes::from(DONE))).await?;
    drop(gate);
    assert_eq!(next_text(&mut response).await?.as_deref(), Some(DONE));
    assert_eq!(next_text(&mut response).await?, None);
    // Until a sample shows the ranks after the end, the control plane keeps publishing them
    // (with nothing in flight), so a lagging sample is not read as load.
    let idle = |id| backlog(id).is_none_or(|b| b.dispatches == 0 && b.decode_blocks == 0 && b.prefill_tokens == 0);
    eventually(Duration::from_secs(10), "the ended stream leaving the backlogs", || async {
        idle(PREFILL_ID) && idle(DECODE_ID)
    })
    .await?;
    harness.stop().await;
    Ok(())
}

/// A streamed request the shim answers with a success that is no event stream (a JSON
/// completion, or nothing under a 204) fails as an exchange broken by the shim, said so, rather
/// than reaching the client as a success holding an error event or as an empty one. A stream
/// whose content type carries a charset is one all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_request_answered_without_an_event_stream_fails_and_says_so() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let replies = [
        (StatusCode::OK, Some("application/json"), r#"{"choices":[]}"#, "200 but no event stream"),
        (StatusCode::NO_CONTENT, None, "", "204 but no event stream"),
    ];
    for (at, (status, content_type, body, said)) in replies.into_iter().enumerate() {
        shim.push(Reply::Fixed { status, content_type: content_type.map(str::to_string), body: Bytes::from(body) });
        let response = harness.post(&chat(MODEL, true)).await?;
        assert_eq!(response.status(), 502, "{said}");
        let error: Value = response.json().await?;
        assert_eq!(error["error"]["code"], "disaggregated_decode_failed", "{error}");
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(said), "{message}");
        assert!(harness.replica.ledger.is_empty(), "the dispatch ended");
        let metrics = harness.metrics().await?;
        let failures = sample(&metrics, r#"disaggregated_errors_total{phase="decode"}"#);
        assert_eq!(failures, Some((at + 1) as f64));
    }
    shim.push(Reply::Fixed {
        status: StatusCode::OK,
        content_type: Some("text/event-stream; charset=utf-8".into()),
        body: Bytes::from(format!("{FIRST}{DONE}")),
    });
    let mut response = harness.post(&chat(MODEL, true)).await?;
    assert_eq!(response.status(), 200);
    let mut relayed = String::new();
    while let Some(text) = next_text(&mut response).await? {
        relayed.push_str(&text);
    }
    assert_eq!(relayed, format!("{FIRST}{DONE}"));
    harness.stop().await;
    Ok(())
}
