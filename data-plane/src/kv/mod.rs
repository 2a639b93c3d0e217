//! The prompt side of KV-overlap-aware selection: from a chat request to the block hashes the
//! model's workers publish in their kv-events. [`KvPrompt::prepare`] agrees the fleet's
//! tokenizer ([`artifacts`]), renders and tokenizes the prompt as dynamo.frontend would
//! ([`render`]) and hashes it ([`hashing`]). Any refusal is a [`Fallback`], never an error the
//! client sees: the request is then scored without a KV term.

pub mod artifacts;
pub mod hashing;
pub mod render;

use std::borrow::Borrow;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use serde_json::Value;

use continuum_proto::model::{MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, PromptDefaults};

use self::artifacts::{ArtifactResult, ArtifactStore, LoadedArtifacts, ModelArtifacts, fleet_key};
use self::hashing::{BlockSize, MAX_BLOCK_SIZES_PER_MODEL, SaltHash};
pub use self::render::PreparedPrompt;
use self::render::Renderer;

/// Why a request is scored without a KV term; the labels are
/// `continuum_dynamo_kv_selection_total{result}` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Fallback {
    /// The rendered text or its tokens exceed the caps.
    #[error("the prompt is too large to hash")]
    PromptTooLarge,
    /// The template failed or ran out of fuel, or no render permit or time was left.
    #[error("the prompt could not be rendered in time")]
    RenderUnavailable,
    /// The workers disagree on their tokenizer, or it is not loaded (yet), or no block size is
    /// usable.
    #[error("no agreed, loaded tokenizer for the model")]
    TokenizerUnavailable,
    /// An artifact the workers name is not in `kv.pinned_artifacts`.
    #[error("the model's tokenizer artifacts are not pinned")]
    ArtifactUnpinned,
}

impl Fallback {
    pub const ALL: [Fallback; 4] = [
        Fallback::PromptTooLarge,
        Fallback::RenderUnavailable,
        Fallback::TokenizerUnavailable,
        Fallback::ArtifactUnpinned,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::PromptTooLarge => "prompt_too_large",
            Fallback::RenderUnavailable => "render_unavailable",
            Fallback::TokenizerUnavailable => "tokenizer_unavailable",
            Fallback::ArtifactUnpinned => "artifact_unpinned",
        }
    }
}

/// (model, block size) pairs remembered so an unsupported block size is logged once.
const MAX_LOGGED_BLOCK_SIZES: usize = 1024;

/// A model's loaded tokenizer and template, its prompt defaults and the block sizes to hash.
#[derive(Debug)]
pub struct Resolved {
    artifacts: Arc<LoadedArtifacts>,
    defaults: PromptDefaults,
    sizes: Vec<BlockSize>,
}

impl Resolved {
    /// Hashes for the first (the fleet's most common) usable block size alone: the one a
    /// lookup uses. A prompt of 65,536 blocks is that many hashes less.
    pub fn first_size_only(mut self) -> Self {
        self.sizes.truncate(1);
        self
    }
}

/// The replica's prompt preparer: one artifact store and one bounded renderer.
#[derive(Debug)]
pub struct KvPrompt {
    store: ArtifactStore,
    renderer: Renderer,
    logged_sizes: Mutex<HashSet<(String, u32)>>,
}

impl KvPrompt {
    /// The store warms `renderer` on every tokenizer it loads, before serving it.
    pub fn new(store: ArtifactStore, renderer: Renderer) -> Self {
        let warming = renderer.clone();
        store.warm_with(Box::new(move |artifacts| {
            let renderer = warming.clone();
            async move { renderer.warm(artifacts).await }.map(drop).boxed()
        }));
        Self { store, renderer, logged_sizes: Mutex::new(HashSet::new()) }
    }

    pub fn store(&self) -> &ArtifactStore {
        &self.store
    }

