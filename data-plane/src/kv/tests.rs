//! End-to-end tests of the prompt path against the real Dynamo 1.6.1 captures: the tiny model's
//! tokenizer and chatml template, its model card, and the kv-events its mocker published.

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use continuum_proto::model::PromptDefaults;
use prometheus::{IntCounterVec, Opts};
use serde_json::{Value, json};

use super::artifacts::{
    ArtifactPolicy, ArtifactStore, CheckedFile, Checksum, Clock, FAILED_LOAD_RETRY, Fetcher, LoadError,
    LoadedArtifacts, MAX_LOADED_TOKENIZERS, ModelArtifacts,
};
use super::hashing::{BlockSize, LocalBlockHash, SaltHash};
use super::render::{RenderLimits, RenderStages, Renderer, Warmed, prepare_blocking};
use super::{Fallback, KvPrompt, request_cache_salt};

/// The real Dynamo 1.6.1 captures and tiny model, in the workspace.
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/dynamo-1.6.1");

pub(crate) fn fixture(path: &str) -> PathBuf {
    Path::new(FIXTURES).join(path)
}

pub(crate) fn tinymodel_config() -> Value {
    serde_json::from_slice(&std::fs::read(fixture("tinymodel/tokenizer_config.json")).unwrap()).unwrap()
}

/// The tiny model's card with its paths pointing at `dir` (the capture recorded /tmp/dynpeer).
fn card_in(dir: &Path) -> ModelArtifacts {
    let file = |name: &str| {
        let path = dir.join(name);
        let bytes = std::fs::read(fixture(&format!("tinymodel/{name}"))).unwrap();
        CheckedFile { path: path.display().to_string(), checksum: Checksum::of(&bytes), size: Some(bytes.len() as u64) }
    };
    ModelArtifacts {
        tokenizer: file("tokenizer.json"),
        tokenizer_config: file("tokenizer_config.json"),
        chat_template: None,
        defaults: Default::default(),
    }
}

fn counter() -> IntCounterVec {
    IntCounterVec::new(Opts::new("continuum_dynamo_kv_artifacts_total", "test"), &["result"]).unwrap()
}

fn count(counter: &IntCounterVec, result: &str) -> u64 {
    counter.with_label_values(&[result]).get()
}

/// A clock the test moves by hand.
fn manual_clock() -> (Clock, Arc<AtomicU64>) {
    let start = Instant::now();
    let offset = Arc::new(AtomicU64::new(0));
    let read = offset.clone();
    (Arc::new(move || start + Duration::from_secs(read.load(Ordering::SeqCst))), offset)
}

struct Harness {
    store: ArtifactStore,
    counter: IntCounterVec,
    cache_dir: tempfile::TempDir,
    offset: Arc<AtomicU64>,
}

fn harness(pinned: impl IntoIterator<Item = Checksum>) -> Harness {
    let cache_dir = tempfile::tempdir().unwrap();
    harness_in(cache_dir, pinned)
}

fn harness_in(cache_dir: tempfile::TempDir, pinned: impl IntoIterator<Item = Checksum>) -> Harness {
    let mut policy = ArtifactPolicy::new(cache_dir.path().join("kv"));
    policy.pinned_artifacts = pinned.into_iter().collect();
    let counter = counter();
    let (clock, offset) = manual_clock();
    let store =
        ArtifactStore::new(policy, Fetcher::new("http://127.0.0.1:9".into(), None), counter.clone(), clock).unwrap();
    Harness { store, counter, cache_dir, offset }
}

fn pinned(card: &ModelArtifacts) -> Vec<Checksum> {
    card.files().map(|f| f.checksum).collect()
}

async fn loaded_tinymodel() -> Arc<LoadedArtifacts> {
    let card = card_in(&fixture("tinymodel"));
    let h = harness(pinned(&card));
    h.store.load("tiny", std::slice::from_ref(&card)).await.unwrap()
}

fn chat(content: &str) -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4})
}

fn sizes(sizes: &[u32]) -> Vec<BlockSize> {
    sizes.iter().map(|&s| BlockSize::new(s).unwrap()).collect()
}

/// Every `tokens_hash` the aggregated mocker published in `stored` kv-events.
fn published_tokens_hashes() -> HashSet<u64> {
    let text = std::fs::read_to_string(fixture("agg/zmq-messages.jsonl")).unwrap();
    let mut hashes = HashSet::new();
    for line in text.lines() {
        let record: Value = serde_json::from_str(line).unwrap();
        for event in record.pointer("/decoded/payload").and_then(Value::as_array).into_iter().flatten() {
            let blocks = event.pointer("/event/data/stored/blocks").and_then(Value::as_array);
            hashes.extend(blocks.into_iter().flatten().filter_map(|b| b["tokens_hash"].as_u64()));
        }
    }
    hashes
}

/// The chat requests of the capture whose responses report `prompt_tokens`.
fn captured_prompts() -> Vec<(String, Value, usize)> {
    let text = std::fs::read_to_string(fixture("agg/http-exchanges.jsonl")).unwrap();
    text.lines()
        .map(|line| serde_json::from_str::<Value>(line).unwrap())
        .filter_map(|exchange| {
            let name = exchange["name"].as_str()?.to_string();
            let body = exchange.pointer("/response/body").and_then(Value::as_str)?;
            let usage = body.split("\"prompt_tokens\":").nth(1)?;
            let tokens = usage.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()?;
            Some((name, exchange["request"]["body"].clone(), tokens))
        })
        .collect()
}

