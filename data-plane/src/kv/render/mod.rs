//! Prompt → tokens → block hashes, on render threads of their own (deep stacks, see
//! `threads`) and inside the seed's bounds: a permit
//! per core (clamped to 4..=32) waited for at most 20 ms, a 2 s deadline for the whole job, the
//! template's fuel and 1 MiB output cap, and 1,048,576 tokens. Every refusal is a [`Fallback`]:
//! the request is still served, scored without a KV term.

mod bpe;
mod context;
mod pieces;
mod python;
mod strftime;
mod template;
pub(crate) mod threads;
mod warm;

use std::borrow::Borrow;
use std::sync::Arc;
use std::time::Duration;

use continuum_proto::model::PromptDefaults;
use prometheus::Histogram;
use serde_json::Value;
use tokio::sync::Semaphore;

pub use pieces::PieceCache;
pub use template::{ChatTemplate, MAX_RENDERED_BYTES, RENDER_FUEL, RenderError, TemplateError};
pub use warm::Warmed;

use super::Fallback;
use super::artifacts::LoadedArtifacts;
use super::hashing::{BlockSize, LocalBlockHash, SaltHash, block_hashes};

/// Tokens one prompt may encode to.
pub const MAX_PROMPT_TOKENS: usize = 1_048_576;
/// Fewest and most concurrent renders, whatever the core count.
pub const MIN_RENDER_PERMITS: usize = 4;
pub const MAX_RENDER_PERMITS: usize = 32;
/// How long a request waits for a render permit before scoring without KV.
pub const PERMIT_WAIT: Duration = Duration::from_millis(20);
/// How long a render (permit wait included) may take before the request stops waiting for it.
pub const RENDER_DEADLINE: Duration = Duration::from_secs(2);

/// The bounds a [`Renderer`] enforces; [`RenderLimits::default`] is the seed's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderLimits {
    pub permits: usize,
    pub permit_wait: Duration,
    pub deadline: Duration,
    pub max_tokens: usize,
}

impl Default for RenderLimits {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            permits: cores.clamp(MIN_RENDER_PERMITS, MAX_RENDER_PERMITS),
            permit_wait: PERMIT_WAIT,
            deadline: RENDER_DEADLINE,
            max_tokens: MAX_PROMPT_TOKENS,
        }
    }
}

/// A rendered, tokenized and hashed prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedPrompt {
    /// The token ids dynamo.frontend would send the worker for the same request.
    pub tokens: Vec<u32>,
    /// Block hashes for each requested block size, in the order the sizes were given.
    pub hashes: Vec<(BlockSize, Vec<LocalBlockHash>)>,
    /// Whether the request carries media ([`carries_media`]); found by the render's job, off
    /// the runtime, since a body may hold hundreds of thousands of content parts.
    pub media: bool,
}

impl PreparedPrompt {
    pub fn hashes_for(&self, block_size: BlockSize) -> Option<&[LocalBlockHash]> {
        self.hashes.iter().find(|(size, _)| *size == block_size).map(|(_, hashes)| hashes.as_slice())
    }
}

#[derive(Debug, Clone)]
pub struct Renderer {
    permits: Arc<Semaphore>,
    limits: RenderLimits,
    stages: Option<RenderStages>,
}

/// Where a render's time goes, observed per render that runs.
#[derive(Debug, Clone)]
pub struct RenderStages {
    /// The wait for a permit and then for a render thread to pick the job up.
    pub queued: Histogram,
    /// The job itself on that thread: template, encode, hash. What is left of a preparation's
    /// time beyond these two is the hand-back to the request's task.
    pub ran: Histogram,
}

impl Default for Renderer {
    fn default() -> Self {
        Self::new(RenderLimits::default())
    }
}

impl Renderer {
    pub fn new(limits: RenderLimits) -> Self {
        Self { permits: Arc::new(Semaphore::new(limits.permits)), limits, stages: None }
    }

    /// The same renderer, observing how long each render waits before it runs and how long it
    /// runs: it tells a slow preparation that waited, or ran long, from one whose result took
    /// long to reach its request.
    pub fn observing(self, stages: RenderStages) -> Self {
        Self { stages: Some(stages), ..self }
    }

    pub fn limits(&self) -> RenderLimits {
        self.limits
    }

    #[cfg(test)]
    pub(crate) fn permits_available(&self) -> usize {
        self.permits.available_permits()
    }

    /// A permit, as a render in progress holds one.
    #[cfg(test)]
    pub(crate) fn hold_permit(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        Arc::clone(&self.permits).try_acquire_owned().ok()
    }

    /// Renders a probe prompt with `artifacts` on as many render threads at once as
    /// there are permits, so the first burst of requests after a tokenizer loads renders on
    /// warm threads and memory (`warm.rs`). Each probe holds a permit, of those free, as a
    /// request's render does: renders of every kind together never outnumber the permits.
    pub async fn warm(&self, artifacts: Arc<LoadedArtifacts>) -> Warmed {
        warm::warm(artifacts, &self.permits, self.limits.permits).await
    }

