//! The KV term of a pick: render and hash the prompt as the model's workers would, ask the
//! control plane's index which ranks hold its prefix, and hand both to the KV-aware picker.
//! Every miss on the way (artifacts, rendering, the index) becomes a counted result and the
//! request is scored without overlap credit; the client never sees it.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use continuum_proto::MAX_DISPATCH_BLOCK_HASHES;
use continuum_proto::model::{KvArtifactPolicy, PromptDefaults, Role, Worker};
use continuum_proto::view::{FleetView, WorkersMemo};
use prometheus::{Histogram, HistogramVec, IntCounterVec};

use super::recent::RecentAnswers;
use super::request::Tree;
use crate::fleet::{Matches, MatchesClient, MatchesError};
use crate::kv::artifacts::{ArtifactKey, ArtifactPolicy, ArtifactStore, Checksum, Fetcher, ModelArtifacts};
use crate::kv::render::{RenderStages, Renderer};
use crate::kv::{Fallback, KvPrompt};
use crate::routing::picker::{IndexAnswer, KvSelectionResult, Overlaps};

/// What the picker scores a request with.
#[derive(Debug)]
pub enum Term {
    Scored {
        /// Rendered prompt tokens.
        tokens: Vec<u32>,
        /// Whether the request carries media (`PreparedPrompt::media`): its tokens, a placeholder
        /// where each item was, are not what the frontend would send the worker, nor as many.
        media: bool,
        block_size: u32,
        overlaps: Overlaps,
        /// The prompt's block hashes at `block_size` (at most [`MAX_DISPATCH_BLOCK_HASHES`]),
        /// reported with the dispatch so the control plane credits them provisionally.
        block_hashes: Vec<u64>,
        /// Where `overlaps` came from: the index, a recent answer standing in for a missed
        /// lookup, or nothing (no rank credited).
        answer: IndexAnswer,
        /// This replica's number for the lookup, reported with the dispatch whether or not the
        /// answer came in time, so the reservation the control plane made for it follows the
        /// request to the rank it took.
        lookup: u64,
        /// This replica's picked prompt tokens when the lookup went out (see
        /// [`KvRouting::picked_since`]).
        picked_before: u64,
        /// What `tokens` were rendered with, which every worker of the model agreed on when
        /// they were (boxed: three checksums would make every `Term` as large).
        artifacts: Box<RenderedWith>,
    },
    Unavailable(KvSelectionResult),
}

/// What a render's tokens depend on besides the request: the model's files, and the prompt
/// defaults its cards ask for (a `default_thinking` changes the text the template writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderedWith {
    pub files: ArtifactKey,
    pub defaults: PromptDefaults,
}

/// Whether `worker`'s card names the files and defaults `rendered` says: tokens rendered with
/// others are not its prompt (a worker that joined with other files or a changed
/// `runtime_config` since the render, in a rolling upgrade).
pub fn renders_with(worker: &Worker, rendered: &RenderedWith) -> bool {
    let card = worker.artifacts.as_deref().and_then(|artifacts| ModelArtifacts::from_fleet(artifacts).ok());
    card.is_some_and(|card| card.key() == rendered.files && card.defaults == rendered.defaults)
}

/// The replica's KV machinery: the prompt preparer (built when the fleet's configuration first
/// names an artifact cache) and the `FindMatches` client.
#[derive(Debug)]
pub struct KvRouting {
    matches: MatchesClient,
    renderer: Renderer,
    artifacts_counter: IntCounterVec,
    prompt: Arc<Mutex<Preparer>>,
    models: Mutex<ModelCache>,
    /// The artifact policy the fleet's models were last prewarmed under, per worker map.
    prewarmed: Mutex<WorkersMemo<Option<KvArtifactPolicy>>>,
    recent: RecentAnswers,
    /// Prompt tokens of the requests the KV-aware picker has picked workers for here, per model
    /// (its display name): another model's picks land on ranks no lookup of this one weighs.
    picked: Mutex<HashMap<String, u64>>,
    /// `continuum_dynamo_kv_term_seconds` by stage.
    prepare_seconds: Histogram,
    find_matches_seconds: Histogram,
}

/// Models whose picked prompt tokens are summed at once (see `KvRouting::picked`).
const MAX_PICKED_MODELS: usize = 256;

