//! The loaded tokenizers: at most [`MAX_LOADED_TOKENIZERS`] artifact sets holding at most
//! [`MAX_LOADED_BYTES`] of artifact bytes, least recently used evicted first; at most
//! [`MAX_CONCURRENT_LOADS`] loads at once; a failed load not retried for [`FAILED_LOAD_RETRY`].
//! Nothing unpinned is read, and every byte loaded has matched its checksum.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use prometheus::IntCounterVec;
use serde_json::Value;
use tokenizers::{AddedToken, Tokenizer};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::cache::{BlobCache, CacheRead, EvictReason, MAX_ARTIFACT_BYTES, ReadError, read_bounded};
use super::card::{ArtifactKey, CheckedFile, Checksum, ModelArtifacts};
use super::source::{FETCH_TIMEOUT, FetchError, Fetcher, Source, SourceError, shown};
use super::{ArtifactPolicy, ArtifactResult};
use crate::kv::Fallback;
use crate::kv::render::{self, ChatTemplate, PieceCache};
use crate::memory::free_off_the_runtime;

/// Loaded tokenizer + template sets kept in memory.
pub const MAX_LOADED_TOKENIZERS: usize = 16;
/// Artifact bytes the loaded sets may add up to.
pub const MAX_LOADED_BYTES: u64 = 256 << 20;
/// Loads (fetch, verify, parse) running at once, a build abandoned past its deadline
/// included until it ends.
pub const MAX_CONCURRENT_LOADS: usize = 2;
/// How long a failed load is left alone before a request may start it again.
pub const FAILED_LOAD_RETRY: Duration = Duration::from_secs(300);
/// Failed loads remembered at once (each a key and the places it was read from); past it, and
/// once those still backing off are all that is left, they start over.
pub const MAX_FAILED_LOADS: usize = 1024;
/// Distinct (model, checksum) pairs remembered so an unpinned checksum is logged once.
const MAX_LOGGED_UNPINNED: usize = 4096;
/// Cards with distinct file locations a load tries, in turn, for the same checksummed files.
pub const MAX_CARD_SOURCES: usize = 8;
/// A load's fetches, verifications and parse together: its three files from one copy each at
/// the fetch's 30 s, and more. Without it, cards whose copies answer a byte a second would hold
/// a load permit for 3 × 8 × 30 s, and two such models every other model's load.
pub const LOAD_DEADLINE: Duration = Duration::from_secs(120);
/// File operations running at once on the artifact cache, and on local sources, each. A read
/// stalled on a volume (a hung network mount, a FIFO put where a tokenizer was) holds its
/// blocking thread however long its caller waits, so each holds a permit until it returns:
/// stalled reads keep at most this many of the pool's threads (which the request path shares)
/// per kind, and a stalled cache leaves the sources readable.
pub const MAX_ARTIFACT_FILE_JOBS: usize = 4;
static CACHE_FILE_JOBS: Semaphore = Semaphore::const_new(MAX_ARTIFACT_FILE_JOBS);
static SOURCE_FILE_JOBS: Semaphore = Semaphore::const_new(MAX_ARTIFACT_FILE_JOBS);

/// Every cache file permit, held as operations stuck on a stalled volume would hold them.
#[cfg(test)]
pub(crate) fn hold_cache_file_jobs() -> tokio::sync::SemaphorePermit<'static> {
    CACHE_FILE_JOBS.try_acquire_many(MAX_ARTIFACT_FILE_JOBS as u32).expect("no cache file job running")
}

/// Runs the file operation `work` on the blocking pool under one of `jobs`' permits, and waits
/// for it at most [`FETCH_TIMEOUT`]; what went wrong otherwise, said.
async fn file_job<T: Send + 'static>(
    jobs: &'static Semaphore,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let permit = jobs.try_acquire().map_err(|_| {
        format!("{MAX_ARTIFACT_FILE_JOBS} artifact file operations are still running (a stalled volume?)")
    })?;
    let job = tokio::task::spawn_blocking(move || {
        let _held = permit;
        work()
    });
    match tokio::time::timeout(FETCH_TIMEOUT, job).await {
        Ok(Ok(done)) => Ok(done),
        Ok(Err(error)) => Err(format!("the file task failed: {error}")),
        Err(_) => Err(format!("not done within {FETCH_TIMEOUT:?}")),
    }
}

