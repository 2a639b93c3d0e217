//! The bytes every subscription's large messages share.
//!
//! A message buffer grows to [`FREE_BUFFER_BYTES`] on its own: that much a subscription keeps
//! between messages, and the subscription caps bound it. Past that it borrows from one
//! [`MessageBudget`], and gives the loan back when its message is done. Without it, 1,024
//! kv-events publishers each sending a 1 MiB batch at once would hold a GiB; with it, large
//! messages hold at most [`LARGE_MESSAGE_BYTES`] together.
//!
//! A frame the budget cannot cover is read through and dropped as an oversized one is
//! ([`super::Dropped::OverBudget`]), and the session goes on. No subscription waits for
//! another's loan, so a set of half-read messages can never wait on each other.
//!
//! A loan is held only briefly: a message that borrows (past a command's slack) must be whole
//! within [`LOAN_DEADLINE`] of its first borrowed byte, or its session ends. Under the whole
//! message's 30 s deadline alone, sixty-four publishers each trickling a megabyte frame (or
//! pausing after one) could hold the budget for half a minute at a time, and every other large
//! batch would be dropped meanwhile; now they would have to send 32 MiB a second between them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// What a message buffer may hold without borrowing; every kv_metrics message fits in it.
pub const FREE_BUFFER_BYTES: usize = 64 * 1024;
/// What all message buffers may borrow past [`FREE_BUFFER_BYTES`] at once: sixty-four
/// kv-events batches of the largest size.
pub const LARGE_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// From a message's first borrowed byte to its last. A worker on the cluster network sends a
/// whole megabyte batch in milliseconds.
pub const LOAN_DEADLINE: Duration = Duration::from_secs(2);

/// The process's one budget, which every subscription family's limits name.
pub static LARGE_MESSAGES: MessageBudget = MessageBudget::new(LARGE_MESSAGE_BYTES);

/// Bytes lent to message buffers, up to a limit.
#[derive(Debug)]
pub struct MessageBudget {
    limit: usize,
    lent: AtomicUsize,
}

impl MessageBudget {
    pub const fn new(limit: usize) -> Self {
        Self { limit, lent: AtomicUsize::new(0) }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes lent now.
    pub fn lent(&self) -> usize {
        self.lent.load(Ordering::Relaxed)
    }

    /// Lends `n` bytes if that stays within the limit.
    pub(super) fn borrow(&self, n: usize) -> bool {
        let limit = self.limit;
        self.lent
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |lent| lent.checked_add(n).filter(|&t| t <= limit))
            .is_ok()
    }

    /// Lends `n` bytes whatever the limit: for a growth the caller could not refuse.
    pub(super) fn overdraw(&self, n: usize) {
        self.lent.fetch_add(n, Ordering::AcqRel);
    }

    pub(super) fn repay(&self, n: usize) {
        self.lent.fetch_sub(n, Ordering::AcqRel);
    }
}

/// A `&'static` budget compared by address, so limits that name one stay `Copy` and `Eq`.
#[derive(Clone, Copy, Debug)]
pub struct BudgetRef(pub &'static MessageBudget);

impl PartialEq for BudgetRef {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for BudgetRef {}

impl std::ops::Deref for BudgetRef {
    type Target = MessageBudget;

    fn deref(&self) -> &MessageBudget {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lends_up_to_its_limit_and_takes_repayments() {
        let budget = MessageBudget::new(100);
        assert!(budget.borrow(60));
        assert!(!budget.borrow(41), "past the limit");
        assert_eq!(budget.lent(), 60, "a refused loan changes nothing");
        assert!(budget.borrow(40));
        budget.repay(100);
        assert_eq!(budget.lent(), 0);
        assert!(!budget.borrow(usize::MAX), "no overflow");
    }
}
