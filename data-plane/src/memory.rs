//! Process-wide bounds on the bytes a replica holds for bodies.
//!
//! Each connection is bounded on its own: a request body at 8 MiB, a buffered answer at 32 MiB.
//! But thousands of connections at their bounds would hold far more than any host has (16,384
//! connections × 8 MiB is 128 GiB). These budgets bound the sum, the way Envoy's overload
//! manager bounds a proxy's heap.
//!
//! A body is charged as its bytes arrive, for the room it is held in (a buffer grown by
//! doubling holds more than its bytes), never for what it announces: a client that announces
//! 8 MiB and sends nothing holds nothing. A request body stays charged until its request has
//! been dispatched and answered (for a stream, until its head: the dispatch keeps the body for
//! a retry on another shim replica until then), a buffered answer until it is written. Past a
//! budget the body is refused at once: waiting while holding part of a budget could leave
//! bodies each waiting on the others' room.
//!
//! Small bodies are free: most chat requests and answers stay under [`FREE_BYTES`], and they
//! cost no accounting.

use bytes::{Bytes, BytesMut};
use tokio::sync::{Semaphore, SemaphorePermit};

/// Tests that fill a process-wide budget take turns: `cargo test` runs a crate's tests on
/// threads of one process, where two filling one budget at once would each wait for room the
/// other holds (`cargo nextest` runs each test in a process of its own).
#[cfg(test)]
pub(crate) static FILLING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A body this small is not charged: its buffers are part of a connection's fixed cost. Small
/// enough that 16,384 connections each holding one, beside what each holds of its head, stay
/// within what `docs/routing.md` promises (about 1.1 GiB outside the budgets).
pub const FREE_BYTES: usize = 16 << 10;
/// Request bodies held at once past [`FREE_BYTES`]: 64 bodies of the largest size.
pub const REQUEST_BODY_BUDGET: usize = 512 << 20;
/// Buffered answers held at once past [`FREE_BYTES`]: 32 answers of the largest size.
pub const BUFFERED_ANSWER_BUDGET: usize = 1 << 30;

/// Lets go of `value` on the blocking pool when called on a runtime: a large tree or a
/// tokenizer's tables are hundreds of thousands of allocations to free, milliseconds every
/// task on the runtime's thread would otherwise wait out. Inline without a runtime.
pub fn free_off_the_runtime<T: Send + 'static>(value: T) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn_blocking(move || drop(value))),
        Err(_) => drop(value),
    }
}

/// One process-wide budget of bytes.
#[derive(Debug)]
pub struct Budget {
    room: Semaphore,
    size: usize,
}

pub static REQUEST_BODIES: Budget = Budget::new(REQUEST_BODY_BUDGET);
pub static BUFFERED_ANSWERS: Budget = Budget::new(BUFFERED_ANSWER_BUDGET);

impl Budget {
    pub const fn new(bytes: usize) -> Self {
        Self { room: Semaphore::const_new(bytes), size: bytes }
    }

    /// Grows `charge` to cover a body now `bytes` long, if there is room at once; false
    /// (keeping what it held) if not.
    pub fn grow(&'static self, charge: &mut Charge, bytes: usize) -> bool {
        let Some(wanted) = chargeable(bytes) else { return true };
        let held = charge.0.as_ref().map_or(0, |permit| u32::try_from(permit.num_permits()).unwrap_or(u32::MAX));
        let Some(more) = wanted.checked_sub(held).filter(|more| *more > 0) else { return true };
        let Ok(permit) = self.room.try_acquire_many(more) else { return false };
        match &mut charge.0 {
            Some(held) => held.merge(permit),
            None => charge.0 = Some(permit),
        }
        true
    }

    /// Gives back what `charge` holds beyond a body now `bytes` long (one that let go of its
    /// spare room).
    pub fn shrink(charge: &mut Charge, bytes: usize) {
        let wanted = chargeable(bytes).map_or(0, |w| usize::try_from(w).unwrap_or(usize::MAX));
        if let Some(permit) = &mut charge.0 {
            let excess = permit.num_permits().saturating_sub(wanted);
            drop(permit.split(excess));
            if permit.num_permits() == 0 {
                charge.0 = None;
            }
        }
    }

