use bytes::Bytes;

use super::{
    Lines, WITHHELD_ERROR_EVENT, carries_answer, carries_error_event, carries_event, ends_with_done_marker,
    engine_error, is_done_marker, sse_error_event, with_error_data, withhold_addresses,
};

/// An error event naming an internal address or a worker goes out in the router's words,
/// its line ending kept; every other line as it came, and a chunk with none uncopied.
#[test]
fn error_events_naming_an_address_are_relayed_in_the_routers_words() {
    let token = "data: {\"choices\":[{\"delta\":{\"content\":\"10.0.0.1\"}}]}\n\n";
    let named = "data: {\"error\":{\"message\":\"worker 10.4.0.12:9000 died\",\"code\":503}}\r\n\r\n";
    let plain = "data: {\"error\":{\"message\":\"Service temporarily unavailable\",\"code\":503}}\n\n";
    let spaced = "data: { \"error\": {\"message\": \"worker 10.4.0.13:9000 died\"}}\n\n";
    let events = Bytes::from(format!("{token}{named}{plain}{spaced}data: [DONE]\n\n"));
    let out = withhold_addresses(events);
    let text = String::from_utf8_lossy(&out);
    assert!(!text.contains("10.4.0.12") && !text.contains("10.4.0.13"), "{text}");
    let expected = format!("{token}{WITHHELD_ERROR_EVENT}\r\n\r\n{plain}{WITHHELD_ERROR_EVENT}\n\ndata: [DONE]\n\n");
    assert_eq!(text, expected, "a token's text is no error event: as it came");
    assert!(carries_error_event(&out), "still an error event");
    let fine = Bytes::from(plain);
    let same = withhold_addresses(fine.clone());
    assert_eq!(same.as_ptr(), fine.as_ptr(), "uncopied");
}

/// An error event's data is checked as a client reads it: a key written twice goes out as the
/// copy that was checked, and data spread over several `data:` lines is checked joined, and
/// goes as one line.
#[test]
fn an_error_events_data_is_checked_whole_as_a_client_reads_it() {
    let twice =
        Bytes::from_static(b"data: {\"error\":{\"message\":\"worker 10.4.0.12:9000 died\",\"message\":\"x\"}}\n\n");
    assert_eq!(&withhold_addresses(twice)[..], b"data: {\"error\":{\"message\":\"x\"}}\n\n");
    let split_address = Bytes::from_static(
        b"data: {\"error\":{\"message\":\"boom\",\r\ndata: \"upstream\":\"10.0.0.7:8000\"}}\r\n\r\n",
    );
    assert!(carries_error_event(&split_address));
    let out = withhold_addresses(split_address);
    assert_eq!(String::from_utf8_lossy(&out), format!("{WITHHELD_ERROR_EVENT}\r\n\r\n"));
    let opened_late = Bytes::from_static(b"data: {\ndata: \"error\":{\"message\":\"at 10.0.0.7:8000\"}}\n\n");
    assert!(carries_error_event(&opened_late), "an error event, however its lines fall");
    assert!(!carries_answer(&opened_late), "no answer: the first token is still to come");
    assert_eq!(String::from_utf8_lossy(&withhold_addresses(opened_late)), format!("{WITHHELD_ERROR_EVENT}\n\n"));
    let readable = Bytes::from_static(b"data: {\"error\":\ndata:  {\"message\":\"out of memory\"}}\n\n");
    assert_eq!(&withhold_addresses(readable)[..], b"data: {\"error\":{\"message\":\"out of memory\"}}\n\n", "one line");
}