/// Each model's parsed cards and block sizes, kept while the fleet's worker map is the same
/// one (load samples change far more often than workers, and replace only the loads).
type ModelCache = WorkersMemo<HashMap<String, Option<Arc<ModelCards>>>>;

/// Most models whose cards are kept at once; past it the cache starts over.
const MAX_CACHED_MODELS: usize = 256;

/// The cards of every routable worker serving a model, and their block sizes, the one most
/// common among the workers that hold prompts first (see [`model_artifacts`]).
#[derive(Debug)]
struct ModelCards {
    cards: Vec<ModelArtifacts>,
    block_sizes: Vec<u32>,
}

#[derive(Debug, Default)]
struct Preparer {
    held: Option<Held>,
    /// The cache directory being opened, on the blocking pool.
    opening: Option<String>,
    /// The latest view to prewarm that came while the store was opening.
    to_prewarm: Option<FleetView>,
    /// The cache directory that last failed to open, and when: the failure is logged once,
    /// and opening it is tried again only after [`CACHE_DIR_RETRY`], not on every request.
    failed_dir: Option<(String, Instant)>,
    /// The version of the newest fleet view whose policy was asked for. A request picked on an
    /// older view (taken before a reload reached this replica) must not put the old policy
    /// back: it would drop the new pins' tokenizers, prune their blobs, or reopen the old
    /// cache directory over the new one. With when it was first asked for: see
    /// [`OLDER_VIEW_WINDOW`].
    newest_view: (u64, Option<Instant>),
}

/// How long after a view's policy was asked for a lower version counts as an older view: a
/// request takes its view as it arrives, milliseconds before it asks. Past it a lower version
/// is a control plane restarted with a clock behind its predecessor's (versions start from the
/// wall clock), whose views are the newest there are: its policy applies.
pub const OLDER_VIEW_WINDOW: Duration = Duration::from_secs(10);

/// How long a KV artifact cache directory that failed to open is left before trying again.
pub const CACHE_DIR_RETRY: Duration = Duration::from_secs(30);

#[derive(Debug)]
struct Held {
    policy: KvArtifactPolicy,
    prompt: Arc<KvPrompt>,
}

impl KvRouting {
    /// `term_seconds` must have the one label `stage` (see `Metrics::kv_term_seconds`).
    pub fn new(
        matches: MatchesClient,
        renderer: Renderer,
        artifacts_counter: IntCounterVec,
        term_seconds: &HistogramVec,
    ) -> Self {
        Self {
            matches,
            renderer: renderer.observing(RenderStages {
                queued: term_seconds.with_label_values(&["queue"]),
                ran: term_seconds.with_label_values(&["render"]),
            }),
            artifacts_counter,
            prompt: Arc::default(),
            models: Mutex::default(),
            prewarmed: Mutex::default(),
            recent: RecentAnswers::default(),
            picked: Mutex::default(),
            prepare_seconds: term_seconds.with_label_values(&["prepare"]),
            find_matches_seconds: term_seconds.with_label_values(&["find_matches"]),
        }
    }

