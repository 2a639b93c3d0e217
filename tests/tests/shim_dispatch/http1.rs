//! The replica's own HTTP/1.1 server, spoken to over raw sockets: pipelining, chunked bodies,
//! `Expect: 100-continue`, HTTP/1.0, refusals of heads that cannot be trusted, and shutdown.

use std::time::Duration;

use continuum_tests::eventually;
use continuum_tests::shim_stub::StubShim;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{Harness, MODEL, chat, config, disaggregated_fleet, sample};

const PATIENCE: Duration = Duration::from_secs(10);

/// One response read off a raw connection: status, head (lowercased) and body.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: Vec<u8>,
}

/// Reads one response with a `Content-Length` body (or none) from `stream`, keeping any bytes
/// past it in `pending`.
async fn read_answer(stream: &mut TcpStream, pending: &mut Vec<u8>) -> anyhow::Result<Answer> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&pending[..end]).to_lowercase();
            let status = head.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(Ok(0), |v| v.trim().parse::<usize>())?;
            if status == 100 || pending.len() >= end + 4 + length {
                let body = pending[end + 4..end + 4 + if status == 100 { 0 } else { length }].to_vec();
                let used = end + 4 + body.len();
                pending.drain(..used);
                return Ok(Answer { status, head, body });
            }
        }
        let n = tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await??;
        anyhow::ensure!(
            n > 0,
            "the connection closed mid-response; read so far: {:?}",
            String::from_utf8_lossy(pending)
        );
        pending.extend_from_slice(&chunk[..n]);
    }
}

/// Whether the server closes `stream` (EOF) within the patience.
async fn closes(stream: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    matches!(tokio::time::timeout(PATIENCE, stream.read_to_end(&mut rest)).await, Ok(Ok(_)))
}

fn chat_head(extra: &str, length: usize) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}content-length: {length}\r\n\r\n"
    )
}