/// The time source; tests inject one they can move.
pub type Clock = Arc<dyn Fn() -> Instant + Send + Sync>;

/// What runs on a freshly built artifact set before the store serves it (see
/// [`ArtifactStore::warm_with`]).
pub type Warm = Box<dyn Fn(Arc<LoadedArtifacts>) -> BoxFuture<'static, ()> + Send + Sync>;

/// A tokenizer and chat template built from verified, pinned bytes.
#[derive(Debug)]
pub struct LoadedArtifacts {
    pub key: ArtifactKey,
    pub tokenizer: Tokenizer,
    /// The tokenizer's prompt pieces encoded so far.
    pub pieces: PieceCache,
    pub template: ChatTemplate,
    /// The artifacts' total size, charged against [`MAX_LOADED_BYTES`].
    pub bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("artifact {0} is not in kv.pinned_artifacts; review it (b3sum) and pin it to enable KV scoring")]
    Unpinned(Checksum),
    #[error("{path}: {source}")]
    Source { path: String, source: SourceError },
    #[error("{path}: the artifact is larger than {MAX_ARTIFACT_BYTES} bytes")]
    TooLarge { path: String },
    #[error("{path}: the bytes do not match the card's checksum {checksum}")]
    ChecksumMismatch { path: String, checksum: Checksum },
    #[error("{0}")]
    Fetch(String),
    #[error("the artifacts verified but are unusable: {0}")]
    Invalid(String),
    #[error("this artifact set failed to load recently; it is retried {FAILED_LOAD_RETRY:?} after the failure")]
    RetryLater,
}

impl LoadError {
    /// The counter label, or `None` for outcomes that are not counted again.
    fn result(&self) -> Option<ArtifactResult> {
        Some(match self {
            LoadError::Unpinned(_) => ArtifactResult::Unpinned,
            LoadError::Source { source: SourceError::Refused(_), .. } => ArtifactResult::RefusedScheme,
            LoadError::Source { .. } => ArtifactResult::Unsupported,
            LoadError::TooLarge { .. } => ArtifactResult::TooLarge,
            LoadError::ChecksumMismatch { .. } => ArtifactResult::ChecksumMismatch,
            LoadError::Fetch(_) => ArtifactResult::FetchFailed,
            LoadError::Invalid(_) => ArtifactResult::Invalid,
            LoadError::RetryLater => return None,
        })
    }
}

#[derive(Clone)]
pub struct ArtifactStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ArtifactStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArtifactStore").field("loaded", &self.state().loaded.len()).finish_non_exhaustive()
    }
}

struct Inner {
    policy: Mutex<Arc<ArtifactPolicy>>,
    cache: BlobCache,
    fetcher: Fetcher,
    loads: Arc<Semaphore>,
    state: Mutex<State>,
    counter: IntCounterVec,
    clock: Clock,
    warm: OnceLock<Warm>,
}

#[derive(Default)]
struct State {
    loaded: HashMap<ArtifactKey, Slot>,
    bytes: u64,
    /// After a failed load of a key from some places ([`places`]): until when. Another card
    /// naming the same files elsewhere (another deployment of the model, readable here) is
    /// tried at once, a failure saying nothing of places it did not read; but each set of
    /// places waits out its own failure, however the loads of two models sharing a tokenizer
    /// from unreadable places take turns. At most [`MAX_FAILED_LOADS`].
    retry_at: HashMap<(ArtifactKey, u64), Instant>,
    loading: HashSet<ArtifactKey>,
    /// Keys whose build runs on a render thread, until it ends: a build abandoned past the
    /// load deadline runs on (a thread cannot be stopped), and its key is not built again
    /// beside it.
    building: HashSet<ArtifactKey>,
    logged_unpinned: HashSet<(String, Checksum)>,
}

