//! A rank's timing estimates, learned from the dispatches that went through it: what the book
//! publishes as the decode blocks *ending* before a hand-over and the prompt tokens already
//! *prefilled* of the prefill under way.

use std::time::Duration;

use super::PROGRESS_STEPS;
use super::prefill_time::PrefillTime;

/// Each new measurement moves a rank's decode and first-token time estimates by this fraction.
const TIMING_WEIGHT: f64 = 0.125;

/// A rank's smoothed times from dispatch to first token and from first token to end, learned
/// from the dispatches that went through it.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Timing {
    pub(super) first_token: Option<Duration>,
    /// From dispatch to first token of the dispatches that found nothing else prefilling, by
    /// their size.
    pub(super) prefill: PrefillTime,
    pub(super) decode: Option<Duration>,
}

impl Timing {
    pub(super) fn observe(estimate: &mut Option<Duration>, measured: Duration) {
        *estimate = Some(match *estimate {
            Some(old) => old.mul_f64(1.0 - TIMING_WEIGHT) + measured.mul_f64(TIMING_WEIGHT),
            None => measured,
        });
    }

    /// How long a dispatch must have decoded to be expected to end before a request
    /// dispatched now reaches the rank by hand-over: its decode time less about the prefill's
    /// share of the time to first token (half of it; the rest is the hand-over and the
    /// decode worker's first step). `None` until both times have been measured.
    pub(super) fn ending_after(&self) -> Option<Duration> {
        Some(self.decode?.saturating_sub(self.first_token? / 2))
    }

    /// How many [`PROGRESS_STEPS`] of a `tokens` prefill that began `elapsed` ago should be
    /// done, at most all but one (a prefill past its expected time is late, not done); 0 until a
    /// prefill alone has been measured.
    pub(super) fn progress_steps(&self, tokens: u64, elapsed: Duration) -> u64 {
        let Some(prefill) = self.prefill.expected(tokens).filter(|p| !p.is_zero()) else { return 0 };
        let steps = elapsed.as_secs_f64() / prefill.as_secs_f64() * PROGRESS_STEPS as f64;
        // `as` saturates; the ratio is finite and non-negative.
        (steps as u64).min(PROGRESS_STEPS - 1)
    }
}