/// The completion's object type: the stub's echo, relayed whole.
fn object_of(answer: &Answer) -> anyhow::Result<String> {
    let body: Value = serde_json::from_slice(&answer.body)?;
    Ok(body["object"].as_str().unwrap_or_default().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order_on_one_connection() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let mut stream = TcpStream::connect(harness.replica.local_addr).await?;
    let mut wire = Vec::new();
    for user in ["r0", "r1", "r2"] {
        let mut body = chat(MODEL, false);
        body["user"] = user.into();
        let body = serde_json::to_vec(&body)?;
        wire.extend_from_slice(chat_head("", body.len()).as_bytes());
        wire.extend_from_slice(&body);
    }
    wire.extend_from_slice(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n");
    stream.write_all(&wire).await?;
    let mut pending = Vec::new();
    for user in ["r0", "r1", "r2"] {
        let answer = read_answer(&mut stream, &mut pending).await?;
        assert_eq!(answer.status, 200, "{answer:?}");
        assert!(!answer.head.contains("x-dynamo"), "{}", answer.head);
        assert_eq!(object_of(&answer)?, "chat.completion");
        let id = serde_json::from_slice::<Value>(&answer.body)?["id"].clone();
        assert_eq!(id, format!("chatcmpl-{user}"), "each answer in its request's place");
    }
    let health = read_answer(&mut stream, &mut pending).await?;
    assert_eq!((health.status, health.body.as_slice()), (200, &b"ok\n"[..]), "the router's endpoints, in turn");
    assert_eq!(shim.received().len(), 3);
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_bodies_and_expect_continue_are_understood() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let mut stream = TcpStream::connect(harness.replica.local_addr).await?;
    let body = serde_json::to_vec(&chat(MODEL, false))?;
    let mut pending = Vec::new();

    // The body waits for the go-ahead.
    stream.write_all(chat_head("expect: 100-continue\r\n", body.len()).as_bytes()).await?;
    let go = read_answer(&mut stream, &mut pending).await?;
    assert_eq!(go.status, 100, "{go:?}");
    stream.write_all(&body).await?;
    assert_eq!(read_answer(&mut stream, &mut pending).await?.status, 200);

    // A chunked body, split at an awkward place, with a trailer.
    let (first, second) = body.split_at(7);
    let chunked = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{}\r\n{:x}\r\n{}\r\n0\r\nx-trailer: 1\r\n\r\n",
        first.len(),
        String::from_utf8_lossy(first),
        second.len(),
        String::from_utf8_lossy(second)
    );
    stream.write_all(chunked.as_bytes()).await?;
    let answer = read_answer(&mut stream, &mut pending).await?;
    assert_eq!((answer.status, object_of(&answer)?.as_str()), (200, "chat.completion"));
    let received = shim.received();
    assert_eq!(received.len(), 2);
    assert!(received.iter().all(|r| r.body == chat(MODEL, false)), "both bodies arrived whole");
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_trickled_in_small_pieces_is_read_whole_wherever_its_blank_line_splits() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let body = serde_json::to_vec(&chat(MODEL, false))?;
    let mut pending = Vec::new();
    for piece in [1, 3, 7] {
        let mut stream = TcpStream::connect(harness.replica.local_addr).await?;
        let head = chat_head("", body.len());
        for part in head.as_bytes().chunks(piece) {
            stream.write_all(part).await?;
            stream.flush().await?;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        stream.write_all(&body).await?;
        let answer = read_answer(&mut stream, &mut pending).await?;
        assert_eq!(answer.status, 200, "{piece}-byte pieces: {answer:?}");
    }
    assert_eq!(shim.received().len(), 3);
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_that_cannot_be_trusted_are_refused_counted_and_closed() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let long_target = format!("GET /{} HTTP/1.1\r\n", "a".repeat(70_000));
    let rows: [(&str, u16, &str); 12] = [
        ("GET / HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n", 400, "malformed"),
        // Empty lines may come before a request line; a bare CR may not (RFC 9112 §2.2).
        ("\r\n\rGET /healthz HTTP/1.1\r\nhost: x\r\n\r\n", 400, "malformed"),
        ("GET / HTTP/1.1\r\n\r\n", 400, "malformed"),
        ("GET / HTTP/1.1\r\nhost: x\r\nhost: y\r\n\r\n", 400, "malformed"),
        (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
            501,
            "unsupported_coding",
        ),
        (&long_target, 414, "target_too_long"),
        (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n",
            400,
            "framing",
        ),
        ("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999999\r\n\r\n", 413, "body_too_large"),
        (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            400,
            "malformed_body",
        ),
        // A chunk size another hop could read otherwise (a sign; a bare LF in an extension).
        (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n+2\r\n{}\r\n",
            400,
            "malformed_body",
        ),
        (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2;\n\r\n{}\r\n",
            400,
            "malformed_body",
        ),
        (
            "POST /v1/chat/completions HTTP/1.0\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n",
            400,
            "framing",
        ),
    ];
    for (wire, status, reason) in rows {
        let series = format!("continuum_http_requests_refused_total{{reason=\"{reason}\"}}");
        let before = sample(&harness.metrics().await?, &series).unwrap_or(0.0);
        let mut stream = TcpStream::connect(harness.replica.local_addr).await?;
        stream.write_all(wire.as_bytes()).await?;
        let answer = read_answer(&mut stream, &mut Vec::new()).await?;
        assert_eq!(answer.status, status, "{wire:?}: {answer:?}");
        assert!(answer.head.contains("connection: close"), "{wire:?}: {}", answer.head);
        let error: Value = serde_json::from_slice(&answer.body)?;
        assert!(error["error"]["message"].as_str().is_some_and(|m| m.len() > 20), "{error}");
        assert!(closes(&mut stream).await, "{wire:?}: the connection is closed after a refusal");
        let after = sample(&harness.metrics().await?, &series).unwrap_or(0.0);
        assert_eq!(after - before, 1.0, "{wire:?}: counted once under {series}");
    }
    // A target httparse reads but a URI may not hold: refused with the head, and counted.
    let series = "continuum_http_requests_refused_total{reason=\"malformed\"}";
    let before = sample(&harness.metrics().await?, series).unwrap_or(0.0);
    let mut stream = TcpStream::connect(harness.replica.local_addr).await?;
    stream.write_all(b"GET /<script> HTTP/1.1\r\nhost: x\r\n\r\n").await?;
    let answer = read_answer(&mut stream, &mut Vec::new()).await?;
    assert_eq!(answer.status, 400, "{answer:?}");
    assert_eq!(sample(&harness.metrics().await?, series).unwrap_or(0.0) - before, 1.0, "counted under {series}");
    assert!(shim.received().is_empty(), "nothing refused reached the shim");
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_for_no_endpoint_get_openai_errors_and_absolute_targets_are_routed() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let mut stream = TcpStream::connect(harness.replica.local_addr).await?;
    let mut pending = Vec::new();
    // A 405 names the methods the path takes (RFC 9110 §15.5.6); heads are read lowercased.
    let rows = [
        ("GET /v1/completions HTTP/1.1\r\nhost: x\r\n\r\n", 404, "not_found", None),
        ("GET /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n", 405, "method_not_allowed", Some("post")),
        (
            "POST /v1/models HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
            405,
            "method_not_allowed",
            Some("get,head"),
        ),
    ];
    for (wire, status, code, allow) in rows {
        stream.write_all(wire.as_bytes()).await?;
        let answer = read_answer(&mut stream, &mut pending).await?;
        assert_eq!(answer.status, status, "{wire:?}: {answer:?}");
        let allowed = answer.head.lines().find_map(|l| l.strip_prefix("allow: ")).map(str::trim_end);
        assert_eq!(allowed, allow, "{wire:?}: {answer:?}");
        let error: Value = serde_json::from_slice(&answer.body)?;
        assert_eq!(error["error"]["code"], code, "{error}");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
        assert!(error["error"]["message"].as_str().is_some_and(|m| m.contains("/v1/chat/completions")), "{error}");
    }
    let metrics = harness.metrics().await?;
    for (reason, count) in [("not_found", 1.0), ("method_not_allowed", 2.0)] {
        let series = format!("continuum_http_requests_refused_total{{reason=\"{reason}\"}}");
        assert_eq!(sample(&metrics, &series), Some(count), "{series}");
    }
    // The connection carries on, and an absolute-form target reaches the chat completion.
    let body = serde_json::to_vec(&chat(MODEL, false))?;
    let absolute = chat_head("", body.len()).replace("POST /v1/", "POST http://router.example/v1/");
    stream.write_all(&[absolute.as_bytes(), &body].concat()).await?;
    let answer = read_answer(&mut stream, &mut pending).await?;
    assert_eq!((answer.status, object_of(&answer)?.as_str()), (200, "chat.completion"), "{answer:?}");
    assert_eq!(shim.received().len(), 1);
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_before_its_buffered_answer_ends_its_dispatch() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    // The shim holds its answer open: the replica waits to read it whole.
    let gate = shim.push_stream();
    let mut stream = TcpStream::connect(harness.replica.local_addr).await?;
    let body = serde_json::to_vec(&chat(MODEL, false))?;
    stream.write_all(&[chat_head("", body.len()).as_bytes(), &body].concat()).await?;
    let ledger = &harness.replica.ledger;
    eventually(PATIENCE, "the dispatch to be recorded", || async { ledger.len() == 1 }).await?;
    drop(stream);
    eventually(PATIENCE, "the dispatch of the client that left to end", || async { ledger.is_empty() }).await?;
    drop(gate);
    harness.stop().await;
    Ok(())
}

/// Past the bytes kept of pipelined requests while an answer is made, the replica still reads
/// (and drops) what comes, so a client that then leaves is seen to: its dispatch ends instead
/// of running until its answer's timeout. An answer it stays for closes the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_pipelining_past_the_bound_is_still_seen_to_leave() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let body = serde_json::to_vec(&chat(MODEL, false))?;
    let request = [chat_head("", body.len()).as_bytes(), &body].concat();
    // Far past the 64 KiB kept (which one read may overshoot): some 400 KB of requests.
    let flood: Vec<u8> = request.iter().copied().cycle().take(request.len() * 2_000).collect();
    let ledger = &harness.replica.ledger;

    // It leaves: its dispatch ends.
    let gate = shim.push_stream();
    let mut stream = TcpStream::connect(harness.replica.local_addr).await?;
    stream.write_all(&request).await?;
    eventually(PATIENCE, "the dispatch to be recorded", || async { ledger.len() == 1 }).await?;
    stream.write_all(&flood).await?;
    drop(stream);
    eventually(PATIENCE, "the dispatch of the client that left to end", || async { ledger.is_empty() }).await?;
    drop(gate);
    let refused = r#"continuum_http_requests_refused_total{reason="pipelined_too_far"}"#;
    let before = sample(&harness.metrics().await?, refused).unwrap_or(0.0);

    // It stays: answered, then closed, the requests past the bound dropped and counted.
    let gate = shim.push_stream();
    let mut stream = TcpStream::connect(harness.replica.local_addr).await?;
    stream.write_all(&request).await?;
    eventually(PATIENCE, "the dispatch to be recorded", || async { ledger.len() == 1 }).await?;
    stream.write_all(&flood).await?;
    // Counted as the replica drops what came past the bound, once for the connection.
    eventually(PATIENCE, "the overflow counted", || async {
        harness.metrics().await.is_ok_and(|m| sample(&m, refused) == Some(before + 1.0))
    })
    .await?;
    drop(gate);
    let answer = read_answer(&mut stream, &mut Vec::new()).await?;
    assert!(answer.head.contains("connection: close"), "{}", answer.head);
    assert!(closes(&mut stream).await, "closed after the answer");
    assert_eq!(sample(&harness.metrics().await?, refused), Some(before + 1.0), "once for the connection");
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_1_0_clients_are_answered_then_closed() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let mut stream = TcpStream::connect(harness.replica.local_addr).await?;
    let body = serde_json::to_vec(&chat(MODEL, false))?;
    let head = chat_head("", body.len()).replace("HTTP/1.1", "HTTP/1.0");
    stream.write_all(&[head.as_bytes(), &body].concat()).await?;
    let answer = read_answer(&mut stream, &mut Vec::new()).await?;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert!(answer.head.contains("connection: close"), "{}", answer.head);
    assert!(closes(&mut stream).await);
    harness.stop().await;
    Ok(())
}

/// A connection closed after its answer (`Connection: close`) with more of the client's bytes
/// behind the request is drained first: closed unread, it would be reset under the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closing_answer_is_not_lost_to_a_reset_when_the_client_sent_more() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    // A reset is the kernel's, after a race of the close with the client's bytes: tried a few times.
    for _ in 0..4 {
        closing_with_unread_bytes_behind(&harness, &shim).await?;
    }
    harness.stop().await;
    Ok(())
}

