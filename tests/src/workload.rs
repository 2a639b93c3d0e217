//! Deterministic chat workloads for the routing benchmark, generated from a seed: shared-prefix
//! multi-turn conversations (groups of users sharing a long system prompt) and unique prompts
//! (nothing to reuse).
//!
//! The generator is pure: text is built from seeded pseudo-words, and the caller supplies the
//! token counter (the fixture model's tokenizer), so each message reaches its target token count
//! whatever the tokenizer. Timing (staggered conversation starts, random think times) is part of
//! the workload, so every router under test sees the same arrivals.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Pseudo-words drawn per workload; each is tokenized once.
const LEXICON_WORDS: usize = 2048;
/// Output tokens of the canned assistant replies that later turns carry.
const ASSISTANT_REPLY_TOKENS: usize = 16;
/// Draws that overshoot the target before a text stops just short of it.
const MAX_MISSES: usize = 64;

/// The shape of a workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Shape {
    /// `groups` × `users` conversations; the users of a group share a system prompt.
    SharedPrefix { groups: usize, users: usize, system_tokens: usize, turn_tokens: usize },
    /// Fresh prompts, sent by `concurrency` clients one after another with a think time
    /// between two: a client's turns carry only their own prompt.
    Unique { prompt_tokens: usize },
}

/// What to generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spec {
    pub shape: Shape,
    /// Total requests over all conversations.
    pub requests: usize,
    pub max_tokens: u32,
    pub concurrency: usize,
    /// Think time between a conversation's turns: uniform in `[0, max_think_ms]`.
    pub max_think_ms: u64,
    /// Seeds the content and the timing; a new seed gives content no cache holds.
    pub seed: u64,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// A request of a conversation: sent `think_ms` after the previous turn's answer (or, for the
/// first turn, `start_ms` after the run starts).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Turn {
    pub think_ms: u64,
    pub messages: Vec<Message>,
}

/// A conversation: its turns run in order, one at a time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conversation {
    pub id: usize,
    /// The shared-prefix group (for unique prompts, the conversation itself).
    pub group: usize,
    pub start_ms: u64,
    pub turns: Vec<Turn>,
}

/// A generated workload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    pub spec: Spec,
    pub conversations: Vec<Conversation>,
}

impl Workload {
    pub fn requests(&self) -> usize {
        self.conversations.iter().map(|c| c.turns.len()).sum()
    }
}

/// Generates `spec`, counting tokens with `count` (tokens of a text as the model's tokenizer
/// encodes it, without special tokens).
pub fn generate(spec: Spec, count: &mut dyn FnMut(&str) -> usize) -> Workload {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let lexicon = Lexicon::new(&mut rng, count);
    let conversations = match spec.shape {
        Shape::SharedPrefix { groups, users, system_tokens, turn_tokens } => {
            shared_prefix(&spec, &mut rng, &lexicon, groups.max(1), users.max(1), system_tokens, turn_tokens)
        }
        Shape::Unique { prompt_tokens } => unique(&spec, &mut rng, &lexicon, prompt_tokens),
    };
    Workload { spec, conversations }
}

fn shared_prefix(
    spec: &Spec,
    rng: &mut StdRng,
    lexicon: &Lexicon,
    groups: usize,
    users: usize,
    system_tokens: usize,
    turn_tokens: usize,
) -> Vec<Conversation> {
    let total = groups * users;
    let systems: Vec<String> = (0..groups).map(|g| format!("g{g} {}", lexicon.text(rng, system_tokens))).collect();
    let mut conversations = Vec::with_capacity(total);
    for id in 0..total {
        let group = id % groups;
        // Turns spread the request count as evenly as it divides; the first conversations take
        // the remainder.
        let turns = spec.requests / total + usize::from(id < spec.requests % total);
        // Groups start staggered, the users of a group close together but not at once.
        let start_ms = group as u64 * 150 + rng.random_range(0..400);
        let mut history = vec![message("system", systems[group].clone())];
        let mut conversation = Conversation { id, group, start_ms, turns: Vec::with_capacity(turns) };
        for turn in 0..turns {
            history.push(message("user", format!("u{id} t{turn} {}", lexicon.text(rng, turn_tokens))));
            let think_ms = if turn == 0 { 0 } else { rng.random_range(0..=spec.max_think_ms) };
            conversation.turns.push(Turn { think_ms, messages: history.clone() });
            history.push(message("assistant", lexicon.text(rng, ASSISTANT_REPLY_TOKENS)));
        }
        conversations.push(conversation);
    }
    // Interleave the groups' users so no group's conversations sit together in the order the
    // client starts them.
    conversations.sort_by_key(|c| (c.start_ms, c.id));
    conversations
}