    /// The KV term for a request to `model` (its Dynamo display name), one of whose
    /// `contenders` (instance id, dp rank) would prefill it. `body` gives its JSON tree (an
    /// OpenAI chat request) and the salt the frontend will hash its blocks with (see
    /// `ChatRequest::cache_salt`), or `None` when there is no room for the tree; it is awaited
    /// only once the model's tokenizer and template are at hand, so a request that cannot be
    /// rendered is not parsed into a tree for nothing.
    pub async fn term(
        &self,
        view: &FleetView,
        model: &str,
        body: impl Future<Output = Option<(Arc<Tree>, Option<String>)>>,
        contenders: &[(u64, u32)],
    ) -> Term {
        let Some(prompt) = self.prompt(&view.config().kv_artifacts, view.version()) else {
            return Term::Unavailable(KvSelectionResult::TokenizerUnavailable);
        };
        let Some(model_cards) = self.model_cards(view, model) else {
            return Term::Unavailable(KvSelectionResult::TokenizerUnavailable);
        };
        let ModelCards { cards, block_sizes } = &*model_cards;
        // The lookup uses the most common size only (ranks of another earn no credit), so only
        // its hashes are made.
        let resolved = match prompt.resolve(model, cards, block_sizes) {
            Ok(resolved) => resolved.first_size_only(),
            Err(fallback) => return Term::Unavailable(selection_result(fallback)),
        };
        let Some((body, cache_salt)) = body.await else {
            // It may hold the tokenizer's last reference (see `Renderer::prepare`).
            crate::memory::free_off_the_runtime(resolved);
            return Term::Unavailable(KvSelectionResult::RenderUnavailable);
        };
        let started = Instant::now();
        let prepared = prompt.render(resolved, body, cache_salt.as_deref(), None).await;
        self.prepare_seconds.observe(started.elapsed().as_secs_f64());
        let prepared = match prepared {
            Ok(prepared) => prepared,
            Err(fallback) => return Term::Unavailable(selection_result(fallback)),
        };
        let media = prepared.media;
        // The fleet's most common block size: ranks of another size earn no credit.
        let Some((block_size, hashes)) = prepared.hashes.first() else {
            return Term::Unavailable(KvSelectionResult::TokenizerUnavailable);
        };
        let chain: Vec<u64> = hashes.iter().map(|h| h.0).collect();
        // A chain past a media item's blocks names blocks no worker holds: the index's answer
        // stops there by itself, but no other request may be credited with it.
        let block_hashes = match media {
            false => chain.iter().take(MAX_DISPATCH_BLOCK_HASHES).copied().collect(),
            true => Vec::new(),
        };
        let started = Instant::now();
        let isl_tokens = prepared.tokens.len() as u64;
        let picked_before = self.picked_so_far(model);
        let lookup = self.matches.number_lookup();
        let answer = self.matches.find_matches(lookup, chain.clone(), model, contenders, isl_tokens).await;
        self.find_matches_seconds.observe(started.elapsed().as_secs_f64());
        let (overlaps, answer) = match answer {
            Ok(Matches { overlaps, turn, suggestion }) => {
                if !media {
                    self.recent.remember(model, &chain, &overlaps, Instant::now());
                }
                (overlaps.into(), IndexAnswer::Answered { turn, suggestion })
            }
            Err(error) => match self.recent.recall(model, &chain, Instant::now()).filter(|_| !media) {
                Some(overlaps) => (overlaps.into(), IndexAnswer::Recent),
                None => {
                    tracing::debug!(%error, "scoring without overlap credit");
                    let result = match error {
                        MatchesError::Deadline(_) => KvSelectionResult::IndexTimeout,
                        MatchesError::Status(_) | MatchesError::Unreachable => KvSelectionResult::IndexUnavailable,
                    };
                    (Overlaps::default(), IndexAnswer::Missed(result))
                }
            },
        };
        let block_size = block_size.get();
        let rendered = |card: &ModelArtifacts| Box::new(RenderedWith { files: card.key(), defaults: card.defaults });
        let Some(artifacts) = cards.first().map(rendered) else {
            return Term::Unavailable(KvSelectionResult::TokenizerUnavailable);
        };
        Term::Scored {
            artifacts,
            tokens: prepared.tokens,
            media,
            block_size,
            overlaps,
            block_hashes,
            answer,
            lookup,
            picked_before,
        }
    }

    /// A pick for a prompt of `tokens` to `model` was made.
    pub fn picked(&self, model: &str, tokens: u64) {
        let mut picked = self.picked.lock().unwrap_or_else(PoisonError::into_inner);
        match picked.get_mut(model) {
            Some(sum) => *sum = sum.saturating_add(tokens),
            None => {
                // Models the fleet serves, a handful; past the bound the sums start over, and
                // a lookup under way then counts nothing picked meanwhile.
                if picked.len() >= MAX_PICKED_MODELS {
                    picked.clear();
                }
                picked.insert(model.to_owned(), tokens);
            }
        }
    }

    fn picked_so_far(&self, model: &str) -> u64 {
        self.picked.lock().unwrap_or_else(PoisonError::into_inner).get(model).copied().unwrap_or(0)
    }

    /// The prompt tokens this replica has picked workers for to `model` since it had picked
    /// `picked_before`. Between a lookup and its pick, the replica's other requests may be
    /// picked: their lookups were answered after this one (the control plane did not weigh them
    /// in its suggestion) or answered before it but picked after (answers that arrive together
    /// wake their tasks in any order). Either way the replica's costs count them and the
    /// suggestion does not, so the suggestion reaches that much further.
    pub fn picked_since(&self, model: &str, picked_before: u64) -> u64 {
        self.picked_so_far(model).saturating_sub(picked_before)
    }

