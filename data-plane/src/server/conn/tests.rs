use tokio::net::TcpListener;

use super::*;

/// The calls of a server that never closes nor becomes crowded.
fn never_closing() -> std::future::Pending<IdleCall> {
    std::future::pending()
}

/// A gauge of waiting connections no one reads.
fn waiting() -> IntGauge {
    IntGauge::new("waiting", "waiting").expect("a valid gauge")
}

/// A client that reads nothing: the first writes fill the sockets' buffers, then the
/// deadline (on the paused clock, which jumps ahead while the runtime idles) ends the wait.
#[tokio::test(start_paused = true)]
async fn a_client_that_stops_reading_is_not_waited_on() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let _reader_that_never_reads = TcpStream::connect(listener.local_addr()?).await?;
    let (mut server, _) = listener.accept().await?;
    let chunk = vec![b'x'; 1 << 20];
    let started = tokio::time::Instant::now();
    let outcome = loop {
        if let Err(error) = write_unless_stalled(&mut server, &chunk, &mut Patience::default()).await {
            break error;
        }
    };
    assert_eq!(outcome.kind(), io::ErrorKind::TimedOut);
    assert!(started.elapsed() >= WRITE_STALL_TIMEOUT, "it waited out the deadline first");
    Ok(())
}

/// A client that reads a little now and then, never pausing for the stall timeout, is
/// still dropped once it falls below the minimum rate.
#[tokio::test(start_paused = true)]
async fn a_client_that_barely_reads_is_not_waited_on() -> io::Result<()> {
    const BUFFER: u32 = 16 << 10;
    let listener = tokio::net::TcpSocket::new_v4()?;
    listener.set_send_buffer_size(BUFFER)?;
    listener.bind("127.0.0.1:0".parse().map_err(io::Error::other)?)?;
    let listener = listener.listen(1)?;
    let client = tokio::net::TcpSocket::new_v4()?;
    client.set_recv_buffer_size(BUFFER)?;
    let mut client = client.connect(listener.local_addr()?).await?;
    let (mut server, _) = listener.accept().await?;
    let trickle = tokio::spawn(async move {
        let mut buffer = vec![0; 64 << 10];
        while client.read(&mut buffer).await.is_ok_and(|n| n > 0) {
            tokio::time::sleep(WRITE_STALL_TIMEOUT / 4).await;
        }
    });
    let answer = vec![b'x'; 8 << 20];
    let started = tokio::time::Instant::now();
    let outcome = write_unless_stalled(&mut server, &answer, &mut Patience::default()).await;
    assert_eq!(outcome.map_err(|e| e.kind()), Err(io::ErrorKind::TimedOut));
    let allowed = WRITE_STALL_TIMEOUT + transfer_time(answer.len());
    assert!(started.elapsed() >= allowed - WRITE_STALL_TIMEOUT / 4, "{:?} of {allowed:?}", started.elapsed());
    assert!(started.elapsed() <= allowed, "{:?} of {allowed:?}", started.elapsed());
    trickle.abort();
    Ok(())
}

/// A stream's client that reads a little before each wait would time out is dropped all the
/// same once its waits add up: the patience is the response's, not each write's.
#[test]
fn a_responses_waits_on_its_client_add_up() {
    let second = Duration::from_secs(1);
    let mut patience = Patience::default();
    assert_eq!(patience.allow(4096, true), WRITE_STALL_TIMEOUT, "no wait past the stall timeout");
    patience.spend(WRITE_STALL_TIMEOUT - second);
    // The next event's write: what is left, and its bytes' time.
    let left = patience.allow(4096, true);
    assert!(left > second && left < 2 * second, "{left:?} left");
    patience.spend(left);
    assert_eq!(patience.allow(0, false), Duration::ZERO);
    // A large answer's write is granted its bytes' time at the minimum rate.
    let mut patience = Patience::default();
    let large = 64 * MIN_WRITE_BYTES_PER_SECOND as usize;
    patience.allow(large, true);
    patience.spend(WRITE_STALL_TIMEOUT);
    // 64 s left: a wait of 60 at most, then the rest; granted once per write, not per wait.
    assert_eq!(patience.allow(large, false), WRITE_STALL_TIMEOUT);
    patience.spend(WRITE_STALL_TIMEOUT);
    assert_eq!(patience.allow(large, false), Duration::from_secs(4));
}

