//! The client against scripted peers over an in-memory pipe: the handshake, framing, and each
//! bound at its edge.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream, duplex};

use super::*;

const PIPE_BYTES: usize = 1 << 20;

fn pub_greeting() -> Vec<u8> {
    let mut g = wire::greeting().to_vec();
    g[32] = 1;
    g
}

fn ready(socket_type: &[u8]) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&u32::try_from(socket_type.len()).unwrap().to_be_bytes());
    body.extend_from_slice(socket_type);
    command(&body)
}

fn command(body: &[u8]) -> Vec<u8> {
    let mut out = vec![wire::FLAG_COMMAND, u8::try_from(body.len()).unwrap()];
    out.extend_from_slice(body);
    out
}

fn frame(more: bool, body: &[u8]) -> Vec<u8> {
    let flag = if more { wire::FLAG_MORE } else { 0 };
    let mut out = match u8::try_from(body.len()) {
        Ok(len) => vec![flag, len],
        Err(_) => {
            let mut header = vec![flag | wire::FLAG_LONG];
            header.extend_from_slice(&u64::try_from(body.len()).unwrap().to_be_bytes());
            header
        }
    };
    out.extend_from_slice(body);
    out
}

fn message(frames: &[&[u8]]) -> Vec<u8> {
    frames.iter().enumerate().flat_map(|(i, f)| frame(i + 1 < frames.len(), f)).collect()
}

fn kv_message(sequence: u8) -> Vec<u8> {
    message(&[b"kv_metrics", &[0, 0, 0, 0, 0, 0, 0, 9], &[0, 0, 0, 0, 0, 0, 0, sequence], &[1, 0, 0, 0, 0]])
}

/// A subscriber whose peer has already written `script` after its greeting and READY.
async fn subscriber(script: &[u8]) -> (Result<ZmtpSubscriber<DuplexStream>, ZmtpError>, DuplexStream) {
    subscriber_with(ZmtpLimits::KV_METRICS, script).await
}

async fn subscriber_with(
    limits: ZmtpLimits,
    script: &[u8],
) -> (Result<ZmtpSubscriber<DuplexStream>, ZmtpError>, DuplexStream) {
    subscriber_of(1, limits, script).await
}

/// [`subscriber_with`], its large messages borrowing against `borrower`'s share.
async fn subscriber_of(
    borrower: u64,
    limits: ZmtpLimits,
    script: &[u8],
) -> (Result<ZmtpSubscriber<DuplexStream>, ZmtpError>, DuplexStream) {
    let (ours, mut peer) = duplex(PIPE_BYTES);
    let mut bytes = pub_greeting();
    bytes.extend(ready(b"PUB"));
    bytes.extend_from_slice(script);
    peer.write_all(&bytes).await.unwrap();
    (ZmtpSubscriber::handshake(ours, limits, b"kv_metrics", borrower).await, peer)
}

async fn next_message(session: &mut ZmtpSubscriber<DuplexStream>) -> Result<Vec<Vec<u8>>, String> {
    match session.recv().await {
        Ok(Incoming::Message(m)) => Ok((0..m.len()).map(|i| m.frame(i).unwrap().to_vec()).collect()),
        Ok(Incoming::Dropped(d)) => Err(format!("dropped {d:?}")),
        Err(e) => Err(format!("error {e}")),
    }
}

#[tokio::test]
async fn the_handshake_sends_greeting_ready_as_sub_and_a_zmtp30_subscription() {
    let (session, mut peer) = subscriber(&kv_message(0)).await;
    let mut session = session.unwrap();
    let mut sent = vec![0u8; 64 + 27 + 13];
    peer.read_exact(&mut sent).await.unwrap();
    assert_eq!(&sent[..64], &wire::greeting()[..]);
    assert_eq!(&sent[10..12], &[3, 0], "ZMTP 3.0, so the PUB expects subscription messages");
    assert_eq!(&sent[12..16], b"NULL");
    assert_eq!(&sent[64..91], &ready(b"SUB")[..]);
    assert_eq!(&sent[91..], &[0, 11, 1, b'k', b'v', b'_', b'm', b'e', b't', b'r', b'i', b'c', b's']);
    let frames = next_message(&mut session).await.unwrap();
    assert_eq!(frames[0], b"kv_metrics");
    assert_eq!(frames.len(), 4);
    assert_eq!(session.buffered_capacity(), 2048 + 64 + 512, "an idle session holds 2,624 bytes of buffers");
}