/// A key's place in [`State::building`], given back when the build ends.
struct Building {
    store: ArtifactStore,
    key: ArtifactKey,
}

impl Drop for Building {
    fn drop(&mut self) {
        self.store.state().building.remove(&self.key);
    }
}

struct Slot {
    artifacts: Arc<LoadedArtifacts>,
    used: Instant,
}

impl ArtifactStore {
    /// `counter` is `continuum_dynamo_kv_artifacts_total`, labelled `result`. Opens (and
    /// tightens) the policy's cache directory.
    pub fn new(policy: ArtifactPolicy, fetcher: Fetcher, counter: IntCounterVec, clock: Clock) -> io::Result<Self> {
        let cache = BlobCache::open(&policy.artifact_cache_dir)?;
        prune(&cache, &policy.pinned_artifacts);
        for result in ArtifactResult::ALL {
            counter.with_label_values(&[result.as_str()]);
        }
        let inner = Inner {
            policy: Mutex::new(Arc::new(policy)),
            cache,
            fetcher,
            loads: Arc::new(Semaphore::new(MAX_CONCURRENT_LOADS)),
            state: Mutex::new(State::default()),
            counter,
            clock,
            warm: OnceLock::new(),
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// Runs `warm` on every artifact set this store builds, before serving it: a request never
    /// meets a tokenizer whose first renders are still paying one-time costs. Set once; a
    /// second call is ignored.
    pub fn warm_with(&self, warm: Warm) {
        let _ = self.inner.warm.set(warm);
    }

    /// A system clock for [`ArtifactStore::new`].
    pub fn system_clock() -> Clock {
        Arc::new(Instant::now)
    }

    /// Applies a reloaded policy (the cache directory is fixed at creation). Tokenizers whose
    /// artifacts are no longer pinned are dropped at once, and loads backing off are tried
    /// again: the new policy may allow what refused them (a pin added, a scheme allowed), and
    /// the operator who changed it should not wait out five minutes to see it work.
    pub fn set_policy(&self, policy: ArtifactPolicy) {
        let mut state = self.state();
        state.retry_at.clear();
        let unpinned: Vec<ArtifactKey> =
            state.loaded.keys().filter(|key| policy.unpinned(key).is_some()).copied().collect();
        let mut dropped = Vec::with_capacity(unpinned.len());
        for key in unpinned {
            if let Some(slot) = state.loaded.remove(&key) {
                state.bytes -= slot.artifacts.bytes;
                self.count(ArtifactResult::Evicted);
                dropped.push(slot);
            }
        }
        // Under a cache file permit, as every other operation on the cache: on a stalled volume
        // each reload would otherwise strand one more blocking thread. With none free the prune
        // waits for the next policy change; the files it would remove are only unpinned ones.
        if let Ok(runtime) = tokio::runtime::Handle::try_current()
            && let Ok(permit) = CACHE_FILE_JOBS.try_acquire()
        {
            let (store, pinned) = (self.clone(), policy.pinned_artifacts.clone());
            runtime.spawn_blocking(move || {
                let _held = permit;
                prune(&store.inner.cache, &pinned)
            });
        }
        // Swapped under the state lock, which `insert` checks a finished load's pin under: no
        // set the old policy pinned is kept once the new one has dropped it.
        *self.inner.policy.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(policy);
        drop(state);
        // Their tokenizers freed after the lock, off the runtime.
        free_off_the_runtime(dropped);
    }

    /// The request path: never waits. A loaded tokenizer, or the reason to score without a KV
    /// term (starting a background load when none is running or backing off).
    ///
    /// `cards` are the model's workers' cards, which agree on the files' checksums (see
    /// [`super::card::fleet_key`]) but may name different places to read them from: each
    /// worker names a path on its own disk, which the router may or may not have.
    pub fn lookup(&self, model: &str, cards: &[ModelArtifacts]) -> Result<Arc<LoadedArtifacts>, Fallback> {
        let artifacts = cards.first().ok_or(Fallback::TokenizerUnavailable)?;
        let key = artifacts.key();
        if let Some(checksum) = self.policy().unpinned(&key) {
            self.refuse_unpinned(model, checksum);
            return Err(Fallback::ArtifactUnpinned);
        }
        let now = (self.inner.clock)();
        let mut state = self.state();
        if let Some(slot) = state.loaded.get_mut(&key) {
            slot.used = now;
            return Ok(slot.artifacts.clone());
        }
        self.start_load(&mut state, model, cards, now);
        Err(Fallback::TokenizerUnavailable)
    }

    /// Starts loading `artifacts` in the background ahead of any request, unless they are
    /// loaded, loading, backing off after a failure or not pinned (a refusal is counted and
    /// logged when a request meets it, not here).
    pub fn prewarm(&self, model: &str, cards: &[ModelArtifacts]) {
        let Some(artifacts) = cards.first() else { return };
        if self.policy().unpinned(&artifacts.key()).is_some() {
            return;
        }
        let now = (self.inner.clock)();
        let mut state = self.state();
        if !state.loaded.contains_key(&artifacts.key()) {
            self.start_load(&mut state, model, cards, now);
        }
    }

    /// A background load of `cards`' files, unless one is running or the last failed too
    /// recently.
    fn start_load(&self, state: &mut State, model: &str, cards: &[ModelArtifacts], now: Instant) {
        let Some(key) = cards.first().map(ModelArtifacts::key) else { return };
        // Every request for the model asks while it loads (up to minutes): looked up first,
        // before a walk over its workers' cards.
        if state.loading.contains(&key) {
            return;
        }
        let sources = sources(cards);
        if !state.backing_off(key, places(&sources), now)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            state.loading.insert(key);
            let (store, model) = (self.clone(), model.to_string());
            runtime.spawn(async move {
                let _ = store.load(&model, &sources).await;
                store.state().loading.remove(&key);
            });
        }
    }

    /// Loads (or returns the loaded) artifact set, waiting for a load slot.
    pub async fn load(&self, model: &str, cards: &[ModelArtifacts]) -> Result<Arc<LoadedArtifacts>, LoadError> {
        let Some(artifacts) = cards.first() else { return Err(LoadError::Invalid("no card names the files".into())) };
        let key = artifacts.key();
        if let Some(checksum) = self.policy().unpinned(&key) {
            self.refuse_unpinned(model, checksum);
            return Err(LoadError::Unpinned(checksum));
        }
        let (sources, places) = {
            let now = (self.inner.clock)();
            let state = self.state();
            if let Some(slot) = state.loaded.get(&key) {
                return Ok(slot.artifacts.clone());
            }
            let sources = sources(cards);
            let places = places(&sources);
            if state.backing_off(key, places, now) || state.building.contains(&key) {
                return Err(LoadError::RetryLater);
            }
            (sources, places)
        };
        let permit = Arc::clone(&self.inner.loads).acquire_owned().await.map_err(|_| LoadError::RetryLater)?;
        let loaded = tokio::time::timeout(LOAD_DEADLINE, self.load_now(&sources, permit)).await.unwrap_or_else(|_| {
            Err(LoadError::Fetch(format!("the artifacts were not loaded within {LOAD_DEADLINE:?}")))
        });
        match loaded.and_then(|loaded| self.insert(loaded)) {
            Ok(loaded) => {
                self.state().retry_at.retain(|(failed, _), _| *failed != key);
                self.count(ArtifactResult::Loaded);
                Ok(loaded)
            }
            Err(error) => {
                // Escaped: the error quotes the card's URIs.
                tracing::warn!(model, error = ?error.to_string(), "KV tokenizer artifacts failed to load; the model is scored without KV overlap");
                if let Some(result) = error.result() {
                    self.count(result);
                }
                let now = (self.inner.clock)();
                let mut state = self.state();
                state.retry_at.retain(|_, until| now < *until);
                if state.retry_at.len() >= MAX_FAILED_LOADS {
                    state.retry_at.clear();
                }
                state.retry_at.insert((key, places), now + FAILED_LOAD_RETRY);
                Err(error)
            }
        }
    }

    /// How many artifact sets are loaded, and their bytes.
    pub fn loaded(&self) -> (usize, u64) {
        let state = self.state();
        (state.loaded.len(), state.bytes)
    }

    /// Builds the set `cards` name: the first card's files, read from wherever any of the
    /// cards ([`sources`] of one key) says they are.
    /// `permit` is the load's room, held until the build ends: past the deadline the load is
    /// abandoned but its build runs on (a render thread cannot be stopped), holding the room
    /// (and its key, which no retry builds again meanwhile).
    async fn load_now(
        &self,
        cards: &[ModelArtifacts],
        permit: OwnedSemaphorePermit,
    ) -> Result<Arc<LoadedArtifacts>, LoadError> {
        let tokenizer = self.resolve(cards.iter().map(|c| &c.tokenizer)).await?;
        let config = self.resolve(cards.iter().map(|c| &c.tokenizer_config)).await?;
        let template = match cards.iter().map(|c| c.chat_template.as_ref()).collect::<Option<Vec<_>>>() {
            Some(files) => Some(self.resolve(files.into_iter()).await?),
            None => None,
        };
        let key = cards.first().map(ModelArtifacts::key).ok_or_else(|| LoadError::Invalid("no card".into()))?;
        // A reload may remove the pin while the files are fetched (up to 30 s): nothing
        // unpinned is compiled or rendered (nor kept: `insert` checks again).
        if let Some(checksum) = self.policy().unpinned(&key) {
            return Err(LoadError::Unpinned(checksum));
        }
        // On a render thread: compiling probes the template with renders, as deep as any.
        self.state().building.insert(key);
        let building = Building { store: self.clone(), key };
        let loaded = render::threads::spawn(move || {
            let _held = (permit, building);
            build(key, &tokenizer, &config, template.as_deref())
        })
        .await
        .map_err(|_| LoadError::Invalid("the loading task failed".into()))?
        .map(Arc::new)?;
        if let Some(warm) = self.inner.warm.get() {
            warm(Arc::clone(&loaded)).await;
        }
        Ok(loaded)
    }

    /// Verified bytes of one artifact, named by `copies` (the same checksum at each place a
    /// card names): from the blob cache, or from the first copy whose bytes verify (then
    /// cached).
    async fn resolve(&self, mut copies: impl Iterator<Item = &CheckedFile>) -> Result<Bytes, LoadError> {
        let file = copies.next().ok_or_else(|| LoadError::Invalid("no card names the file".into()))?;
        let checksum = file.checksum;
        // Bounded as a source's read is: a stalled cache volume must not hold the load (and
        // its permit) for good; the source is read instead.
        let store = self.clone();
        let cached = file_job(&CACHE_FILE_JOBS, move || store.inner.cache.read(&checksum)).await;
        match cached {
            Ok(Ok(CacheRead::Hit(bytes))) => {
                self.count(ArtifactResult::Cached);
                return Ok(Bytes::from(bytes));
            }
            Ok(Ok(CacheRead::Evicted(EvictReason::ChecksumMismatch))) => self.count(ArtifactResult::ChecksumMismatch),
            Ok(Ok(CacheRead::Evicted(EvictReason::TooLarge))) => self.count(ArtifactResult::TooLarge),
            Ok(Ok(CacheRead::Miss)) => {}
            Ok(Err(error)) => tracing::warn!(%error, "the KV artifact cache could not be read; reading the source"),
            Err(error) => tracing::warn!(%error, "the KV artifact cache was not read; reading the source"),
        }
        let mut failed = Vec::new();
        let mut bytes = self.verified_source(file).await;
        // Each place once, however many cards name it.
        let mut tried = vec![file.path.as_str()];
        let copies = copies.filter(|other| {
            let new = !tried.contains(&other.path.as_str());
            if new {
                tried.push(other.path.as_str());
            }
            new
        });
        for other in copies {
            match bytes {
                Ok(_) => break,
                Err(error) => {
                    // Counted as it happens: a copy that fails (tampered with, say) while another
                    // serves is as much a finding as the last failure the load is counted by.
                    if let Some(result) = error.result() {
                        self.count(result);
                    }
                    failed.push(error)
                }
            }
            bytes = self.verified_source(other).await;
        }
        if !failed.is_empty() {
            let tried = failed.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
            match &bytes {
                Ok(_) => tracing::info!(tried, "a KV artifact was not where some cards say; read another card's copy"),
                Err(_) => tracing::warn!(tried, "a KV artifact could not be read from any card's copy"),
            }
        }
        let bytes = bytes?;
        self.count(ArtifactResult::Fetched);
        let (store, copy) = (self.clone(), bytes.clone());
        match file_job(&CACHE_FILE_JOBS, move || store.inner.cache.write(&checksum, &copy)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "a KV artifact could not be cached; it is used anyway"),
            Err(error) => tracing::warn!(%error, "a KV artifact was not cached; it is used anyway"),
        }
        Ok(bytes)
    }