    /// Renders `request` (an OpenAI chat-completions body) with the model's template, shaped by
    /// its card's `defaults`, encodes it as dynamo.frontend does (no added special tokens), and
    /// hashes every complete block. The job shares `request` rather than copying it, and holds it
    /// until it ends: a body's bounds (see `ingress::request::Tree`) last as long as a render
    /// abandoned at its deadline runs.
    pub async fn prepare<R>(
        &self,
        artifacts: Arc<LoadedArtifacts>,
        request: Arc<R>,
        defaults: PromptDefaults,
        block_sizes: &[BlockSize],
        salt: SaltHash,
    ) -> Result<PreparedPrompt, Fallback>
    where
        R: Borrow<Value> + Send + Sync + 'static,
    {
        let started = tokio::time::Instant::now();
        let permit = match tokio::time::timeout(self.limits.permit_wait, self.permits.clone().acquire_owned()).await {
            Ok(Ok(permit)) => permit,
            Ok(Err(_)) | Err(_) => {
                // Perhaps the tokenizer's last holder, evicted meanwhile: its tables are freed
                // off the runtime, as the store frees them.
                crate::memory::free_off_the_runtime(artifacts);
                return Err(Fallback::RenderUnavailable);
            }
        };
        let (sizes, max_tokens) = (block_sizes.to_vec(), self.limits.max_tokens);
        let stages = self.stages.clone();
        let job = threads::spawn(move || {
            let running = tokio::time::Instant::now();
            if let Some(stages) = &stages {
                stages.queued.observe(running.duration_since(started).as_secs_f64());
            }
            // The permit is held until the job ends, even past the deadline, so abandoned
            // renders still count against the bound.
            let _permit = permit;
            let prepared = prepare_blocking(&artifacts, (*request).borrow(), defaults, &sizes, salt, max_tokens);
            if let Some(stages) = &stages {
                stages.ran.observe(running.elapsed().as_secs_f64());
            }
            // The request goes back with the result: freeing its tree here, its last holder
            // being this job, would hold up the result (a large body's takes tens of
            // milliseconds) for the caller waiting on it.
            (prepared, request)
        });
        let remaining = self.limits.deadline.saturating_sub(started.elapsed());
        match tokio::time::timeout(remaining, job).await {
            Ok(Ok((result, request))) => {
                drop(request);
                result
            }
            Ok(Err(_)) | Err(_) => Err(Fallback::RenderUnavailable),
        }
    }
}

/// The pure core of a render: template, encode, hash.
pub fn prepare_blocking(
    artifacts: &LoadedArtifacts,
    request: &Value,
    defaults: PromptDefaults,
    block_sizes: &[BlockSize],
    salt: SaltHash,
    max_tokens: usize,
) -> Result<PreparedPrompt, Fallback> {
    let text = artifacts.template.render_with(request, defaults).map_err(|error| match error {
        RenderError::TooLarge => Fallback::PromptTooLarge,
        RenderError::OutOfFuel | RenderError::Refused(_) | RenderError::Template(_) => {
            tracing::debug!(%error, "chat template render failed");
            Fallback::RenderUnavailable
        }
    })?;
    // The frontend drops NUL characters from a rendered prompt before encoding it: one kept
    // would be a token it never sees, and shift every block after it.
    let text = if text.contains('\0') { text.replace('\0', "") } else { text };
    let tokens = encode_within(artifacts, &text, salt.isolation())?;
    if tokens.len() > max_tokens {
        return Err(Fallback::PromptTooLarge);
    }
    let hashes = block_sizes.iter().map(|&size| (size, block_hashes(&tokens, size, salt))).collect();
    Ok(PreparedPrompt { tokens, hashes, media: carries_media(request) })
}

/// Whether a chat request's messages carry media (images, video, audio). Dynamo mixes each
/// item's own hash into the blocks that hold it, which a router that never fetches the items
/// cannot: the chain it makes holds for the text before the first item only, so it is neither
/// credited to other requests nor remembered for them, and the rendered tokens, placeholders
/// where the items were, are not sent as the prompt's.
fn carries_media(request: &Value) -> bool {
    let messages = request.get("messages").and_then(Value::as_array).into_iter().flatten();
    let parts = messages.filter_map(|message| message.get("content")?.as_array()).flatten();
    parts
        .map(|part| part.get("type").and_then(Value::as_str))
        .any(|kind| matches!(kind, Some("image_url" | "video_url" | "audio_url" | "input_audio")))
}

/// dynamo.frontend encodes a rendered chat prompt with `add_special_tokens = false`: the
/// template already wrote whatever BOS it wants. Pieces seen before come from the tokenizer's
/// [`PieceCache`].
pub fn encode(artifacts: &LoadedArtifacts, text: &str) -> Result<Vec<u32>, Fallback> {
    encode_within(artifacts, text, None)
}

/// [`encode`], a salted request's pieces kept apart ([`PieceCache::encode_within`]).
fn encode_within(artifacts: &LoadedArtifacts, text: &str, isolation: Option<u64>) -> Result<Vec<u32>, Fallback> {
    artifacts.pieces.encode_within(&artifacts.tokenizer, text, isolation).map_err(|error| {
        tracing::debug!(%error, "tokenizer encode failed");
        Fallback::RenderUnavailable
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Media is any image, video or audio part of any message's content; text parts, and
    /// those words inside text, are not.
    #[test]
    fn media_is_an_image_video_or_audio_part_of_a_message() {
        let request = |content: Value| {
            serde_json::json!({"model": "m", "messages": [
                {"role": "system", "content": "you see images"},
                {"role": "user", "content": content},
            ]})
        };
        for kind in ["image_url", "video_url", "audio_url", "input_audio"] {
            let parts = serde_json::json!([{"type": "text", "text": "what is this"}, {"type": kind}]);
            assert!(carries_media(&request(parts)), "{kind}");
        }
        for content in [
            serde_json::json!("an image_url"),
            serde_json::json!([{"type": "text", "text": "image_url"}]),
            serde_json::json!([{"type": "refusal", "refusal": "no"}]),
        ] {
            assert!(!carries_media(&request(content.clone())), "{content}");
        }
        assert!(!carries_media(&serde_json::json!({"messages": "not an array"})));
    }
}