    /// Starts loading the tokenizer of every model the fleet serves when its workers or the
    /// artifact policy change, so that a replica's first requests for a model are scored with
    /// their KV term rather than on load alone while the load runs (and do not share the cores
    /// with it): a real model's tokenizer takes hundreds of milliseconds to parse.
    pub fn prewarm(&self, view: &FleetView) {
        let config = view.config();
        if !config.picker.kv_enabled {
            return;
        }
        let prompt = match self.prompt(&config.kv_artifacts, view.version()) {
            Some(prompt) => prompt,
            None => {
                let mut preparer = self.prompt.lock().unwrap_or_else(PoisonError::into_inner);
                // The store is opening: it prewarms the latest such view once open.
                if preparer.opening.is_some() {
                    preparer.to_prewarm = Some(view.clone());
                    return;
                }
                // Or it opened on the blocking pool before this took the lock, with no view to
                // prewarm left it: this one is prewarmed here, or never would be.
                match preparer.held.as_ref().filter(|held| held.policy == config.kv_artifacts) {
                    Some(held) => Arc::clone(&held.prompt),
                    None => return,
                }
            }
        };
        {
            let mut prewarmed = self.prewarmed.lock().unwrap_or_else(PoisonError::into_inner);
            let policy = prewarmed.for_view(view);
            if policy.as_ref() == Some(&config.kv_artifacts) {
                return;
            }
            *policy = Some(config.kv_artifacts.clone());
        }
        for model in view.workers().values().map(|worker| worker.model.as_str()).collect::<BTreeSet<_>>() {
            if let Some(cards) = self.model_cards(view, model) {
                prompt.store().prewarm(model, &cards.cards);
            }
        }
    }

    /// `model`'s cards, parsed once per worker map rather than on every request. A model no
    /// worker serves is not cached: its name is the client's, up to the body's size, and the
    /// request is refused anyway.
    fn model_cards(&self, view: &FleetView, model: &str) -> Option<Arc<ModelCards>> {
        let mut cache = self.models.lock().unwrap_or_else(PoisonError::into_inner);
        let models = cache.for_view(view);
        if let Some(cards) = models.get(model) {
            return cards.clone();
        }
        if !view.workers().values().any(|w| serves(w, model)) {
            return None;
        }
        if models.len() >= MAX_CACHED_MODELS {
            models.clear();
        }
        models.entry(model.to_string()).or_insert_with(|| model_artifacts(view, model).map(Arc::new)).clone()
    }

    /// The preparer under the fleet's artifact policy: a changed policy applies at once (a
    /// removed pin drops its tokenizer), a changed cache directory starts a new store. Opening
    /// one is file-system work (making the directory, reading a CA bundle) that a stalled
    /// volume could hold up indefinitely, so it runs on the blocking pool while requests go on
    /// without the KV term (`None`), as they do while a tokenizer loads.
    fn prompt(&self, policy: &KvArtifactPolicy, view_version: u64) -> Option<Arc<KvPrompt>> {
        let mut preparer = self.prompt.lock().unwrap_or_else(PoisonError::into_inner);
        let (newest, asked_at) = preparer.newest_view;
        if view_version < newest && asked_at.is_some_and(|at| at.elapsed() < OLDER_VIEW_WINDOW) {
            // An older view's policy: the store held serves, unchanged.
            return preparer.held.as_ref().map(|held| Arc::clone(&held.prompt));
        }
        if view_version != newest || asked_at.is_none() {
            preparer.newest_view = (view_version, Some(Instant::now()));
        }
        match preparer.held.as_mut() {
            Some(h) if h.policy == *policy => return Some(Arc::clone(&h.prompt)),
            Some(h) if h.policy.cache_dir == policy.cache_dir => {
                h.prompt.store().set_policy(artifact_policy(policy));
                h.policy = policy.clone();
                return Some(Arc::clone(&h.prompt));
            }
            _ => {}
        }
        if preparer.opening.as_ref() == Some(&policy.cache_dir) {
            return None;
        }
        let failed_here = preparer.failed_dir.as_ref().filter(|(dir, _)| *dir == policy.cache_dir);
        if failed_here.is_some_and(|(_, at)| at.elapsed() < CACHE_DIR_RETRY) {
            return None;
        }
        let logged = failed_here.is_some();
        preparer.opening = Some(policy.cache_dir.clone());
        drop(preparer);
        let (preparer, policy) = (Arc::clone(&self.prompt), policy.clone());
        let (counter, renderer) = (self.artifacts_counter.clone(), self.renderer.clone());
        let open = move || open_store(&preparer, policy, counter, renderer, logged);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn_blocking(open);
                None
            }
            Err(_) => open(),
        }
    }
}