/// `spec.concurrency` clients, request `i` the turn `i / clients` of client `i % clients`, all
/// starting at once. Think times break the lockstep a closed loop without them falls into: each
/// request would then be sent the instant another ends, so the arrivals keep one phase against
/// an engine's fixed step cadence (the 1.6.1 mocker steps its decode batch every ~27 ms), and a
/// router's first-token times measure that phase as much as its choices.
fn unique(spec: &Spec, rng: &mut StdRng, lexicon: &Lexicon, prompt_tokens: usize) -> Vec<Conversation> {
    // Every prompt first, in request order, then the timing: the content of a seed stays the
    // same whatever the think times.
    let prompts: Vec<String> =
        (0..spec.requests).map(|id| format!("r{id} {}", lexicon.text(rng, prompt_tokens))).collect();
    let clients = spec.concurrency.clamp(1, spec.requests.max(1));
    let mut conversations: Vec<Conversation> =
        (0..clients).map(|id| Conversation { id, group: id, start_ms: 0, turns: Vec::new() }).collect();
    for (request, prompt) in prompts.into_iter().enumerate() {
        let conversation = &mut conversations[request % clients];
        let think_ms = if conversation.turns.is_empty() { 0 } else { rng.random_range(0..=spec.max_think_ms) };
        conversation.turns.push(Turn { think_ms, messages: vec![message("user", prompt)] });
    }
    conversations
}

fn message(role: &str, content: String) -> Message {
    Message { role: role.to_string(), content }
}

/// Seeded pseudo-words (a–z, 3 to 9 letters, like the fixture tokenizer's training text) with
/// their token counts when preceded by a space.
struct Lexicon {
    words: Vec<(String, usize)>,
}

impl Lexicon {
    fn new(rng: &mut StdRng, count: &mut dyn FnMut(&str) -> usize) -> Self {
        let words = (0..LEXICON_WORDS)
            .map(|_| {
                let len = rng.random_range(3..=9);
                let word: String = (0..len).map(|_| char::from(b'a' + rng.random_range(0..26u8))).collect();
                let tokens = count(&format!(" {word}")).max(1);
                (word, tokens)
            })
            .collect();
        Self { words }
    }

