//! Routing end to end against the real Dynamo 1.6.1 fleet: `dynamo.mocker` workers, the real
//! `dynamo.frontend --router-mode direct` as the shim, the real control plane and data-plane
//! replicas, all inside a private network namespace.
//!
//! Every request asks the replica to disclose its pins (`x-backend`) and the frontend to echo
//! the pins it used (`nvext.extra_fields: ["worker_id"]`); the two must agree every time, which
//! proves the picker's choice, and nothing else, reached the frontend.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use continuum_data_plane::routing::picker::{EJECT_AFTER, EJECTION};
use continuum_tests::dynamo::{self, InstanceWatch, Mocker, Mode};
use continuum_tests::dynamo_routing::{
    self, Answer, FRONTEND, Outcome, Pins, RoutedContinuum, buffered_echo, chat_body, post_chat, post_chat_noting_head,
    streamed_echo,
};
use continuum_tests::netns::NetNs;
use continuum_tests::wire_tap::{Tapped, WireTap};
use serde_json::json;

const PREFILL: Mocker = Mocker { mode: Mode::Prefill, kv_blocks: 1024, dp_size: 1 };
const DECODE: Mocker = Mocker { mode: Mode::Decode, kv_blocks: 1024, dp_size: 1 };
const AGGREGATED_DP2: Mocker = Mocker { mode: Mode::Aggregated, kv_blocks: 512, dp_size: 2 };

/// The request count through the replicas.
const REQUESTS: usize = 200;
const SPOOFED_REQUESTS: usize = 20;
/// Streams open when a decode worker is SIGKILLed, half through each replica.
const IN_FLIGHT_AT_DECODE_KILL: usize = 4;
/// Tokens in each: a few seconds of the mocker's generation, so they are open at the kill.
const LONG_STREAM_TOKENS: u32 = 200;
/// A stream open at the kill must end within this, not hang.
const LONG_STREAM_MAX_TIME: Duration = Duration::from_secs(60);
/// How long each replica's client goes on sending after the control plane's SIGKILL: past
/// twice `dynamo.load.max_staleness` (3 s), so every load sample the replicas hold is stale.
const ROUTING_ON_LAST_KNOWN_GOOD_FOR: Duration = Duration::from_secs(7);
const REQUESTS_AFTER_DECODE_KILL: usize = 20;
/// Requests each replica's client has had answered when the control plane is killed.
const ANSWERED_BEFORE_KILL: usize = 3;
/// A healthy request; generous for a loaded 2-core machine (they take tens of milliseconds).
const REQUEST_MAX_TIME: Duration = Duration::from_secs(20);
/// A request pinned to a SIGKILLed worker must be answered within this, not hang.
const FAILURE_MAX_TIME: Duration = Duration::from_secs(15);
/// The frontend may list the model before it can serve a disaggregated request.
const WARM_UP_WITHIN: Duration = Duration::from_secs(15);
const MAX_TOKENS: u32 = 4;
/// An id no worker has.
const UNKNOWN_ID: u64 = 12345;
/// Where the replicas reach the frontend: a tap in front of it records what it was sent.
const TAP: &str = "127.0.0.1:8100";
/// The pin headers Dynamo 1.6.1 honours besides its `x-dynamo-*` ones. It reads an alias only
/// when the `x-dynamo-*` header is absent, and the replicas always send those, so an alias that
/// leaked would not show in the frontend's echo: the tap is what can see it.
const PIN_ALIASES: [&str; 5] =
    ["x-worker-instance-id", "x-prefill-instance-id", "x-dp-rank", "x-data-parallel-rank", "x-prefill-dp-rank"];