    /// `file` from its source, if its bytes match its checksum (hashed on the blocking pool:
    /// an artifact may be 64 MiB).
    async fn verified_source(&self, file: &CheckedFile) -> Result<Bytes, LoadError> {
        let bytes = Bytes::from(self.read_source(file).await?);
        let (checksum, read) = (file.checksum, bytes.clone());
        match tokio::task::spawn_blocking(move || checksum.matches(&read)).await {
            Ok(true) => Ok(bytes),
            Ok(false) => Err(LoadError::ChecksumMismatch { path: shown(&file.path), checksum }),
            Err(_) => Err(LoadError::Invalid("the checksum task failed".into())),
        }
    }

    async fn read_source(&self, file: &CheckedFile) -> Result<Vec<u8>, LoadError> {
        // As errors and logs show it: a card's URL may carry a password or a signature.
        let path = shown(&file.path);
        if file.size.is_some_and(|size| size > MAX_ARTIFACT_BYTES) {
            return Err(LoadError::TooLarge { path });
        }
        let source = Source::classify(&file.path, self.policy().schemes())
            .map_err(|source| LoadError::Source { path: path.clone(), source })?;
        match source {
            // Bounded in time as a fetch is: a stalled volume must not hold the load's permit.
            Source::Local(local) => match file_job(&SOURCE_FILE_JOBS, move || read_bounded(&local)).await {
                Ok(Ok(bytes)) => Ok(bytes),
                Ok(Err(ReadError::TooLarge)) => Err(LoadError::TooLarge { path }),
                Ok(Err(error)) => Err(LoadError::Fetch(format!("{path}: {error}"))),
                Err(error) => Err(LoadError::Fetch(format!("{path}: {error}"))),
            },
            remote => match self.inner.fetcher.fetch(&remote).await {
                Ok(bytes) => Ok(bytes),
                Err(FetchError::TooLarge) => Err(LoadError::TooLarge { path }),
                Err(error) => Err(LoadError::Fetch(error.to_string())),
            },
        }
    }