/// What the handshake waits on is flushed first: over a buffered stream, a publisher that
/// answers only what it has read (its greeting after ours, its READY after ours) would
/// otherwise wait on bytes still in the buffer, and the handshake would time out.
#[tokio::test(start_paused = true)]
async fn the_handshake_flushes_what_it_waits_on() {
    let (ours, mut peer) = duplex(PIPE_BYTES);
    let publisher = tokio::spawn(async move {
        let mut greeting = [0u8; 64];
        peer.read_exact(&mut greeting).await?;
        peer.write_all(&pub_greeting()).await?;
        let mut ready_sub = [0u8; 27];
        peer.read_exact(&mut ready_sub).await?;
        peer.write_all(&ready(b"PUB")).await?;
        let mut subscription = [0u8; 13];
        peer.read_exact(&mut subscription).await?;
        peer.write_all(&kv_message(0)).await?;
        std::io::Result::Ok(peer)
    });
    let buffered = tokio::io::BufStream::new(ours);
    let handshake = ZmtpSubscriber::handshake(buffered, ZmtpLimits::KV_METRICS, b"kv_metrics", 1);
    let mut session = handshake.await.expect("a handshake the publisher answered");
    assert!(matches!(session.recv().await, Ok(Incoming::Message(_))), "the message after the subscription");
    let _peer = publisher.await.expect("the publisher's task").expect("the publisher read each write");
}

#[tokio::test]
async fn ping_is_answered_with_pong_carrying_its_context() {
    let mut ping = vec![4];
    ping.extend_from_slice(b"PING");
    ping.extend_from_slice(&[0, 10]);
    ping.extend_from_slice(b"ctx");
    let mut script = command(&ping);
    script.extend(kv_message(1));
    let (session, mut peer) = subscriber(&script).await;
    let mut session = session.unwrap();
    assert!(next_message(&mut session).await.is_ok());
    let mut sent = vec![0u8; 64 + 27 + 13 + 10];
    peer.read_exact(&mut sent).await.unwrap();
    assert_eq!(&sent[104..], &[wire::FLAG_COMMAND, 8, 4, b'P', b'O', b'N', b'G', b'c', b't', b'x']);
}

#[tokio::test]
async fn a_frame_length_of_2_pow_63_ends_the_session_before_any_allocation() {
    let mut script = vec![wire::FLAG_LONG];
    script.extend_from_slice(&(1u64 << 63).to_be_bytes());
    let (session, _peer) = subscriber(&script).await;
    let mut session = session.unwrap();
    let error = session.recv().await.err().unwrap();
    assert!(matches!(error, ZmtpError::FrameTooLarge { declared, .. } if declared == 1 << 63), "{error}");
    assert!(error.is_violation());
    assert_eq!(session.message_capacity().0, INITIAL_BUFFER_BYTES);
}

#[tokio::test]
async fn an_oversized_frame_is_skipped_unbuffered_and_the_next_message_arrives() {
    let big = vec![7u8; 17 * 1024];
    let mut script = message(&[b"kv_metrics", &[0; 8], &[0; 8], &big]);
    script.extend(kv_message(2));
    let (session, _peer) = subscriber(&script).await;
    let mut session = session.unwrap();
    assert_eq!(next_message(&mut session).await, Err("dropped Oversized".into()));
    assert!(next_message(&mut session).await.is_ok());
    let (capacity, ceiling) = session.message_capacity();
    assert!(capacity <= 1024, "the skipped frame was never buffered: {capacity}");
    assert!(ceiling <= ZmtpLimits::KV_METRICS.max_message_bytes + MAX_COMMAND_BYTES);
}

