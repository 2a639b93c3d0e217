//! Tokenizers and chat templates named by workers' model cards: resolving a card's
//! `CheckedFile`s, refusing whatever the operator has not pinned, a content-addressed blob cache
//! verified on every read, and the bounded set of loaded tokenizers the renderer uses.
//!
//! Lifecycle: an [`ArtifactStore`] lives as long as the replica's KV configuration; a request
//! asks it for the model's [`ArtifactKey`] and gets a loaded tokenizer at once or a fallback,
//! while loads run in the background on the blocking pool.

mod cache;
mod card;
mod reach;
mod source;
mod store;

pub use cache::{BlobCache, MAX_ARTIFACT_BYTES};
pub use card::{ArtifactKey, CardError, CheckedFile, Checksum, ChecksumError, ModelArtifacts, fleet_key};
pub use source::{ARTIFACT_CA_FILE_ENV, DEFAULT_HF_ENDPOINT, Fetcher, Schemes, Source, SourceError, TlsSetupError};
#[cfg(test)]
pub(crate) use store::hold_cache_file_jobs;
pub use store::{
    ArtifactStore, Clock, FAILED_LOAD_RETRY, LOAD_DEADLINE, LoadError, LoadedArtifacts, MAX_CONCURRENT_LOADS,
    MAX_LOADED_BYTES, MAX_LOADED_TOKENIZERS, Warm,
};

use std::collections::BTreeSet;
use std::path::PathBuf;

/// The operator's artifact rules (`dynamo.kv.*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArtifactPolicy {
    /// Fetch `http(s)://` artifacts (an operator's mirror, a worker's own metadata URL). Default
    /// true. Any host a card names is asked, loopback and private networks included, but for
    /// the metadata and link-local addresses `reach` refuses; only bytes matching a pinned
    /// checksum are kept, so a card naming another host costs that host a GET and nothing more.
    pub allow_http_artifacts: bool,
    /// Fetch `hf://` artifacts from `HF_ENDPOINT`. Default false: public egress is opt-in.
    pub allow_hf_artifacts: bool,
    /// The only checksums that may be fetched, cached, loaded or rendered. Empty by default.
    pub pinned_artifacts: BTreeSet<Checksum>,
    /// Holds `blobs/<checksum>`.
    pub artifact_cache_dir: PathBuf,
}

impl ArtifactPolicy {
    pub fn new(artifact_cache_dir: PathBuf) -> Self {
        Self {
            allow_http_artifacts: true,
            allow_hf_artifacts: false,
            pinned_artifacts: BTreeSet::new(),
            artifact_cache_dir,
        }
    }

    pub fn schemes(&self) -> Schemes {
        Schemes { allow_http: self.allow_http_artifacts, allow_hf: self.allow_hf_artifacts }
    }

    /// The first checksum of `key` that is not pinned.
    pub fn unpinned(&self, key: &ArtifactKey) -> Option<Checksum> {
        key.checksums().find(|c| !self.pinned_artifacts.contains(c))
    }
}

/// `continuum_dynamo_kv_artifacts_total{result}`: a closed label set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ArtifactResult {
    /// A tokenizer and template were built and cached in memory.
    Loaded,
    /// An artifact was served from the blob cache after its checksum verified.
    Cached,
    /// An artifact was read from its source (local file or fetch) and verified.
    Fetched,
    /// A checksum is not in `pinned_artifacts`: nothing was read.
    Unpinned,
    /// Bytes (cached or fetched) did not hash to the card's checksum.
    ChecksumMismatch,
    /// An artifact exceeded 64 MiB.
    TooLarge,
    /// Reading or fetching the source failed.
    FetchFailed,
    /// The source's scheme is disabled by the policy.
    RefusedScheme,
    /// A card slot, URI scheme or block size the router does not handle.
    Unsupported,
    /// The bytes verified but are not a usable tokenizer, config or template.
    Invalid,
    /// A loaded tokenizer was dropped to stay within the count and byte budgets, or unpinned.
    Evicted,
}

impl ArtifactResult {
    pub const ALL: [ArtifactResult; 11] = [
        ArtifactResult::Loaded,
        ArtifactResult::Cached,
        ArtifactResult::Fetched,
        ArtifactResult::Unpinned,
        ArtifactResult::ChecksumMismatch,
        ArtifactResult::TooLarge,
        ArtifactResult::FetchFailed,
        ArtifactResult::RefusedScheme,
        ArtifactResult::Unsupported,
        ArtifactResult::Invalid,
        ArtifactResult::Evicted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ArtifactResult::Loaded => "loaded",
            ArtifactResult::Cached => "cached",
            ArtifactResult::Fetched => "fetched",
            ArtifactResult::Unpinned => "unpinned",
            ArtifactResult::ChecksumMismatch => "checksum_mismatch",
            ArtifactResult::TooLarge => "too_large",
            ArtifactResult::FetchFailed => "fetch_failed",
            ArtifactResult::RefusedScheme => "refused_scheme",
            ArtifactResult::Unsupported => "unsupported",
            ArtifactResult::Invalid => "invalid",
            ArtifactResult::Evicted => "evicted",
        }
    }
}
