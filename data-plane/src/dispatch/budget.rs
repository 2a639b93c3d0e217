//! The retry budget: retries on another shim replica are paid from a bucket that every request
//! fills a little, so retries stay a bounded fraction of traffic (Finagle's and Linkerd's
//! budget). A burst of failures cannot multiply the load on the replicas that are left.

use std::sync::atomic::{AtomicU32, Ordering};

/// Attempts one request may make, on distinct replicas of its pool: the first and two retries.
pub const MAX_ATTEMPTS: usize = 3;
/// Each request deposits this fraction of a retry, in tenths: 2 = one retry per 5 requests.
pub const DEPOSIT_TENTHS: u32 = 2;
/// A retry costs one whole token.
const RETRY_COST_TENTHS: u32 = 10;
/// Retries a fresh (or idle) replica can spend at once, so a quiet data plane still retries.
pub const RESERVE_RETRIES: u32 = 10;
/// The most retries the bucket saves up.
pub const MAX_SAVED_RETRIES: u32 = 100;

#[derive(Debug)]
pub struct RetryBudget {
    tenths: AtomicU32,
}

impl Default for RetryBudget {
    fn default() -> Self {
        Self { tenths: AtomicU32::new(RESERVE_RETRIES * RETRY_COST_TENTHS) }
    }
}

impl RetryBudget {
    /// Called once per request.
    pub fn deposit(&self) {
        let cap = MAX_SAVED_RETRIES * RETRY_COST_TENTHS;
        let _ = self.tenths.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| Some((t + DEPOSIT_TENTHS).min(cap)));
    }

    /// Pays for one retry, or says the budget is spent.
    pub fn withdraw(&self) -> bool {
        self.tenths.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| t.checked_sub(RETRY_COST_TENTHS)).is_ok()
    }

    /// Gives back a retry paid for and not made (its replica would not take it).
    pub fn refund(&self) {
        let cap = MAX_SAVED_RETRIES * RETRY_COST_TENTHS;
        let _ =
            self.tenths.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| Some((t + RETRY_COST_TENTHS).min(cap)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_spent_then_requests_earn_one_retry_per_five() {
        let budget = RetryBudget::default();
        for _ in 0..RESERVE_RETRIES {
            assert!(budget.withdraw());
        }
        assert!(!budget.withdraw(), "the reserve is spent");
        for _ in 0..4 {
            budget.deposit();
        }
        assert!(!budget.withdraw(), "four requests earn less than one retry");
        budget.deposit();
        assert!(budget.withdraw());
    }

    #[test]
    fn a_refunded_retry_can_be_spent_again_within_the_cap() {
        let budget = RetryBudget::default();
        for _ in 0..RESERVE_RETRIES {
            assert!(budget.withdraw());
        }
        budget.refund();
        assert!(budget.withdraw(), "the refunded retry");
        assert!(!budget.withdraw());
        for _ in 0..10_000 {
            budget.refund();
        }
        let spent = std::iter::repeat_with(|| budget.withdraw()).take_while(|ok| *ok).count();
        assert_eq!(spent, usize::try_from(MAX_SAVED_RETRIES).unwrap_or(0), "refunds are capped like savings");
    }

    #[test]
    fn savings_are_capped() {
        let budget = RetryBudget::default();
        for _ in 0..10_000 {
            budget.deposit();
        }
        let spent = std::iter::repeat_with(|| budget.withdraw()).take_while(|ok| *ok).count();
        assert_eq!(spent, usize::try_from(MAX_SAVED_RETRIES).unwrap_or(0));
    }
}