#[tokio::test]
async fn a_large_message_the_shared_budget_cannot_hold_is_skipped_and_the_loan_comes_back() {
    // Room for one 200 KiB message past a buffer's free 64 KiB, not for two at once, whoever
    // borrows.
    let budget = BudgetRef(Box::leak(Box::new(MessageBudget::with_share(192 * 1024, 192 * 1024))));
    let limits = ZmtpLimits { budget, ..ZmtpLimits::KV_EVENTS };
    let large = message(&[b"kv_metrics", &[0; 8], &[0; 8], &vec![7u8; 200 * 1024]]);
    let mut script = large.clone();
    script.extend(kv_message(2));
    let (first, _p1) = subscriber_of(1, limits, &large).await;
    let (second, _p2) = subscriber_of(2, limits, &script).await;
    let (mut first, mut second) = (first.unwrap(), second.unwrap());

    assert_eq!(next_message(&mut first).await.unwrap()[3].len(), 200 * 1024);
    // Topic and ids (26 bytes), the frame, a command's slack: all but 64 KiB of it borrowed.
    assert_eq!(budget.lent(), 26 + 200 * 1024 + MAX_COMMAND_BYTES - FREE_BUFFER_BYTES);
    assert_eq!(next_message(&mut second).await, Err("dropped OverBudget".into()), "the first holds the budget");
    assert!(second.message_capacity().0 <= FREE_BUFFER_BYTES, "read through, not buffered");
    assert!(next_message(&mut second).await.is_ok(), "the session goes on");
    drop(first);
    assert_eq!(budget.lent(), 0, "repaid when the session ends");
}

/// One worker's channels share one borrower's part of the budget: a second large message of
/// the same worker is dropped while the first holds its share, and another worker's is not.
#[tokio::test]
async fn a_workers_channels_hold_at_most_its_share_of_the_budget_together() {
    // A borrower's share is room for one 200 KiB message past a buffer's free 64 KiB.
    let budget = BudgetRef(Box::leak(Box::new(MessageBudget::with_share(4 << 20, 192 * 1024))));
    let limits = ZmtpLimits { budget, ..ZmtpLimits::KV_EVENTS };
    let large = message(&[b"kv_metrics", &[0; 8], &[0; 8], &vec![7u8; 200 * 1024]]);
    let (first, _p1) = subscriber_of(7, limits, &large).await;
    let (same_worker, _p2) = subscriber_of(7, limits, &large).await;
    let (other_worker, _p3) = subscriber_of(8, limits, &large).await;
    let (mut first, mut same_worker, mut other_worker) = (first.unwrap(), same_worker.unwrap(), other_worker.unwrap());
    assert!(next_message(&mut first).await.is_ok());
    assert_eq!(next_message(&mut same_worker).await, Err("dropped OverBudget".into()), "its worker's share is held");
    assert!(next_message(&mut other_worker).await.is_ok(), "another worker's share is its own");
    assert_eq!(budget.lent_to(7), budget.lent_to(8));
    drop((first, other_worker));
    assert_eq!(budget.lent(), 0, "repaid when the sessions end");
}

/// A loan is everyone's: a message that borrows must be whole soon after, or its session ends
/// and the loan goes back long before the message's own 30 s deadline. Trickling the large
/// frame, or pausing after it before the message's next frame, holds it no longer.
#[tokio::test(start_paused = true)]
async fn a_borrowing_message_that_trickles_or_pauses_ends_its_session_and_gives_its_loan_back() {
    let budget = BudgetRef(Box::leak(Box::new(MessageBudget::new(LARGE_MESSAGE_BYTES))));
    let limits = ZmtpLimits { budget, ..ZmtpLimits::KV_EVENTS };
    let large = message(&[b"kv_metrics", &[0; 8], &[0; 8], &vec![7u8; 200 * 1024]]);
    let trickled = large.len() - 100 * 1024;
    // The large frame first, whole, then the sequence frame after it: `[0; 8]` moved last.
    let paused = message(&[b"kv_metrics", &[0; 8], &vec![7u8; 200 * 1024], &[0; 8]]);
    let before_pause = paused.len() - 10;
    // The rest a kilobyte a second; or after a pause longer than the loan, well within the
    // message's own deadline.
    let cases = [("trickled", large.clone(), trickled, 1), ("paused", paused, before_pause, 10)];
    for (case, bytes, split, gap) in cases {
        let (head, tail) = bytes.split_at(split);
        let (session, mut peer) = subscriber_with(limits, head).await;
        let mut session = session.unwrap();
        let tail = tail.to_vec();
        let sender = tokio::spawn(async move {
            for chunk in tail.chunks(1024) {
                tokio::time::sleep(Duration::from_secs(gap)).await;
                peer.write_all(chunk).await?;
            }
            tokio::time::sleep(MESSAGE_TIMEOUT).await;
            std::io::Result::Ok(peer)
        });
        let started = tokio::time::Instant::now();
        let ended = session.recv().await.err();
        assert!(matches!(ended, Some(ZmtpError::LoanTimeout(_))), "{case}: {ended:?}");
        assert!(ended.is_some_and(|e| e.is_violation()), "{case}: the publisher's fault");
        assert_eq!(started.elapsed(), LOAN_DEADLINE, "{case}: long before {MESSAGE_TIMEOUT:?}");
        assert!(budget.lent() > 0, "{case}: held until the session goes");
        drop(session);
        assert_eq!(budget.lent(), 0, "{case}");
        sender.abort();
    }

    // The same message sent whole borrows, and is read.
    let (session, _peer) = subscriber_with(limits, &large).await;
    assert_eq!(next_message(&mut session.unwrap()).await.unwrap()[3].len(), 200 * 1024);
}

