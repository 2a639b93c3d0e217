//! The load-only rules' prompt sizes, calibrated per model against the tokens the model counts.
//!
//! Without a tokenizer a prompt is sized by characters and words ([`super::PromptText`]), which
//! suits English and a production model's vocabulary: about four characters a token. It can be
//! off by a large factor elsewhere (CJK text runs about one character a token; the benchmark's
//! fixture tokenizer, with short pieces, counts about twice the estimate). An estimate off by a
//! factor weighs a worker's queued prefill wrongly against its decode memory, so the load-only
//! cost sends requests behind running prefills. Every answer states what the model counted
//! (`usage.prompt_tokens`, in a buffered body or a stream's last chunk when the client asked for
//! usage), so each replica learns, per model, the ratio of that count to its estimate and sizes
//! later prompts by it.
//!
//! The ratio is a moving average in log space (a prompt twice too large and one half too small
//! cancel), each observation clamped to [`FACTOR_BOUNDS`], so one odd answer moves it a little
//! and a run of them no further than the bounds. The estimate covers only what the model is
//! given (a chat body's messages, and its tools unless `tool_choice` is `"none"`), so a client
//! cannot skew it with members the template never renders. At most [`MAX_CALIBRATED_MODELS`] models are
//! kept: a new one past them takes the place (and the gauge series) of the model answered
//! longest ago, so a fleet whose model names roll over keeps learning its current ones.

use std::sync::{LazyLock, Mutex, PoisonError};

use continuum_proto::fast_hash::FastMap;
use memchr::memmem::FinderRev;
use prometheus::{Gauge, GaugeVec};

/// The most models whose ratio a replica keeps.
pub const MAX_CALIBRATED_MODELS: usize = 256;
/// The ratio stays within these bounds: a tokenizer is not eight times off a character count.
pub const FACTOR_BOUNDS: (f64, f64) = (0.125, 8.0);
/// The weight of each new observation: about ten answers take the ratio most of the way.
const LEARNING_RATE: f64 = 0.2;

#[derive(Debug, Default)]
pub struct PromptSizes {
    factors: Mutex<Factors>,
    /// `continuum_prompt_estimate_ratio{model}`, when the replica registered it.
    gauge: Option<GaugeVec>,
}

#[derive(Debug, Default)]
struct Factors {
    /// Keyed by the fleet's model names: a model is learnt only once the fleet serves it (a
    /// pick, or a render for a model the picker serves).
    by_model: FastMap<Box<str>, Learnt>,
    /// Answers learnt from so far: each model's last one orders the models for eviction.
    answers: u64,
}

/// A model's ratio, with its series of the gauge (resolved once, not per answer).
#[derive(Debug)]
struct Learnt {
    factor: f64,
    gauge: Option<Gauge>,
    /// The answer it last learnt from ([`Factors::answers`]).
    last: u64,
}

impl PromptSizes {
    /// Ratios that also show on `gauge` (label `model`; at most `MAX_CALIBRATED_MODELS`).
    pub fn showing_on(gauge: GaugeVec) -> Self {
        Self { gauge: Some(gauge), ..Self::default() }
    }

    /// The tokens a prompt `estimate`d at this many is likely to have for `model`.
    pub fn tokens(&self, model: &str, estimate: u64) -> u64 {
        // A float to integer cast saturates; the factor is finite and positive.
        (estimate as f64 * self.factor(model)).round() as u64
    }

    /// The model's learnt ratio of counted to estimated tokens (1 before any answer).
    pub fn factor(&self, model: &str) -> f64 {
        let factors = self.factors.lock().unwrap_or_else(PoisonError::into_inner);
        factors.by_model.get(model).map_or(1.0, |learnt| learnt.factor)
    }

