//! What the KV-aware picker is told about one request's prefix: the overlaps the control
//! plane's KV index found for its block hashes, or why there are none.

use std::collections::HashMap;
use std::fmt;

/// The KV term of one pick.
#[derive(Clone, Copy, Debug)]
pub enum KvTerm<'a> {
    /// The request was rendered and hashed, and the index answered.
    Scored {
        /// The rendered prompt's length in tokens (not the load picker's estimate).
        isl_tokens: u64,
        /// The block size the hashes (and so `overlaps`) are counted in. Every cost is counted
        /// in it; a rank whose card declares another size cannot have matched the hashes.
        block_size: u32,
        overlaps: &'a Overlaps,
        /// `overlaps` is the replica's recent answer for the prompt's prefix, standing in for
        /// a lookup that missed its deadline: counted `index_recent`.
        recent: bool,
    },
    /// No KV term: the request is picked by the load-only rules and the result is counted.
    Unavailable(KvSelectionResult),
}

/// Per (instance id, dp rank): the blocks of the request's prefix the rank holds, contiguous
/// from the first. Ranks absent hold none. Instance ids are Dynamo lease ids, unique across
/// namespaces, so they need no namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overlaps {
    blocks: HashMap<(u64, u32), u32>,
}

impl Overlaps {
    /// The blocks rank `dp_rank` of `instance_id` holds (0 when absent).
    pub fn get(&self, instance_id: u64, dp_rank: u32) -> u32 {
        self.blocks.get(&(instance_id, dp_rank)).copied().unwrap_or(0)
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// From `(instance_id, dp_rank, blocks)` triples (a `FindMatches` reply). A rank listed twice
/// keeps its longer match; zero-block entries are dropped, as if absent.
impl FromIterator<(u64, u32, u32)> for Overlaps {
    fn from_iter<I: IntoIterator<Item = (u64, u32, u32)>>(iter: I) -> Self {
        let mut blocks: HashMap<(u64, u32), u32> = HashMap::new();
        for (instance_id, dp_rank, n) in iter.into_iter().filter(|(_, _, n)| *n > 0) {
            let held = blocks.entry((instance_id, dp_rank)).or_default();
            *held = (*held).max(n);
        }
        Self { blocks }
    }
}

impl From<Vec<(u64, u32, u32)>> for Overlaps {
    fn from(triples: Vec<(u64, u32, u32)>) -> Self {
        triples.into_iter().collect()
    }
}

/// The `result` label of `continuum_dynamo_kv_selection_total`: one per selected request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvSelectionResult {
    /// Scored, and the rank that prefills the request holds part of its prefix.
    Overlap,
    /// Scored, and the rank that prefills the request holds none of it.
    NoOverlap,
    /// The model's workers disagree on their tokenizer, or it is not loaded yet.
    TokenizerUnavailable,
    /// The rendered prompt or its tokens exceed the caps.
    PromptTooLarge,
    /// The chat template failed, ran out of fuel, or no render permit or time was left.
    RenderUnavailable,
    /// A tokenizer or template the workers name is not in `kv.pinned_artifacts`.
    ArtifactUnpinned,
    /// Conditional disaggregation: the decode worker prefills locally.
    Bypass,
    /// The control plane's `FindMatches` failed (unreachable, refused, or a malformed reply).
    IndexUnavailable,
    /// `FindMatches` did not answer within its deadline.
    IndexTimeout,
    /// `FindMatches` missed its deadline or failed, and a recent answer for the prompt's
    /// prefix scored it.
    IndexRecent,
}

impl KvSelectionResult {
    pub const ALL: [KvSelectionResult; 10] = [
        KvSelectionResult::Overlap,
        KvSelectionResult::NoOverlap,
        KvSelectionResult::TokenizerUnavailable,
        KvSelectionResult::PromptTooLarge,
        KvSelectionResult::RenderUnavailable,
        KvSelectionResult::ArtifactUnpinned,
        KvSelectionResult::Bypass,
        KvSelectionResult::IndexUnavailable,
        KvSelectionResult::IndexTimeout,
        KvSelectionResult::IndexRecent,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            KvSelectionResult::Overlap => "overlap",
            KvSelectionResult::NoOverlap => "no_overlap",
            KvSelectionResult::TokenizerUnavailable => "tokenizer_unavailable",
            KvSelectionResult::PromptTooLarge => "prompt_too_large",
            KvSelectionResult::RenderUnavailable => "render_unavailable",
            KvSelectionResult::ArtifactUnpinned => "artifact_unpinned",
            KvSelectionResult::Bypass => "bypass",
            KvSelectionResult::IndexUnavailable => "index_unavailable",
            KvSelectionResult::IndexTimeout => "index_timeout",
            KvSelectionResult::IndexRecent => "index_recent",
        }
    }
}

impl fmt::Display for KvSelectionResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