#[tokio::test]
async fn a_frame_at_the_ceiling_is_buffered_and_the_buffer_stops_there() {
    let payload = vec![7u8; ZmtpLimits::KV_METRICS.max_frame_bytes];
    let topic = [b'k'; MAX_TOPIC_BYTES];
    let script = message(&[&topic, &[0; 8], &[0; 8], &payload]);
    let (session, _peer) = subscriber(&script).await;
    let mut session = session.unwrap();
    let frames = next_message(&mut session).await.unwrap();
    assert_eq!(frames[3].len(), ZmtpLimits::KV_METRICS.max_frame_bytes);
    let (capacity, ceiling) = session.message_capacity();
    assert_eq!(capacity, ceiling, "clamped to the ceiling instead of doubling to 32 KiB");
    assert_eq!(ceiling, ZmtpLimits::KV_METRICS.max_message_bytes + MAX_COMMAND_BYTES);
}

/// A subscription waiting after a large message holds what an idle one does, not the room the
/// message took.
#[tokio::test]
async fn after_a_large_message_the_subscription_waits_in_its_first_buffers() {
    let payload = vec![7u8; ZmtpLimits::KV_METRICS.max_frame_bytes];
    let mut script = message(&[b"kv_metrics", &[0; 8], &[0; 8], &payload]);
    script.extend(kv_message(3));
    let (session, _peer) = subscriber(&script).await;
    let mut session = session.unwrap();
    let idle = session.buffered_capacity();
    next_message(&mut session).await.unwrap();
    next_message(&mut session).await.unwrap();
    assert_eq!(session.buffered_capacity(), idle, "back to the idle buffers once its message was read");
}

#[tokio::test]
async fn a_fifth_frame_drops_the_message_and_the_session_goes_on() {
    let mut script = message(&[b"kv_metrics", &[0; 8], &[0; 8], &[1, 0, 0, 0, 0], b"extra"]);
    script.extend(kv_message(3));
    let (session, _peer) = subscriber(&script).await;
    let mut session = session.unwrap();
    assert_eq!(next_message(&mut session).await, Err("dropped TooManyFrames".into()));
    assert!(next_message(&mut session).await.is_ok());
}

#[tokio::test]
async fn a_long_first_frame_is_not_a_topic_we_buffer() {
    let mut script = message(&[&[b'x'; 300], &[0; 8]]);
    script.extend(kv_message(3));
    let (session, _peer) = subscriber(&script).await;
    let mut session = session.unwrap();
    assert_eq!(next_message(&mut session).await, Err("dropped TopicTooLong".into()));
    assert!(next_message(&mut session).await.is_ok());
}

/// Publishers speak when something changes: a long silence between messages, or after a PING,
/// is no fault. A message begun and left unfinished is.
#[tokio::test(start_paused = true)]
async fn a_message_must_arrive_whole_within_its_deadline_but_silence_between_messages_is_no_fault() {
    let mut ping = vec![4];
    ping.extend_from_slice(b"PING");
    ping.extend_from_slice(&[0, 10]);
    let (session, mut peer) = subscriber(&command(&ping)).await;
    let mut session = session.unwrap();
    let whole = kv_message(1);
    let sender = tokio::spawn(async move {
        tokio::time::sleep(MESSAGE_TIMEOUT * 10).await;
        peer.write_all(&whole).await?;
        // The next message stops a few bytes in, and never goes on.
        let half = kv_message(2);
        peer.write_all(&half[..half.len() / 2]).await?;
        tokio::time::sleep(MESSAGE_TIMEOUT * 10).await;
        std::io::Result::Ok(peer)
    });
    let frames = next_message(&mut session).await.unwrap();
    assert_eq!(frames[2], [0, 0, 0, 0, 0, 0, 0, 1], "the message after a long silence arrives");
    let started = tokio::time::Instant::now();
    let stalled = session.recv().await.err();
    assert!(matches!(stalled, Some(ZmtpError::MessageTimeout(_))), "{stalled:?}");
    assert!(started.elapsed() >= MESSAGE_TIMEOUT && started.elapsed() < MESSAGE_TIMEOUT * 2);
    assert!(stalled.is_some_and(|e| e.is_violation()), "counted as the publisher's fault");
    sender.abort();
}