    /// Words joined by spaces, totalling `tokens` tokens: a byte-level BPE encodes each
    /// space-led word on its own, so the counts add up.
    fn text(&self, rng: &mut StdRng, tokens: usize) -> String {
        let mut text = String::with_capacity(tokens * 6);
        let (mut total, mut misses) = (0, 0);
        while total < tokens && misses < MAX_MISSES {
            let (word, n) = &self.words[rng.random_range(0..self.words.len())];
            if total + n > tokens && total > 0 {
                // Prefer a word that lands exactly; a few draws find one, else stop just short.
                misses += 1;
                continue;
            }
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(word);
            total += n;
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> tokenizers::Tokenizer {
        let path = crate::tools::dynamo_fixtures().join("tinymodel/tokenizer.json");
        tokenizers::Tokenizer::from_file(path).unwrap()
    }

    fn counter(tokenizer: &tokenizers::Tokenizer) -> impl FnMut(&str) -> usize + '_ {
        |text| tokenizer.encode(text, false).unwrap().len()
    }

    const SHARED: Spec = Spec {
        shape: Shape::SharedPrefix { groups: 8, users: 2, system_tokens: 1500, turn_tokens: 60 },
        requests: 100,
        max_tokens: 16,
        concurrency: 8,
        max_think_ms: 300,
        seed: 7,
    };

    #[test]
    fn the_same_seed_gives_the_same_workload_and_another_seed_other_content() {
        let tokenizer = tokenizer();
        let a = generate(SHARED, &mut counter(&tokenizer));
        let b = generate(SHARED, &mut counter(&tokenizer));
        assert_eq!(a, b);
        let c = generate(Spec { seed: 8, ..SHARED }, &mut counter(&tokenizer));
        let system = |w: &Workload| w.conversations[0].turns[0].messages[0].content.clone();
        assert_ne!(system(&a), system(&c));
    }

    #[test]
    fn shared_prefix_messages_hit_their_token_targets_and_users_of_a_group_share_the_system_prompt() {
        let tokenizer = tokenizer();
        let mut count = counter(&tokenizer);
        let w = generate(SHARED, &mut count);
        assert_eq!(w.requests(), 100);
        assert_eq!(w.conversations.len(), 16);
        for c in &w.conversations {
            let last = c.turns.last().unwrap();
            let system = &last.messages[0];
            assert_eq!(system.role, "system");
            let n = count(&system.content);
            assert!((1490..=1510).contains(&n), "system prompt of {n} tokens");
            for user in last.messages.iter().filter(|m| m.role == "user") {
                let n = count(&user.content);
                assert!((58..=68).contains(&n), "user turn of {n} tokens");
            }
            // Each turn extends the previous one's messages.
            for pair in c.turns.windows(2) {
                assert_eq!(pair[1].messages[..pair[0].messages.len()], pair[0].messages[..]);
                assert!(pair[1].think_ms <= SHARED.max_think_ms);
            }
            let peer = w.conversations.iter().find(|o| o.group == c.group && o.id != c.id).unwrap();
            assert_eq!(peer.turns[0].messages[0], c.turns[0].messages[0]);
        }
        let systems: std::collections::BTreeSet<_> =
            w.conversations.iter().map(|c| c.turns[0].messages[0].content.clone()).collect();
        assert_eq!(systems.len(), 8, "one system prompt per group");
    }

    #[test]
    fn unique_prompts_share_nothing_and_hit_their_target() {
        let tokenizer = tokenizer();
        let mut count = counter(&tokenizer);
        let spec = Spec { shape: Shape::Unique { prompt_tokens: 1560 }, requests: 20, ..SHARED };
        let w = generate(spec, &mut count);
        assert_eq!(w.requests(), 20);
        assert_eq!(w.conversations.len(), spec.concurrency, "one conversation per client");
        let mut firsts = std::collections::BTreeSet::new();
        for c in &w.conversations {
            assert_eq!(c.turns[0].think_ms, 0, "every client starts at once");
            for turn in &c.turns {
                assert_eq!(turn.messages.len(), 1, "a turn carries only its own prompt");
                assert!(turn.think_ms <= spec.max_think_ms);
                let text = &turn.messages[0].content;
                let n = count(text);
                assert!((1550..=1570).contains(&n), "prompt of {n} tokens");
                // Even the first block (16 tokens) differs between requests.
                assert!(firsts.insert(text.split(' ').take(6).collect::<Vec<_>>().join(" ")));
            }
        }
        assert!(w.conversations.iter().flat_map(|c| &c.turns[1..]).any(|t| t.think_ms > 0), "clients think");
    }

    #[test]
    fn unique_prompts_keep_their_content_whatever_the_think_times() {
        let tokenizer = tokenizer();
        let mut count = counter(&tokenizer);
        let spec = Spec { shape: Shape::Unique { prompt_tokens: 64 }, requests: 10, ..SHARED };
        let prompts = |w: &Workload| {
            let mut all: Vec<String> =
                w.conversations.iter().flat_map(|c| &c.turns).map(|t| t.messages[0].content.clone()).collect();
            all.sort();
            all
        };
        let thinking = generate(spec, &mut count);
        let lockstep = generate(Spec { max_think_ms: 0, ..spec }, &mut count);
        assert_eq!(prompts(&thinking), prompts(&lockstep));
        assert!(lockstep.conversations.iter().flat_map(|c| &c.turns).all(|t| t.think_ms == 0));
    }
}