/// Sends a head announcing a body of `body` bytes, then `step` bytes of it every `every`.
fn trickle(client: TcpStream, body: usize, step: usize, every: Duration) -> tokio::task::JoinHandle<TcpStream> {
    let mut client = client;
    tokio::spawn(async move {
        let head = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-length: {body}\r\n\r\n");
        let _ = client.write_all(head.as_bytes()).await;
        let mut sent = 0;
        while sent < body {
            tokio::time::sleep(every).await;
            let part = step.min(body - sent);
            if client.write_all(&vec![b'x'; part]).await.is_err() {
                break;
            }
            sent += part;
        }
        client
    })
}

/// A large body on a slow uplink takes longer than the request read timeout, and arrives:
/// each byte read earns its time at the minimum rate. A client that trickles a few bytes
/// earns next to nothing and is refused at about the timeout.
#[tokio::test(start_paused = true)]
async fn a_slow_upload_may_take_its_bytes_time_and_a_trickle_may_not() -> io::Result<()> {
    // Not while another test fills the budget for large bodies: bytes would earn nothing.
    let _turn = crate::memory::FILLING.lock().await;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    // 4 MiB at 128 KiB/s: 32 s, past the timeout, well within the time its bytes earn.
    let body = 4 << 20;
    let sending =
        trickle(TcpStream::connect(listener.local_addr()?).await?, body, 64 << 10, Duration::from_millis(500));
    let (server, _) = listener.accept().await?;
    let started = tokio::time::Instant::now();
    let metrics = Metrics::new().expect("metrics");
    let mut conn = Connection::new(server, &metrics);
    let Ok((_, read, _)) = conn.read_request(std::pin::pin!(never_closing()), false, &waiting()).await else {
        panic!("a request")
    };
    assert_eq!(read.len(), body);
    assert!(started.elapsed() > REQUEST_READ_TIMEOUT, "{:?}: the upload outlasted the timeout", started.elapsed());
    drop(sending.await);

    let sending = trickle(TcpStream::connect(listener.local_addr()?).await?, body, 100, Duration::from_secs(5));
    let (server, _) = listener.accept().await?;
    let started = tokio::time::Instant::now();
    let metrics = Metrics::new().expect("metrics");
    let mut conn = Connection::new(server, &metrics);
    let refused = conn.read_request(std::pin::pin!(never_closing()), false, &waiting()).await;
    assert!(matches!(refused, Err(Stop::Refuse(HeadError::Timeout))), "a trickle is timed out");
    let waited = started.elapsed();
    assert!(waited >= REQUEST_READ_TIMEOUT && waited < REQUEST_READ_TIMEOUT + Duration::from_secs(1), "{waited:?}");
    sending.abort();
    Ok(())
}

