//! The one buffer a subscription holds a message in: it starts at [`INITIAL_BUFFER_BYTES`],
//! doubles only when a frame that passed its ceiling check needs the room, and never grows past
//! its ceiling.

use super::{INITIAL_BUFFER_BYTES, SHRINK_ABOVE_BYTES};

#[derive(Debug)]
pub struct MessageBuffer {
    bytes: Vec<u8>,
    ceiling: usize,
}

impl MessageBuffer {
    pub fn new(ceiling: usize) -> Self {
        Self { bytes: Vec::with_capacity(INITIAL_BUFFER_BYTES.min(ceiling)), ceiling }
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

    /// Appends `n` zeroed bytes to be filled, growing by powers of two clamped to the ceiling.
    /// The caller has checked [`Self::fits`].
    pub fn extend(&mut self, n: usize) {
        let start = self.bytes.len();
        let need = start + n;
        debug_assert!(need <= self.ceiling, "MessageBuffer::extend past its ceiling");
        if need > self.bytes.capacity() {
            let target = need.next_power_of_two().clamp(INITIAL_BUFFER_BYTES, self.ceiling.max(need));
            self.bytes.reserve_exact(target - start);
        }
        self.bytes.resize(need, 0);
    }

    /// Held bytes to fill in place.
    pub fn slice_mut(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        &mut self.bytes[range]
    }

    pub fn truncate(&mut self, len: usize) {
        self.bytes.truncate(len);
    }

    /// Empties the buffer for the next message, releasing a large allocation.
    pub fn reset(&mut self) {
        self.bytes.clear();
        if self.bytes.capacity() > SHRINK_ABOVE_BYTES {
            self.bytes = Vec::with_capacity(INITIAL_BUFFER_BYTES.min(self.ceiling));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_by_powers_of_two_and_stops_at_the_ceiling() {
        let mut buffer = MessageBuffer::new(16_660);
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
        let buffer = MessageBuffer::new(16_660);
        assert!(!buffer.fits(1 << 63));
        assert!(!buffer.fits(u64::MAX));
    }

    #[test]
    fn reset_releases_only_large_buffers() {
        let mut small = MessageBuffer::new(1 << 20);
        small.extend(4000);
        small.reset();
        assert_eq!((small.len(), small.capacity()), (0, 4096));
        let mut large = MessageBuffer::new(1 << 20);
        large.extend(100_000);
        large.reset();
        assert_eq!((large.len(), large.capacity()), (0, 512));
    }
}
