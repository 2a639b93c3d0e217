//! Encoding a rendered chat prompt piece by piece, remembering the pieces.
//!
//! A tokenizer first splits its input at the added tokens it matches before normalization (chat
//! markers such as `<|im_start|>`), then normalizes, pre-tokenizes and encodes each piece
//! between them on its own (`AddedVocabulary::extract_and_normalize`). The ids of the whole are
//! therefore the ids of its pieces with the markers' ids between, and a piece encodes the same
//! wherever it appears. A conversation resends its system prompt and its history with every
//! turn, and many conversations share one system prompt, so most pieces of a prompt were
//! encoded before: on the benchmark's multi-turn prompts, a turn's new text is about 80 of its
//! 2,000–2,800 tokens.
//!
//! Exact by construction, and checked once per tokenizer on a probe text built from its own
//! markers. Off (every prompt encoded whole) for a tokenizer that matches added tokens after
//! normalization, or that pads or truncates, since its pieces are not independent.
//!
//! Bounded: at most [`MAX_CACHED_BYTES`] of pieces and ids per tokenizer, in two generations of
//! half that each. New pieces go into the young one; when it is full, the old one is let go and
//! the young one ages. A piece found in the old one moves back to the young, so pieces in use
//! (a fleet's shared system prompts) outlive a flood of pieces seen once, such as a client
//! sending megabytes of unique text. Pieces shorter than [`MIN_CACHED_PIECE`] bytes are encoded
//! each time.
//!
//! A piece not seen before is encoded by [`ByteLevelBpe`] when the tokenizer is one it
//! reproduces, by `tokenizers` otherwise.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokenizers::{NormalizerWrapper, OffsetReferential, OffsetType, Tokenizer};

use super::bpe::ByteLevelBpe;

/// Text and ids one tokenizer's cache holds at most, in bytes.
pub const MAX_CACHED_BYTES: usize = 32 << 20;
/// Pieces shorter than this are cheaper to encode than to look up and keep.
pub const MIN_CACHED_PIECE: usize = 64;
/// What one cached piece costs beyond its text and ids (map entry, `Arc` and `Box` headers).
const ENTRY_OVERHEAD: usize = 64;

#[derive(Debug)]
pub struct PieceCache {
    /// Whether this tokenizer's pieces are independent (see the module docs).
    enabled: bool,
    /// The lean encoder for new pieces, when the tokenizer is one it reproduces.
    bpe: Option<ByteLevelBpe>,
    pieces: Mutex<Pieces>,
}

#[derive(Debug, Default)]
struct Pieces {
    /// Pieces kept or found since the last ageing, and their cost in bytes.
    young: Generation,
    /// Pieces kept before it; let go at the next ageing.
    old: Generation,
}

#[derive(Debug, Default)]
struct Generation {
    ids: HashMap<Box<str>, Arc<[u32]>>,
    bytes: usize,
}

impl PieceCache {
    /// A cache for `tokenizer`, on only if its pieces encode independently and a probe text
    /// made of its own markers encodes the same whole and by pieces.
    pub fn for_tokenizer(tokenizer: &Tokenizer) -> Self {
        let off = Self { enabled: false, bpe: None, pieces: Mutex::default() };
        let added = tokenizer.get_added_tokens_decoder();
        if added.values().any(|token| token.normalized)
            || tokenizer.get_truncation().is_some()
            || tokenizer.get_padding().is_some()
        {
            return off;
        }
        let mut markers: Vec<&str> = added.values().map(|token| token.content.as_str()).collect();
        markers.sort_unstable();
        let mut probe = String::from("Probe: a prompt's first piece.\n");
        for marker in markers {
            probe.push_str(marker);
            probe.push_str("system\nYou are  a helpful assistant; answer in one line.\n  ");
        }
        let bpe = ByteLevelBpe::for_tokenizer(tokenizer)
            .inspect_err(
                |why| tracing::info!(%why, "encoding new prompt pieces with `tokenizers`, not the lean encoder"),
            )
            .ok();
        let on = Self { enabled: true, bpe, ..off };
        let whole = tokenizer.encode(probe.as_str(), false).map(|e| e.get_ids().to_vec());
        match (whole, on.encode(tokenizer, &probe)) {
            (Ok(whole), Ok(pieces)) if whole == pieces => {
                on.clear();
                on
            }
            _ => {
                tracing::warn!("this tokenizer's prompt pieces do not encode independently; encoding prompts whole");
                Self { enabled: false, bpe: None, ..on }
            }
        }
    }

    /// Whether prompts are encoded by pieces (tests).
    #[cfg(test)]
    fn enabled(&self) -> bool {
        self.enabled
    }