/// A client that sent most of a large body at once and then stopped is refused once its
/// bytes have stopped for the stall timeout, not when the time they earned runs out (minutes
/// later, its buffer charged against the budget for large bodies all the while); while the
/// server is crowded, a head begun with one byte is refused after the crowded idle timeout.
#[tokio::test(start_paused = true)]
async fn a_request_whose_bytes_stop_is_refused_after_the_stall_timeout() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let body = 4 << 20;
    let mut client = TcpStream::connect(listener.local_addr()?).await?;
    let (server, _) = listener.accept().await?;
    let head = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-length: {body}\r\n\r\n");
    let sending = tokio::spawn(async move {
        client.write_all(head.as_bytes()).await?;
        client.write_all(&vec![b'x'; body - 1]).await?;
        // And nothing more: held open until the test ends.
        std::future::pending::<io::Result<TcpStream>>().await
    });
    let metrics = Metrics::new().expect("metrics");
    let mut conn = Connection::new(server, &metrics);
    let started = tokio::time::Instant::now();
    let refused = conn.read_request(std::pin::pin!(never_closing()), false, &waiting()).await;
    assert!(matches!(refused, Err(Stop::Refuse(HeadError::Timeout))), "refused when its bytes stopped");
    let waited = started.elapsed();
    assert!(waited >= READ_STALL_TIMEOUT && waited < REQUEST_READ_TIMEOUT, "{waited:?}");
    sending.abort();

    let mut client = TcpStream::connect(listener.local_addr()?).await?;
    let (server, _) = listener.accept().await?;
    client.write_all(b"P").await?;
    let metrics = Metrics::new().expect("metrics");
    let mut conn = Connection::new(server, &metrics);
    let started = tokio::time::Instant::now();
    let refused = conn.read_request(std::pin::pin!(never_closing()), true, &waiting()).await;
    assert!(matches!(refused, Err(Stop::Refuse(HeadError::Timeout))), "a head begun and stopped");
    let waited = started.elapsed();
    assert!(waited >= CROWDED_IDLE_TIMEOUT && waited < READ_STALL_TIMEOUT, "{waited:?}");
    Ok(())
}

/// What a request's bytes earn is capped at its largest size: a chunked body padded with
/// framing (each byte of body behind a 4 KiB chunk extension) earns no more time than a whole
/// body of the largest size, instead of days at the minimum rate.
#[test]
fn a_request_earns_time_for_no_more_bytes_than_its_largest_size() {
    let _turn = crate::memory::FILLING.blocking_lock();
    let mut deadline = ReadDeadline::from_now();
    let longest = deadline.start
        + REQUEST_READ_TIMEOUT
        + Duration::from_millis(MAX_READ_CREDIT as u64 * 1000 / MIN_READ_BYTES_PER_SECOND);
    deadline.received(MAX_REQUEST_BODY_BYTES);
    assert!(deadline.at() < longest, "a whole body earns its time");
    for _ in 0..8 << 20 {
        deadline.received(4 << 10);
    }
    assert_eq!(deadline.at(), longest, "32 GiB of framing earns no more than the cap");
    assert!(longest - deadline.start < Duration::from_secs(200), "{:?}", longest - deadline.start);
}

/// While more than half the budget for large bodies is charged, a request's bytes earn it no
/// time: each must arrive within the timeout of its first byte, and holds its room no longer.
#[tokio::test]
async fn under_pressure_on_the_body_budget_bytes_earn_no_time() {
    let _turn = crate::memory::FILLING.lock().await;
    let mut deadline = ReadDeadline::from_now();
    deadline.received(4 << 20);
    let earned = deadline.at();
    assert!(earned > deadline.start + REQUEST_READ_TIMEOUT + Duration::from_secs(60), "4 MiB earn a minute");
    let mut others = Charge::default();
    assert!(REQUEST_BODIES.grow(&mut others, crate::memory::REQUEST_BODY_BUDGET / 2 + 1));
    assert_eq!(deadline.at(), deadline.start + REQUEST_READ_TIMEOUT, "nothing earned under pressure");
    drop(others);
    assert_eq!(deadline.at(), earned, "earned again once the room is back");
}

/// A body's last read takes little past it: a client that sends megabytes behind its body
/// does not get them read (uncharged) into the buffer while its response runs.
#[tokio::test]
async fn a_bodys_reads_stop_a_read_past_its_end() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let mut client = TcpStream::connect(listener.local_addr()?).await?;
    let (server, _) = listener.accept().await?;
    let body = 100 << 10;
    let mut request =
        format!("POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-length: {body}\r\n\r\n").into_bytes();
    request.extend(std::iter::repeat_n(b'x', body + (1 << 20)));
    let sending = tokio::spawn(async move {
        let _ = client.write_all(&request).await;
        client
    });
    // Everything is sent (or sits in the sockets' buffers) before the server reads.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let metrics = Metrics::new().expect("metrics");
    let mut conn = Connection::new(server, &metrics);
    let Ok((_, read, _)) = conn.read_request(std::pin::pin!(never_closing()), false, &waiting()).await else {
        panic!("a request")
    };
    assert_eq!(read.len(), body);
    assert!(conn.read.len() <= READ_CHUNK, "{} bytes read past the body", conn.read.len());
    sending.abort();
    Ok(())
}

