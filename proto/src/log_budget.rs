//! Warnings a peer can cause once per request, frame or record, written a few a minute at most.
//!
//! A client sending bad requests, a shim failing every answer or a fleet rewriting a bad etcd
//! key in a loop can cause such a warning tens of thousands of times a second: one line each
//! would fill the disk and take the CPU the traffic needs. The metrics count every one; the
//! log keeps the first few of each minute as examples, and the next line written says how many
//! were held back since the last (`held_back`). [`warn_limited!`](crate::warn_limited) is the
//! usual way in: a `tracing::warn!` with a budget of its own.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a budget's window lasts.
const WINDOW: Duration = Duration::from_secs(60);

/// Lines a minute of each [`warn_limited!`](crate::warn_limited) warning.
pub const LINES_PER_MINUTE: u32 = 10;

/// `tracing::warn!` for a warning a peer can cause at its request (or frame, or record) rate:
/// each use site has a [`LogBudget`] of its own, [`LINES_PER_MINUTE`] lines, and each line
/// written carries `held_back`, how many that site held back since its last line. The calling
/// crate's `tracing` writes it.
#[macro_export]
macro_rules! warn_limited {
    ($($arg:tt)+) => {{
        static BUDGET: $crate::log_budget::LogBudget =
            $crate::log_budget::LogBudget::per_minute($crate::log_budget::LINES_PER_MINUTE);
        if let Some(held_back) = BUDGET.admit() {
            tracing::warn!(held_back, $($arg)+);
        }
    }};
}

/// Lines of one warning written per minute at most. Hold one per warning (a `static` beside
/// it), so that a flood of one cause does not silence another.
#[derive(Debug)]
pub struct LogBudget {
    per_window: u32,
    state: Mutex<Window>,
}

#[derive(Debug)]
struct Window {
    /// When the window began; `None` before the first line.
    start: Option<Instant>,
    written: u32,
    held_back: u64,
}

impl LogBudget {
    /// A budget of `lines` a minute.
    pub const fn per_minute(lines: u32) -> Self {
        Self { per_window: lines, state: Mutex::new(Window { start: None, written: 0, held_back: 0 }) }
    }

    /// Whether a line may be written now: if so, how many were held back since the last one
    /// written (to say in it), taken by this caller alone.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Option<u64> {
        let mut window = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if window.start.is_none_or(|start| now.saturating_duration_since(start) >= WINDOW) {
            window.start = Some(now);
            window.written = 0;
        }
        if window.written >= self.per_window {
            window.held_back = window.held_back.saturating_add(1);
            return None;
        }
        window.written += 1;
        Some(std::mem::take(&mut window.held_back))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_few_lines_a_minute_are_written_and_the_next_says_how_many_were_held_back() {
        let budget = LogBudget::per_minute(2);
        let t0 = Instant::now();
        assert_eq!(budget.admit_at(t0), Some(0));
        assert_eq!(budget.admit_at(t0 + Duration::from_secs(1)), Some(0));
        for s in 2..59 {
            assert_eq!(budget.admit_at(t0 + Duration::from_secs(s)), None, "second {s}: past the budget");
        }
        let next = t0 + WINDOW;
        assert_eq!(budget.admit_at(next), Some(57), "the first of the next minute says how many");
        assert_eq!(budget.admit_at(next), Some(0), "and only it");
        assert_eq!(budget.admit_at(next), None);
    }

    #[test]
    fn a_budget_of_none_writes_nothing() {
        let budget = LogBudget::per_minute(0);
        assert_eq!(budget.admit_at(Instant::now()), None);
    }
}