async fn closing_with_unread_bytes_behind(harness: &Harness, shim: &StubShim) -> anyhow::Result<()> {
    // The answer is held open while the client's extra bytes pile up unread in the socket.
    let gate = shim.push_stream();
    let stream = TcpStream::connect(harness.replica.local_addr).await?;
    let body = serde_json::to_vec(&chat(MODEL, true))?;
    let mut wire = [chat_head("connection: close\r\n", body.len()).as_bytes(), &body].concat();
    wire.extend_from_slice(&vec![b'x'; 4 << 20]);
    let (mut read, mut write) = stream.into_split();
    let sending = tokio::spawn(async move {
        let _ = write.write_all(&wire).await;
        write
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    gate.send(Ok("data: [DONE]\n\n".into())).await?;
    drop(gate);
    let mut answer = Vec::new();
    let outcome = tokio::time::timeout(PATIENCE, read.read_to_end(&mut answer)).await?;
    let text = String::from_utf8_lossy(&answer);
    assert!(outcome.is_ok(), "{outcome:?} after {} bytes: {text:.300}", answer.len());
    assert!(text.starts_with("HTTP/1.1 200") && text.contains("[DONE]"), "{text:.400}");
    sending.abort();
    Ok(())
}

/// RFC 9112's smaller courtesies. A blank line after a body (some clients add one) leaves the
/// connection idle, not reading a request that never comes: it closes at once on shutdown
/// instead of after the 30 s read deadline, and no timeout is counted. An HTTP/1.0 client that
/// asks to keep its connection is told it is kept. A HEAD answer names the length its GET's
/// body has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blank_lines_http_1_0_keep_alive_and_head_lengths_are_answered_as_rfc_9112_asks() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;

    let mut http10 = TcpStream::connect(harness.replica.local_addr).await?;
    let mut pending = Vec::new();
    for _ in 0..2 {
        http10.write_all(b"GET /healthz HTTP/1.0\r\nconnection: keep-alive\r\n\r\n").await?;
        let answer = read_answer(&mut http10, &mut pending).await?;
        assert_eq!(answer.status, 200, "{answer:?}");
        assert!(answer.head.contains("connection: keep-alive"), "{}", answer.head);
    }

    let mut head = TcpStream::connect(harness.replica.local_addr).await?;
    head.write_all(b"HEAD /v1/models HTTP/1.1\r\nhost: x\r\n\r\n").await?;
    let mut said = Vec::new();
    while !said.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        anyhow::ensure!(tokio::time::timeout(PATIENCE, head.read(&mut byte)).await?? == 1, "closed");
        said.push(byte[0]);
    }
    let said = String::from_utf8_lossy(&said).to_lowercase();
    head.write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n").await?;
    let get = read_answer(&mut head, &mut Vec::new()).await?;
    assert!(!get.body.is_empty());
    assert!(said.contains(&format!("content-length: {}\r\n", get.body.len())), "{said}");

    let mut blank = TcpStream::connect(harness.replica.local_addr).await?;
    let body = serde_json::to_vec(&chat(MODEL, false))?;
    blank.write_all(&[chat_head("", body.len()).as_bytes(), &body, b"\r\n"].concat()).await?;
    assert_eq!(read_answer(&mut blank, &mut Vec::new()).await?.status, 200);
    // Read after the shutdown has closed every connection: a read deadline counted then, or
    // as the connection ends, is counted by the time `stop` returns.
    let timeouts = harness.replica.metrics.http_refused.with_label_values(&["timeout"]);
    tokio::time::timeout(PATIENCE, harness.stop()).await?;
    assert!(closes(&mut blank).await, "idle, so closed at once");
    assert_eq!(timeouts.get(), 0, "no read deadline passed");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_idle_keep_alive_connections() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let mut stream = TcpStream::connect(harness.replica.local_addr).await?;
    stream.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await?;
    assert_eq!(read_answer(&mut stream, &mut Vec::new()).await?.status, 200);
    let open = sample(&harness.metrics().await?, "continuum_http_connections");
    assert_eq!(open, Some(2.0), "this connection and the one asking for the metrics");
    // The connection is idle and kept alive; stopping the replica must not wait on it.
    tokio::time::timeout(PATIENCE, harness.stop()).await?;
    assert!(closes(&mut stream).await);
    Ok(())
}