#[tokio::test]
async fn tinymodel_prompts_hash_to_what_the_real_mocker_published() {
    let artifacts = loaded_tinymodel().await;
    let published = published_tokens_hashes();
    let prompts: Vec<_> = captured_prompts().into_iter().filter(|(name, ..)| name.starts_with("kv_prompt_")).collect();
    assert_eq!(prompts.len(), 4, "the capture holds kv_prompt_0..3");
    for (name, request, prompt_tokens) in prompts {
        let prepared = prepare_blocking(
            &artifacts,
            &request,
            PromptDefaults::default(),
            &sizes(&[16]),
            SaltHash::default(),
            1 << 20,
        )
        .unwrap();
        assert_eq!(prepared.tokens.len(), prompt_tokens, "{name}: token count as dynamo.frontend reported");
        let hashes = prepared.hashes_for(BlockSize::new(16).unwrap()).unwrap();
        assert_eq!(hashes.len(), prompt_tokens / 16, "{name}");
        for LocalBlockHash(hash) in hashes {
            assert!(published.contains(hash), "{name}: block hash {hash} was never published by the worker");
        }
    }
}

#[tokio::test]
async fn first_captured_block_is_the_hello_world_prompt() {
    let artifacts = loaded_tinymodel().await;
    let request = chat("Hello world, the quick brown fox");
    let prepared = prepare_blocking(
        &artifacts,
        &request,
        PromptDefaults::default(),
        &sizes(&[16, 32]),
        SaltHash::default(),
        1 << 20,
    )
    .unwrap();
    assert_eq!(prepared.tokens.len(), 17);
    assert_eq!(prepared.hashes_for(BlockSize::new(16).unwrap()).unwrap(), [LocalBlockHash(9_503_089_339_561_884_111)]);
    assert_eq!(prepared.hashes_for(BlockSize::new(32).unwrap()).unwrap(), []);
    // A salt changes every hash; the tokens stay the same.
    let salted = prepare_blocking(
        &artifacts,
        &request,
        PromptDefaults::default(),
        &sizes(&[16]),
        SaltHash::new(Some("s"), None),
        1 << 20,
    )
    .unwrap();
    assert_eq!(salted.tokens, prepared.tokens);
    assert_ne!(salted.hashes, prepared.hashes);
}

/// A request body, noting where it was dropped.
struct NotesDrop {
    body: Value,
    dropped_on: Arc<std::sync::Mutex<Option<String>>>,
}

impl std::borrow::Borrow<Value> for NotesDrop {
    fn borrow(&self) -> &Value {
        &self.body
    }
}

impl Drop for NotesDrop {
    fn drop(&mut self) {
        let thread = std::thread::current().name().unwrap_or_default().to_string();
        *self.dropped_on.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(thread);
    }
}

/// A render hands its request back with the result: the last holder of a large body's tree
/// frees it on the runtime (which sends it to the blocking pool), not on the render thread
/// before the result goes out.
#[tokio::test]
async fn a_rendered_request_is_not_freed_on_the_render_thread() {
    let card = card_in(&fixture("tinymodel"));
    let h = harness(pinned(&card));
    let kv = KvPrompt::new(h.store.clone(), Renderer::default());
    let _ = kv.prepare("tiny", std::slice::from_ref(&card), Arc::new(chat("hi")), &[16], None, None).await;
    assert!(until_loaded(&h.store, 1).await);
    let dropped_on = Arc::new(std::sync::Mutex::new(None));
    let request = NotesDrop { body: chat("Hello world, the quick brown fox"), dropped_on: Arc::clone(&dropped_on) };
    let prepared = kv.prepare("tiny", std::slice::from_ref(&card), Arc::new(request), &[16], None, None).await;
    assert!(prepared.is_ok(), "{prepared:?}");
    let thread = dropped_on.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    assert!(thread.as_deref().is_some_and(|name| name != "continuum-render"), "dropped on {thread:?}");
}

#[tokio::test]
async fn prepare_uses_the_fleet_tokenizer_once_loaded() {
    let card = card_in(&fixture("tinymodel"));
    let h = harness(pinned(&card));
    let kv = KvPrompt::new(h.store.clone(), Renderer::default());
    let request = chat("Hello world, the quick brown fox");
    let first = kv.prepare("tiny", &[card.clone(), card.clone()], Arc::new(request.clone()), &[16], None, None).await;
    assert_eq!(first, Err(Fallback::TokenizerUnavailable), "the first request starts the load and does not wait");
    assert!(until_loaded(&h.store, 1).await);
    let prepared =
        kv.prepare("tiny", &[card.clone(), card.clone()], Arc::new(request.clone()), &[16], None, None).await.unwrap();
    assert_eq!(prepared.hashes_for(BlockSize::new(16).unwrap()).unwrap(), [LocalBlockHash(9_503_089_339_561_884_111)]);
    assert_eq!(count(&h.counter, "loaded"), 1);
    assert_eq!(count(&h.counter, "fetched"), 2);

    let mut upgraded = card.clone();
    upgraded.tokenizer_config.checksum = Checksum::of(b"another template");
    let disagree = kv.prepare("tiny", &[card.clone(), upgraded], Arc::new(request.clone()), &[16], None, None).await;
    assert_eq!(disagree, Err(Fallback::TokenizerUnavailable));

    let bad_sizes =
        kv.prepare("tiny", std::slice::from_ref(&card), Arc::new(request.clone()), &[8, 70_000], None, None).await;
    assert_eq!(bad_sizes, Err(Fallback::TokenizerUnavailable));
    assert_eq!(count(&h.counter, "unsupported"), 2);
    let three = kv
        .prepare("tiny", std::slice::from_ref(&card), Arc::new(request.clone()), &[16, 32, 64], None, None)
        .await
        .unwrap();
    assert_eq!(three.hashes.len(), 2, "at most two block sizes per model");
    assert_eq!(count(&h.counter, "unsupported"), 3);
    // Once per model and size, not per request: the count is no request rate.
    kv.prepare("tiny", &[card], Arc::new(request.clone()), &[8, 16, 32, 64], None, None).await.unwrap();
    assert_eq!(count(&h.counter, "unsupported"), 3);
}