/// Body fields that choose workers or ranks, or replace the prompt: listed here, not taken from
/// the data plane, so that one it stopped stripping fails this test.
const NVEXT_ROUTING_FIELDS: [&str; 10] = [
    "backend_instance_id",
    "prefill_worker_id",
    "decode_worker_id",
    "dp_rank",
    "prefill_dp_rank",
    "decode_dp_rank",
    "data_parallel_rank",
    "token_data",
    "worker_id",
    "routing_constraints",
];
/// Top-level fields with which an engine's own server (vLLM's, SGLang's, TensorRT-LLM's)
/// chooses a KV source or a rank: listed here for the same reason.
const ENGINE_ROUTING_FIELDS: [&str; 9] = [
    "kv_transfer_params",
    "disaggregated_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "routed_dp_rank",
    "disagg_prefill_dp_rank",
    "data_parallel_rank",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_pins_are_the_pickers_spoofs_never_reach_the_frontend_and_replicas_route_on_after_the_control_plane_and_a_decode_worker_die()
-> anyhow::Result<()> {
    let began = Instant::now();
    let ns = NetNs::create()?;
    dynamo::start_etcd(&ns).await?;
    let watch = InstanceWatch::start(&ns).await?;
    let tap = WireTap::start(&ns, TAP, FRONTEND).await?;
    let continuum =
        RoutedContinuum::start_with(&ns, 2, &dynamo_routing::control_plane_yaml_via(TAP, false), &[]).await?;
    dynamo_routing::start_frontend(&ns)?;
    let prefills = [
        PREFILL.start(&ns, &watch, "prefill-a").await?.instance.instance_id,
        PREFILL.start(&ns, &watch, "prefill-b").await?.instance.instance_id,
    ];
    let prefill = prefills[0];
    let decoders = [DECODE.start(&ns, &watch, "decode-a").await?, DECODE.start(&ns, &watch, "decode-b").await?];
    let fleet = Fleet {
        ns: &ns,
        replicas: &continuum.replicas,
        prefills: prefills.to_vec(),
        decodes: decoders.iter().map(|d| d.instance.instance_id).collect(),
        picked: Mutex::default(),
    };
    continuum.wait_for_workers(&ns, 4).await?;
    dynamo_routing::wait_model_listed(&ns, "frontend", &format!("http://{FRONTEND}"), "tiny").await?;
    for replica in &continuum.replicas {
        dynamo_routing::wait_model_listed(&ns, "replica", replica, "tiny").await?;
    }
    let warm_up = fleet.warm_up().await?;
    let mut report = vec![format!("fleet up and first request answered after {:?} ({warm_up})", began.elapsed())];

    let phase = Instant::now();
    let mut spread: BTreeMap<(usize, u64), usize> = BTreeMap::new();
    let mut by_prefill: BTreeMap<u64, usize> = BTreeMap::new();
    for n in 0..REQUESTS {
        let (replica, stream) = (n % 2, (n / 2) % 2 == 0);
        let pins = fleet.routed(n, replica, stream, &[], &chat_body(n, stream, MAX_TOKENS)).await?;
        *spread.entry((replica, pins.decode)).or_default() += 1;
        *by_prefill.entry(pins.prefill.context("a disaggregated pick names its prefill worker")?).or_default() += 1;
    }
    // Each prefill was the picker's own choice between two workers, as each decode was.
    let busiest_prefill = by_prefill.values().max().copied().unwrap_or(REQUESTS);
    ensure!(
        by_prefill.len() == 2 && busiest_prefill <= REQUESTS * 7 / 10,
        "the prefill workers did not share the requests: prefill -> count {by_prefill:?}"
    );
    // Idle workers tie, and ties go to the one the fleet sent a request longest ago: the two
    // decode workers share the requests, whichever replica each came through.
    let mut by_decode: BTreeMap<u64, usize> = BTreeMap::new();
    for ((_, decode), n) in &spread {
        *by_decode.entry(*decode).or_default() += n;
    }
    let busiest = by_decode.values().max().copied().unwrap_or(REQUESTS);
    ensure!(
        by_decode.len() == 2 && busiest <= REQUESTS * 7 / 10,
        "the decode workers did not share the requests: (replica, decode) -> count {spread:?}"
    );
    report.push(format!(
        "{REQUESTS} requests (half streaming, alternating replicas): all 200, echo == disclosed pins, in {:?}; (replica, decode) -> count {spread:?}; prefill -> count {by_prefill:?}",
        phase.elapsed()
    ));

    let phase = Instant::now();
    let mut spoof_differed = 0;
    for n in 0..SPOOFED_REQUESTS {
        let (replica, stream) = (n % 2, (n / 2) % 2 == 0);
        // Three kinds of spoof. Had one arrived, the frontend would have refused the first two
        // (the roles swapped; ids no worker has) and followed the third (a real decode worker,
        // the prefill's own id), which `check` would see as an echo unlike the disclosure
        // whenever the picker chose the other decode worker. Dp ranks out of range throughout.
        let (decode, prefill) = match n % 3 {
            0 => (prefill, fleet.decodes[n % 2]),
            1 => (UNKNOWN_ID, UNKNOWN_ID),
            _ => (fleet.decodes[n / 2 % 2], prefill),
        };
        let (decode_text, prefill_text) = (decode.to_string(), prefill.to_string());
        let (decode_hex, prefill_hex) = (format!("{decode:#x}"), format!("{prefill:#x}"));
        let headers = [
            ("x-dynamo-worker-instance-id", decode_text.as_str()),
            // Repeated, in hex: the frontend ignores hex, but not every hop would.
            ("X-Dynamo-Worker-Instance-Id", decode_hex.as_str()),
            ("x-dynamo-prefill-instance-id", prefill_hex.as_str()),
            ("X-Worker-Instance-Id", decode_text.as_str()),
            ("X-Dynamo-Prefill-Instance-Id", prefill_text.as_str()),
            ("x-PREFILL-instance-id", prefill_text.as_str()),
            ("X-Dynamo-Dp-Rank", "5"),
            ("x-dp-rank", "5"),
            ("X-Data-Parallel-Rank", "5"),
            ("x-dynamo-prefill-dp-rank", "5"),
            ("X-Prefill-Dp-Rank", "5"),
            ("X-Dynamo-Anything-Else", "5"),
        ];
        // Every body routing field the data plane knows, ids and ranks alike (Dynamo reads
        // each under some name), and tokens that are not the prompt's.
        // Prompts of their own, so that the tap can tell each request from the first phase's.
        let mut body = chat_body(REQUESTS + n, stream, MAX_TOKENS);
        for field in NVEXT_ROUTING_FIELDS {
            body["nvext"][field] = match field {
                "prefill_worker_id" => json!(prefill),
                "token_data" => json!([1, 2, 3]),
                // Taints no worker has: a frontend that saw it would refuse every worker.
                "routing_constraints" => json!({"required_taints": ["gpu-a"]}),
                field if field.ends_with("rank") => json!(5),
                _ => json!(decode),
            };
        }
        // An engine's own (vLLM's remote KV source, SGLang's bootstrap and rank, TensorRT-LLM's
        // context phase).
        for field in ENGINE_ROUTING_FIELDS {
            body[field] = json!({"remote_host": "10.0.0.9", "remote_port": 5600});
        }
        // The query-only first stage: the frontend's own router would pick and answer ids.
        body["nvext"]["annotations"] = json!(["query_instance_id:decode", "the client's own"]);
        let pins = fleet.routed(n, replica, stream, &headers, &body).await?;
        if n % 3 == 2 && pins.decode != decode {
            spoof_differed += 1;
        }
    }
    // Otherwise a followed spoof of a real worker would have been indistinguishable from the pick.
    ensure!(spoof_differed > 0, "the picker chose every spoofed real decode worker itself; the spoof went untested");
    report.push(format!(
        "{SPOOFED_REQUESTS} requests with every pin header alias (mixed case) and nvext ids spoofed: all 200 with the picker's pins, in {:?}",
        phase.elapsed()
    ));
    let tapped: Vec<Tapped> =
        tap.requests()?.into_iter().filter(|r| r.method == "POST" && r.path == "/v1/chat/completions").collect();
    ensure!(
        tapped.len() >= REQUESTS + SPOOFED_REQUESTS,
        "the tap saw {} chat requests reach the frontend, fewer than were answered",
        tapped.len()
    );
    let mut matched = 0;
    for (i, request) in tapped.iter().enumerate() {
        let pick =
            fleet.sent_only_pins(request).with_context(|| format!("chat request {i} as the frontend received it"))?;
        matched += usize::from(pick);
    }
    // Every prompt of the two phases was sent once, so its pick is known: fewer would be a
    // request that never reached the frontend, more one sent twice.
    ensure!(
        matched == REQUESTS + SPOOFED_REQUESTS,
        "{matched} requests the frontend received were matched to the pick made for them, not {}",
        REQUESTS + SPOOFED_REQUESTS
    );
    report.push(format!(
        "the frontend received {} chat requests (the tap's record): each with one pin per header, the picker's, no alias and no nvext routing field",
        tapped.len()
    ));

    // The control plane dies mid-run: each replica has a client sending requests one after
    // another (half streaming) when it is killed, and they go on past twice `max_staleness`,
    // so the replicas route on their last-known-good view with every load sample gone stale.
    let phase = Instant::now();
    let killed = std::sync::atomic::AtomicBool::new(false);
    let answered = [AtomicUsize::new(0), AtomicUsize::new(0)];
    let client = |replica: usize| {
        let (killed, answered) = (&killed, &answered[replica]);
        let fleet = &fleet;
        async move {
            let mut decodes = BTreeMap::<u64, usize>::new();
            let mut killed_at: Option<Instant> = None;
            for i in 0.. {
                let n = REQUESTS + SPOOFED_REQUESTS + 2 * i + replica;
                let stream = i % 2 == 0;
                let pins = fleet.routed(n, replica, stream, &[], &chat_body(n, stream, MAX_TOKENS)).await?;
                answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if killed.load(std::sync::atomic::Ordering::SeqCst) {
                    let since = *killed_at.get_or_insert_with(Instant::now);
                    *decodes.entry(pins.decode).or_default() += 1;
                    if since.elapsed() > ROUTING_ON_LAST_KNOWN_GOOD_FOR {
                        return anyhow::Ok((i + 1, decodes));
                    }
                }
            }
            unreachable!("the loop returns once it has run past the kill")
        }
    };
    let killer = async {
        // Mid-run: once both clients are answered a few times, whatever the machine's pace.
        let running = || answered.iter().all(|n| n.load(std::sync::atomic::Ordering::SeqCst) >= ANSWERED_BEFORE_KILL);
        let waiting = Instant::now();
        while !running() {
            ensure!(
                waiting.elapsed() < REQUEST_MAX_TIME,
                "the clients were not answered before the kill: {answered:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let status = ns.kill(continuum.control_plane_pid)?;
        killed.store(true, std::sync::atomic::Ordering::SeqCst);
        let stale = continuum.selections(&ns, "decode", "round_robin_stale").await?;
        anyhow::Ok((status, stale))
    };
    // The first error ends the phase: the clients run until the kill, and the killer waits on them.
    let ((status, stale_at_kill), (sent_first, decodes_first), (sent_second, decodes_second)) =
        tokio::try_join!(killer, client(0), client(1))?;
    // They went on routing after the kill; by now both have seen the stream go, and their
    // samples aged past `max_staleness`: each replica went on picking decode workers in turn.
    continuum.wait_for_disconnection(&ns).await?;
    let stale_after = continuum.selections(&ns, "decode", "round_robin_stale").await?;
    ensure!(
        stale_after.iter().zip(&stale_at_kill).all(|(after, at_kill)| after > at_kill),
        "every replica routes on stale samples once the control plane is gone: round_robin_stale decode selections {stale_at_kill:?} at the kill, {stale_after:?} after"
    );
    ensure!(
        decodes_first.len() == 2 && decodes_second.len() == 2,
        "each replica goes on picking both decode workers in turn: {decodes_first:?}, {decodes_second:?}"
    );
    let mut decodes_after_kill = decodes_first;
    for (decode, n) in decodes_second {
        *decodes_after_kill.entry(decode).or_default() += n;
    }
    report.push(format!(
        "control plane SIGKILLed ({status}) while each replica had a client sending: {sent_first} and {sent_second} requests, all 200 with echo == disclosed, for {ROUTING_ON_LAST_KNOWN_GOOD_FOR:?} past the kill (twice max_staleness), in {:?}; both replicas then report the stream down; decode selections on stale samples {stale_at_kill:?} at the kill, {stale_after:?} after",
        phase.elapsed()
    ));

    // The control plane is gone, so every replica keeps the dead worker in its last-known-good
    // view: requests pinned to it must fail as specified, promptly. The victim is the decode
    // worker the replicas chose most since the control plane died: their load samples froze
    // with it, so a worker whose last sample showed a request may be passed over until they go
    // stale, and killing that one would leave the failure arm untested.
    let busiest = decodes_after_kill.iter().max_by_key(|(_, n)| **n).map(|(id, _)| *id);
    let (victim, survivor) = match &decoders {
        [a, b] if busiest == Some(b.instance.instance_id) => (b, a.instance.instance_id),
        [a, b] => (a, b.instance.instance_id),
    };
    // The decode worker dies with streams open on it and on the survivor. Those on it must end
    // promptly (1.6.1's frontend sends an error event, relayed as it came, then `[DONE]`); the
    // survivor's run to their end.
    let phase = Instant::now();
    let heads = tempfile::tempdir()?;
    let head_of = |i: usize| heads.path().join(format!("head-{i}"));
    let streams = async {
        let sends = (0..IN_FLIGHT_AT_DECODE_KILL).map(|i| {
            let body = chat_body(20_000 + i, true, LONG_STREAM_TOKENS);
            let (fleet, head) = (&fleet, head_of(i));
            async move {
                let outcome = fleet.send_noting_head(i % 2, &body, LONG_STREAM_MAX_TIME, &head).await;
                (i, outcome)
            }
        });
        futures::future::join_all(sends).await
    };
    let killing = async {
        // Once every stream's head has reached its client, however loaded the machine: far
        // sooner than the streams end.
        let begun = |i: usize| std::fs::read_to_string(head_of(i)).is_ok_and(|head| head.contains("\r\n\r\n"));
        let deadline = Instant::now() + REQUEST_MAX_TIME;
        while !(0..IN_FLIGHT_AT_DECODE_KILL).all(begun) {
            ensure!(Instant::now() < deadline, "the streams to be cut never all began");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        ns.kill(victim.pid)
    };
    let (streamed, killed) = tokio::join!(streams, killing);
    killed?;
    let (mut cut, mut whole) = (0, 0);
    for (i, outcome) in streamed {
        let answer = match outcome? {
            Outcome::TimedOut => bail!("stream {i} open at the decode SIGKILL hung past {LONG_STREAM_MAX_TIME:?}"),
            Outcome::Answered(answer) => answer,
        };
        ensure!(answer.status == 200, "stream {i}: its head came before the kill: {answer:?}");
        let disclosed = answer.disclosed()?;
        let events: Vec<&str> = answer.body.split("\n\n").filter(|e| !e.trim().is_empty()).collect();
        ensure!(events.last() == Some(&"data: [DONE]"), "stream {i} did not end: {:?}", events.last());
        let error_event = events.iter().any(|e| e.starts_with("data: {\"error\""));
        if disclosed.decode == victim.instance.instance_id {
            ensure!(error_event, "stream {i} on the killed worker ended without an error: {:?}", events.last());
            cut += 1;
        } else {
            ensure!(!error_event && answer.body.contains("\"finish_reason\":\"length\""), "stream {i}: {events:?}");
            // And what the frontend echoes is what the replica chose.
            fleet.check(20_000 + i, &answer, true)?;
            whole += 1;
        }
    }
    ensure!(cut > 0 && whole > 0, "streams on the killed worker {cut}, on the survivor {whole}: a case went untested");
    report.push(format!(
        "decode {} SIGKILLed with {IN_FLIGHT_AT_DECODE_KILL} streams open: the {cut} on it ended with the frontend's error event relayed, the {whole} on the survivor ran to their end, in {:?}",
        victim.instance.instance_id,
        phase.elapsed()
    ));

    let phase = Instant::now();
    let (mut ok, mut failed, mut slowest) = (0, BTreeMap::<(u16, String), usize>::new(), Duration::ZERO);
    for n in 0..REQUESTS_AFTER_DECODE_KILL {
        let (replica, stream) = (n % 2, (n / 2) % 2 == 0);
        let sent = Instant::now();
        let answer = match fleet
            .send(replica, &[("x-backend", "any")], &chat_body(n, stream, MAX_TOKENS), FAILURE_MAX_TIME)
            .await?
        {
            Outcome::TimedOut => bail!("request {n} after the decode SIGKILL hung past {FAILURE_MAX_TIME:?}"),
            Outcome::Answered(answer) => answer,
        };
        slowest = slowest.max(sent.elapsed());
        if answer.status == 200 {
            let pins = fleet.check(n, &answer, stream)?;
            ensure!(pins.decode == survivor, "request {n} answered 200 from the killed decode worker: {pins:?}");
            ok += 1;
            continue;
        }
        let code = answer.error_code().unwrap_or_default();
        ensure!(
            matches!(answer.status, 502 | 503) && code == "disaggregated_decode_failed",
            "request {n} after the decode SIGKILL: want 200 or 502/503 disaggregated_decode_failed, got {} {}",
            answer.status,
            answer.body
        );
        *failed.entry((answer.status, code)).or_default() += 1;
    }
    // The frozen view still holds the dead worker, so the failure arm must have been taken.
    ensure!(!failed.is_empty(), "no request was pinned to the killed decode worker; the failure arm went untested");
    // And each replica stops pinning it after EJECT_AFTER failures in a row, for EJECTION at a
    // time, though its view still lists it: the survivor takes the rest.
    let failures: usize = failed.values().sum();
    let ejections = 1 + phase.elapsed().as_millis() / EJECTION.as_millis();
    let most = EJECT_AFTER as usize * continuum.replicas.len() * usize::try_from(ejections)?;
    ensure!(failures <= most, "{failures} requests failed on the dead worker, more than {most}: it was not ejected");
    ensure!(ok > 0, "no request reached the surviving decode worker");
    report.push(format!(
        "{REQUESTS_AFTER_DECODE_KILL} requests after SIGKILL of decode {} (control plane dead; decode -> requests since: {decodes_after_kill:?}): {ok} x 200 from decode {survivor}, failures {failed:?}, slowest {slowest:?}, phase {:?}",
        victim.instance.instance_id,
        phase.elapsed()
    ));
    report.push(format!("whole test: {:?}", began.elapsed()));
    println!("{}", report.join("\n"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_worker_with_two_dp_ranks_is_pinned_to_both_ranks() -> anyhow::Result<()> {
    let began = Instant::now();
    let ns = NetNs::create()?;
    dynamo::start_etcd(&ns).await?;
    let watch = InstanceWatch::start(&ns).await?;
    let continuum = RoutedContinuum::start(&ns, 1, false).await?;
    dynamo_routing::start_frontend(&ns)?;
    let worker = AGGREGATED_DP2.start(&ns, &watch, "aggregated").await?.instance.instance_id;
    continuum.wait_for_workers(&ns, 1).await?;
    dynamo_routing::wait_model_listed(&ns, "frontend", &format!("http://{FRONTEND}"), "tiny").await?;
    dynamo_routing::wait_model_listed(&ns, "replica", &continuum.replicas[0], "tiny").await?;
    let fleet = Fleet {
        ns: &ns,
        replicas: &continuum.replicas,
        prefills: vec![worker],
        decodes: vec![worker],
        picked: Mutex::default(),
    };
    let warm_up = fleet.warm_up().await?;

    let mut ranks: BTreeMap<u64, usize> = BTreeMap::new();
    for n in 0..20 {
        let stream = n % 2 == 0;
        let pins = fleet.routed(n, 0, stream, &[], &chat_body(n, stream, MAX_TOKENS)).await?;
        let rank = pins.decode_dp_rank.with_context(|| format!("request {n}: no dp rank echoed: {pins:?}"))?;
        *ranks.entry(rank).or_default() += 1;
    }
    // Each request ends before the next, so the ranks tie and take turns: 10 each, give or
    // take a sample that shows one rank's cached blocks a moment longer.
    ensure!(
        ranks.keys().copied().eq([0, 1]) && ranks.values().all(|n| *n >= 8),
        "both dp ranks must share the requests, got {ranks:?}"
    );
    println!(
        "aggregated dp=2 ({warm_up}): 20 requests, echoed decode_dp_rank -> count {ranks:?}; whole test {:?}",
        began.elapsed()
    );
    Ok(())
}

/// The fleet as a client of the replicas sees it.
struct Fleet<'a> {
    ns: &'a NetNs,
    replicas: &'a [String],
    /// The prefill workers' ids (the aggregated worker's, where there is no prefill).
    prefills: Vec<u64>,
    decodes: Vec<u64>,
    /// The pins disclosed for each prompt sent (`None`: sent more than once, pins ambiguous).
    picked: Mutex<BTreeMap<String, Option<Pins>>>,
}

impl Fleet<'_> {
    async fn send(
        &self,
        replica: usize,
        headers: &[(&str, &str)],
        body: &serde_json::Value,
        max_time: Duration,
    ) -> anyhow::Result<Outcome> {
        post_chat(self.ns, &self.replicas[replica], body, headers, max_time).await
    }

    /// [`Self::send`] with `x-backend`, the answer's head written to `head` as it arrives.
    async fn send_noting_head(
        &self,
        replica: usize,
        body: &serde_json::Value,
        max_time: Duration,
        head: &std::path::Path,
    ) -> anyhow::Result<Outcome> {
        let headers = [("x-backend", "any")];
        post_chat_noting_head(self.ns, &self.replicas[replica], body, &headers, max_time, Some(head)).await
    }

    /// Sends through the first replica until one request succeeds, within [`WARM_UP_WITHIN`].
    async fn warm_up(&self) -> anyhow::Result<String> {
        let started = Instant::now();
        for attempt in 1.. {
            // A prompt of its own: the tap must not take it for request 0.
            let body = chat_body(usize::MAX, false, MAX_TOKENS);
            let last = match self.send(0, &[("x-backend", "any")], &body, REQUEST_MAX_TIME).await? {
                Outcome::Answered(answer) if answer.status == 200 => {
                    return Ok(format!("warm-up: {attempt} attempt(s), {:?}", started.elapsed()));
                }
                other => other,
            };
            if started.elapsed() > WARM_UP_WITHIN {
                bail!(
                    "no request succeeded within {WARM_UP_WITHIN:?}; the last: {last:?}\n{}",
                    self.ns.log_tail("frontend")
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        unreachable!("the warm-up loop returns or bails")
    }

    /// Sends request `n` with `x-backend` (plus `headers`); it must succeed with the disclosed
    /// pins echoed by the frontend. Returns them.
    async fn routed(
        &self,
        n: usize,
        replica: usize,
        stream: bool,
        headers: &[(&str, &str)],
        body: &serde_json::Value,
    ) -> anyhow::Result<Pins> {
        let headers: Vec<(&str, &str)> = [("x-backend", "any")].into_iter().chain(headers.iter().copied()).collect();
        let answer = match self.send(replica, &headers, body, REQUEST_MAX_TIME).await? {
            Outcome::TimedOut => bail!("request {n} to replica {replica} hung past {REQUEST_MAX_TIME:?}"),
            Outcome::Answered(answer) => answer,
        };
        ensure!(
            answer.status == 200,
            "request {n} (stream {stream}) to replica {replica}: {} {}",
            answer.status,
            answer.body
        );
        let pins = self.check(n, &answer, stream)?;
        let prompt = body["messages"][0]["content"].as_str().unwrap_or_default().to_string();
        let mut picked = self.picked.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        picked.entry(prompt).and_modify(|seen| *seen = None).or_insert(Some(pins));
        Ok(pins)
    }

    /// The echo equals the disclosure, names workers of this fleet, and no pin header came back.
    fn check(&self, n: usize, answer: &Answer, stream: bool) -> anyhow::Result<Pins> {
        let disclosed = answer.disclosed()?;
        let echoed = if stream { streamed_echo(&answer.body)? } else { buffered_echo(&answer.body)? };
        if stream {
            ensure!(
                answer.header("content-type").is_some_and(|c| c.starts_with("text/event-stream")),
                "request {n}: {answer:?}"
            );
        }
        ensure!(
            self.decodes.contains(&echoed.decode),
            "request {n}: decode {} is not a worker of this fleet",
            echoed.decode
        );
        let agree = match disclosed.prefill {
            // Disaggregated: the echo names exactly the disclosed pair.
            Some(prefill) => {
                echoed.decode == disclosed.decode
                    && echoed.prefill == Some(prefill)
                    && self.prefills.contains(&prefill)
                    && (echoed.decode_dp_rank, echoed.prefill_dp_rank)
                        == (disclosed.decode_dp_rank, disclosed.prefill_dp_rank)
            }
            // Aggregated: the frontend echoes the worker as its own prefill, and the rank used.
            // Only in an aggregated fleet: with prefill workers beside the decode workers,
            // every request is a pair.
            None => {
                self.prefills == self.decodes
                    && echoed.decode == disclosed.decode
                    && echoed.decode_dp_rank == disclosed.decode_dp_rank
                    && echoed.prefill.is_none_or(|p| p == echoed.decode)
            }
        };
        ensure!(agree, "request {n}: the replica disclosed {disclosed:?}, the frontend echoed {echoed:?}");
        let leaked: Vec<_> = answer.headers.iter().filter(|(h, _)| h.starts_with("x-dynamo-")).collect();
        ensure!(leaked.is_empty(), "request {n}: pin headers reached the client: {leaked:?}");
        Ok(echoed)
    }

    /// A request as the frontend received it names workers only in one `x-dynamo-*` header per
    /// pin, each a worker of this fleet and rank 0 (every worker has one rank), and those the
    /// picker chose for its prompt where the prompt was sent once: no alias, no other
    /// `x-dynamo-*` header, no repeated or spoofed pin, no routing field in the body. Returns
    /// whether its pick was known.
    fn sent_only_pins(&self, request: &Tapped) -> anyhow::Result<bool> {
        for alias in PIN_ALIASES {
            ensure!(request.values(alias).is_empty(), "{alias} reached the frontend: {:?}", request.headers);
        }
        let dynamo: BTreeSet<&str> = request
            .headers
            .iter()
            .map(|(name, _)| name.as_str())
            .filter(|name| name.starts_with("x-dynamo-"))
            .collect();
        let pins = [
            "x-dynamo-dp-rank",
            "x-dynamo-prefill-dp-rank",
            "x-dynamo-prefill-instance-id",
            "x-dynamo-worker-instance-id",
        ];
        ensure!(dynamo.into_iter().eq(pins), "x-dynamo-* headers other than the pins: {:?}", request.headers);
        let one = |name: &str| match request.values(name)[..] {
            [value] => value.parse::<u64>().with_context(|| format!("{name}: {value:?}")),
            ref values => bail!("{name} {values:?}, not one value"),
        };
        ensure!(self.decodes.contains(&one("x-dynamo-worker-instance-id")?), "{:?}", request.headers);
        ensure!(self.prefills.contains(&one("x-dynamo-prefill-instance-id")?), "{:?}", request.headers);
        ensure!(one("x-dynamo-dp-rank")? == 0 && one("x-dynamo-prefill-dp-rank")? == 0, "{:?}", request.headers);
        let body: serde_json::Value = serde_json::from_slice(&request.body).context("the body")?;
        for field in NVEXT_ROUTING_FIELDS {
            ensure!(body["nvext"].get(field).is_none(), "nvext.{field} reached the frontend: {body}");
        }
        for field in ENGINE_ROUTING_FIELDS {
            ensure!(body.get(field).is_none(), "{field} reached the frontend: {body}");
        }
        let annotations = body["nvext"]["annotations"].as_array().into_iter().flatten();
        let query_only = annotations.filter_map(|a| a.as_str()).any(|a| a.starts_with("query_instance_id"));
        ensure!(!query_only, "a query-only annotation reached the frontend: {body}");
        let prompt = body["messages"][0]["content"].as_str().unwrap_or_default();
        let picked = self.picked.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(Some(pick)) = picked.get(prompt) else { return Ok(false) };
        let sent = (one("x-dynamo-worker-instance-id")?, one("x-dynamo-prefill-instance-id")?);
        ensure!(
            sent == (pick.decode, pick.prefill.unwrap_or(pick.decode)),
            "{prompt:?}: sent {sent:?}, picked {pick:?}"
        );
        Ok(true)
    }
}