    /// Whether a body of `bytes` would find room now (it may not when it comes: others grow).
    pub fn has_room(&self, bytes: usize) -> bool {
        chargeable(bytes).is_none_or(|wanted| usize::try_from(wanted).is_ok_and(|w| w <= self.room.available_permits()))
    }

    /// Whether more than half the budget is charged: bodies that take their time then hold
    /// room others may need.
    pub fn crowded(&self) -> bool {
        self.charged() > self.size / 2
    }

    /// Bytes charged now.
    pub fn charged(&self) -> usize {
        self.size.saturating_sub(self.room.available_permits())
    }
}

/// What a body of `bytes` is charged: nothing up to [`FREE_BYTES`], all of it past. A body
/// past what a `u32` counts is larger than any bound here, and charged the most.
fn chargeable(bytes: usize) -> Option<u32> {
    (bytes > FREE_BYTES).then(|| u32::try_from(bytes).unwrap_or(u32::MAX))
}

/// Appends `data` to a body charged in `charge`, the charge covering the room the body holds
/// rather than the bytes in it: a vector's doubling held up to twice what was charged, and 64
/// uploads stalled just past a power of two held twice the budget. It doubles still (its
/// length unknown, a body of many frames is copied a logarithmic number of times), but never
/// past `most`, the largest body. False, the body unchanged, when the budget has no room.
pub fn append_charged(
    body: &mut BytesMut,
    data: &[u8],
    most: usize,
    (budget, charge): (&'static Budget, &mut Charge),
) -> bool {
    let needed = body.len() + data.len();
    if needed > body.capacity() {
        let capacity = needed.max(2 * body.capacity()).min(most.max(needed));
        if !budget.grow(charge, capacity) {
            return false;
        }
        reallocate(body, capacity);
    }
    body.extend_from_slice(data);
    true
}

/// A body grown by [`append_charged`], as it will be held, and its charge cut to match: one
/// just past a power of two would hold nearly twice its length, so its spare room is let go
/// with a copy.
pub fn settle(body: BytesMut, charge: &mut Charge) -> Bytes {
    let body = fitted(body);
    Budget::shrink(charge, body.len() + FREE_BYTES);
    body
}

/// Moves `buffer` into an allocation of exactly `capacity` (at least its length): `BytesMut`'s
/// own growth doubles, past any bound the caller keeps.
pub fn reallocate(buffer: &mut BytesMut, capacity: usize) {
    let mut grown = BytesMut::with_capacity(capacity);
    grown.extend_from_slice(buffer);
    *buffer = grown;
}

/// `body`, in no more room than [`FREE_BYTES`] past its length.
fn fitted(body: BytesMut) -> Bytes {
    if body.capacity() - body.len() > FREE_BYTES { Bytes::copy_from_slice(&body) } else { body.freeze() }
}

/// What a body holds of its budget; given back when dropped.
#[derive(Debug, Default)]
pub struct Charge(Option<SemaphorePermit<'static>>);

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// The largest body of these tests.
    const MOST: usize = 8 << 20;

    #[test]
    fn a_body_is_held_in_no_more_room_than_it_is_charged_for() {
        let mut grown = BytesMut::new();
        for _ in 0..=(4 << 20) / 4096 {
            grown.extend_from_slice(&[b'x'; 4096]);
        }
        assert!(grown.capacity() >= 2 * grown.len() - (8 << 10), "grown by doubling: {}", grown.capacity());
        let len = grown.len();
        let held = fitted(grown);
        assert_eq!(held.len(), len);
        // A `Bytes` frozen from a vector keeps the vector's capacity: what `try_into_mut` gets back.
        let room = held.try_into_mut().map(|body| body.capacity()).ok();
        assert!(room.is_some_and(|room| room <= len + FREE_BYTES), "{room:?} held for {len}");
        let small = BytesMut::from(&b"{}"[..]);
        assert_eq!(fitted(small), Bytes::from_static(b"{}"));
    }

    #[test]
    fn a_body_grown_by_frames_holds_no_more_room_than_it_is_charged_for() {
        static BUDGET: Budget = Budget::new(64 << 20);
        let (mut body, mut charge) = (BytesMut::new(), Charge::default());
        // Chunks of an odd size, so that the body passes each power of two by a little.
        let chunk = [b'x'; 8191];
        while body.len() + chunk.len() <= MOST {
            assert!(append_charged(&mut body, &chunk, MOST, (&BUDGET, &mut charge)));
            assert!(
                body.capacity() <= BUDGET.charged().max(FREE_BYTES),
                "{} held, {} charged",
                body.capacity(),
                BUDGET.charged()
            );
        }
        assert!(body.capacity() <= MOST, "never past the largest body: {}", body.capacity());
        assert!(body.iter().all(|b| *b == b'x'));
        drop((body, charge));
        assert_eq!(BUDGET.charged(), 0);

        // Whole, a body just past a power of two lets go of its spare room, and of the charge
        // for it.
        let (mut body, mut charge) = (BytesMut::new(), Charge::default());
        while body.len() <= 4 << 20 {
            assert!(append_charged(&mut body, &chunk, MOST, (&BUDGET, &mut charge)));
        }
        let (len, charged) = (body.len(), BUDGET.charged());
        assert!(charged > len + (1 << 20), "{charged} charged for {len} while growing");
        settle(body, &mut charge);
        assert!(BUDGET.charged() <= len + FREE_BYTES, "{} charged for {len}", BUDGET.charged());
        drop(charge);
        assert_eq!(BUDGET.charged(), 0);

        // Past the budget's room: refused, the body as it was.
        static SMALL: Budget = Budget::new(FREE_BYTES * 2);
        let (mut body, mut charge) = (BytesMut::new(), Charge::default());
        while append_charged(&mut body, &chunk, MOST, (&SMALL, &mut charge)) {}
        assert!(body.len() <= FREE_BYTES * 2 && SMALL.charged() <= FREE_BYTES * 2);
        let len = body.len();
        assert!(!append_charged(&mut body, &chunk, MOST, (&SMALL, &mut charge)));
        assert_eq!(body.len(), len);
    }

    /// Dropped where it was freed: the thread that ran its drop.
    struct Freed(Arc<Mutex<Option<std::thread::ThreadId>>>);

    impl Drop for Freed {
        fn drop(&mut self) {
            *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::thread::current().id());
        }
    }

    /// What is let go of on a runtime is freed on the blocking pool, not on the runtime's
    /// thread (here the test's own, a current-thread runtime), and at once without a runtime.
    #[tokio::test]
    async fn what_is_let_go_of_is_freed_off_the_runtime() {
        let on = Arc::new(Mutex::new(None));
        free_off_the_runtime(Freed(Arc::clone(&on)));
        for _ in 0..1000 {
            if on.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let freed_on = *on.lock().unwrap_or_else(|e| e.into_inner());
        assert!(freed_on.is_some_and(|thread| thread != std::thread::current().id()), "{freed_on:?}");

        let inline = Arc::new(Mutex::new(None));
        std::thread::scope(|scope| {
            scope.spawn(|| {
                free_off_the_runtime(Freed(Arc::clone(&inline)));
                let freed_on = *inline.lock().unwrap_or_else(|e| e.into_inner());
                assert_eq!(freed_on, Some(std::thread::current().id()), "no runtime: freed at once");
            });
        });
    }

    #[test]
    fn bodies_past_the_free_size_share_the_budget_and_give_it_back() {
        static BUDGET: Budget = Budget::new(1 << 20);
        let mut small = Charge::default();
        assert!(BUDGET.grow(&mut small, FREE_BYTES));
        assert_eq!(BUDGET.charged(), 0, "a small body is not charged");
        let (mut half, mut growing) = (Charge::default(), Charge::default());
        assert!(BUDGET.grow(&mut half, 512 << 10));
        assert!(BUDGET.grow(&mut growing, 300 << 10));
        assert!(BUDGET.grow(&mut growing, 200 << 10), "a body charged past its size keeps it");
        assert!(!BUDGET.grow(&mut growing, 600 << 10), "past the budget: refused at once");
        assert_eq!(BUDGET.charged(), (512 + 300) << 10, "a refused growth keeps what it had");
        drop(half);
        assert!(BUDGET.grow(&mut growing, 600 << 10), "room again");
        assert_eq!(BUDGET.charged(), 600 << 10);
        drop(growing);
        assert_eq!(BUDGET.charged(), 0, "everything given back");
    }
}