#[tokio::test]
async fn a_cards_prompt_defaults_shape_what_its_template_renders() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = tinymodel_config();
    config["chat_template"] = json!(
        "{% if tools %}tools {% endif %}{% if enable_thinking is defined %}thinking {{ enable_thinking }} {% endif %}\
         {% for m in messages %}{{ m.content }}{% endfor %}"
    );
    let files = [
        ("tokenizer.json", std::fs::read(fixture("tinymodel/tokenizer.json")).unwrap()),
        ("tokenizer_config.json", serde_json::to_vec(&config).unwrap()),
    ];
    let checked = |(name, bytes): &(&str, Vec<u8>)| {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        CheckedFile { path: path.display().to_string(), checksum: Checksum::of(bytes), size: Some(bytes.len() as u64) }
    };
    let plain = ModelArtifacts {
        tokenizer: checked(&files[0]),
        tokenizer_config: checked(&files[1]),
        chat_template: None,
        defaults: PromptDefaults::default(),
    };
    let h = harness(pinned(&plain));
    let kv = KvPrompt::new(h.store.clone(), Renderer::default());
    let tokens = async |card: &ModelArtifacts, request: Value| {
        let prepared = kv.prepare("tiny", std::slice::from_ref(card), Arc::new(request), &[16], None, None).await;
        prepared.unwrap().tokens
    };
    assert_eq!(
        kv.prepare("tiny", std::slice::from_ref(&plain), Arc::new(chat("hi")), &[16], None, None).await,
        Err(Fallback::TokenizerUnavailable)
    );
    assert!(until_loaded(&h.store, 1).await);

    let mut with_tools = chat("hi");
    with_tools["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
    let mut choice_none = with_tools.clone();
    choice_none["tool_choice"] = json!("none");
    let keeps_tools = ModelArtifacts {
        defaults: PromptDefaults { keep_tools_when_tool_choice_none: true, ..PromptDefaults::default() },
        ..plain.clone()
    };
    assert_ne!(tokens(&plain, with_tools.clone()).await, tokens(&plain, chat("hi")).await, "the template prints tools");
    assert_eq!(tokens(&plain, choice_none.clone()).await, tokens(&plain, chat("hi")).await, "dropped by default");
    assert_eq!(tokens(&keeps_tools, choice_none).await, tokens(&plain, with_tools).await, "kept as the card asks");

    let thinks_not = ModelArtifacts {
        defaults: PromptDefaults { default_thinking: Some(false), ..PromptDefaults::default() },
        ..plain.clone()
    };
    let mut switched_off = chat("hi");
    switched_off["thinking"] = json!(false);
    let mut switched_on = chat("hi");
    switched_on["thinking"] = json!(true);
    let off = tokens(&plain, switched_off).await;
    assert_ne!(off, tokens(&plain, chat("hi")).await);
    assert_eq!(tokens(&thinks_not, chat("hi")).await, off, "the card's default for a request that sets none");
    assert_eq!(tokens(&thinks_not, switched_on.clone()).await, tokens(&plain, switched_on).await, "the client's wins");
}

