//! The one buffer a subscription holds a message in: it starts at [`INITIAL_BUFFER_BYTES`],
//! doubles only when a frame that passed its ceiling check needs the room (past the free part,
//! grows to exactly what is needed), and never grows past its ceiling. Capacity past [`FREE_BUFFER_BYTES`] is borrowed from the process's
//! [`MessageBudget`](super::MessageBudget) and repaid when the buffer shrinks or is dropped.

use super::INITIAL_BUFFER_BYTES;
use super::budget::{Borrower, BudgetRef, FREE_BUFFER_BYTES};

#[derive(Debug)]
pub struct MessageBuffer {
    bytes: Vec<u8>,
    ceiling: usize,
    budget: BudgetRef,
    /// Whose share of `budget` the loans count against.
    borrower: Borrower,
    /// Bytes of capacity borrowed from `budget`: what was asked for past the free part.
    borrowed: usize,
}

impl MessageBuffer {
    pub fn new(ceiling: usize, budget: BudgetRef, borrower: Borrower) -> Self {
        Self { bytes: Vec::with_capacity(INITIAL_BUFFER_BYTES.min(ceiling)), ceiling, budget, borrower, borrowed: 0 }
    }

    /// Bytes borrowed from the budget now.
    pub fn borrowed(&self) -> usize {
        self.borrowed
    }

    pub fn ceiling(&self) -> usize {
        self.ceiling
    }

    pub fn capacity(&self) -> usize {
        self.bytes.capacity()
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.bytes
    }

    /// Whether `more` bytes fit under the ceiling after what is held.
    pub fn fits(&self, more: u64) -> bool {
        u64::try_from(self.ceiling.saturating_sub(self.bytes.len())).is_ok_and(|room| more <= room)
    }

    /// Makes room for `more` bytes after those held, growing by powers of two clamped to the
    /// ceiling; once past the free part, for `slack` bytes after them as well, so that an
    /// [`Self::extend`] of up to `slack` bytes never borrows. False, changing nothing, when the
    /// growth would borrow more than the budget has left. The caller has checked [`Self::fits`]
    /// for `more + slack`.
    pub fn make_room(&mut self, more: usize, slack: usize) -> bool {
        let need = self.bytes.len() + more;
        if need + slack <= FREE_BUFFER_BYTES { self.grow(need, false) } else { self.grow(need + slack, false) }
    }

    /// Appends `n` zeroed bytes to be filled. The caller has checked [`Self::fits`], and made
    /// room with [`Self::make_room`] unless `n` is within the slack it asked for: a growth here
    /// borrows past the budget's limit rather than fail.
    pub fn extend(&mut self, n: usize) {
        let need = self.bytes.len() + n;
        self.grow(need, true);
        self.bytes.resize(need, 0);
    }

    /// Grows the capacity to hold `need` bytes.
    fn grow(&mut self, need: usize, overdraw: bool) -> bool {
        debug_assert!(need <= self.ceiling, "MessageBuffer grown past its ceiling");
        if need <= self.bytes.capacity() {
            return true;
        }
        // Doubling serves the small frames that arrive one after another; past the free part a
        // frame is read whole into room made for it, so exactly that is borrowed.
        let target = if need > FREE_BUFFER_BYTES {
            need
        } else {
            need.next_power_of_two().clamp(INITIAL_BUFFER_BYTES, self.ceiling.max(need))
        };
        let loan = target.saturating_sub(FREE_BUFFER_BYTES).saturating_sub(self.borrowed);
        if loan > 0 {
            if overdraw {
                self.budget.overdraw(loan, self.borrower);
            } else if !self.budget.borrow(loan, self.borrower) {
                return false;
            }
            self.borrowed += loan;
        }
        self.bytes.reserve_exact(target - self.bytes.len());
        true
    }

    /// Held bytes to fill in place.
    pub fn slice_mut(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        &mut self.bytes[range]
    }

    pub fn truncate(&mut self, len: usize) {
        self.bytes.truncate(len);
    }

    /// Empties the buffer for the next message, back to its first size (repaying what it
    /// borrowed): a subscription waits between messages with no more than that, however large
    /// the last one was. The next large message grows it again, a few doublings at most.
    pub fn reset(&mut self) {
        self.bytes.clear();
        let initial = INITIAL_BUFFER_BYTES.min(self.ceiling);
        if self.bytes.capacity() > initial {
            self.bytes = Vec::with_capacity(initial);
            self.repay();
        }
    }

    fn repay(&mut self) {
        self.budget.repay(std::mem::take(&mut self.borrowed), self.borrower);
    }
}

impl Drop for MessageBuffer {
    fn drop(&mut self) {
        self.repay();
    }
}