/// A request with a large head grows the connection's read buffer; once it is read, the
/// buffer is let go, so the idle connection that follows holds no more than a fresh one.
#[tokio::test]
async fn a_large_request_head_leaves_no_large_buffer_behind() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let mut client = TcpStream::connect(listener.local_addr()?).await?;
    let (server, _) = listener.accept().await?;
    let filler = "x".repeat(40 << 10);
    let request = format!("POST /v1/models HTTP/1.1\r\nhost: r\r\nx-filler: {filler}\r\ncontent-length: 2\r\n\r\n{{}}");
    client.write_all(request.as_bytes()).await?;
    let metrics = Metrics::new().expect("metrics");
    let mut conn = Connection::new(server, &metrics);
    let Ok((_, body, _)) = conn.read_request(std::pin::pin!(never_closing()), false, &waiting()).await else {
        panic!("a request")
    };
    assert_eq!(&body[..], b"{}");
    assert!(conn.read.is_empty());
    assert!(!conn.read.try_reclaim(READ_CHUNK + 1), "the 40 KiB the head took is given back");
    Ok(())
}

/// A head that arrives in two parts doubles the read buffer past the kept size though the
/// request is smaller: the buffer is let go all the same.
#[tokio::test]
async fn a_request_under_the_kept_size_that_doubled_the_buffer_leaves_no_large_buffer_behind() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let mut client = TcpStream::connect(listener.local_addr()?).await?;
    let (server, _) = listener.accept().await?;
    let filler = "x".repeat(KEPT_READ_CAPACITY - (2 << 10));
    let head = format!("GET /v1/models HTTP/1.1\r\nhost: r\r\nx-filler: {filler}\r\n");
    client.write_all(head.as_bytes()).await?;
    let metrics = Metrics::new().expect("metrics");
    let mut conn = Connection::new(server, &metrics);
    while conn.read.len() < head.len() {
        conn.fill_at_most(usize::MAX).await?;
    }
    client.write_all(format!("x-more: {}\r\n\r\n", "y".repeat(1 << 10)).as_bytes()).await?;
    let Ok((head, _, _)) = conn.read_request(std::pin::pin!(never_closing()), false, &waiting()).await else {
        panic!("a request")
    };
    assert_eq!(head.target, "/v1/models");
    assert!(!conn.read.try_reclaim(KEPT_READ_CAPACITY + 1), "the doubled buffer is given back");
    Ok(())
}

/// A large head's buffer is let go once the head is read: a body trickling behind it does not
/// keep the tens of kilobytes its head took, on each of thousands of connections.
#[tokio::test]
async fn a_large_heads_buffer_is_let_go_before_its_body_arrives() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let mut client = TcpStream::connect(listener.local_addr()?).await?;
    let (server, _) = listener.accept().await?;
    let filler = "x".repeat(40 << 10);
    let sent = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\nx-filler: {filler}\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"
    );
    client.write_all(sent.as_bytes()).await?;
    let metrics = Metrics::new().expect("metrics");
    let mut conn = Connection::new(server, &metrics);
    while conn.read.len() < sent.len() {
        conn.fill_at_most(usize::MAX).await?;
    }
    assert!(conn.read.capacity() > KEPT_READ_CAPACITY, "the head took a large buffer");
    let (closing, waiting) = (std::pin::pin!(never_closing()), waiting());
    let reading = conn.read_request(closing, false, &waiting);
    // Everything sent is read already: the request now waits for the rest of its body.
    assert!(tokio::time::timeout(Duration::from_millis(100), reading).await.is_err(), "the body goes on");
    assert!(!conn.read.try_reclaim(KEPT_READ_CAPACITY + 1), "the head's buffer is given back");
    Ok(())
}