#[cfg(test)]
impl KvRouting {
    /// The store for `policy`, once open (it opens on the blocking pool when first asked for).
    pub(crate) async fn open(&self, policy: &KvArtifactPolicy) -> anyhow::Result<Arc<KvPrompt>> {
        // As new as the newest view asked for yet.
        let newest = || self.prompt.lock().unwrap_or_else(PoisonError::into_inner).newest_view.0;
        opened(|| self.prompt(policy, newest())).await
    }
}

/// What `ready` gives once it gives something (the blocking pool's open has ended).
#[cfg(test)]
async fn opened<T>(ready: impl Fn() -> Option<T>) -> anyhow::Result<T> {
    for _ in 0..1000 {
        if let Some(value) = ready() {
            return Ok(value);
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    anyhow::bail!("the store's open did not end within 10 s")
}

/// Opens the store for `policy` and keeps it for the requests after, or remembers the failure
/// (logged unless `logged` already) so that the directory is tried again only after
/// [`CACHE_DIR_RETRY`], not on every request. An open that ends after another directory's
/// began (a reload moved the cache while this one stalled on its volume) keeps nothing.
fn open_store(
    preparer: &Mutex<Preparer>,
    policy: KvArtifactPolicy,
    counter: IntCounterVec,
    renderer: Renderer,
    logged: bool,
) -> Option<Arc<KvPrompt>> {
    let store =
        ArtifactStore::new(artifact_policy(&policy), Fetcher::from_env(), counter, ArtifactStore::system_clock());
    let mut preparer = preparer.lock().unwrap_or_else(PoisonError::into_inner);
    if preparer.opening.as_ref() != Some(&policy.cache_dir) {
        return None;
    }
    preparer.opening = None;
    match store {
        Ok(store) => {
            let prompt = Arc::new(KvPrompt::new(store, renderer));
            preparer.held = Some(Held { policy, prompt: Arc::clone(&prompt) });
            preparer.failed_dir = None;
            if let Some(view) = preparer.to_prewarm.take() {
                for (model, cards) in served_models(&view) {
                    prompt.store().prewarm(model, &cards.cards);
                }
            }
            Some(prompt)
        }
        Err(error) => {
            if !logged {
                tracing::warn!(dir = %policy.cache_dir, %error, "cannot open the KV artifact cache; scoring without the KV term");
            }
            preparer.failed_dir = Some((policy.cache_dir, Instant::now()));
            None
        }
    }
}

/// Each model `view`'s workers serve whose cards name a renderable tokenizer, with its cards.
fn served_models(view: &FleetView) -> impl Iterator<Item = (&str, ModelCards)> {
    let models: BTreeSet<&str> = view.workers().values().map(|worker| worker.model.as_str()).collect();
    models.into_iter().filter_map(|model| Some((model, model_artifacts(view, model)?)))
}

/// Whether `worker` serves `model` in a role that is routed to.
fn serves(worker: &Worker, model: &str) -> bool {
    worker.model == model && worker.role != Role::Unknown
}

/// `model`'s [`ModelCards`]; `None` when a worker's card names no renderable tokenizer.
fn model_artifacts(view: &FleetView, model: &str) -> Option<ModelCards> {
    let defaults = rendering_defaults(view, model)?;
    let mut cards = Vec::new();
    // (size, workers holding prompts of that size, workers of that size)
    let mut sizes: Vec<(u32, usize, usize)> = Vec::new();
    for worker in view.workers().values().filter(|w| serves(w, model)) {
        let card = ModelArtifacts::from_fleet(worker.artifacts.as_deref()?).ok()?;
        cards.push(ModelArtifacts { defaults, ..card });
        if let Some(size) = worker.block_size {
            // The lookup is for the ranks that hold prompts, whose kv-events fill the index: a
            // disaggregated fleet's decode workers publish none (Dynamo 1.6.1), and however many
            // of them run at another size, hashes at theirs would find no prefill rank's blocks.
            let holds_prompts = usize::from(worker.role != Role::Decode);
            match sizes.iter_mut().find(|(s, _, _)| *s == size) {
                Some((_, holding, all)) => (*holding, *all) = (*holding + holds_prompts, *all + 1),
                None => sizes.push((size, holds_prompts, 1)),
            }
        }
    }
    sizes.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.cmp(&a.2)).then(a.0.cmp(&b.0)));
    Some(ModelCards { cards, block_sizes: sizes.into_iter().map(|(s, _, _)| s).collect() })
}