/// A shim (or a proxy in front of it) whose keep-alive comments come faster than they are
/// relayed never leaves its body pending, where the idle deadline is otherwise polled: the
/// stream ends at the deadline all the same.
#[tokio::test]
async fn comments_that_never_let_the_body_wait_still_end_the_stream_at_the_idle_deadline() -> anyhow::Result<()> {
    use std::time::Duration;

    use http_body_util::BodyExt;
    use tokio::io::AsyncWriteExt;

    use super::super::breaker::{ShimExchange, ShimHealth};
    use super::super::connections::{Conn, READ_CHUNK};
    use super::super::pool::ShimReplica;
    use super::super::shim_body::ShimBody;
    use super::super::wire::Framing;
    use super::RelayBody;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let (client, accepted) = tokio::join!(tokio::net::TcpStream::connect(listener.local_addr()?), listener.accept());
    let (mut server, _) = accepted?;
    // Many reads' worth, all sent at once: every read of the relay finds more waiting.
    let comments = ":\n\n".repeat(8 * READ_CHUNK / 3);
    let writer = tokio::spawn(async move { server.write_all(comments.as_bytes()).await.map(|()| server) });
    let shim = ShimExchange::new(
        &ShimHealth::default(),
        &ShimReplica::for_tests("shim", "http://a"),
        std::time::Instant::now(),
    );
    let idle = Duration::from_millis(50);
    let inner = ShimBody::new(Conn::new(client?), Framing::UntilClose, None);
    let first = prometheus::Histogram::with_opts(prometheus::HistogramOpts::new("first", "first"))?;
    let counted = (prometheus::IntCounter::new("failed", "failed")?, (first, tokio::time::Instant::now()));
    let mut body = RelayBody::new(inner, idle, (None, shim), counted);
    let first = body.frame().await.and_then(|frame| frame.ok()?.into_data().ok());
    assert!(first.is_some_and(|data| data.starts_with(b":\n\n")), "comments are relayed");
    tokio::time::sleep(idle * 3).await;
    let next = body.frame().await.and_then(|frame| frame.ok()?.into_data().ok()).unwrap_or_default();
    let text = String::from_utf8_lossy(&next);
    assert!(
        text.contains("stream_timeout"),
        "the stream ends at its idle deadline, not with more comments: {text:.40}"
    );
    assert!(body.frame().await.is_none(), "and nothing follows");
    writer.abort();
    Ok(())
}

/// What each piece fed in turn releases: the prefix that ends an event, if any.
fn releases(pieces: &[&[u8]]) -> Vec<Option<usize>> {
    let mut lines = Lines::default();
    pieces.iter().map(|piece| lines.feed(piece)).collect()
}

#[test]
fn an_event_ends_at_a_blank_line_whatever_its_line_endings_and_wherever_the_frames_break() {
    type Row = (&'static [&'static [u8]], &'static [Option<usize>]);
    let rows: [Row; 10] = [
        (&[b"data: {}\n\n"], &[Some(10)]),
        (&[b"data: {}\r\n\r\n"], &[Some(12)]),
        (&[b"data: x\r\r"], &[Some(9)]),
        (&[b"data: a\n\ndata: b\n\ndata: c"], &[Some(18)]),
        (&[b"data: {\"choices\":[{\"ind"], &[None]),
        (&[b"data: {}\n"], &[None]),
        (&[b"data: {}\r\n"], &[None]),
        // The blank line split across frames: it ends the event in the frame it ends in.
        (&[b"data: {}\n", b"\ndata: next"], &[None, Some(1)]),
        // A CRLF split after its CR: the LF that follows is no second line ending.
        (&[b"data: {}\r", b"\n", b"\r\n"], &[None, None, Some(2)]),
        (&[b"data: a\n\r", b"\ndata: b"], &[Some(9), None]),
    ];
    for (pieces, expected) in rows {
        assert_eq!(releases(pieces), expected, "{pieces:?}");
    }
}

#[test]
fn only_a_data_line_opening_with_an_error_member_is_an_error_event() {
    let frontend_503 = b"data: {\"error\":{\"message\":\"Service temporarily unavailable\",\"type\":\"service_unavailable\",\"code\":503}}\n\ndata: [DONE]\n\n";
    assert!(carries_error_event(frontend_503));
    assert!(carries_error_event(b"data: {\"id\":1}\n\ndata:{\"error\":\"x\"}\r\n\r\n"));
    assert!(carries_error_event(b"data: {\"id\":1}\r\rdata: {\"error\":\"x\"}\r\r"), "CR-only lines");
    assert!(carries_error_event(b"data: { \"error\" : {\"message\":\"x\"}}\n\n"), "white space in the JSON");
    for fine in [
        &b"data: {\"choices\":[{\"delta\":{\"content\":\"error\"}}]}\n\n"[..],
        b"data: {\"choices\":[{\"delta\":{\"content\":\"{\\\"error\\\"\"}}]}\n\n",
        b": {\"error\": a comment}\n\n",
        b"event: errors\ndata: {}\n\n",
        b"event: message\ndata: {}\n\n",
    ] {
        assert!(!carries_error_event(fine), "{:?}", String::from_utf8_lossy(fine));
    }
    for named in [&b"event: error\n: Remote prefill failed\n\n"[..], b"event:error\r\n\r\n"] {
        assert!(carries_error_event(named), "{:?}", String::from_utf8_lossy(named));
    }
}

