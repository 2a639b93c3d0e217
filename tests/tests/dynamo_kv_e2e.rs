//! KV-aware selection end to end against the real Dynamo 1.6.1 fleet in a network namespace:
//! two aggregated `dynamo.mocker` workers (one with dp=2, so three ranks), the real
//! `dynamo.frontend --router-mode direct` as the shim, the real control plane indexing the
//! workers' kv-events, and two data-plane replicas rendering, hashing and asking `FindMatches`.
//!
//! * Hash conformance: the replica's rendering and XXH3 block hashes of a chat request equal
//!   the `tokens_hash` chain the worker publishes for it, byte for byte.
//! * Affinity: a multi-turn conversation with a long shared prefix keeps landing on the rank
//!   that holds it, through either replica; unrelated prefixes take every rank in turn; the
//!   replicas count `overlap` selections.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use continuum_data_plane::kv::artifacts::{ArtifactPolicy, ArtifactStore, Fetcher, ModelArtifacts};
use continuum_data_plane::kv::hashing::BlockSize;
use continuum_data_plane::kv::render::Renderer;
use continuum_data_plane::kv::{KvPrompt, PreparedPrompt};
use continuum_tests::dynamo::{self, InstanceWatch, Mocker, Mode};
use continuum_tests::dynamo_kv::{KvTap, channel_endpoints, kv_control_plane_yaml, tinymodel_pins};
use continuum_tests::dynamo_routing::{self, CONTROL_PLANE_GRPC, FRONTEND, Outcome, Pins, RoutedContinuum, post_chat};
use continuum_tests::netns::NetNs;
use continuum_tests::tools::{self, dynamo_fixtures};
use serde_json::{Value, json};

const AGG: Mocker = Mocker { mode: Mode::Aggregated, kv_blocks: 1024, dp_size: 1 };
const AGG_DP2: Mocker = Mocker { mode: Mode::Aggregated, kv_blocks: 1024, dp_size: 2 };
const BLOCK: u32 = 16;
const REQUEST_MAX_TIME: Duration = Duration::from_secs(20);
/// Generous on a loaded 2-core machine, where a lookup that misses would score a request on
/// load alone and fail a routing assertion; the lookup normally answers in well under 1 ms.
const FIND_MATCHES_DEADLINE: &str = "2s";
const TURNS: usize = 6;
const UNRELATED: usize = 6;

fn pins() -> anyhow::Result<Vec<String>> {
    tinymodel_pins()
}

fn kv_yaml(cache_dir: &std::path::Path) -> anyhow::Result<String> {
    kv_control_plane_yaml(cache_dir, &[])
}

/// A long system prompt shared by every turn of conversation `n`, then the turns so far.
fn conversation(n: usize, turns: usize) -> Value {
    let words = ["alpha", "brisk", "cobalt", "dune", "ember", "fjord", "glade", "harbor", "island", "jasper"];
    let system: Vec<String> =
        (0..160).map(|i| format!("{}{}", words[(i * 7 + n * 3) % words.len()], (i * 31 + n) % 97)).collect();
    let mut messages = vec![json!({"role": "system", "content": format!("conversation {n}: {}", system.join(" "))})];
    for t in 0..turns {
        messages.push(json!({"role": "user", "content": format!("question {t} about topic {n}")}));
        if t + 1 < turns {
            messages.push(json!({"role": "assistant", "content": format!("answer {t}")}));
        }
    }
    json!({"model": "tiny", "messages": messages, "max_tokens": 2, "stream": false,
           "nvext": {"extra_fields": ["worker_id"]}})
}

/// The replica's own renderer and hasher, loaded from the pinned fixture files.
async fn reference_prompt(cache: PathBuf) -> anyhow::Result<(KvPrompt, ModelArtifacts)> {
    let mut policy = ArtifactPolicy::new(cache);
    policy.pinned_artifacts = pins()?.iter().map(|p| p.parse()).collect::<Result<_, _>>()?;
    let counter = prometheus::IntCounterVec::new(prometheus::Opts::new("a", "a"), &["result"])?;
    let store = ArtifactStore::new(policy, Fetcher::from_env(), counter, ArtifactStore::system_clock())?;
    let dir = dynamo_fixtures().join("tinymodel");
    let card = json!({
        "tokenizer": {"hf_tokenizer_json": {"path": dir.join("tokenizer.json"), "checksum": pins()?[0]}},
        "prompt_formatter": {"hf_tokenizer_config_json": {"path": dir.join("tokenizer_config.json"), "checksum": pins()?[1]}},
    });
    let card = ModelArtifacts::from_card(&card)?;
    store.load("tiny", std::slice::from_ref(&card)).await.map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok((KvPrompt::new(store, Renderer::default()), card))
}