/// The prompt defaults `model`'s prompts render with: the frontend renders with a decode or
/// aggregated worker's card (prefill workers serve no HTTP model of their own), so a prefill
/// card's say nothing. `None` when those cards disagree: the workers would see other bytes.
fn rendering_defaults(view: &FleetView, model: &str) -> Option<PromptDefaults> {
    let mut rendering = view
        .workers()
        .values()
        .filter(|w| serves(w, model) && w.role != Role::Prefill)
        .map(|w| w.artifacts.as_deref().map(|a| a.defaults).unwrap_or_default());
    let first = rendering.next().unwrap_or_default();
    rendering.all(|defaults| defaults == first).then_some(first)
}

fn artifact_policy(policy: &KvArtifactPolicy) -> ArtifactPolicy {
    // The control plane validates the pins; one that does not parse pins nothing.
    let pinned: BTreeSet<Checksum> = policy.pinned.iter().filter_map(|c| c.parse().ok()).collect();
    ArtifactPolicy {
        allow_http_artifacts: policy.allow_http,
        allow_hf_artifacts: policy.allow_hf,
        pinned_artifacts: pinned,
        artifact_cache_dir: PathBuf::from(&policy.cache_dir),
    }
}

fn selection_result(fallback: Fallback) -> KvSelectionResult {
    match fallback {
        Fallback::PromptTooLarge => KvSelectionResult::PromptTooLarge,
        Fallback::RenderUnavailable => KvSelectionResult::RenderUnavailable,
        Fallback::TokenizerUnavailable => KvSelectionResult::TokenizerUnavailable,
        Fallback::ArtifactUnpinned => KvSelectionResult::ArtifactUnpinned,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use continuum_proto::model::KvArtifactPolicy;

    use super::*;

    use crate::fleet::{FleetClientConfig, MatchesClient};
    use crate::metrics::Metrics;

    /// KV routing whose lookups go to a port nobody listens on.
    fn routing() -> anyhow::Result<KvRouting> {
        let metrics = Metrics::new()?;
        let matches =
            MatchesClient::new(&FleetClientConfig::new("http://127.0.0.1:9", "test"), Duration::from_millis(10))?;
        Ok(KvRouting::new(matches, Renderer::default(), metrics.kv_artifacts.clone(), &metrics.kv_term_seconds))
    }

    /// A worker of the model "tiny" in namespace "ns", with `artifacts` as its card's.
    fn tiny_worker(id: u64, role: Role, artifacts: Option<Arc<continuum_proto::model::ModelArtifacts>>) -> Worker {
        Worker {
            key: continuum_proto::model::WorkerKey::new("ns", id),
            role,
            model: "tiny".into(),
            component: "backend".into(),
            endpoint: "generate".into(),
            block_size: Some(16),
            capacity: continuum_proto::model::Capacity::default(),
            dp_start_rank: 0,
            dp_size: 0,
            disaggregated_endpoint: None,
            artifacts,
        }
    }

    #[tokio::test]
    async fn picks_of_another_model_do_not_widen_a_lookups_reach() -> anyhow::Result<()> {
        let routing = routing()?;
        routing.picked("a", 100);
        let (a_before, b_before) = (routing.picked_so_far("a"), routing.picked_so_far("b"));
        routing.picked("b", 4000);
        routing.picked("a", 50);
        assert_eq!(routing.picked_since("a", a_before), 50);
        assert_eq!(routing.picked_since("b", b_before), 4000);
        for i in 0..MAX_PICKED_MODELS {
            routing.picked(&format!("m{i}"), 1);
        }
        assert_eq!(routing.picked_since("a", a_before), 0, "the sums started over past the bound");
        Ok(())
    }

    #[tokio::test]
    async fn cards_are_cached_for_models_the_fleet_serves_and_no_others() -> anyhow::Result<()> {
        use continuum_proto::model::DataPlaneConfig;
        let routing = routing()?;
        let worker = tiny_worker(7, Role::Aggregated, None);
        let view = FleetView::new(1, [Arc::new(worker)], [], Arc::new(DataPlaneConfig::default()))?;
        let cached = || routing.models.lock().unwrap_or_else(PoisonError::into_inner).for_view(&view).len();
        for name in ["nobody serves this", &"x".repeat(1 << 20)] {
            assert!(routing.model_cards(&view, name).is_none());
        }
        assert_eq!(cached(), 0, "a client's model names take no room");
        assert!(routing.model_cards(&view, "tiny").is_none(), "served, but its card names no artifacts");
        assert_eq!(cached(), 1, "and that is remembered");
        Ok(())
    }

    #[test]
    fn prompts_render_with_the_decode_workers_defaults_whatever_a_prefill_card_says() -> anyhow::Result<()> {
        use continuum_proto::model::{CheckedFile, DataPlaneConfig, ModelArtifacts as Card};
        let file = |name: &str| CheckedFile {
            uri: format!("/m/{name}"),
            checksum: format!("blake3:{}", "ab".repeat(32)),
            size: 2,
        };
        let worker = |id, role, default_thinking| {
            let card = Card {
                tokenizer: Some(file("tokenizer.json")),
                tokenizer_config: Some(file("tokenizer_config.json")),
                chat_template: None,
                defaults: PromptDefaults { default_thinking, ..PromptDefaults::default() },
            };
            tiny_worker(id, role, Some(Arc::new(card)))
        };
        let view = |workers: Vec<Worker>| {
            FleetView::new(1, workers.into_iter().map(Arc::new), [], Arc::new(DataPlaneConfig::default()))
        };
        let split = view(vec![worker(1, Role::Prefill, None), worker(2, Role::Decode, Some(false))])?;
        let cards = model_artifacts(&split, "tiny").expect("one rendering");
        let thinking: Vec<_> = cards.cards.iter().map(|card| card.defaults.default_thinking).collect();
        assert_eq!(thinking, [Some(false), Some(false)], "the decode worker's, for every card");
        let torn = view(vec![worker(1, Role::Decode, None), worker(2, Role::Decode, Some(false))])?;
        assert!(model_artifacts(&torn, "tiny").is_none(), "decode workers that would render apart");

        // Block sizes: the prefill workers' first, however many decode workers run another.
        let sized = |id, role, size| Worker { block_size: Some(size), ..worker(id, role, Some(false)) };
        let fleet = view(vec![
            sized(1, Role::Prefill, 32),
            sized(2, Role::Decode, 16),
            sized(3, Role::Decode, 16),
            sized(4, Role::Decode, 16),
        ])?;
        assert_eq!(model_artifacts(&fleet, "tiny").map(|c| c.block_sizes), Some(vec![32, 16]));
        let decode_only =
            view(vec![sized(2, Role::Decode, 64), sized(3, Role::Decode, 16), sized(4, Role::Decode, 16)])?;
        assert_eq!(model_artifacts(&decode_only, "tiny").map(|c| c.block_sizes), Some(vec![16, 64]), "most common");
        Ok(())
    }

    #[tokio::test]
    async fn a_cache_directory_that_cannot_open_is_tried_again_after_a_while_not_per_request() -> anyhow::Result<()> {
        let routing = routing()?;
        // Under a regular file, no directory can be made.
        let file = tempfile::NamedTempFile::new()?;
        let policy = KvArtifactPolicy { cache_dir: format!("{}/kv", file.path().display()), ..Default::default() };
        let preparer = || routing.prompt.lock().unwrap_or_else(PoisonError::into_inner);
        assert!(routing.prompt(&policy, 0).is_none());
        let first = opened(|| preparer().failed_dir.clone().map(|(_, at)| at)).await?;
        assert!(routing.prompt(&policy, 0).is_none());
        assert!(preparer().opening.is_none(), "not tried again within {CACHE_DIR_RETRY:?}");
        assert_eq!(preparer().failed_dir.clone().map(|(_, at)| at), Some(first));
        Ok(())
    }

    /// A directory whose open ends after another's began (it stalled on its volume while a
    /// reload moved the cache) is not kept: it would replace the newer store.
    #[tokio::test]
    async fn an_open_overtaken_by_another_directorys_keeps_nothing() -> anyhow::Result<()> {
        let routing = routing()?;
        let dir = tempfile::tempdir()?;
        let policy = |name: &str| KvArtifactPolicy {
            cache_dir: dir.path().join(name).display().to_string(),
            ..Default::default()
        };
        let (slow, newer) = (policy("slow"), policy("newer"));
        let preparer = || routing.prompt.lock().unwrap_or_else(PoisonError::into_inner);
        preparer().opening = Some(newer.cache_dir.clone());
        let open = |policy: &KvArtifactPolicy| {
            open_store(
                &routing.prompt,
                policy.clone(),
                routing.artifacts_counter.clone(),
                routing.renderer.clone(),
                false,
            )
        };
        assert!(open(&slow).is_none(), "overtaken");
        assert!(preparer().held.is_none() && preparer().opening == Some(newer.cache_dir.clone()));
        assert!(open(&newer).is_some(), "the directory being opened is kept");
        assert_eq!(preparer().held.as_ref().map(|held| held.policy.cache_dir.clone()), Some(newer.cache_dir.clone()));
        assert!(preparer().opening.is_none());
        Ok(())
    }

    /// A request picked on a view older than one whose policy applied (it took its view before
    /// a reload reached the replica) puts nothing back: the newer policy's store serves it.
    #[tokio::test]
    async fn an_older_views_policy_does_not_replace_a_newer_ones() -> anyhow::Result<()> {
        let routing = routing()?;
        let dir = tempfile::tempdir()?;
        let old = KvArtifactPolicy { cache_dir: dir.path().join("kv").display().to_string(), ..Default::default() };
        let new = KvArtifactPolicy { allow_hf: !old.allow_hf, ..old.clone() };
        routing.prompt(&old, 1);
        let opened = routing.open(&old).await?;
        assert!(Arc::ptr_eq(&opened, &routing.prompt(&new, 3).expect("the same directory: held")));
        let held = || routing.prompt.lock().unwrap().held.as_ref().map(|held| held.policy.clone());
        assert_eq!(held(), Some(new.clone()));
        let late = routing.prompt(&old, 2).expect("the store held serves");
        assert!(Arc::ptr_eq(&opened, &late));
        assert_eq!(held(), Some(new.clone()), "the older view's policy was not put back");

        // A control plane restarted with its clock behind: its views have lower versions, and
        // once no request can still hold a view of the old one, they are the newest there are.
        let restarted = KvArtifactPolicy { allow_hf: !new.allow_hf, ..new.clone() };
        let asked_at = Instant::now() - OLDER_VIEW_WINDOW;
        routing.prompt.lock().unwrap().newest_view.1 = Some(asked_at);
        assert!(routing.prompt(&restarted, 2).is_some());
        assert_eq!(held(), Some(restarted), "the restarted control plane's policy applies");
        assert_eq!(routing.prompt(&new, 3).map(|_| held()), Some(Some(new)), "and versions count from there");
        Ok(())
    }

    /// The store opens off the request path: requests meanwhile go on without the KV term, and
    /// the requests after it use the store.
    #[tokio::test]
    async fn a_cache_directory_opens_on_the_blocking_pool_while_requests_go_on_without_it() -> anyhow::Result<()> {
        let routing = routing()?;
        let dir = tempfile::tempdir()?;
        let policy = KvArtifactPolicy { cache_dir: dir.path().join("kv").display().to_string(), ..Default::default() };
        assert!(routing.prompt(&policy, 0).is_none(), "not waited for");
        let prompt = routing.open(&policy).await?;
        assert!(dir.path().join("kv/blobs").is_dir());
        assert!(Arc::ptr_eq(&prompt, &routing.prompt(&policy, 0).expect("held")), "opened once, then kept");
        Ok(())
    }
}