/// An event named `error` carries its words in `data:` lines of any shape, all of them
/// checked, and one that names an address goes as one line of the router's in place of
/// all its `data:` lines; a token's text in another event of the same read is not checked.
#[test]
fn every_data_line_of_an_event_named_error_is_checked_for_addresses() {
    let token = "data: {\"choices\":[{\"delta\":{\"content\":\"ssh 10.0.0.1:22\"}}]}\r\n\r\n";
    let typed = "event: error\r\ndata: {\"type\":\"error\",\"message\":\"connect 10.4.0.12:9000 refused\"}\r\n\r\n";
    let late_name = "data: worker 10.4.0.13:9000 died\ndata: again\nevent: error\n\n";
    let plain = "event: error\ndata: the engine ran out of memory\n\n";
    let events = Bytes::from(format!("{token}{typed}{late_name}{plain}"));
    let out = String::from_utf8_lossy(&withhold_addresses(events)).into_owned();
    let expected =
        format!("{token}event: error\r\n{WITHHELD_ERROR_EVENT}\r\n\r\n{WITHHELD_ERROR_EVENT}\nevent: error\n\n{plain}");
    assert_eq!(out, expected, "a token's text passes; each error event's address does not");
    let fine = Bytes::from(format!("{token}{plain}"));
    assert_eq!(withhold_addresses(fine.clone()).as_ptr(), fine.as_ptr(), "nothing named: uncopied");
}