    /// One answer: a prompt estimated at `estimate` tokens was counted as `counted`.
    pub fn learn(&self, model: &str, estimate: u64, counted: u64) {
        if estimate == 0 || counted == 0 {
            return;
        }
        let mut factors = self.factors.lock().unwrap_or_else(PoisonError::into_inner);
        factors.answers += 1;
        let last = factors.answers;
        if let Some(learnt) = factors.by_model.get_mut(model) {
            learnt.factor = next_factor(learnt.factor, estimate, counted);
            learnt.last = last;
            show(learnt.gauge.as_ref(), learnt.factor);
            return;
        }
        if factors.by_model.len() >= MAX_CALIBRATED_MODELS {
            // A scan of the few kept, only as a new model arrives at a full table.
            let oldest = factors.by_model.iter().min_by_key(|(_, learnt)| learnt.last).map(|(name, _)| name.clone());
            if let Some(oldest) = oldest {
                factors.by_model.remove(&oldest);
                if let Some(gauge) = &self.gauge {
                    let _ = gauge.remove_label_values(&[&oldest]);
                }
            }
        }
        let factor = next_factor(1.0, estimate, counted);
        // A gauge built with other labels only loses the figure; sizing goes on.
        let gauge = self.gauge.as_ref().and_then(|g| g.get_metric_with_label_values(&[model]).ok());
        show(gauge.as_ref(), factor);
        factors.by_model.insert(model.into(), Learnt { factor, gauge, last });
    }
}

fn show(gauge: Option<&Gauge>, factor: f64) {
    if let Some(gauge) = gauge {
        gauge.set(factor);
    }
}

/// The ratio after one more observation.
fn next_factor(current: f64, estimate: u64, counted: u64) -> f64 {
    let (low, high) = FACTOR_BOUNDS;
    let observed = (counted as f64 / estimate as f64).clamp(low, high);
    ((1.0 - LEARNING_RATE) * current.ln() + LEARNING_RATE * observed.ln()).exp().clamp(low, high)
}

/// Colons from an answer's end tried for the `prompt_tokens` key before a substring search.
const KEY_COLONS_TRIED: usize = 16;

