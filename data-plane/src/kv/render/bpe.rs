//! A lean encoder for byte-level BPE tokenizers (GPT-2's, and Llama 3's and Qwen 2's, which
//! split with a regex of their own before the byte-level step), giving the ids `tokenizers` gives.
//!
//! Why: on a prompt nothing in the fleet has seen, encoding is most of what the KV term adds
//! before a pick, and `tokenizers` spends most of it building what routing never reads (a
//! normalized string with alignments per split, a `String` and offsets per token). This does
//! only what decides the ids: split with the same regexes (`fancy-regex`, the engine our
//! `tokenizers` build uses), map each byte to its byte-level symbol, and apply the merges in the
//! order `tokenizers` does (lowest rank first, leftmost on a tie; `ignore_merges` honoured).
//!
//! Exact by construction for the configurations it accepts, and checked:
//! [`ByteLevelBpe::for_tokenizer`] declines any other configuration, and declines a tokenizer
//! whose ids differ from `tokenizers`' on a probe text. A piece it cannot encode (a byte without a
//! symbol in the vocabulary, a regex that gives up) is left to `tokenizers`.

use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use fancy_regex::Regex;
use serde_json::Value;
use tokenizers::Tokenizer;

/// The regex `tokenizers`' `ByteLevel` pre-tokenizer splits with when `use_regex` is on.
const GPT2_SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Text the encoder must encode as `tokenizers` does before it is used: letters of several
/// scripts, digits, contractions, runs of spaces, tabs and newlines, symbols and emoji.
const PROBE: &str = "Hello, world! It's 2026-12-03; we'll see   what's   there.\n\n\tTabs\tand  \
                     trailing spaces   \nCafé naïve 東京 Привет мир 😀👍🏽 x=1_000_000; \
                     f(x) -> y?! <<tag>> don'T I'M you'RE\r\n  1234567890 ١٢٣  end.   ";

/// Why a tokenizer's configuration is not one this encoder reproduces.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unsupported(String);

fn unsupported(what: impl Into<String>) -> Unsupported {
    Unsupported(what.into())
}

#[derive(Debug)]
pub struct ByteLevelBpe {
    /// Applied in turn, each to the pieces of the one before (`Split` pre-tokenizers in a
    /// `Sequence`, then `ByteLevel`'s own regex when `use_regex` is on).
    splitters: Vec<Regex>,
    /// The id of each byte's byte-level symbol; `None` when the vocabulary lacks it.
    byte_ids: [Option<u32>; 256],
    /// `(left, right)` packed in a `u64` → `(rank, merged id)`.
    merges: HashMap<u64, (u32, u32), BuildHasherDefault<PairHasher>>,
    /// With `ignore_merges`: the vocabulary by the raw bytes each token stands for; a split found
    /// here is that one token.
    whole_words: Option<HashMap<Box<[u8]>, u32>>,
    /// With an NFC normalizer: only ASCII pieces, which NFC leaves as they are.
    ascii_only: bool,
}

impl ByteLevelBpe {
    /// The encoder for `tokenizer`, if its configuration is one this reproduces and it encodes
    /// the probe text as `tokenizer` does. Added tokens are the caller's to split out first.
    pub fn for_tokenizer(tokenizer: &Tokenizer) -> Result<Self, Unsupported> {
        // Asked first, of the loaded model: the configuration as a tree takes several times a
        // tokenizer's file, for nothing when it is no BPE (a SentencePiece Unigram of tens of
        // megabytes, say).
        if !matches!(tokenizer.get_model(), tokenizers::models::ModelWrapper::BPE(_)) {
            return Err(unsupported("model other than BPE"));
        }
        // Once per tokenizer load, on a render thread; the configuration is dropped after.
        let json = serde_json::to_value(tokenizer).map_err(|e| unsupported(e.to_string()))?;
        let encoder = Self::from_config(&json)?;
        let probe = match tokenizer.encode(PROBE, false) {
            Ok(encoding) => encoding.get_ids().to_vec(),
            Err(error) => return Err(unsupported(format!("the probe text does not encode: {error}"))),
        };
        // The probe is not ASCII: under NFC it is checked as is, and equality is what counts.
        let ascii_only = encoder.ascii_only;
        let checked = Self { ascii_only: false, ..encoder };
        let mut mine = Vec::new();
        match checked.encode(PROBE, &mut mine) {
            Some(()) if mine == probe => Ok(Self { ascii_only, ..checked }),
            _ => Err(unsupported("the probe text encodes differently")),
        }
    }