    /// Keeps a loaded set, unless its pin is gone: checked under the state lock, which a
    /// reload holds while it swaps the policy, so no set is kept that the reload did not see.
    fn insert(&self, loaded: Arc<LoadedArtifacts>) -> Result<Arc<LoadedArtifacts>, LoadError> {
        let now = (self.inner.clock)();
        let mut state = self.state();
        if let Some(checksum) = self.policy().unpinned(&loaded.key) {
            return Err(LoadError::Unpinned(checksum));
        }
        let mut dropped = Vec::new();
        if let Some(old) = state.loaded.remove(&loaded.key) {
            state.bytes -= old.artifacts.bytes;
            dropped.push(old);
        }
        while !state.loaded.is_empty()
            && (state.loaded.len() >= MAX_LOADED_TOKENIZERS || state.bytes + loaded.bytes > MAX_LOADED_BYTES)
        {
            let Some(oldest) = state.loaded.iter().min_by_key(|(_, slot)| slot.used).map(|(key, _)| *key) else {
                break;
            };
            if let Some(slot) = state.loaded.remove(&oldest) {
                state.bytes -= slot.artifacts.bytes;
                self.count(ArtifactResult::Evicted);
                dropped.push(slot);
            }
        }
        state.bytes += loaded.bytes;
        state.loaded.insert(loaded.key, Slot { artifacts: Arc::clone(&loaded), used: now });
        drop(state);
        // Their tokenizers freed after the lock, off the runtime.
        free_off_the_runtime(dropped);
        Ok(loaded)
    }