#[tokio::test]
async fn an_endless_greeting_times_out() {
    let (ours, mut peer) = duplex(PIPE_BYTES);
    let limits = ZmtpLimits { handshake_timeout: Duration::from_millis(200), ..ZmtpLimits::KV_METRICS };
    let slowloris = tokio::spawn(async move {
        for _ in 0..100 {
            if peer.write_all(&[0xFF]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let result = ZmtpSubscriber::handshake(ours, limits, b"kv_metrics", 1).await;
    assert!(matches!(result, Err(ZmtpError::HandshakeTimeout(_))), "{:?}", result.err());
    slowloris.abort();
}

#[tokio::test]
async fn handshake_refusals() {
    let cases: [(&str, Vec<u8>); 7] = [
        ("HTTP instead of ZMTP", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".iter().copied().chain([0; 64]).collect()),
        ("ZMTP 2", {
            let mut g = pub_greeting();
            g[10] = 1;
            g
        }),
        ("PLAIN security", {
            let mut g = pub_greeting();
            g[12..17].copy_from_slice(b"PLAIN");
            g
        }),
        ("a REQ socket", [pub_greeting(), ready(b"REQ")].concat()),
        ("a message before READY", [pub_greeting(), kv_message(0)].concat()),
        ("ERROR", [pub_greeting(), command(&[5, b'E', b'R', b'R', b'O', b'R', 2, b'n', b'o'])].concat()),
        ("READY without Socket-Type", [pub_greeting(), command(&[5, b'R', b'E', b'A', b'D', b'Y'])].concat()),
    ];
    for (what, script) in cases {
        let (ours, mut peer) = duplex(PIPE_BYTES);
        peer.write_all(&script).await.unwrap();
        let result = ZmtpSubscriber::handshake(ours, ZmtpLimits::KV_METRICS, b"kv_metrics", 1).await;
        let error = result.err().unwrap_or_else(|| panic!("{what} was accepted"));
        assert!(error.is_violation(), "{what}: {error}");
    }
}

#[tokio::test]
async fn framing_violations_end_the_session() {
    let long_command = {
        let mut c = vec![wire::FLAG_COMMAND | wire::FLAG_LONG];
        c.extend_from_slice(&600u64.to_be_bytes());
        c.extend(std::iter::repeat_n(0, 600));
        c
    };
    let cases: [(&str, Vec<u8>); 4] = [
        ("reserved flag bits", vec![0x80, 0]),
        ("a command with MORE", vec![wire::FLAG_COMMAND | wire::FLAG_MORE, 0]),
        ("a 600-byte command", long_command),
        ("a second READY", ready(b"PUB")),
    ];
    for (what, script) in cases {
        let (session, _peer) = subscriber(&script).await;
        let error = session.unwrap().recv().await.err().unwrap_or_else(|| panic!("{what} was accepted"));
        assert!(error.is_violation(), "{what}: {error}");
    }
}

#[tokio::test]
async fn a_closed_connection_is_not_a_violation() {
    let (session, peer) = subscriber(&kv_message(0)[..5]).await;
    let mut session = session.unwrap();
    drop(peer);
    let error = session.recv().await.err().unwrap();
    assert!(matches!(error, ZmtpError::Closed), "{error}");
    assert!(!error.is_violation());
}

#[tokio::test]
async fn a_frame_skipped_past_the_discard_bound_ends_the_session() {
    let mut script = vec![wire::FLAG_LONG];
    script.extend_from_slice(&(ZmtpLimits::KV_METRICS.max_discard_bytes + 1).to_be_bytes());
    let (session, _peer) = subscriber(&script).await;
    let error = session.unwrap().recv().await.err().unwrap();
    assert!(matches!(error, ZmtpError::FrameTooLarge { .. }), "{error}");
}

/// One endless message of frames each within the bounds, skipped one by one, would keep the
/// session reading and dropping them for as long as the publisher liked: past
/// [`MAX_SKIPPED_FRAMES`] frames, or `max_discard_bytes` skipped in all, the session ends.
#[tokio::test]
async fn a_message_whose_skipped_frames_add_up_past_the_bounds_ends_the_session() {
    // Empty frames past the fourth: they cost nothing each, but they never end.
    let many: Vec<u8> = (0..MAX_FRAMES_PER_MESSAGE + MAX_SKIPPED_FRAMES + 1).flat_map(|_| frame(true, b"")).collect();
    // Frames each over the frame bound and under the discard bound (here 64 KiB, so that the
    // script fits the pipe): together past it.
    let limits = ZmtpLimits { max_discard_bytes: 64 << 10, ..ZmtpLimits::KV_METRICS };
    let large = vec![0u8; limits.max_frame_bytes + 1];
    let count = usize::try_from(limits.max_discard_bytes).unwrap() / large.len() + 1;
    let heavy: Vec<u8> = (0..count).flat_map(|_| frame(true, &large)).collect();
    for (what, script) in [("frames", many), ("bytes", heavy)] {
        let (session, _peer) = subscriber_with(limits, &script).await;
        let error = session.unwrap().recv().await.err().unwrap_or_else(|| panic!("{what}: a message"));
        assert!(matches!(error, ZmtpError::SkippedTooMuch { .. }), "{what}: {error}");
        assert!(error.is_violation(), "{what}");
    }
    // Within both, a message past the frame bound is dropped and the session goes on.
    let mut script = frame(true, b"kv_metrics");
    script.extend(frame(false, &large));
    script.extend(kv_message(1));
    let (session, _peer) = subscriber(&script).await;
    let mut session = session.unwrap();
    assert_eq!(next_message(&mut session).await, Err("dropped Oversized".into()));
    assert!(next_message(&mut session).await.is_ok(), "the next message is read");
}

mod fuzz {
    //! Arbitrary bytes from a subscribed publisher: the session may end, but it never panics,
    //! never buffers past its ceiling, and never hangs on bytes it has.

    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn arbitrary_bytes_after_the_handshake_stay_within_bounds(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                let (session, peer) = subscriber(&bytes).await;
                let mut session = session.unwrap();
                drop(peer);
                for _ in 0..10_000 {
                    if session.recv().await.is_err() {
                        break;
                    }
                }
                let (capacity, ceiling) = session.message_capacity();
                prop_assert!(capacity <= ceiling);
                Ok(())
            })?;
        }

        #[test]
        fn valid_frames_with_arbitrary_lengths_stay_within_bounds(
            frames in proptest::collection::vec((any::<bool>(), any::<bool>(), 0u64..40_000), 1..8),
        ) {
            let mut script = Vec::new();
            for (more, long, len) in frames {
                let flags = u8::from(more) | if long { wire::FLAG_LONG } else { 0 };
                script.push(flags);
                if long {
                    script.extend_from_slice(&len.to_be_bytes());
                } else {
                    script.push(u8::try_from(len % 256).unwrap());
                }
                let body = if long { len } else { len % 256 };
                script.extend(std::iter::repeat_n(0x5a, usize::try_from(body).unwrap()));
            }
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                let (session, peer) = subscriber(&script).await;
                let mut session = session.unwrap();
                drop(peer);
                while session.recv().await.is_ok() {}
                let (capacity, ceiling) = session.message_capacity();
                prop_assert!(capacity <= ceiling);
                Ok(())
            })?;
        }
    }
}

#[tokio::test]
async fn a_peers_error_reason_cannot_forge_a_log_line() {
    let reason = b"no\n2026-12-04T00:00:00Z  INFO forged";
    let mut body = vec![5, b'E', b'R', b'R', b'O', b'R', reason.len() as u8];
    body.extend_from_slice(reason);
    let (ours, mut peer) = duplex(PIPE_BYTES);
    peer.write_all(&[pub_greeting(), command(&body)].concat()).await.unwrap();
    let result = ZmtpSubscriber::handshake(ours, ZmtpLimits::KV_METRICS, b"kv_metrics", 1).await;
    let Err(error) = result else { panic!("an ERROR ends the handshake") };
    let error = error.to_string();
    assert!(!error.contains('\n') && error.contains(r"no\n2026"), "{error}");
}