#[cfg(test)]
mod tests {
    use super::super::budget::MessageBudget;
    use super::*;

    fn budget(limit: usize) -> BudgetRef {
        BudgetRef(Box::leak(Box::new(MessageBudget::new(limit))))
    }

    #[test]
    fn grows_by_powers_of_two_and_stops_at_the_ceiling() {
        let mut buffer = MessageBuffer::new(16_660, budget(usize::MAX), 1);
        assert_eq!(buffer.capacity(), 512);
        buffer.extend(300);
        assert_eq!(buffer.capacity(), 512, "fits the first allocation");
        buffer.extend(300);
        assert_eq!(buffer.capacity(), 1024);
        buffer.extend(8000);
        assert_eq!(buffer.capacity(), 16_384);
        assert!(buffer.fits(16_660 - 8600));
        assert!(!buffer.fits(16_660 - 8600 + 1));
        buffer.extend(16_660 - 8600);
        assert_eq!(buffer.capacity(), 16_660, "clamped to the ceiling, not 32 KiB");
        assert!(!buffer.fits(1));
    }

    #[test]
    fn a_huge_declared_length_never_fits() {
        let buffer = MessageBuffer::new(16_660, budget(usize::MAX), 1);
        assert!(!buffer.fits(1 << 63));
        assert!(!buffer.fits(u64::MAX));
    }

    #[test]
    fn reset_returns_the_buffer_to_its_first_size_and_repays_its_loan() {
        let mut first = MessageBuffer::new(1 << 20, budget(usize::MAX), 1);
        first.extend(300);
        first.reset();
        assert_eq!((first.len(), first.capacity()), (0, 512), "kept as it was");
        let mut grown = MessageBuffer::new(1 << 20, budget(usize::MAX), 1);
        grown.extend(4000);
        grown.reset();
        assert_eq!((grown.len(), grown.capacity()), (0, 512));
        let mut large = MessageBuffer::new(1 << 20, budget(usize::MAX), 1);
        large.extend(100_000);
        assert!(large.borrowed() > 0);
        large.reset();
        assert_eq!((large.len(), large.capacity(), large.borrowed()), (0, 512, 0));
    }

    #[test]
    fn capacity_past_the_free_part_is_borrowed_and_repaid() {
        // The buffer's borrower may hold 200 KiB of it.
        let budget = budget(super::super::budget::BORROWER_SHARE * 200 * 1024);
        let mut buffer = MessageBuffer::new(1 << 20, budget, 1);
        assert!(buffer.make_room(60_000, 512));
        buffer.extend(60_000);
        assert_eq!((budget.lent(), buffer.capacity()), (0, 64 * 1024), "64 KiB is the buffer's own");
        assert!(buffer.make_room(60_000, 512), "grows to exactly 120,512 bytes");
        assert_eq!((budget.lent(), buffer.capacity()), (120_512 - 64 * 1024, 120_512));
        buffer.extend(60_000);
        assert!(!buffer.make_room(200_000, 512), "320,512 bytes would borrow more than is left");
        assert_eq!((budget.lent(), buffer.capacity()), (120_512 - 64 * 1024, 120_512), "a refusal changes nothing");
        buffer.reset();
        assert_eq!(budget.lent(), 0, "repaid with the allocation");
        assert!(buffer.make_room(200_000, 512));
        assert_eq!(budget.lent(), 200_512 - 64 * 1024);
        drop(buffer);
        assert_eq!(budget.lent(), 0, "repaid when the session ends");
    }

    #[test]
    fn the_slack_is_held_only_once_borrowing_so_small_messages_stay_small() {
        let mut buffer = MessageBuffer::new(1 << 20, budget(1 << 20), 1);
        assert!(buffer.make_room(40, 512));
        assert_eq!(buffer.capacity(), 512, "an idle session keeps its 512 bytes");
        buffer.reset();
        assert!(buffer.make_room(66_000, 512));
        assert_eq!(buffer.capacity(), 66_512, "past the free part, exactly the room, slack included");
        buffer.extend(66_000);
        buffer.extend(512);
        assert_eq!(buffer.capacity(), 66_512, "the slack never borrows again");
    }

    #[test]
    fn a_growth_the_caller_could_not_refuse_overdraws() {
        let budget = budget(0);
        let mut buffer = MessageBuffer::new(1 << 20, budget, 1);
        assert!(buffer.make_room(FREE_BUFFER_BYTES, 0));
        buffer.extend(FREE_BUFFER_BYTES);
        assert!(!buffer.make_room(1, 0));
        buffer.extend(512);
        assert_eq!(budget.lent(), 512, "exactly the growth, repaid on reset");
        buffer.reset();
        assert_eq!(budget.lent(), 0);
    }
}