/// A head that never ends is refused past its bound, its buffer grown to no more than the
/// bound and a read: not doubled to twice the bound, for every connection a client opens.
#[tokio::test]
async fn a_head_that_never_ends_grows_its_buffer_no_further_than_the_bound() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let mut client = TcpStream::connect(listener.local_addr()?).await?;
    let (server, _) = listener.accept().await?;
    let head = format!("GET /v1/models HTTP/1.1\r\nx-filler: {}", "x".repeat(2 * MAX_HEAD_BYTES));
    let writer = tokio::spawn(async move { client.write_all(head.as_bytes()).await.map(|()| client) });
    let metrics = Metrics::new().expect("metrics");
    let mut conn = Connection::new(server, &metrics);
    let refused = conn.read_request(std::pin::pin!(never_closing()), false, &waiting()).await;
    assert!(matches!(refused, Err(Stop::Refuse(HeadError::TooLarge))), "refused past the bound");
    assert!(conn.read.len() > MAX_HEAD_BYTES, "read up to the bound: {}", conn.read.len());
    assert!(conn.read.capacity() <= MAX_HEAD_BYTES + READ_CHUNK, "{} held", conn.read.capacity());
    writer.abort();
    Ok(())
}

/// Blank lines pipelined behind a request are skipped, and the room they took is given back
/// before the connection idles.
#[tokio::test]
async fn blank_lines_pipelined_behind_a_request_leave_no_large_buffer_behind() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let mut client = TcpStream::connect(listener.local_addr()?).await?;
    let (server, _) = listener.accept().await?;
    let blank = "\r\n".repeat(32 << 10);
    let sent = format!("GET /v1/models HTTP/1.1\r\nhost: r\r\n\r\n{blank}");
    client.write_all(sent.as_bytes()).await?;
    let metrics = Metrics::new().expect("metrics");
    let mut conn = Connection::new(server, &metrics);
    while conn.read.len() < sent.len() {
        conn.fill_at_most(usize::MAX).await?;
    }
    let Ok((head, _, _)) = conn.read_request(std::pin::pin!(never_closing()), false, &waiting()).await else {
        panic!("a request")
    };
    assert_eq!(head.target, "/v1/models");
    assert!(conn.read.len() >= blank.len(), "the blank lines wait in the buffer");
    // The next request's wait: it skips them, then idles until the test stops waiting.
    let (closing, waiting) = (std::pin::pin!(never_closing()), waiting());
    let next = tokio::time::timeout(Duration::from_millis(50), conn.read_request(closing, false, &waiting));
    assert!(next.await.is_err(), "no request came");
    assert!(conn.read.is_empty());
    assert!(!conn.read.try_reclaim(KEPT_READ_CAPACITY + 1), "the 64 KiB of blank lines are given back");
    Ok(())
}

/// Requests pipelined behind a small one stay where they are read: the buffer is not copied
/// for each request taken from its front.
#[tokio::test]
async fn requests_pipelined_behind_a_small_one_are_not_copied_for_each() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let mut client = TcpStream::connect(listener.local_addr()?).await?;
    let (server, _) = listener.accept().await?;
    let request = "GET /v1/models HTTP/1.1\r\nhost: r\r\n\r\n";
    let pipelined = request.repeat((40 << 10) / request.len());
    client.write_all(pipelined.as_bytes()).await?;
    let metrics = Metrics::new().expect("metrics");
    let mut conn = Connection::new(server, &metrics);
    while conn.read.len() < pipelined.len() {
        conn.fill_at_most(usize::MAX).await?;
    }
    for _ in 0..3 {
        let before = conn.read.as_ptr();
        let Ok((head, _, _)) = conn.read_request(std::pin::pin!(never_closing()), false, &waiting()).await else {
            panic!("a request")
        };
        assert_eq!(head.target, "/v1/models");
        assert_eq!(conn.read.as_ptr(), before.wrapping_add(request.len()), "the rest was not moved");
    }
    Ok(())
}