/// An event named `error` an OpenAI client cannot read (its words in comments, as a later
/// frontend sends them, or in data that is no JSON error) goes whole, the router's unnamed
/// error event in its place saying its words, those naming an address left out; the events
/// around it, the closing marker among them, go as they came.
#[test]
fn an_error_event_clients_cannot_read_is_replaced_by_the_routers_saying_its_words() {
    let routers =
        |words: &str| String::from_utf8_lossy(&sse_error_event("backend_failed", &engine_error(words))).into_owned();
    let named = Bytes::from_static(
        b"event: error\n: Remote prefill failed: nvext.prefill_worker_id=7668682560356784121 does not identify a known worker at 10.4.0.12:9000\n\n",
    );
    let out = String::from_utf8_lossy(&with_error_data(withhold_addresses(named))).into_owned();
    assert_eq!(out, routers(""), "its only words withheld: the router's alone");
    let plain = "event: error\n: Stream ended before generation completed\n\n";
    let closed = Bytes::from(format!("data: {{\"choices\":[]}}\n\n{plain}data: [DONE]\n\n"));
    assert_eq!(withhold_addresses(closed.clone()), closed, "nothing named: uncopied");
    let out = String::from_utf8_lossy(&with_error_data(closed)).into_owned();
    let said = routers("Stream ended before generation completed");
    assert_eq!(out, format!("data: {{\"choices\":[]}}\n\n{said}data: [DONE]\n\n"));
    assert!(said.contains(r#""message":"The model server reported an error in the stream: Stream ended"#), "{said}");
    // Words as plain data, or as JSON of another shape, are no error a client reads; the
    // CRLFs of the events around one replaced are kept whole.
    let crlf = "data: {}\r\n\r\nevent: error\r\n: gone\r\n\r\ndata: [DONE]\r\n\r\n";
    let out = with_error_data(Bytes::from(crlf));
    assert_eq!(String::from_utf8_lossy(&out), format!("data: {{}}\r\n\r\n{}data: [DONE]\r\n\r\n", routers("gone")));
    for (event, words) in [
        ("event: error\r\ndata: the engine ran out of memory\r\n\r\n", "the engine ran out of memory"),
        ("data: {\"type\":\"error\"}\nevent: error\n\n", r#"{"type":"error"}"#),
    ] {
        let out = with_error_data(Bytes::from(event));
        assert_eq!(String::from_utf8_lossy(&out), routers(words), "{event:?}");
    }
    // One that carries its words as an error's data needs nothing more.
    let with_data = Bytes::from_static(b"event: error\ndata: {\"error\":{\"message\":\"x\"}}\n\n");
    assert_eq!(with_error_data(with_data.clone()), with_data);
}

/// An error event is no answer, whatever its data's shape; a token beside it is.
#[test]
fn an_error_event_of_any_shape_is_no_answer() {
    let token = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
    for errors in [
        "data: {\"error\":{\"message\":\"x\"}}\n\ndata: [DONE]\n\n",
        "event: error\ndata: the engine ran out of memory\n\n",
        "data: {\"type\":\"error\"}\r\nevent: error\r\n\r\n: ping\n\n",
        "event: error\n: words in comments\n\n",
    ] {
        assert!(!carries_answer(errors.as_bytes()), "{errors:?}");
        assert!(carries_answer(format!("{errors}{token}").as_bytes()), "{errors:?} then a token");
    }
    assert!(carries_answer(b"event: message\ndata: {\"choices\":[]}\n\n"), "an event of another name");
}

#[test]
fn whole_events_end_with_the_closing_marker_only_when_their_last_event_line_is_it() {
    let cases: [(&[u8], bool); 8] = [
        (b"data: [DONE]\n\n", true),
        // A keep-alive comment after the marker, in the same read, hides nothing.
        (b"data: [DONE]\n\n:\n\n", true),
        (b"data: [DONE]\n\n: ping\r\n\r\n", true),
        (b"data: {\"choices\":[]}\n\ndata: [DONE]\r\n\r\n", true),
        (b"data:[DONE]\r\r", true),
        (b"data: [DONE]\n\ndata: {\"choices\":[]}\n\n", false),
        (b"data: {\"content\":\"data: [DONE]\"}\n\n", false),
        (b"data: {\"choices\":[]}\n\n", false),
    ];
    for (events, closed) in cases {
        assert_eq!(ends_with_done_marker(events), closed, "{:?}", String::from_utf8_lossy(events));
    }
}

#[test]
fn only_a_data_line_of_done_is_the_closing_marker() {
    for done in [&b"data: [DONE]"[..], b"data:[DONE]\r\n", b"data: [DONE]\n"] {
        assert!(is_done_marker(done), "{:?}", String::from_utf8_lossy(done));
    }
    for done in [&b": keep-alive\ndata: [DONE]"[..], b":\r\ndata: [DONE]\r\n"] {
        assert!(is_done_marker(done), "after a comment: {:?}", String::from_utf8_lossy(done));
    }
    for other in
        [&b"data: [DONE] x"[..], b"data: {\"a\":1}", b": [DONE]", b"event: [DONE]", b"data: {\"a\":1}\ndata: [DONE]"]
    {
        assert!(!is_done_marker(other), "{:?}", String::from_utf8_lossy(other));
    }
}

/// What a client's SSE reader dispatches is an event: data (or an event named `error`, which
/// the router turns into one). Comments, and blocks of other fields alone, are none: they
/// neither keep a stalled stream open nor mark its first token.
#[test]
fn only_events_with_data_are_events() {
    for quiet in [&b":\n\n"[..], b": keep-alive\r\n\r\n", b"", b"\n", b":\n\n:\n\n"] {
        assert!(!carries_event(quiet), "{:?}", String::from_utf8_lossy(quiet));
    }
    for quiet in [&b": a\r\r"[..], b":\r:\r\r"] {
        assert!(!carries_event(quiet), "CR-only lines: {:?}", String::from_utf8_lossy(quiet));
    }
    for fields in [&b"id: 1\n\n"[..], b"retry: 1000\n\n", b"event: ping\n\n", b" \n\n", b"\"}]}\n\n", b"dataX: 1\n\n"] {
        assert!(!carries_event(fields), "no data: {:?}", String::from_utf8_lossy(fields));
        assert!(!carries_answer(fields), "no answer: {:?}", String::from_utf8_lossy(fields));
    }
    for event in
        [&b"data: {}\n\n"[..], b":\n\ndata: [DONE]\n\n", b"data\n\n", b"event: error\r\n", b": ka\rdata: {}\r\r"]
    {
        assert!(carries_event(event), "{:?}", String::from_utf8_lossy(event));
    }
}

/// An unfinished event past what a small body holds free is charged to the process's budget
/// for buffered answers while it is held, and the charge comes back as the event is relayed;
/// with no room in the budget, the stream ends with the router's own busy error, blaming no one.
#[tokio::test]
async fn an_unfinished_event_is_charged_while_held_and_refused_past_the_budget() -> anyhow::Result<()> {
    use std::time::Duration;

    use http_body_util::BodyExt;
    use tokio::io::AsyncWriteExt;

    use super::super::breaker::{ShimExchange, ShimHealth};
    use super::super::connections::Conn;
    use super::super::pool::ShimReplica;
    use super::super::shim_body::ShimBody;
    use super::super::wire::Framing;
    use super::RelayBody;
    use crate::memory::{BUFFERED_ANSWERS, Charge, FILLING, FREE_BYTES};

    let _turn = FILLING.lock().await;
    let event_start = format!("data: {{\"x\":\"{}", "x".repeat(2 * FREE_BYTES));
    for room in [true, false] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let (client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(listener.local_addr()?), listener.accept());
        let (mut server, _) = accepted?;
        let shim = ShimExchange::new(
            &ShimHealth::default(),
            &ShimReplica::for_tests("shim", "http://a"),
            std::time::Instant::now(),
        );
        let inner = ShimBody::new(Conn::new(client?), Framing::UntilClose, None);
        let first = prometheus::Histogram::with_opts(prometheus::HistogramOpts::new("first", "first"))?;
        let failed = prometheus::IntCounter::new("failed", "failed")?;
        let counted = (failed.clone(), (first, tokio::time::Instant::now()));
        let mut body = RelayBody::new(inner, Duration::from_secs(30), (None, shim), counted);
        // All of the budget but what a free body holds, taken by others.
        let (baseline, mut others) = (BUFFERED_ANSWERS.charged(), Charge::default());
        if !room {
            let rest = crate::memory::BUFFERED_ANSWER_BUDGET - baseline - FREE_BYTES;
            assert!(BUFFERED_ANSWERS.grow(&mut others, rest));
        }
        let before = BUFFERED_ANSWERS.charged();
        server.write_all(b"data: {}\n\n").await?;
        let relayed = body.frame().await.and_then(|frame| frame.ok()?.into_data().ok()).unwrap_or_default();
        assert_eq!(&relayed[..], b"data: {}\n\n");
        server.write_all(event_start.as_bytes()).await?;
        if room {
            server.write_all(b"\"}\n\n").await?;
            let relayed = body.frame().await.and_then(|frame| frame.ok()?.into_data().ok()).unwrap_or_default();
            assert_eq!(relayed.len(), event_start.len() + 4, "the event, whole");
            assert_eq!(BUFFERED_ANSWERS.charged(), before, "its charge came back as it was relayed");
            // Held, it was charged: a second one, left unfinished, is.
            server.write_all(event_start.as_bytes()).await?;
            let pending = tokio::time::timeout(Duration::from_millis(200), body.frame()).await;
            assert!(pending.is_err(), "nothing whole to relay");
            assert!(BUFFERED_ANSWERS.charged() > before + FREE_BYTES, "held past the free part, charged");
        } else {
            let next = body.frame().await.and_then(|frame| frame.ok()?.into_data().ok()).unwrap_or_default();
            let text = String::from_utf8_lossy(&next);
            assert!(text.contains("server_busy"), "{text:.80}");
            assert!(body.frame().await.is_none(), "and nothing follows");
            assert_eq!(failed.get(), 1, "counted as a failed stream");
        }
        drop((body, others));
        assert_eq!(BUFFERED_ANSWERS.charged(), baseline, "every charge came back");
    }
    Ok(())
}
