//! How long one rank takes to prefill a prompt of a given size, learned from its own
//! dispatches.
//!
//! A prefill's time is about linear in its uncached tokens at the sizes routers see (the 1.6.1
//! mocker charges `4.2e-7·T² + 0.0152·T + 16.5` ms; a real engine's step is fixed overhead plus
//! work per token), so the rank keeps an exponentially weighted least-squares line through
//! (tokens, time to first token) of the dispatches that found nothing else prefilling. A
//! single mean would mix a 60-token turn with a 1,560-token first prompt and misjudge both.
//! When every observed prompt had about the same size the line is undefined and the mean
//! answers.

use std::time::Duration;

/// Each observation's weight against the ones before it: the fit remembers the last few dozen.
const WEIGHT: f64 = 1.0 / 16.0;
/// Below this spread of sizes (as a variance, tokens²) the slope is not trusted: 16 tokens
/// standard deviation, a block.
const MIN_SIZE_VARIANCE: f64 = 256.0;

/// Exponentially weighted sums over the observations (size `t`, seconds `y`).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(super) struct PrefillTime {
    weight: f64,
    t: f64,
    tt: f64,
    y: f64,
    ty: f64,
}

impl PrefillTime {
    pub fn observe(&mut self, tokens: u64, took: Duration) {
        let (t, y) = (tokens as f64, took.as_secs_f64());
        // The first observation is the whole fit.
        let (keep, add) = if self.weight == 0.0 { (0.0, 1.0) } else { (1.0 - WEIGHT, WEIGHT) };
        self.weight = keep * self.weight + add;
        self.t = keep * self.t + add * t;
        self.tt = keep * self.tt + add * t * t;
        self.y = keep * self.y + add * y;
        self.ty = keep * self.ty + add * t * y;
    }

    /// The expected prefill time of `tokens`; `None` before any observation. Never below a
    /// tenth of the mean, since the line's intercept can be negative.
    pub fn expected(&self, tokens: u64) -> Option<Duration> {
        if self.weight <= 0.0 {
            return None;
        }
        let (mean_t, mean_y) = (self.t / self.weight, self.y / self.weight);
        let variance = self.tt / self.weight - mean_t * mean_t;
        let covariance = self.ty / self.weight - mean_t * mean_y;
        let seconds = if variance >= MIN_SIZE_VARIANCE && covariance > 0.0 {
            let slope = covariance / variance;
            mean_y + slope * (tokens as f64 - mean_t)
        } else {
            mean_y
        };
        Duration::try_from_secs_f64(seconds.max(mean_y / 10.0)).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn close(got: Option<Duration>, want_ms: f64) -> bool {
        got.is_some_and(|d| (d.as_secs_f64() * 1e3 - want_ms).abs() < 0.5)
    }

    #[test]
    fn one_size_gives_its_mean_and_nothing_before() {
        let mut fit = PrefillTime::default();
        assert_eq!(fit.expected(1600), None);
        fit.observe(1600, ms(40));
        fit.observe(1600, ms(48));
        // The newer observation weighs a sixteenth.
        assert!(close(fit.expected(1600), 40.5), "{:?}", fit.expected(1600));
        assert!(close(fit.expected(60), 40.5), "no spread of sizes, no slope: {:?}", fit.expected(60));
    }

    #[test]
    fn mixed_sizes_give_a_line_through_them() {
        let mut fit = PrefillTime::default();
        // 16 ms + 0.02 ms per token.
        for tokens in [60, 1560, 800, 60, 1560, 300] {
            fit.observe(tokens, Duration::from_secs_f64((16.0 + 0.02 * tokens as f64) / 1e3));
        }
        assert!(close(fit.expected(1560), 47.2), "{:?}", fit.expected(1560));
        assert!(close(fit.expected(60), 17.2), "{:?}", fit.expected(60));
    }

    #[test]
    fn a_falling_line_is_not_believed_and_the_answer_stays_positive() {
        let mut fit = PrefillTime::default();
        fit.observe(100, ms(50));
        fit.observe(2000, ms(10));
        let mean = fit.expected(100).expect("observed");
        assert_eq!(fit.expected(5000), Some(mean), "time does not fall with size: the mean");
        // A line from (1000, 10 ms) to (2000, 100 ms) crosses zero at 889 tokens.
        let mut steep = PrefillTime::default();
        steep.observe(1000, ms(10));
        steep.observe(2000, ms(100));
        assert!(close(steep.expected(0), 15.625 / 10.0), "a tenth of the mean: {:?}", steep.expected(0));
    }
}