    /// Tokens and block hashes of `request` (an OpenAI chat-completions body) for a model whose
    /// serving workers' cards are `cards` and declare `block_sizes`. `cache_salt` and
    /// `lora_name` seed the hashes as Dynamo does ([`request_cache_salt`] reads the salt).
    ///
    /// Never waits for a tokenizer to load: the first requests after a card appears fall back
    /// with [`Fallback::TokenizerUnavailable`] while the load runs in the background.
    pub async fn prepare<R>(
        &self,
        model: &str,
        cards: &[ModelArtifacts],
        request: Arc<R>,
        block_sizes: &[u32],
        cache_salt: Option<&str>,
        lora_name: Option<&str>,
    ) -> Result<PreparedPrompt, Fallback>
    where
        R: Borrow<Value> + Send + Sync + 'static,
    {
        let resolved = self.resolve(model, cards, block_sizes)?;
        self.render(resolved, request, cache_salt, lora_name).await
    }

    /// What [`KvPrompt::prepare`] needs besides the request, or why it cannot run: checked
    /// before the request's JSON tree is built, which is not worth building for nothing.
    pub fn resolve(&self, model: &str, cards: &[ModelArtifacts], block_sizes: &[u32]) -> Result<Resolved, Fallback> {
        fleet_key(cards).ok_or(Fallback::TokenizerUnavailable)?;
        let sizes = self.usable_block_sizes(model, block_sizes);
        if sizes.is_empty() {
            return Err(Fallback::TokenizerUnavailable);
        }
        let card = cards.first().ok_or(Fallback::TokenizerUnavailable)?;
        let artifacts = self.store.lookup(model, cards)?;
        Ok(Resolved { artifacts, defaults: card.defaults, sizes })
    }

    /// [`KvPrompt::prepare`] with what [`KvPrompt::resolve`] found.
    pub async fn render<R>(
        &self,
        resolved: Resolved,
        request: Arc<R>,
        cache_salt: Option<&str>,
        lora_name: Option<&str>,
    ) -> Result<PreparedPrompt, Fallback>
    where
        R: Borrow<Value> + Send + Sync + 'static,
    {
        let Resolved { artifacts, defaults, sizes } = resolved;
        self.renderer.prepare(artifacts, request, defaults, &sizes, SaltHash::new(cache_salt, lora_name)).await
    }

    /// The distinct valid sizes, at most [`MAX_BLOCK_SIZES_PER_MODEL`] of them; the rest are
    /// counted as `unsupported` and logged once per model.
    fn usable_block_sizes(&self, model: &str, declared: &[u32]) -> Vec<BlockSize> {
        let mut sizes: Vec<BlockSize> = Vec::with_capacity(MAX_BLOCK_SIZES_PER_MODEL);
        for &size in declared {
            match BlockSize::new(size) {
                Ok(valid) if sizes.contains(&valid) => {}
                Ok(valid) if sizes.len() < MAX_BLOCK_SIZES_PER_MODEL => sizes.push(valid),
                Ok(_) | Err(_) => self.unsupported_block_size(model, size),
            }
        }
        sizes
    }

    /// Counted and logged once per model and size, as the artifacts' other results are once
    /// per load: counted per request, the series would be a request rate that hides them.
    fn unsupported_block_size(&self, model: &str, size: u32) {
        let mut logged = self.logged_sizes.lock().unwrap_or_else(|e| e.into_inner());
        if logged.len() >= MAX_LOGGED_BLOCK_SIZES {
            logged.clear();
        }
        if logged.insert((model.to_string(), size)) {
            self.store.record(ArtifactResult::Unsupported);
            tracing::warn!(
                model,
                size,
                "kv_cache_block_size is outside {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE} or a third distinct size; not hashed for KV overlap"
            );
        }
    }
}

/// The request's cache salt as dynamo.frontend 1.6.1 reads it from the body: a non-empty
/// `nvext.cache_salt`, else a non-empty top-level `cache_salt` (an empty or null one does not
/// hide the other).
pub fn request_cache_salt(request: &Value) -> Option<&str> {
    non_empty(request.pointer("/nvext/cache_salt")).or_else(|| non_empty(request.get("cache_salt")))
}

fn non_empty(value: Option<&Value>) -> Option<&str> {
    value.and_then(Value::as_str).filter(|salt| !salt.is_empty())
}

#[cfg(test)]
pub(crate) mod tests;
