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
        /// Where `overlaps` came from.
        answer: IndexAnswer,
    },
    /// No KV term: the request is picked by the load-only rules and the result is counted.
    Unavailable(KvSelectionResult),
}

/// Where a scored term's overlaps came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexAnswer {
    /// The control plane's index answered `FindMatches`, numbering the lookup `turn` among all
    /// it has answered for the model (0: unnumbered). Ties rotate by the turn, so replicas that
    /// see the same tie at once take different ranks. `suggestion` is the rank (instance id,
    /// dp rank) the control plane suggested, if any.
    Answered { turn: u64, suggestion: Option<Suggested> },
    /// The lookup missed its deadline or failed, and the replica's recent answer for the
    /// prompt's prefix stands in: counted `index_recent`.
    Recent,
    /// The lookup missed its deadline or failed with no recent answer to stand in: no rank is
    /// credited an overlap, and the selection is counted with this result (`index_timeout` or
    /// `index_unavailable`). The prompt was rendered all the same, so the formula still weighs
    /// its exact length against every rank's prefill and decode load; the load-only rules
    /// would score an aggregated worker by its decode blocks alone and queue the request
    /// behind a prefill.
    Missed(KvSelectionResult),
}

impl IndexAnswer {
    /// The lookup's fleet-wide turn, when the control plane answered and numbered it.
    pub fn turn(self) -> Option<u64> {
        match self {
            IndexAnswer::Answered { turn, .. } if turn > 0 => Some(turn),
            _ => None,
        }
    }

    /// The same answer for a pick made after this replica picked `tokens` of other prompts
    /// since the lookup went out: picks the control plane did not weigh in its suggestion but
    /// this replica's costs count, so the suggestion reaches that much further. A tie-break
    /// then becomes a suggestion weighed against them.
    pub fn picked_meanwhile(self, tokens: u64) -> Self {
        match self {
            IndexAnswer::Answered { turn, suggestion: Some(suggestion) } if tokens > 0 => {
                let (rank, reserved_tokens) = match suggestion {
                    Suggested::Weighed { rank, reserved_tokens } => (rank, reserved_tokens),
                    Suggested::TieBreak(rank) => (rank, 0),
                };
                let reserved_tokens = reserved_tokens.saturating_add(tokens);
                let suggestion = Some(Suggested::Weighed { rank, reserved_tokens });
                IndexAnswer::Answered { turn, suggestion }
            }
            answer => answer,
        }
    }

    /// The rank the control plane suggested, when it answered with one.
    pub fn suggestion(self) -> Option<Suggested> {
        match self {
            IndexAnswer::Answered { suggestion, .. } => suggestion,
            _ => None,
        }
    }
}

/// A rank (instance id, dp rank) the control plane suggested to a lookup, among the ranks the
/// replica named as the request's contenders (`FindMatchesResponse.suggestion`, `tie_break`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Suggested {
    /// Weighed against every replica's lookups of the last few milliseconds, which this
    /// replica's view may not count yet; they reserved `reserved_tokens` on the contenders, the
    /// most by which this replica's costs can be behind, so it is taken within that much of
    /// the cheapest.
    Weighed { rank: (u64, u32), reserved_tokens: u64 },
    /// Nothing recent to weigh: taken only among ranks the replica's costs tie exactly, so the
    /// control plane knows the rank before the dispatch report says so.
    TieBreak((u64, u32)),
}

impl Suggested {
    pub fn rank(self) -> (u64, u32) {
        match self {
            Suggested::Weighed { rank, .. } | Suggested::TieBreak(rank) => rank,
        }
    }
}

/// One rank's share of a request's prefix, as `FindMatches` answers it. Instance ids are
/// Dynamo lease ids, unique across namespaces, so they need no namespace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankOverlap {
    pub instance_id: u64,
    pub dp_rank: u32,
    /// Blocks of the prefix the rank holds (cached, or credited provisionally), contiguous
    /// from the first.
    pub blocks: u32,
    /// Of those, the blocks the fleet's requests in flight on the rank hold: the request
    /// would share them rather than make them active again.
    pub active: u32,
}

impl RankOverlap {
    /// A rank caching `blocks` of the prefix, none of them held by a request in flight.
    pub fn cached(instance_id: u64, dp_rank: u32, blocks: u32) -> Self {
        Self { instance_id, dp_rank, blocks, active: 0 }
    }

    /// The same overlap for a prefix of at most `blocks` blocks.
    pub fn capped(self, blocks: u32) -> Self {
        Self { blocks: self.blocks.min(blocks), active: self.active.min(blocks), ..self }
    }
}

/// Per (instance id, dp rank): the rank's [`RankOverlap`]. Ranks absent hold none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overlaps {
    /// (blocks, active) per rank.
    held: HashMap<(u64, u32), (u32, u32)>,
}

impl Overlaps {
    /// The blocks rank `dp_rank` of `instance_id` holds (0 when absent).
    pub fn get(&self, instance_id: u64, dp_rank: u32) -> u32 {
        self.held.get(&(instance_id, dp_rank)).map_or(0, |(blocks, _)| *blocks)
    }

    /// Of [`Overlaps::get`], the blocks its requests in flight hold (0 when absent).
    pub fn active(&self, instance_id: u64, dp_rank: u32) -> u32 {
        self.held.get(&(instance_id, dp_rank)).map_or(0, |(_, active)| *active)
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// From a `FindMatches` reply. A rank listed twice keeps its longer matches; zero-block
/// entries are dropped, as if absent; a rank's active blocks never exceed its blocks.
impl FromIterator<RankOverlap> for Overlaps {
    fn from_iter<I: IntoIterator<Item = RankOverlap>>(iter: I) -> Self {
        let mut held: HashMap<(u64, u32), (u32, u32)> = HashMap::new();
        for overlap in iter.into_iter().filter(|o| o.blocks > 0) {
            let (blocks, active) = held.entry((overlap.instance_id, overlap.dp_rank)).or_default();
            *blocks = (*blocks).max(overlap.blocks);
            *active = (*active).max(overlap.active.min(overlap.blocks));
        }
        Self { held }
    }
}

impl From<Vec<RankOverlap>> for Overlaps {
    fn from(reply: Vec<RankOverlap>) -> Self {
        reply.into_iter().collect()
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