/// Waits (a bounded while) for the store to hold `n` loaded artifact sets.
async fn until_loaded(store: &ArtifactStore, n: usize) -> bool {
    // A minute, as `ingress::select`'s tests allow: the blocking pool is shared on two cores.
    for _ in 0..6000 {
        if store.loaded().0 == n {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

#[tokio::test]
async fn prewarming_loads_pinned_artifacts_before_the_first_request_and_never_touches_unpinned_ones() {
    let card = card_in(&fixture("tinymodel"));
    let h = harness(pinned(&card));
    h.store.prewarm("tiny", std::slice::from_ref(&card));
    assert!(until_loaded(&h.store, 1).await, "the prewarm loaded the tokenizer");
    let kv = KvPrompt::new(h.store.clone(), Renderer::default());
    let request = chat("Hello world, the quick brown fox");
    let first = kv.prepare("tiny", std::slice::from_ref(&card), Arc::new(request.clone()), &[16], None, None).await;
    assert!(first.is_ok(), "the first request is scored with its KV term");
    h.store.prewarm("tiny", std::slice::from_ref(&card));
    assert_eq!(count(&h.counter, "loaded"), 1, "a loaded set is not loaded again");

    let dir = tempfile::tempdir().unwrap();
    let unpinned = card_in(dir.path());
    let h = harness(Vec::new());
    h.store.prewarm("tiny", std::slice::from_ref(&unpinned));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(h.store.loaded().0, 0);
    assert_eq!(count(&h.counter, "unpinned"), 0, "a refusal is counted when a request meets it");
    assert_eq!(count(&h.counter, "fetched") + count(&h.counter, "loaded"), 0);
}

#[tokio::test]
async fn a_loaded_tokenizer_is_warmed_once_before_any_request_sees_it() {
    let card = card_in(&fixture("tinymodel"));
    let h = harness(pinned(&card));
    let (store, warmed) = (h.store.clone(), Arc::new(AtomicU64::new(0)));
    let seen = Arc::clone(&warmed);
    h.store.warm_with(Box::new(move |artifacts| {
        // While the warm runs, the store does not serve the set yet.
        let served = store.loaded().0 > 0;
        let seen = Arc::clone(&seen);
        Box::pin(async move {
            assert!(!served, "the tokenizer is served only once warm");
            assert!(artifacts.tokenizer.get_vocab_size(true) > 0);
            seen.fetch_add(1, Ordering::SeqCst);
        })
    }));
    h.store.load("tiny", std::slice::from_ref(&card)).await.unwrap();
    h.store.load("tiny", std::slice::from_ref(&card)).await.unwrap();
    assert_eq!(warmed.load(Ordering::SeqCst), 1, "a set already loaded is not warmed again");
}

#[tokio::test]
async fn warming_renders_a_long_probe_on_each_permit_s_own_thread() {
    let artifacts = loaded_tinymodel().await;
    let renderer = Renderer::new(RenderLimits { permits: 4, ..RenderLimits::default() });
    let warmed = renderer.warm(Arc::clone(&artifacts)).await;
    assert_eq!(warmed, Warmed { rendered: 4, threads: 4 });

    assert_eq!(renderer.permits_available(), 4, "each probe gave its permit back");
    // A render in progress holds a permit: warming takes only the free ones, without waiting.
    let held = renderer.hold_permit();
    assert_eq!(renderer.warm(Arc::clone(&artifacts)).await.rendered, 3);
    drop(held);
    assert_eq!(renderer.permits_available(), 4);
    assert_eq!(artifacts.pieces.len(), 0, "the probes encode whole: they leave no pieces behind");
    let request = chat("and a request after them still encodes");
    let prepared =
        prepare_blocking(&artifacts, &request, PromptDefaults::default(), &sizes(&[16]), SaltHash::default(), 1 << 20)
            .unwrap();
    assert!(!prepared.tokens.is_empty());
}

#[tokio::test]
async fn unpinned_artifacts_are_never_read() {
    let dir = tempfile::tempdir().unwrap();
    let card = card_in(dir.path()); // the files do not even exist: nothing may try to read them
    let mut partly = pinned(&card);
    partly.pop();
    let h = harness(partly);
    assert_eq!(h.store.lookup("tiny", std::slice::from_ref(&card)).unwrap_err(), Fallback::ArtifactUnpinned);
    assert!(
        matches!(h.store.load("tiny", std::slice::from_ref(&card)).await, Err(LoadError::Unpinned(c)) if c == card.tokenizer_config.checksum)
    );
    assert_eq!(count(&h.counter, "unpinned"), 2);
    assert_eq!(count(&h.counter, "fetch_failed") + count(&h.counter, "fetched"), 0);
    let blobs = std::fs::read_dir(h.cache_dir.path().join("kv/blobs")).unwrap().count();
    assert_eq!(blobs, 0, "nothing was cached");
}

fn copy_tinymodel(dir: &Path) {
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture(&format!("tinymodel/{name}")), dir.join(name)).unwrap();
    }
}

#[tokio::test]
async fn a_tampered_source_is_never_loaded() {
    let dir = tempfile::tempdir().unwrap();
    copy_tinymodel(dir.path());
    let card = card_in(dir.path());
    let tampered = tinymodel_config().to_string().replace("<|im_start|>", "<|evil|>");
    std::fs::write(dir.path().join("tokenizer_config.json"), tampered).unwrap();
    let h = harness(pinned(&card));
    assert!(matches!(h.store.load("tiny", std::slice::from_ref(&card)).await, Err(LoadError::ChecksumMismatch { .. })));
    assert_eq!(count(&h.counter, "checksum_mismatch"), 1);
    assert_eq!(count(&h.counter, "loaded"), 0);
    assert_eq!(h.store.loaded(), (0, 0));
    assert!(!h.cache_dir.path().join("kv/blobs").join(card.tokenizer_config.checksum.hex()).exists());
}

#[tokio::test]
async fn a_tampered_cache_blob_is_evicted_and_the_source_reverified() {
    let card = card_in(&fixture("tinymodel"));
    let first = harness(pinned(&card));
    first.store.load("tiny", std::slice::from_ref(&card)).await.unwrap();
    let blob = first.cache_dir.path().join("kv/blobs").join(card.tokenizer_config.checksum.hex());
    assert!(blob.exists());
    let tampered = tinymodel_config().to_string().replace("<|im_start|>", "<|evil|>");
    std::fs::write(&blob, tampered).unwrap();

    // A fresh store over the same cache, as after a restart.
    let second = harness_in(first.cache_dir, pinned(&card));
    let loaded = second.store.load("tiny", std::slice::from_ref(&card)).await.unwrap();
    assert_eq!(count(&second.counter, "checksum_mismatch"), 1);
    assert_eq!(count(&second.counter, "cached"), 1, "the untouched tokenizer.json blob verified");
    assert_eq!(count(&second.counter, "fetched"), 1, "the config was read again from its source");
    let text = loaded.template.render(&chat("hi")).unwrap();
    assert!(text.starts_with("<|im_start|>user") && !text.contains("evil"));
    assert!(Checksum::of(&std::fs::read(&blob).unwrap()) == card.tokenizer_config.checksum, "the blob was rewritten");
}

#[tokio::test]
async fn oversized_and_refused_artifacts_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    copy_tinymodel(dir.path());
    let mut card = card_in(dir.path());
    card.tokenizer.size = Some(65 << 20);
    let h = harness(pinned(&card));
    assert!(matches!(h.store.load("tiny", std::slice::from_ref(&card)).await, Err(LoadError::TooLarge { .. })));
    assert_eq!(count(&h.counter, "too_large"), 1);

    let mut hub = card_in(dir.path());
    hub.tokenizer.path = "hf://Qwen/Qwen3-0.6B/tokenizer.json".into();
    let h = harness(pinned(&hub));
    assert!(matches!(h.store.load("tiny", std::slice::from_ref(&hub)).await, Err(LoadError::Source { .. })));
    assert_eq!(count(&h.counter, "refused_scheme"), 1);
    assert_eq!(count(&h.counter, "fetched"), 0, "nothing was read once one artifact was refused");
}