    /// Whether new pieces are encoded by [`ByteLevelBpe`] (tests).
    #[cfg(test)]
    pub(crate) fn lean(&self) -> bool {
        self.bpe.is_some()
    }

    /// `text`'s ids as `tokenizer.encode(text, false)` gives them.
    pub fn encode(&self, tokenizer: &Tokenizer, text: &str) -> tokenizers::Result<Vec<u32>> {
        self.encode_within(tokenizer, text, None)
    }

    /// [`Self::encode`], with the pieces a salted request encodes kept apart under its
    /// `isolation` ([`crate::kv::hashing::SaltHash::isolation`]): whether a piece was cached
    /// shows in how soon a request is routed, and a tenant that salts its prompts must not learn
    /// from that what another sent (as the salt keeps the engines' caches apart).
    pub fn encode_within(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        isolation: Option<u64>,
    ) -> tokenizers::Result<Vec<u32>> {
        if !self.enabled {
            return Ok(tokenizer.encode(text, false)?.get_ids().to_vec());
        }
        let split = tokenizer.get_added_vocabulary().extract_and_normalize(None::<&NormalizerWrapper>, text);
        let mut ids = Vec::with_capacity(text.len() / 3);
        for (piece, _, marker) in split.get_splits(OffsetReferential::Original, OffsetType::Byte) {
            match marker {
                Some(tokens) => ids.extend(tokens.iter().map(|token| token.id)),
                None => ids.extend_from_slice(&self.piece(tokenizer, piece, isolation)?),
            }
        }
        Ok(ids)
    }

    /// One piece's ids, from the cache or encoded (and kept, when long enough).
    fn piece(&self, tokenizer: &Tokenizer, piece: &str, isolation: Option<u64>) -> tokenizers::Result<Arc<[u32]>> {
        let cached = piece.len() >= MIN_CACHED_PIECE;
        // A salted request's pieces under a key no unsalted piece can have: a rendered prompt
        // holds no NUL (the frontend strips them before encoding, and so does the render).
        let key: Cow<'_, str> = match isolation {
            Some(seed) if cached => Cow::Owned(format!("\0{seed:016x}{piece}")),
            _ => Cow::Borrowed(piece),
        };
        if cached && let Some(ids) = self.pieces.lock().unwrap_or_else(PoisonError::into_inner).get(&key) {
            return Ok(ids);
        }
        let mut ids = Vec::new();
        let ids: Arc<[u32]> = match self.bpe.as_ref().and_then(|bpe| bpe.encode(piece, &mut ids)) {
            Some(()) => ids.into(),
            None => tokenizer.encode(piece, false)?.get_ids().into(),
        };
        if cached {
            self.pieces.lock().unwrap_or_else(PoisonError::into_inner).insert(&key, Arc::clone(&ids));
        }
        Ok(ids)
    }

    /// Forgets every piece (benchmarks measure a cold encode this way).
    pub fn clear(&self) {
        self.pieces.lock().unwrap_or_else(PoisonError::into_inner).clear();
    }

    /// Pieces held now (tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        let pieces = self.pieces.lock().unwrap_or_else(PoisonError::into_inner);
        pieces.young.ids.len() + pieces.old.ids.len()
    }
}

impl Pieces {
    /// A piece's ids, if kept; one found in the old generation moves back to the young.
    fn get(&mut self, piece: &str) -> Option<Arc<[u32]>> {
        if let Some(ids) = self.young.ids.get(piece) {
            return Some(Arc::clone(ids));
        }
        let (piece, ids) = self.old.ids.remove_entry(piece)?;
        self.old.bytes = self.old.bytes.saturating_sub(cost(&piece, &ids));
        self.keep(piece, Arc::clone(&ids));
        Some(ids)
    }

    fn insert(&mut self, piece: &str, ids: Arc<[u32]>) {
        self.keep(piece.into(), ids);
    }

    fn keep(&mut self, piece: Box<str>, ids: Arc<[u32]>) {
        let cost = cost(&piece, &ids);
        if cost > MAX_CACHED_BYTES / 2 {
            return;
        }
        if self.young.bytes + cost > MAX_CACHED_BYTES / 2 {
            self.old = std::mem::take(&mut self.young);
        }
        if self.young.ids.insert(piece, ids).is_none() {
            self.young.bytes += cost;
        }
    }

    fn clear(&mut self) {
        *self = Self::default();
    }

    /// Bytes held, both generations.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.young.bytes + self.old.bytes
    }
}

/// What keeping a piece costs, in bytes.
fn cost(piece: &str, ids: &[u32]) -> usize {
    piece.len() + size_of_val(ids) + ENTRY_OVERHEAD
}

#[cfg(test)]
mod tests;