/// The replica's process-wide body budgets (`continuum_data_plane::memory`): with the room taken
/// elsewhere, a large request body or buffered answer is refused 503 and counted, while small
/// ones still pass; once room returns they pass too, each charged while held and given back
/// after. (The budgets are the process's: nextest runs this test in a process of its own.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_process_wide_body_budgets_large_bodies_are_refused_and_their_room_comes_back() -> anyhow::Result<()> {
    use axum::http::StatusCode;
    use continuum_data_plane::memory::{
        BUFFERED_ANSWER_BUDGET, BUFFERED_ANSWERS, Charge, FREE_BYTES, REQUEST_BODIES, REQUEST_BODY_BUDGET,
    };
    use continuum_tests::shim_stub::Reply;

    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let mut large = chat(MODEL, false);
    large["messages"][0]["content"] = Value::from("x".repeat(2 * FREE_BYTES));
    let large = serde_json::to_vec(&large)?;
    let chunked = |body: &[u8]| {
        let mut wire = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n".to_vec();
        wire.extend_from_slice(format!("transfer-encoding: chunked\r\n\r\n{:x}\r\n", body.len()).as_bytes());
        wire.extend_from_slice(body);
        wire.extend_from_slice(b"\r\n0\r\n\r\n");
        wire
    };

    let mut elsewhere = Charge::default();
    assert!(REQUEST_BODIES.grow(&mut elsewhere, REQUEST_BODY_BUDGET), "the whole request budget, held");
    let mut stream = TcpStream::connect(harness.replica.local_addr).await?;
    stream.write_all(&chunked(&large)).await?;
    let answer = read_answer(&mut stream, &mut Vec::new()).await?;
    assert_eq!(answer.status, 503, "{answer:?}");
    let error: Value = serde_json::from_slice(&answer.body)?;
    assert_eq!(error["error"]["code"], "server_busy", "{error}");
    assert_eq!(harness.post(&chat(MODEL, false)).await?.status(), 200, "a small body costs no room");
    // A client waiting for `100 Continue` is not invited to send a body there is no room for.
    let mut waiting = TcpStream::connect(harness.replica.local_addr).await?;
    waiting.write_all(chat_head("expect: 100-continue\r\n", 8_000_000).as_bytes()).await?;
    let answer = read_answer(&mut waiting, &mut Vec::new()).await?;
    assert_eq!(answer.status, 503, "refused at once, not invited: {answer:?}");
    let mut waiting = TcpStream::connect(harness.replica.local_addr).await?;
    let chunked_head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                        expect: 100-continue\r\ntransfer-encoding: chunked\r\n\r\n";
    waiting.write_all(chunked_head.as_bytes()).await?;
    let answer = read_answer(&mut waiting, &mut Vec::new()).await?;
    assert_eq!(answer.status, 503, "a chunked body of unknown length neither: {answer:?}");
    let held = sample(&harness.metrics().await?, "continuum_body_bytes_held{budget=\"request\"}");
    assert_eq!(held, Some(REQUEST_BODY_BUDGET as f64), "what is held, exported");
    drop(elsewhere);
    // Charged as it arrives: the three quarters of a body sent hold their room.
    let mut stream = TcpStream::connect(harness.replica.local_addr).await?;
    let wire = chunked(&large);
    let (sent, rest) = wire.split_at(wire.len() * 3 / 4);
    stream.write_all(sent).await?;
    eventually(PATIENCE, "what arrived, charged", || async { REQUEST_BODIES.charged() > FREE_BYTES }).await?;
    stream.write_all(rest).await?;
    assert_eq!(read_answer(&mut stream, &mut Vec::new()).await?.status, 200);
    let mut idle = TcpStream::connect(harness.replica.local_addr).await?;
    idle.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 8000000\r\n\r\n").await?;
    let sent = harness.http.post(harness.url("/v1/chat/completions")).header("content-type", "application/json");
    assert_eq!(sent.body(large.clone()).send().await?.status(), 200, "a Content-Length body too");
    // Given back once each request is dispatched; an announced body never sent holds nothing.
    eventually(PATIENCE, "every body's room given back once answered", || async { REQUEST_BODIES.charged() == 0 })
        .await?;
    drop(idle);
    let refused = sample(&harness.metrics().await?, "continuum_http_requests_refused_total{reason=\"busy\"}");
    assert_eq!(refused, Some(3.0));

    let answer = || Reply::Fixed {
        status: StatusCode::OK,
        content_type: Some("application/json".into()),
        body: serde_json::to_vec(&serde_json::json!({"choices": [], "padding": "y".repeat(2 * FREE_BYTES)}))
            .expect("serializes")
            .into(),
    };
    let mut elsewhere = Charge::default();
    assert!(BUFFERED_ANSWERS.grow(&mut elsewhere, BUFFERED_ANSWER_BUDGET), "the whole answer budget, held");
    shim.push(answer());
    let (status, code) = super::error_of(harness.post(&chat(MODEL, false)).await?).await?;
    assert_eq!((status, code.as_str()), (503, "server_busy"), "the router's own overload, not the workers'");
    let decode_errors = "disaggregated_errors_total{phase=\"decode\"}";
    assert_eq!(sample(&harness.metrics().await?, decode_errors), Some(0.0), "not counted against the workers");
    drop(elsewhere);
    shim.push(answer());
    let relayed = harness.post(&chat(MODEL, false)).await?;
    assert_eq!(relayed.status(), 200);
    let relayed: Value = serde_json::from_slice(&relayed.bytes().await?)?;
    assert_eq!(relayed["padding"].as_str().map(str::len), Some(2 * FREE_BYTES), "relayed whole, in order");
    eventually(PATIENCE, "the answer's room given back once written", || async { BUFFERED_ANSWERS.charged() == 0 })
        .await?;
    harness.stop().await;
    Ok(())
}