/// A body announced by its length and sent in part holds no more than it is charged for.
#[tokio::test]
async fn a_body_uploading_is_held_in_no_more_room_than_it_is_charged_for() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let mut client = TcpStream::connect(listener.local_addr()?).await?;
    let (server, _) = listener.accept().await?;
    let length = (4 << 20) + (64 << 10);
    client
        .write_all(
            format!("POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-length: {length}\r\n\r\n").as_bytes(),
        )
        .await?;
    let writer = tokio::spawn(async move {
        let chunk = vec![b' '; 64 << 10];
        let mut sent = 0;
        while sent < length - 1 {
            let n = chunk.len().min(length - 1 - sent);
            client.write_all(&chunk[..n]).await?;
            sent += n;
        }
        Ok::<_, io::Error>(client)
    });
    let metrics = Metrics::new().expect("metrics");
    let mut conn = Connection::new(server, &metrics);
    let (closing, waiting) = (std::pin::pin!(never_closing()), waiting());
    let read = tokio::time::timeout(Duration::from_secs(2), conn.read_request(closing, false, &waiting));
    assert!(read.await.is_err(), "the body's last byte never came");
    let _client = writer.await.map_err(io::Error::other)??;
    assert_eq!(conn.read.len(), length - 1, "every byte sent was read");
    assert!(conn.read.capacity() <= length + READ_CHUNK, "{} held for a body of {length}", conn.read.capacity());
    Ok(())
}

#[tokio::test]
async fn a_reading_client_gets_every_byte() -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let mut client = TcpStream::connect(listener.local_addr()?).await?;
    let (mut server, _) = listener.accept().await?;
    let sent: Vec<u8> = (0..4 << 20).map(|i| (i % 251) as u8).collect();
    let reading = tokio::spawn(async move {
        let mut received = Vec::new();
        client.read_to_end(&mut received).await.map(|_| received)
    });
    write_unless_stalled(&mut server, &sent, &mut Patience::default()).await?;
    drop(server);
    let received = reading.await.map_err(io::Error::other)??;
    assert!(received == sent, "{} bytes of {} arrived, in order", received.len(), sent.len());
    Ok(())
}

/// A stream whose producer is far ahead of its client leaves its frames in the body, not in
/// the write buffer: one write gathers what is ready up to the buffer's bound, and no more.
#[test]
fn a_write_gathers_ready_frames_up_to_the_buffers_bound() {
    let event = Bytes::from(vec![b'x'; 1000]);
    let ready = futures::stream::iter((0..1000).map(move |_| Ok::<_, io::Error>(event.clone())));
    let mut body = Body::from_stream(ready);
    let mut frames = Frames::new(ResponseFraming::Chunked);
    let mut out = Vec::new();
    frames.gather_ready(&mut body, &mut out);
    assert!(!frames.ended, "the rest waits in the body");
    assert!(out.len() >= KEPT_WRITE_CAPACITY && out.len() < KEPT_WRITE_CAPACITY + 1024, "{} gathered", out.len());
}

/// An answer's body must be as long as the `Content-Length` written for it: one that ends
/// short, or runs past it, breaks the connection rather than frame the next answer wrongly.
#[test]
fn a_body_other_than_its_length_breaks_the_connection() {
    let data = |text: &'static str| Some(Ok(http_body::Frame::data(Bytes::from_static(text.as_bytes()))));
    let written = |parts: Vec<Frame>| {
        let (mut frames, mut out) = (Frames::new(ResponseFraming::Length(5)), Vec::new());
        for part in parts {
            frames.append(part, &mut out);
        }
        (String::from_utf8_lossy(&out).into_owned(), frames.ended, frames.broken)
    };
    assert_eq!(written(vec![data("abc"), data("de"), None]), ("abcde".into(), true, false));
    assert_eq!(written(vec![data("abc"), None]), ("abc".into(), true, true), "short");
    assert_eq!(written(vec![data("abc"), data("defg")]), ("abcde".into(), true, true), "past its length");
}