    fn from_config(json: &Value) -> Result<Self, Unsupported> {
        let ascii_only = match &json["normalizer"] {
            Value::Null => false,
            normalizer if normalizer["type"] == "NFC" => true,
            other => return Err(unsupported(format!("normalizer {}", other["type"]))),
        };
        let splitters = splitters(&json["pre_tokenizer"])?;
        let model = &json["model"];
        if model["type"] != "BPE" {
            return Err(unsupported(format!("model {}", model["type"])));
        }
        if model["dropout"].as_f64().is_some_and(|d| d > 0.0) {
            return Err(unsupported("BPE dropout"));
        }
        for affix in ["continuing_subword_prefix", "end_of_word_suffix"] {
            if model[affix].as_str().is_some_and(|s| !s.is_empty()) {
                return Err(unsupported(format!("BPE {affix}")));
            }
        }
        let vocab: HashMap<&str, u32> = model["vocab"]
            .as_object()
            .ok_or_else(|| unsupported("BPE without a vocabulary"))?
            .iter()
            .filter_map(|(token, id)| Some((token.as_str(), u32::try_from(id.as_u64()?).ok()?)))
            .collect();
        let symbols = byte_symbols();
        let mut byte_ids = [None; 256];
        for (byte, symbol) in symbols.iter().enumerate() {
            byte_ids[byte] = vocab.get(symbol.encode_utf8(&mut [0; 4]) as &str).copied();
        }
        let mut merges = HashMap::default();
        for (rank, merge) in
            model["merges"].as_array().ok_or_else(|| unsupported("BPE without merges"))?.iter().enumerate()
        {
            let (left, right) = merge_pair(merge).ok_or_else(|| unsupported(format!("merge {merge}")))?;
            let id = |token: &str| {
                vocab
                    .get(token)
                    .copied()
                    .ok_or_else(|| unsupported(format!("merge {merge}: {token:?} not in the vocabulary")))
            };
            let merged = id(&format!("{left}{right}"))?;
            let rank = u32::try_from(rank).map_err(|_| unsupported("too many merges"))?;
            // As `tokenizers` builds its map: a repeated pair keeps its last rank.
            merges.insert(pair_key(id(left)?, id(right)?), (rank, merged));
        }
        let whole_words = model["ignore_merges"].as_bool().unwrap_or(false).then(|| {
            let bytes_of: HashMap<char, u8> = symbols.iter().enumerate().map(|(byte, &c)| (c, byte as u8)).collect();
            vocab
                .iter()
                .filter_map(|(token, &id)| {
                    let bytes: Option<Box<[u8]>> = token.chars().map(|c| bytes_of.get(&c).copied()).collect();
                    Some((bytes?, id))
                })
                .collect()
        });
        Ok(Self { splitters, byte_ids, merges, whole_words, ascii_only })
    }

    /// Appends `text`'s ids (a piece between added tokens) to `ids`, as `tokenizer.encode(text,
    /// false)` gives them; `None` (with `ids` as it was) when the piece is `tokenizers`' to encode.
    pub fn encode(&self, text: &str, ids: &mut Vec<u32>) -> Option<()> {
        if self.ascii_only && !text.is_ascii() {
            return None;
        }
        let before = ids.len();
        let mut scratch = Scratch::default();
        let encoded = self.split(0, text, &mut |word| self.encode_word(word.as_bytes(), ids, &mut scratch));
        if encoded.is_none() {
            ids.truncate(before);
        }
        encoded
    }

    /// Feeds `text`'s pieces under splitters `level..` to `word`, in order.
    fn split(&self, level: usize, text: &str, word: &mut dyn FnMut(&str) -> Option<()>) -> Option<()> {
        let Some(regex) = self.splitters.get(level) else {
            return if text.is_empty() { Some(()) } else { word(text) };
        };
        // Matches and the gaps between them are pieces alike (`Isolated`).
        let mut done = 0;
        for found in regex.find_iter(text) {
            let found = found.ok()?;
            self.split(level + 1, &text[done..found.start()], word)?;
            self.split(level + 1, found.as_str(), word)?;
            done = found.end();
        }
        self.split(level + 1, &text[done..], word)
    }

