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
//! No one worker may hold more than a [`BORROWER_SHARE`]th of it, all its ranks' subscriptions
//! together: one sending megabyte batches on 64 rank channels as fast as the network takes
//! them would otherwise keep the whole budget lent, and every other worker's large batches
//! would be dropped, their ranks' blocks cleared each time. Its own are dropped instead.
//!
//! A loan is held only briefly: a message that borrows (past a command's slack) must be whole
//! within [`LOAN_DEADLINE`] of its first borrowed byte, or its session ends. Under the whole
//! message's 30 s deadline alone, sixty-four publishers each trickling a megabyte frame (or
//! pausing after one) could hold the budget for half a minute at a time, and every other large
//! batch would be dropped meanwhile; now they would have to send 32 MiB a second between them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// What a message buffer may hold without borrowing; every kv_metrics message fits in it.
pub const FREE_BUFFER_BYTES: usize = 64 * 1024;
/// What all message buffers may borrow past [`FREE_BUFFER_BYTES`] at once: sixty-four
/// kv-events batches of the largest size.
pub const LARGE_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// From a message's first borrowed byte to its last. A worker on the cluster network sends a
/// whole megabyte batch in milliseconds.
pub const LOAN_DEADLINE: Duration = Duration::from_secs(2);

/// The part of a budget one borrower (a worker) may hold at once: an eighth, eight megabyte
/// batches of the largest size in flight at once on its ranks' channels.
pub const BORROWER_SHARE: usize = 8;

/// The process's one budget, which every subscription family's limits name.
pub static LARGE_MESSAGES: MessageBudget = MessageBudget::new(LARGE_MESSAGE_BYTES);

/// Who borrows: the worker a publisher speaks for (its instance id). Only publishers of workers
/// in the fleet are dialled, so a pile of records naming others borrows nothing.
pub type Borrower = u64;

/// Bytes lent to message buffers, up to a limit, and to each borrower up to its share.
#[derive(Debug)]
pub struct MessageBudget {
    limit: usize,
    /// What one borrower may hold.
    share: usize,
    lent: AtomicUsize,
    /// What each borrower holds now; only those holding something are listed. Taken only for
    /// a message past [`FREE_BUFFER_BYTES`], so never on the path of the kv_metrics samples.
    by_borrower: Mutex<BTreeMap<Borrower, usize>>,
}

impl MessageBudget {
    /// A budget of `limit` bytes, of which one borrower may hold a [`BORROWER_SHARE`]th.
    pub const fn new(limit: usize) -> Self {
        Self::with_share(limit, limit / BORROWER_SHARE)
    }

    /// A budget of `limit` bytes, of which one borrower may hold `share`.
    pub const fn with_share(limit: usize, share: usize) -> Self {
        Self { limit, share, lent: AtomicUsize::new(0), by_borrower: Mutex::new(BTreeMap::new()) }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes lent now.
    pub fn lent(&self) -> usize {
        self.lent.load(Ordering::Relaxed)
    }

    /// What `borrower` holds now.
    #[cfg(test)]
    pub fn lent_to(&self, borrower: Borrower) -> usize {
        self.borrowers().get(&borrower).copied().unwrap_or(0)
    }

    fn borrowers(&self) -> std::sync::MutexGuard<'_, BTreeMap<Borrower, usize>> {
        self.by_borrower.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lends `borrower` `n` bytes if that stays within the limit and the borrower's share.
    pub(super) fn borrow(&self, n: usize, borrower: Borrower) -> bool {
        let mut borrowers = self.borrowers();
        let held = borrowers.get(&borrower).copied().unwrap_or(0);
        if held.checked_add(n).is_none_or(|held| held > self.share) {
            return false;
        }
        let limit = self.limit;
        let lent = self
            .lent
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |lent| lent.checked_add(n).filter(|&t| t <= limit));
        if lent.is_ok() {
            borrowers.insert(borrower, held + n);
        }
        lent.is_ok()
    }

    /// `Self::borrow`, repaid when the loan is dropped; `None` when it would pass the limit
    /// or the borrower's share.
    pub fn loan(&'static self, n: usize, borrower: Borrower) -> Option<Loan> {
        (n == 0 || self.borrow(n, borrower)).then_some(Loan { budget: self, n, borrower })
    }

    /// Lends `n` bytes whatever the limit and share: for a growth the caller could not refuse.
    pub(super) fn overdraw(&self, n: usize, borrower: Borrower) {
        *self.borrowers().entry(borrower).or_default() += n;
        self.lent.fetch_add(n, Ordering::AcqRel);
    }

    pub(super) fn repay(&self, n: usize, borrower: Borrower) {
        if n == 0 {
            return;
        }
        let mut borrowers = self.borrowers();
        if let Some(held) = borrowers.get_mut(&borrower) {
            *held = held.saturating_sub(n);
            if *held == 0 {
                borrowers.remove(&borrower);
            }
        }
        self.lent.fetch_sub(n, Ordering::AcqRel);
    }
}

/// Bytes lent until dropped: what a decoded message holds beyond its frames.
#[derive(Debug)]
#[must_use = "the loan is repaid when dropped"]
pub struct Loan {
    budget: &'static MessageBudget,
    n: usize,
    borrower: Borrower,
}

impl Drop for Loan {
    fn drop(&mut self) {
        self.budget.repay(self.n, self.borrower);
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
        let budget = MessageBudget::new(800);
        for borrower in 0..8 {
            assert!(budget.borrow(100, borrower));
        }
        budget.repay(50, 0);
        assert!(!budget.borrow(51, 8), "past the limit, within the borrower's share");
        assert_eq!(budget.lent(), 750, "a refused loan changes nothing");
        assert!(budget.borrow(50, 8));
        for borrower in 0..=8 {
            budget.repay(budget.lent_to(borrower), borrower);
        }
        assert_eq!(budget.lent(), 0);
        assert!(!budget.borrow(usize::MAX, 0), "no overflow");
        assert!(budget.borrowers().is_empty(), "a borrower who repaid is forgotten");
    }

    /// One borrower (a worker, over all its ranks' channels) holds at most its share: what it
    /// asks past that is refused while others still borrow.
    #[test]
    fn one_borrower_holds_at_most_its_share() {
        let budget = MessageBudget::new(800);
        assert!(budget.borrow(60, 1));
        assert!(budget.borrow(40, 1), "its share is 100");
        assert!(!budget.borrow(1, 1), "past its share");
        assert!(budget.borrow(100, 2), "another worker borrows its own share");
        budget.repay(40, 1);
        assert!(budget.borrow(40, 1), "room again once it repaid");
        budget.overdraw(10, 1);
        assert_eq!((budget.lent(), budget.lent_to(1)), (210, 110), "an overdraw is counted too");
    }
}