    fn refuse_unpinned(&self, model: &str, checksum: Checksum) {
        self.count(ArtifactResult::Unpinned);
        let mut state = self.state();
        if state.logged_unpinned.len() >= MAX_LOGGED_UNPINNED {
            state.logged_unpinned.clear();
        }
        if state.logged_unpinned.insert((model.to_string(), checksum)) {
            tracing::warn!(model, %checksum, "a KV tokenizer artifact is not pinned; review it and add it to kv.pinned_artifacts");
        }
    }

    fn policy(&self) -> Arc<ArtifactPolicy> {
        self.inner.policy.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts an outcome decided outside the store (an unsupported block size).
    pub fn record(&self, result: ArtifactResult) {
        self.count(result);
    }

    fn count(&self, result: ArtifactResult) {
        self.inner.counter.with_label_values(&[result.as_str()]).inc();
    }
}

/// Removes from `cache` what `pinned` no longer names (see [`BlobCache::prune`]). Blocking.
fn prune(cache: &BlobCache, pinned: &BTreeSet<Checksum>) {
    match cache.prune(pinned) {
        Ok(0) => {}
        Ok(removed) => tracing::info!(removed, "removed cached KV artifacts no longer pinned"),
        Err(error) => tracing::warn!(%error, "could not prune the KV artifact cache"),
    }
}

impl State {
    /// Whether a load of `key` from `places` waits out an earlier failure from the same places.
    fn backing_off(&self, key: ArtifactKey, places: u64, now: Instant) -> bool {
        self.retry_at.get(&(key, places)).is_some_and(|until| now < *until)
    }
}

/// Where `sources` say their files are, as one figure: the places a load reads.
fn places(sources: &[ModelArtifacts]) -> u64 {
    let mut paths: Vec<&str> = sources.iter().flat_map(ModelArtifacts::files).map(|file| file.path.as_str()).collect();
    paths.sort_unstable();
    // One fixed hasher, so the same places give the same figure at every call.
    std::hash::BuildHasher::hash_one(&std::hash::BuildHasherDefault::<std::hash::DefaultHasher>::default(), &paths)
}

/// The cards of `cards`' first key with distinct file locations, at most
/// [`MAX_CARD_SOURCES`] of them: a fleet whose workers all name the same paths gives one.
fn sources(cards: &[ModelArtifacts]) -> Vec<ModelArtifacts> {
    let Some(key) = cards.first().map(ModelArtifacts::key) else { return Vec::new() };
    // Borrowed: a fleet of a thousand workers naming the same paths copies none of them.
    fn paths(card: &ModelArtifacts) -> (&str, &str, Option<&str>) {
        let template = card.chat_template.as_ref().map(|file| file.path.as_str());
        (card.tokenizer.path.as_str(), card.tokenizer_config.path.as_str(), template)
    }
    let mut seen = HashSet::new();
    cards.iter().filter(|card| card.key() == key && seen.insert(paths(card))).take(MAX_CARD_SOURCES).cloned().collect()
}

/// Parses verified bytes into a tokenizer and template (blocking: run on a render thread).
fn build(
    key: ArtifactKey,
    tokenizer_json: &[u8],
    config_json: &[u8],
    template: Option<&[u8]>,
) -> Result<LoadedArtifacts, LoadError> {
    let mut tokenizer =
        Tokenizer::from_bytes(tokenizer_json).map_err(|e| LoadError::Invalid(format!("tokenizer.json: {e}")))?;
    let config: Value =
        serde_json::from_slice(config_json).map_err(|e| LoadError::Invalid(format!("tokenizer_config.json: {e}")))?;
    merge_config_special_tokens(&mut tokenizer, &config)
        .map_err(|e| LoadError::Invalid(format!("tokenizer_config.json added_tokens_decoder: {e}")))?;
    let template_source = template
        .map(|bytes| {
            std::str::from_utf8(bytes).map_err(|_| LoadError::Invalid("the chat template is not UTF-8".into()))
        })
        .transpose()?;
    let bytes = (tokenizer_json.len() + config_json.len() + template.map_or(0, <[u8]>::len)) as u64;
    let template = ChatTemplate::new(&config, template_source).map_err(|e| LoadError::Invalid(e.to_string()))?;
    let pieces = PieceCache::for_tokenizer(&tokenizer);
    Ok(LoadedArtifacts { key, tokenizer, pieces, template, bytes })
}

/// dynamo.frontend promotes `tokenizer_config.json`'s `added_tokens_decoder` entries marked
/// special onto the tokenizer, so a special token declared only there still encodes as one id.
fn merge_config_special_tokens(tokenizer: &mut Tokenizer, config: &Value) -> tokenizers::Result<()> {
    let Some(decoder) = config.get("added_tokens_decoder").and_then(Value::as_object) else { return Ok(()) };
    let flag = |spec: &Value, name: &str| spec.get(name).and_then(Value::as_bool).unwrap_or(false);
    let tokens: Vec<AddedToken> = decoder
        .values()
        .filter(|spec| flag(spec, "special"))
        .filter_map(|spec| {
            let content = spec.get("content").and_then(Value::as_str).filter(|c| !c.is_empty())?;
            Some(
                AddedToken::from(content.to_string(), true)
                    .single_word(flag(spec, "single_word"))
                    .lstrip(flag(spec, "lstrip"))
                    .rstrip(flag(spec, "rstrip"))
                    .normalized(flag(spec, "normalized")),
            )
        })
        .collect();
    if !tokens.is_empty() {
        tokenizer.add_special_tokens(tokens)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// File operations stalled on a volume keep their permits until they return: past
    /// [`MAX_ARTIFACT_FILE_JOBS`] another is refused at once, rather than strand one more of
    /// the blocking pool's threads; once they return, operations run again.
    #[tokio::test]
    async fn stalled_file_operations_hold_at_most_so_many_blocking_threads() {
        static JOBS: Semaphore = Semaphore::const_new(MAX_ARTIFACT_FILE_JOBS);
        let (release, stalled) = std::sync::mpsc::channel::<()>();
        let stalled = Arc::new(Mutex::new(stalled));
        let mut running = Vec::new();
        for _ in 0..MAX_ARTIFACT_FILE_JOBS {
            let stalled = Arc::clone(&stalled);
            running.push(tokio::spawn(file_job(&JOBS, move || {
                let _ = stalled.lock().map(|rx| rx.recv());
            })));
        }
        while JOBS.available_permits() > 0 {
            tokio::task::yield_now().await;
        }
        let refused = file_job(&JOBS, || 1).await;
        assert!(refused.as_ref().is_err_and(|e| e.contains("still running")), "{refused:?}");
        for _ in 0..MAX_ARTIFACT_FILE_JOBS {
            release.send(()).unwrap();
        }
        for job in running {
            assert!(job.await.unwrap().is_ok());
        }
        assert_eq!(file_job(&JOBS, || 1).await, Ok(1));
    }
}