#[tokio::test]
async fn a_failed_load_is_retried_after_five_minutes() {
    let dir = tempfile::tempdir().unwrap();
    let card = card_in(dir.path()); // missing files: the read fails
    let h = harness(pinned(&card));
    assert!(matches!(h.store.load("tiny", std::slice::from_ref(&card)).await, Err(LoadError::Fetch(_))));
    assert!(matches!(h.store.load("tiny", std::slice::from_ref(&card)).await, Err(LoadError::RetryLater)));
    assert_eq!(h.store.lookup("tiny", std::slice::from_ref(&card)).unwrap_err(), Fallback::TokenizerUnavailable);
    assert_eq!(count(&h.counter, "fetch_failed"), 1, "no second attempt while backing off");
    h.offset.store(FAILED_LOAD_RETRY.as_secs() - 1, Ordering::SeqCst);
    assert!(matches!(h.store.load("tiny", std::slice::from_ref(&card)).await, Err(LoadError::RetryLater)));
    copy_tinymodel(dir.path());
    h.offset.store(FAILED_LOAD_RETRY.as_secs(), Ordering::SeqCst);
    h.store.load("tiny", std::slice::from_ref(&card)).await.unwrap();
    assert_eq!(count(&h.counter, "loaded"), 1);
}

/// A failed load backs off the places it read, not the files: another model (or deployment)
/// naming the same pinned files where they can be read loads at once, and serves both.
#[tokio::test]
async fn a_failed_load_does_not_hold_up_the_same_files_named_elsewhere() {
    let missing = tempfile::tempdir().unwrap();
    let (unreadable, readable) = (card_in(missing.path()), card_in(&fixture("tinymodel")));
    let h = harness(pinned(&readable));
    assert!(matches!(h.store.load("a", std::slice::from_ref(&unreadable)).await, Err(LoadError::Fetch(_))));
    assert!(matches!(h.store.load("a", std::slice::from_ref(&unreadable)).await, Err(LoadError::RetryLater)));
    h.store.load("b", std::slice::from_ref(&readable)).await.unwrap();
    assert_eq!(count(&h.counter, "loaded"), 1);
    assert!(
        h.store.load("a", std::slice::from_ref(&unreadable)).await.is_ok(),
        "the files are loaded, whoever named them"
    );
}

/// Two models sharing a tokenizer whose cards name places this replica cannot read (each
/// worker's own disk) each wait out their own failure: loads taking turns between them do not
/// start over at every request.
#[tokio::test]
async fn loads_from_two_unreadable_places_each_back_off() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (in_a, in_b) = (card_in(a.path()), card_in(b.path()));
    let h = harness(pinned(&in_a));
    assert!(matches!(h.store.load("a", std::slice::from_ref(&in_a)).await, Err(LoadError::Fetch(_))));
    assert!(matches!(h.store.load("b", std::slice::from_ref(&in_b)).await, Err(LoadError::Fetch(_))));
    assert!(matches!(h.store.load("a", std::slice::from_ref(&in_a)).await, Err(LoadError::RetryLater)));
    assert!(matches!(h.store.load("b", std::slice::from_ref(&in_b)).await, Err(LoadError::RetryLater)));
    assert_eq!(count(&h.counter, "fetch_failed"), 2, "one failed read of each place");
}