/// The `prompt_tokens` of an OpenAI `usage` object in a response body or SSE chunk, if there is
/// one. Model text cannot fake it: inside a JSON string every quote is escaped, so the key's
/// closing `":` never appears there.
pub fn usage_prompt_tokens(body: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"prompt_tokens\":";
    // From the end: `usage` closes an answer, which may be megabytes of choices before it.
    // The key ends in a colon, and the last few colons are found faster than any substring
    // search sets out (`usage` has three); past them (model text may hold any number) the
    // substring search, built once, takes over.
    static FINDER: LazyLock<FinderRev<'static>> = LazyLock::new(|| FinderRev::new(KEY));
    let mut colons = memchr::memrchr_iter(b':', body);
    let near_the_end = colons.by_ref().take(KEY_COLONS_TRIED).find(|&colon| body[..=colon].ends_with(KEY));
    let at = match near_the_end {
        Some(colon) => colon + 1 - KEY.len(),
        None => FINDER.rfind(body)?,
    };
    let rest = body.get(at + KEY.len()..)?;
    let digits = rest.iter().skip_while(|b| b.is_ascii_whitespace());
    let mut value: u64 = 0;
    let mut any = false;
    for byte in digits.take_while(|b| b.is_ascii_digit()) {
        value = value.checked_mul(10)?.checked_add(u64::from(byte - b'0'))?;
        any = true;
    }
    any.then_some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_factor_moves_toward_the_observed_ratio_and_settles_there() {
        let sizes = PromptSizes::default();
        assert_eq!(sizes.tokens("tiny", 750), 750, "no answer yet: the plain estimate");
        sizes.learn("tiny", 750, 1500);
        let first = sizes.factor("tiny");
        assert!(first > 1.0 && first < 2.0, "one answer moves it part of the way: {first}");
        for _ in 0..40 {
            sizes.learn("tiny", 750, 1500);
        }
        assert!((sizes.factor("tiny") - 2.0).abs() < 0.01, "{}", sizes.factor("tiny"));
        assert_eq!(sizes.tokens("tiny", 750), 1500);
        assert_eq!(sizes.tokens("other", 750), 750, "models learn apart");
    }

    #[test]
    fn odd_answers_are_bounded() {
        let sizes = PromptSizes::default();
        for _ in 0..200 {
            sizes.learn("m", 1, u64::MAX);
        }
        let bounded = sizes.factor("m");
        assert!((bounded - FACTOR_BOUNDS.1).abs() < 1e-9, "{bounded}");
        sizes.learn("m", 0, 10);
        sizes.learn("m", 10, 0);
        assert_eq!(sizes.factor("m"), bounded, "an empty estimate or count teaches nothing");
        assert_eq!(sizes.tokens("m", u64::MAX), u64::MAX, "sizes saturate");
        // A single answer a thousand times off moves a settled ratio by a fifth of its clamp.
        let settled = PromptSizes::default();
        for _ in 0..60 {
            settled.learn("m", 100, 100);
        }
        settled.learn("m", 1, 1000);
        let moved = settled.factor("m");
        assert!((moved - 8f64.powf(LEARNING_RATE)).abs() < 1e-9, "{moved}");
    }

    #[test]
    fn at_most_so_many_models_are_kept_and_a_new_one_takes_the_place_of_the_one_answered_longest_ago() {
        let gauge = GaugeVec::new(prometheus::Opts::new("ratio", "ratio"), &["model"]).unwrap();
        let sizes = PromptSizes::showing_on(gauge.clone());
        let model = |i: usize| format!("model-{i}");
        for i in 0..MAX_CALIBRATED_MODELS {
            sizes.learn(&model(i), 100, 200);
        }
        // Model 0 answers again: model 1 is now the one answered longest ago.
        sizes.learn(&model(0), 100, 200);
        sizes.learn("newcomer", 100, 400);
        assert_eq!(sizes.factors.lock().unwrap().by_model.len(), MAX_CALIBRATED_MODELS);
        assert!(sizes.factor("newcomer") > 1.0, "learnt");
        assert_eq!(sizes.factor(&model(1)), 1.0, "the one answered longest ago went");
        assert!(sizes.factor(&model(0)) > 1.0 && sizes.factor(&model(2)) > 1.0, "the others stay");
        assert!(gauge.get_metric_with_label_values(&["newcomer"]).unwrap().get() > 1.0);
        let series: Vec<String> = prometheus::core::Collector::collect(&gauge)[0]
            .get_metric()
            .iter()
            .map(|m| m.get_label()[0].value().to_owned())
            .collect();
        assert_eq!(series.len(), MAX_CALIBRATED_MODELS);
        assert!(!series.contains(&model(1)), "its series went with it");
    }

    #[test]
    fn usage_is_read_from_bodies_and_chunks() {
        let cases: &[(&str, &[u8], Option<u64>)] = &[
            (
                "buffered completion",
                br#"{"choices":[],"usage":{"prompt_tokens":1571,"completion_tokens":16,"total_tokens":1587}}"#,
                Some(1571),
            ),
            (
                "stream's last chunk",
                b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\": 42,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n",
                Some(42),
            ),
            (
                "details alone are not the count",
                br#"{"usage":{"prompt_tokens_details":{"cached_tokens":16}}}"#,
                None,
            ),
            ("no usage", br#"{"choices":[{"delta":{"content":"hi"}}]}"#, None),
            ("model text cannot fake it", br#"{"delta":{"content":"\"prompt_tokens\":9"}}"#, None),
            ("not a number", br#"{"usage":{"prompt_tokens":null}}"#, None),
            ("too large", br#"{"usage":{"prompt_tokens":99999999999999999999999}}"#, None),
        ];
        let colons = ":".repeat(KEY_COLONS_TRIED * 2);
        let past_the_colons_tried = format!(r#"{{"usage":{{"prompt_tokens":7}},"x":"{colons}"}}"#);
        let cases = cases.iter().copied().chain([
            ("past the colons tried", past_the_colons_tried.as_bytes(), Some(7)),
            ("the last of two", br#"{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}"#, Some(2)),
        ]);
        for (name, body, expected) in cases {
            assert_eq!(usage_prompt_tokens(body), expected, "{name}");
        }
    }
}