async fn prepare(prompt: &KvPrompt, card: &ModelArtifacts, body: &Value) -> anyhow::Result<(PreparedPrompt, Vec<u64>)> {
    let prepared = prompt
        .prepare("tiny", std::slice::from_ref(card), Arc::new(body.clone()), &[BLOCK], None, None)
        .await
        .map_err(|f| anyhow::anyhow!("prepare: {f}"))?;
    let hashes =
        prepared.hashes_for(BlockSize::new(BLOCK)?).context("block size 16 hashed")?.iter().map(|h| h.0).collect();
    Ok((prepared, hashes))
}

async fn answered(ns: &NetNs, base: &str, body: &Value, headers: &[(&str, &str)]) -> anyhow::Result<(Pins, Value)> {
    match post_chat(ns, base, body, headers, REQUEST_MAX_TIME).await? {
        Outcome::Answered(a) if a.status == 200 => {
            let disclosed = if headers.iter().any(|(n, _)| *n == "x-backend") { Some(a.disclosed()?) } else { None };
            let echo = dynamo_routing::buffered_echo(&a.body)?;
            // An aggregated worker prefills its own requests: the frontend echoes it as both.
            if let Some(disclosed) = disclosed {
                let same = (disclosed.decode, disclosed.decode_dp_rank) == (echo.decode, echo.decode_dp_rank);
                ensure!(same, "the replica disclosed {disclosed:?}, the frontend used {echo:?}");
            }
            Ok((echo, serde_json::from_str(&a.body)?))
        }
        Outcome::Answered(a) => bail!("status {}: {}", a.status, a.body),
        Outcome::TimedOut => bail!("the request hung"),
    }
}