/// What is no longer pinned leaves the disk cache, when the store opens and when the policy
/// changes, as do temporary files a crashed process left (any other process's, once old: its
/// pid may be this one's, in a container); nothing else in it is touched, nor a recent write
/// of another process sharing the directory.
#[tokio::test]
async fn blobs_no_longer_pinned_leave_the_disk_cache() {
    let cache_dir = tempfile::tempdir().unwrap();
    let blobs = cache_dir.path().join("kv/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let (kept, dropped) = (Checksum::of(b"kept"), Checksum::of(b"dropped"));
    let ours = format!(".{}.{}.0.tmp", kept.hex(), crate::kv::artifacts::BlobCache::writer_mark());
    let crashed = format!(".{}.{}.0.tmp", kept.hex(), std::process::id());
    let writing = format!(".{}.1.0.tmp", kept.hex());
    for name in [kept.hex(), dropped.hex(), ours.clone(), crashed.clone(), writing.clone(), "notes.txt".into()] {
        std::fs::write(blobs.join(name), b"x").unwrap();
    }
    let an_hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    std::fs::File::options().write(true).open(blobs.join(&crashed)).unwrap().set_modified(an_hour_ago).unwrap();
    let present = |name: &str| blobs.join(name).exists();
    let h = harness_in(cache_dir, [kept]);
    assert!(present(&kept.hex()) && present(&ours) && present(&writing) && present("notes.txt"));
    assert!(!present(&dropped.hex()) && !present(&crashed), "pruned as the store opened");
    // With every cache file permit taken (a stalled volume), a reload strands no thread on it.
    let stalled = crate::kv::artifacts::hold_cache_file_jobs();
    h.store.set_policy(ArtifactPolicy::new(h.cache_dir.path().join("kv")));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(present(&kept.hex()), "not pruned while no cache file permit is free");
    drop(stalled);
    h.store.set_policy(ArtifactPolicy::new(h.cache_dir.path().join("kv")));
    for _ in 0..500 {
        if !present(&kept.hex()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!present(&kept.hex()), "pruned once its pin went");
    assert!(present("notes.txt"));
}

/// Each worker's card names the files on its own disk: where the first card's copy cannot be
/// read (or is not the pinned bytes), another card's is, and the set loads from it.
#[tokio::test]
async fn files_missing_where_one_card_says_are_read_where_another_says() {
    let (missing, corrupt) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    copy_tinymodel(corrupt.path());
    std::fs::write(corrupt.path().join("tokenizer.json"), b"{}").unwrap();
    let cards = [card_in(missing.path()), card_in(corrupt.path()), card_in(&fixture("tinymodel"))];
    let h = harness(pinned(&cards[0]));
    h.store.load("tiny", &cards).await.unwrap();
    assert_eq!(count(&h.counter, "loaded"), 1);
    assert_eq!(count(&h.counter, "fetched"), 2, "each file once, from the copy that verified");
    // The copies that failed on the way are counted too: a tampered copy is a finding even
    // when another serves.
    assert_eq!(count(&h.counter, "checksum_mismatch"), 1, "the corrupt tokenizer.json");
    assert!(count(&h.counter, "fetch_failed") >= 2, "the missing copies");
    // With only the unreadable copies the load fails, as it did before any card was tried.
    let h = harness(pinned(&cards[0]));
    assert!(matches!(h.store.load("tiny", &cards[..2]).await, Err(LoadError::ChecksumMismatch { .. })));
}

/// A reload that removes the pin while a load runs (here while the set is warmed) leaves
/// nothing loaded: the set is refused as unpinned, never kept in a slot a pinned one needs.
#[tokio::test]
async fn a_pin_removed_while_its_set_loads_leaves_nothing_loaded() {
    let card = card_in(&fixture("tinymodel"));
    let h = harness(pinned(&card));
    let (store, cache_dir) = (h.store.clone(), h.cache_dir.path().join("kv"));
    h.store.warm_with(Box::new(move |_| {
        store.set_policy(ArtifactPolicy::new(cache_dir.clone()));
        Box::pin(async {})
    }));
    assert!(matches!(h.store.load("tiny", std::slice::from_ref(&card)).await, Err(LoadError::Unpinned(_))));
    assert_eq!(h.store.loaded().0, 0);
    assert_eq!(count(&h.counter, "loaded"), 0);
}
/// A reloaded policy may allow what refused a load (a scheme, a pin): the load is tried again
/// at once rather than after its five minutes.
#[tokio::test]
async fn a_reloaded_policy_ends_the_wait_of_a_failed_load() {
    let dir = tempfile::tempdir().unwrap();
    let card = card_in(dir.path());
    let h = harness(pinned(&card));
    assert!(matches!(h.store.load("tiny", std::slice::from_ref(&card)).await, Err(LoadError::Fetch(_))));
    assert!(matches!(h.store.load("tiny", std::slice::from_ref(&card)).await, Err(LoadError::RetryLater)));
    copy_tinymodel(dir.path());
    let mut policy = ArtifactPolicy::new(h.cache_dir.path().join("kv"));
    policy.pinned_artifacts = pinned(&card).into_iter().collect();
    h.store.set_policy(policy);
    h.store.load("tiny", std::slice::from_ref(&card)).await.unwrap();
    assert_eq!(count(&h.counter, "loaded"), 1);
}

#[tokio::test]
async fn loaded_tokenizers_are_bounded_and_unpinning_drops_them() {
    let dir = tempfile::tempdir().unwrap();
    copy_tinymodel(dir.path());
    let mut cards = Vec::new();
    for i in 0..=MAX_LOADED_TOKENIZERS {
        let mut config = tinymodel_config();
        config["variant"] = json!(i);
        let path = dir.path().join(format!("tokenizer_config_{i}.json"));
        std::fs::write(&path, config.to_string()).unwrap();
        let mut card = card_in(dir.path());
        card.tokenizer_config = CheckedFile {
            path: path.display().to_string(),
            checksum: Checksum::of(config.to_string().as_bytes()),
            size: None,
        };
        cards.push(card);
    }
    let all: BTreeSet<Checksum> = cards.iter().flat_map(pinned).collect();
    let h = harness(all.clone());
    for (i, card) in cards.iter().enumerate() {
        h.offset.store(i as u64, Ordering::SeqCst);
        h.store.load("tiny", std::slice::from_ref(card)).await.unwrap();
    }
    assert_eq!(h.store.loaded().0, MAX_LOADED_TOKENIZERS);
    assert_eq!(count(&h.counter, "evicted"), 1);
    assert_eq!(h.store.lookup("tiny", &cards[0..=0]).unwrap_err(), Fallback::TokenizerUnavailable, "the oldest went");
    assert!(h.store.lookup("tiny", &cards[1..=1]).is_ok());

    let mut policy = ArtifactPolicy::new(h.cache_dir.path().join("kv"));
    policy.pinned_artifacts = all.into_iter().filter(|c| *c != cards[1].tokenizer_config.checksum).collect();
    h.store.set_policy(policy);
    assert_eq!(h.store.loaded().0, MAX_LOADED_TOKENIZERS - 1);
    assert_eq!(h.store.lookup("tiny", &cards[1..=1]).unwrap_err(), Fallback::ArtifactUnpinned);
}

#[tokio::test]
async fn rendering_limits_fall_back() {
    let artifacts = loaded_tinymodel().await;
    let size16 = sizes(&[16]);
    let huge = chat(&"x".repeat(1 << 20));
    assert_eq!(
        prepare_blocking(&artifacts, &huge, PromptDefaults::default(), &size16, SaltHash::default(), 1 << 20),
        Err(Fallback::PromptTooLarge)
    );
    let request = chat("Hello world, the quick brown fox");
    assert_eq!(
        prepare_blocking(&artifacts, &request, PromptDefaults::default(), &size16, SaltHash::default(), 16),
        Err(Fallback::PromptTooLarge)
    );
    assert!(
        prepare_blocking(&artifacts, &request, PromptDefaults::default(), &size16, SaltHash::default(), 17).is_ok()
    );
    assert_eq!(
        prepare_blocking(
            &artifacts,
            &json!({"model": "tiny"}),
            PromptDefaults::default(),
            &size16,
            SaltHash::default(),
            17
        ),
        Err(Fallback::RenderUnavailable)
    );
}

/// `renderer` preparing `request` as for a card with no prompt defaults, unsalted, in blocks
/// of 16.
/// dynamo.frontend drops NUL characters from the rendered prompt before encoding it.
#[tokio::test]
async fn nul_characters_are_dropped_before_encoding_as_the_frontend_does() {
    let artifacts = loaded_tinymodel().await;
    let renderer = Renderer::new(RenderLimits::default());
    let with_nul = prepare16(&renderer, &artifacts, &chat("a tool's output:\u{0}\u{0} done")).await.unwrap();
    let without = prepare16(&renderer, &artifacts, &chat("a tool's output: done")).await.unwrap();
    assert_eq!(with_nul.tokens, without.tokens);
}

async fn prepare16(
    renderer: &Renderer,
    artifacts: &Arc<LoadedArtifacts>,
    request: &Value,
) -> Result<super::PreparedPrompt, Fallback> {
    let sizes = sizes(&[16]);
    let request = Arc::new(request.clone());
    renderer.prepare(Arc::clone(artifacts), request, PromptDefaults::default(), &sizes, SaltHash::default()).await
}

/// The tiny tokenizer with a template that burns its whole fuel budget.
fn looping_artifacts(template: &Arc<LoadedArtifacts>) -> Arc<LoadedArtifacts> {
    let config =
        json!({"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"});
    Arc::new(LoadedArtifacts {
        key: template.key,
        tokenizer: template.tokenizer.clone(),
        pieces: super::render::PieceCache::for_tokenizer(&template.tokenizer),
        template: super::render::ChatTemplate::new(&config, None).unwrap(),
        bytes: 0,
    })
}

#[tokio::test]
async fn fuel_permit_wait_and_deadline_fall_back() {
    let artifacts = loaded_tinymodel().await;
    let looping = looping_artifacts(&artifacts);
    let request = chat("hi");
    let relaxed = RenderLimits {
        permits: 1,
        permit_wait: Duration::from_secs(5),
        deadline: Duration::from_secs(60),
        ..RenderLimits::default()
    };
    let renderer = Renderer::new(relaxed);
    let fuel = prepare16(&renderer, &looping, &request).await;
    assert_eq!(fuel, Err(Fallback::RenderUnavailable), "out of fuel");

    // One permit, held by a long render: the next request waits 20 ms and gives up.
    let one = Renderer::new(RenderLimits { permits: 1, deadline: Duration::from_secs(60), ..RenderLimits::default() });
    let busy = tokio::spawn({
        let (one, looping, request) = (one.clone(), looping.clone(), request.clone());
        async move { prepare16(&one, &looping, &request).await }
    });
    while one.permits_available() > 0 {
        tokio::task::yield_now().await;
    }
    // Refused: had it waited for the permit past the render, it would have rendered.
    assert_eq!(prepare16(&one, &artifacts, &request).await, Err(Fallback::RenderUnavailable));
    assert_eq!(busy.await.unwrap(), Err(Fallback::RenderUnavailable));
    assert!(prepare16(&one, &artifacts, &request).await.is_ok(), "the permit came back");

    // The deadline covers the render itself: refused while the render still runs (it holds its
    // permit until it ends), not once its fuel has run out.
    let hasty =
        Renderer::new(RenderLimits { permits: 1, deadline: Duration::from_millis(1), ..RenderLimits::default() });
    assert_eq!(prepare16(&hasty, &looping, &request).await, Err(Fallback::RenderUnavailable));
    assert_eq!(hasty.permits_available(), 0, "answered while the render runs");
    while hasty.permits_available() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn each_render_that_runs_observes_its_wait_once_and_one_refused_at_the_permit_none() {
    let artifacts = loaded_tinymodel().await;
    let looping = looping_artifacts(&artifacts);
    let request = chat("hi");
    let histogram = |name: &str| prometheus::Histogram::with_opts(prometheus::HistogramOpts::new(name, name)).unwrap();
    let (queued, ran) = (histogram("queued"), histogram("ran"));
    let limits = RenderLimits { permits: 1, deadline: Duration::from_secs(60), ..RenderLimits::default() };
    let stages = RenderStages { queued: queued.clone(), ran: ran.clone() };
    let one = Renderer::new(limits).observing(stages);
    let started = Instant::now();
    assert!(prepare16(&one, &artifacts, &request).await.is_ok());
    let took = started.elapsed().as_secs_f64();
    assert_eq!((queued.get_sample_count(), ran.get_sample_count()), (1, 1));
    assert!(queued.get_sample_sum() + ran.get_sample_sum() <= took, "both stages lie within the preparation");
    // A long render holds the only permit: the next request gives up at the permit wait
    // without running, so it has no wait to observe.
    let busy = tokio::spawn({
        let (one, looping, request) = (one.clone(), looping.clone(), request.clone());
        async move { prepare16(&one, &looping, &request).await }
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert!(prepare16(&one, &artifacts, &request).await.is_err());
    assert!(busy.await.unwrap().is_err());
    assert_eq!(queued.get_sample_count(), 2, "the long render ran; the refused one did not");
    assert_eq!(ran.get_sample_count(), 2, "the long render's run is observed when it ends");
}

#[test]
fn fallback_labels_are_the_selection_results() {
    let labels: Vec<_> = Fallback::ALL.iter().map(|f| f.as_str()).collect();
    assert_eq!(labels, ["prompt_too_large", "render_unavailable", "tokenizer_unavailable", "artifact_unpinned"]);
}

#[test]
fn cache_salt_is_read_from_nvext_first() {
    assert_eq!(request_cache_salt(&json!({"nvext": {"cache_salt": "a"}, "cache_salt": "b"})), Some("a"));
    assert_eq!(request_cache_salt(&json!({"cache_salt": "b"})), Some("b"));
    assert_eq!(request_cache_salt(&json!({})), None);
    assert_eq!(request_cache_salt(&json!({"nvext": {"cache_salt": null}, "cache_salt": "b"})), Some("b"));
    assert_eq!(request_cache_salt(&json!({"nvext": {"cache_salt": ""}, "cache_salt": "b"})), Some("b"));
    assert_eq!(request_cache_salt(&json!({"nvext": {"cache_salt": "a"}, "cache_salt": ""})), Some("a"));
    assert_eq!(request_cache_salt(&json!({"cache_salt": ""})), None);
}

/// Cards whose copies never answer hold a load no longer than its deadline, not their
/// fetches' 30 s each one after another; and a place several cards name is tried once.
#[tokio::test(start_paused = true)]
async fn a_load_whose_sources_never_answer_ends_at_its_deadline() {
    use tokio::io::AsyncReadExt;

    use crate::kv::artifacts::LOAD_DEADLINE;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = listener.local_addr().unwrap();
    let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
    let heard = Arc::clone(&asked);
    // Reads each request's line and never answers.
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut connection, _)) = listener.accept().await {
            let mut head = vec![0; 1024];
            let read = connection.read(&mut head).await.unwrap_or(0);
            let line = String::from_utf8_lossy(&head[..read]).lines().next().unwrap_or_default().to_owned();
            heard.lock().unwrap().push(line.split(' ').nth(1).unwrap_or_default().to_owned());
            held.push(connection);
        }
    });
    let local = card_in(&fixture("tinymodel"));
    // Card `card`'s tokenizer at place `n`; its config somewhere of its own, so that no two
    // cards are the same card.
    let at = |(card, n): (usize, usize)| {
        let mut named = local.clone();
        named.tokenizer.path = format!("http://{silent}/{n}/tokenizer.json");
        named.tokenizer_config.path = format!("/nonexistent/{card}/tokenizer_config.json");
        named
    };
    // Eight cards, two naming one place: seven places, 30 s each, past the load's deadline.
    let cards: Vec<ModelArtifacts> = [0, 1, 1, 2, 3, 4, 5, 6].into_iter().enumerate().map(at).collect();
    let h = harness(pinned(&local));
    let started = tokio::time::Instant::now();
    let failed = h.store.load("tiny", &cards).await;
    assert!(matches!(&failed, Err(LoadError::Fetch(why)) if why.contains("within")), "{failed:?}");
    assert_eq!(started.elapsed(), LOAD_DEADLINE);
    let asked = asked.lock().unwrap().clone();
    let places: Vec<String> = (0..4).map(|n| format!("/{n}/tokenizer.json")).collect();
    assert_eq!(asked, places, "four places in 120 s, the one named twice once");
}