    fn encode_word(&self, word: &[u8], ids: &mut Vec<u32>, scratch: &mut Scratch) -> Option<()> {
        if let Some(id) = self.whole_words.as_ref().and_then(|words| words.get(word)) {
            ids.push(*id);
            return Some(());
        }
        let Scratch { symbols, queue } = scratch;
        symbols.clear();
        queue.clear();
        for (i, &byte) in word.iter().enumerate() {
            symbols.push(Symbol {
                id: self.byte_ids[usize::from(byte)]?,
                prev: i.checked_sub(1),
                next: i + 1,
                live: true,
            });
        }
        for pos in 0..symbols.len().saturating_sub(1) {
            if let Some(&(rank, merged)) = self.merges.get(&pair_key(symbols[pos].id, symbols[pos + 1].id)) {
                queue.push(Merge { rank, pos, merged });
            }
        }
        while let Some(Merge { pos, merged, .. }) = queue.pop() {
            let left = symbols[pos];
            if !left.live || left.next >= symbols.len() {
                continue;
            }
            let right = symbols[left.next];
            // A queued merge outlived by an earlier one at its place no longer applies.
            if self.merges.get(&pair_key(left.id, right.id)).is_none_or(|&(_, id)| id != merged) {
                continue;
            }
            symbols[pos] = Symbol { id: merged, next: right.next, ..left };
            symbols[left.next].live = false;
            if let Some(after) = symbols.get_mut(right.next) {
                after.prev = Some(pos);
            }
            if let Some(prev) = left.prev
                && let Some(&(rank, merged)) = self.merges.get(&pair_key(symbols[prev].id, merged))
            {
                queue.push(Merge { rank, pos: prev, merged });
            }
            if let Some(next) = symbols.get(right.next)
                && let Some(&(rank, merged)) = self.merges.get(&pair_key(merged, next.id))
            {
                queue.push(Merge { rank, pos, merged });
            }
        }
        ids.extend(symbols.iter().filter(|symbol| symbol.live).map(|symbol| symbol.id));
        Some(())
    }
}

/// Buffers one `encode` call reuses from word to word.
#[derive(Default)]
struct Scratch {
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Merge>,
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    id: u32,
    prev: Option<usize>,
    /// Past the end for the last symbol.
    next: usize,
    /// False once merged into the symbol before it.
    live: bool,
}

/// A merge waiting in the queue; the queue pops the lowest rank first, then the leftmost.
#[derive(Debug, PartialEq, Eq)]
struct Merge {
    rank: u32,
    pos: usize,
    merged: u32,
}

impl Ord for Merge {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.rank, other.pos).cmp(&(self.rank, self.pos))
    }
}

impl PartialOrd for Merge {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// The regexes a pre-tokenizer configuration splits with, if it is one this encoder reproduces:
/// `ByteLevel` without a prefix space, alone or last in a `Sequence` after `Split`s by regex that
/// keep both matches and gaps (`Isolated`, not inverted).
fn splitters(pre_tokenizer: &Value) -> Result<Vec<Regex>, Unsupported> {
    let steps = match pre_tokenizer["type"].as_str() {
        Some("Sequence") => pre_tokenizer["pretokenizers"].as_array().map(Vec::as_slice).unwrap_or_default(),
        _ => std::slice::from_ref(pre_tokenizer),
    };
    let Some((byte_level, splits)) = steps.split_last() else {
        return Err(unsupported("an empty pre-tokenizer sequence"));
    };
    if byte_level["type"] != "ByteLevel" || byte_level["add_prefix_space"] != false {
        return Err(unsupported(format!("pre-tokenizer {}", byte_level["type"])));
    }
    let compile = |pattern: &str| Regex::new(pattern).map_err(|e| unsupported(format!("split regex {pattern:?}: {e}")));
    let mut regexes = Vec::new();
    for split in splits {
        let pattern = split["pattern"]["Regex"].as_str();
        match pattern {
            Some(pattern)
                if split["type"] == "Split" && split["behavior"] == "Isolated" && split["invert"] == false =>
            {
                regexes.push(compile(pattern)?)
            }
            _ => return Err(unsupported(format!("pre-tokenizer {split}"))),
        }
    }
    // `use_regex` defaults to on when the field is absent.
    if byte_level["use_regex"] != false {
        regexes.push(compile(GPT2_SPLIT)?);
    }
    Ok(regexes)
}

/// A merge as `tokenizer.json` writes it: `["left", "right"]`, or `"left right"` in older files.
fn merge_pair(merge: &Value) -> Option<(&str, &str)> {
    match merge {
        Value::Array(pair) => match pair.as_slice() {
            [left, right] => Some((left.as_str()?, right.as_str()?)),
            _ => None,
        },
        Value::String(pair) => pair.split_once(' '),
        _ => None,
    }
}

/// GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the rest for the
/// code points from U+0100 up, in byte order.
fn byte_symbols() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut symbols = ['\0'; 256];
    let mut shifted = 0x100;
    for byte in 0..=255u8 {
        symbols[usize::from(byte)] = if printable(byte) {
            char::from(byte)
        } else {
            shifted += 1;
            char::from_u32(shifted - 1).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
    }
    symbols
}

fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// Hashes the one `u64` a pair key is with a multiply (Fibonacci hashing): the merge table is
/// looked up once or more per byte encoded, where SipHash would cost more than the merge.
#[derive(Default)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, key: u64) {
        self.0 = (self.0 ^ key).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(26);
    }
}

#[cfg(test)]
mod tests;