fn metric(text: &str, series: &str) -> f64 {
    continuum_tests::sample(text, series).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_hashes_match_the_workers_and_conversations_stick_to_the_rank_holding_their_prefix() -> anyhow::Result<()>
{
    let ns = NetNs::create()?;
    dynamo::start_etcd(&ns).await?;
    let watch = InstanceWatch::start(&ns).await?;
    let cache = ns.dir().join("kv-artifacts");
    let replica_args = ["--find-matches-deadline", FIND_MATCHES_DEADLINE];
    let continuum = RoutedContinuum::start_with(&ns, 2, &kv_yaml(&cache)?, &replica_args).await?;
    dynamo_routing::start_frontend(&ns)?;
    let solo = AGG.start(&ns, &watch, "agg-a").await?.instance.instance_id;
    let pair = AGG_DP2.start(&ns, &watch, "agg-b").await?.instance.instance_id;
    continuum.wait_for_workers(&ns, 2).await?;
    dynamo_routing::wait_model_listed(&ns, "frontend", &format!("http://{FRONTEND}"), "tiny").await?;
    let tap = KvTap::start(&ns, &channel_endpoints(&ns, "kv-events").await?).await?;
    let (prompt, card) = reference_prompt(ns.dir().join("reference-artifacts")).await?;

    // Hash conformance: pinned straight to `solo` through the frontend, our chain must be what
    // the worker stores.
    let body = conversation(99, 1);
    let (prepared, ours) = prepare(&prompt, &card, &body).await?;
    ensure!(ours.len() >= 8, "a prompt of several blocks: {} tokens", prepared.tokens.len());
    let pin = solo.to_string();
    let (_, completion) =
        answered(&ns, &format!("http://{FRONTEND}"), &body, &[("x-dynamo-worker-instance-id", &pin)]).await?;
    ensure!(
        completion["usage"]["prompt_tokens"] == prepared.tokens.len(),
        "the frontend tokenized {} tokens, we rendered {}",
        completion["usage"]["prompt_tokens"],
        prepared.tokens.len()
    );
    let stored = tap.wait_stored(solo, ours.len(), REQUEST_MAX_TIME).await?;
    assert_eq!(stored[..ours.len()], ours[..], "our block hashes are the worker's tokens_hash chain");

    // A replica loads a model's tokenizer in the background on its first request (scored on
    // load alone meanwhile); warm both before counting.
    let disclose = [("x-backend", "any")];
    for replica in &continuum.replicas {
        answered(&ns, replica, &conversation(98, 1), &disclose).await?;
        wait_metric(&ns, &format!("{replica}/metrics"), "continuum_dynamo_kv_artifacts_total{result=\"loaded\"}")
            .await?;
    }
    let overlap_before = overlap_selections(&ns, &continuum).await?;

    // Affinity: each turn extends the conversation; whichever rank took the first turn holds
    // its prefix and takes every later turn, through either replica.
    let (first, _) = answered(&ns, &continuum.replicas[0], &conversation(1, 1), &disclose).await?;
    let holder = (first.decode, first.decode_dp_rank);
    let (_, first_hashes) = prepare(&prompt, &card, &conversation(1, 1)).await?;
    tap.wait_stored(first.decode, 1, REQUEST_MAX_TIME).await?;
    wait_indexed(&ns, holder, &first_hashes).await?;
    for turn in 2..=TURNS {
        let replica = &continuum.replicas[turn % 2];
        let (pins, _) = answered(&ns, replica, &conversation(1, turn), &disclose).await?;
        assert_eq!((pins.decode, pins.decode_dp_rank), holder, "turn {turn} through {replica} left the prefix's rank");
    }

    // Unrelated prefixes, sent one at a time: nothing to reuse and every rank idle, so each
    // goes to the rank the fleet sent a dispatch longest ago, whichever replica sent that one.
    let mut ranks = BTreeSet::new();
    for n in 0..UNRELATED {
        let (pins, _) = answered(&ns, &continuum.replicas[n % 2], &conversation(10 + n, 1), &disclose).await?;
        ranks.insert((pins.decode, pins.decode_dp_rank));
    }
    ensure!(ranks.len() == 3, "{UNRELATED} unrelated prefixes took {ranks:?}, not all three ranks in turn");
    ensure!(ranks.iter().all(|(w, _)| *w == solo || *w == pair));

    let overlap = overlap_selections(&ns, &continuum).await? - overlap_before;
    ensure!(overlap >= (TURNS - 1) as f64, "every later turn was scored with its overlap: {overlap}");
    Ok(())
}

/// `continuum_dynamo_kv_selection_total{result="overlap"}` summed over the replicas, which
/// must never have refused the pinned artifacts.
async fn overlap_selections(ns: &NetNs, continuum: &RoutedContinuum) -> anyhow::Result<f64> {
    let mut overlap = 0.0;
    for replica in &continuum.replicas {
        let (_, text) = ns.get(&format!("{replica}/metrics")).await?;
        let scored = metric(&text, "continuum_dynamo_kv_selection_total{result=\"overlap\"}");
        ensure!(metric(&text, "continuum_dynamo_kv_selection_total{result=\"artifact_unpinned\"}") == 0.0);
        // Every scored selection was timed at both stages of its KV term.
        let timed =
            |stage: &str| metric(&text, &format!("continuum_dynamo_kv_term_seconds_count{{stage=\"{stage}\"}}"));
        ensure!(timed("find_matches") >= scored && timed("prepare") >= timed("find_matches"), "{text}");
        overlap += scored;
    }
    Ok(overlap)
}

async fn wait_metric(ns: &NetNs, url: &str, series: &str) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + REQUEST_MAX_TIME;
    loop {
        let (_, text) = ns.get(url).await?;
        if metric(&text, series) > 0.0 {
            return Ok(());
        }
        ensure!(std::time::Instant::now() < deadline, "{series} stayed 0 at {url}:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the control plane's index credits `hashes` to `holder` (kv-events reach it a
/// few milliseconds after the worker stores the blocks), asking `FindMatches` as a replica does,
/// with grpcurl over reflection.
async fn wait_indexed(ns: &NetNs, holder: (u64, Option<u64>), hashes: &[u64]) -> anyhow::Result<()> {
    let request = json!({"block_hashes": hashes.iter().map(u64::to_string).collect::<Vec<_>>()}).to_string();
    let deadline = std::time::Instant::now() + REQUEST_MAX_TIME;
    loop {
        let mut grpcurl = ns.command(tools::grpcurl());
        grpcurl.args(["-plaintext", "-d", &request, CONTROL_PLANE_GRPC, "continuum.fleet.v1.Fleet/FindMatches"]);
        let reply: Value = serde_json::from_str(&ns.run(grpcurl).await?).unwrap_or_default();
        let held = reply["overlaps"].as_array().into_iter().flatten().any(|o| {
            o["instanceId"].as_str().and_then(|id| id.parse::<u64>().ok()) == Some(holder.0)
                && o["dpRank"].as_u64().unwrap_or(0) == holder.1.unwrap_or(0)
                && o["blocks"].as_u64() == Some(hashes.len() as u64)
        });
        if held {
            return Ok(());
        }
        ensure!(std::time::Instant::now() < deadline, "FindMatches never credited {holder:?}: {reply}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
