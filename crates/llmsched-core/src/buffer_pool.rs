//! Per-thread pools of cleared `Vec` buffers, reused between calls on hot paths.
//!
//! A match over hundreds of workers, a list of a few hundred hashes or a token array of a few
//! thousand ids is kilobytes: beyond the allocator's small-size caches, so allocating and
//! freeing one per call cost a tenth of the call. Each user declares its own thread-local pool
//! with a cap on how many buffers it keeps and on their capacity:
//!
//! ```
//! use llmsched_core::buffer_pool::{self, BufferPool};
//!
//! thread_local! {
//!     static IDS: BufferPool<u32> = const { BufferPool::new(4, 1 << 16) };
//! }
//!
//! let mut ids = buffer_pool::take(&IDS);
//! ids.extend([1, 2, 3]);
//! buffer_pool::give(&IDS, ids);
//! assert!(buffer_pool::take(&IDS).capacity() >= 3);
//! ```

use std::cell::RefCell;
use std::thread::LocalKey;

/// Cleared buffers kept for reuse, at most `max_buffers` of them, none holding room for more
/// than `max_capacity` items.
pub struct BufferPool<T> {
    buffers: RefCell<Vec<Vec<T>>>,
    max_buffers: usize,
    max_capacity: usize,
}

impl<T> BufferPool<T> {
    /// An empty pool keeping at most `max_buffers` buffers of at most `max_capacity` items.
    pub const fn new(max_buffers: usize, max_capacity: usize) -> Self {
        BufferPool { buffers: RefCell::new(Vec::new()), max_buffers, max_capacity }
    }

    /// An empty buffer, the most recently returned one when the pool has any (as it was given
    /// back by [`BufferPool::give_filled`], else empty).
    pub fn take(&self) -> Vec<T> {
        // Busy only if a caller takes from inside another take's borrow; a fresh buffer is
        // correct then too.
        self.buffers.try_borrow_mut().ok().and_then(|mut buffers| buffers.pop()).unwrap_or_default()
    }

    /// Keeps `buffer`'s allocation (cleared) unless the pool is full or the buffer is empty or
    /// larger than the pool keeps; otherwise it is freed.
    pub fn give(&self, mut buffer: Vec<T>) {
        buffer.clear();
        self.give_filled(buffer);
    }

    /// [`BufferPool::give`] keeping `buffer`'s items: [`BufferPool::take`] then hands it back
    /// as it was, for a taker that overwrites every item it uses (resizing a filled buffer
    /// writes only what it adds, where a cleared one is written through first).
    pub fn give_filled(&self, buffer: Vec<T>) {
        if buffer.capacity() == 0 || buffer.capacity() > self.max_capacity {
            return;
        }
        if let Ok(mut buffers) = self.buffers.try_borrow_mut() {
            if buffers.len() < self.max_buffers {
                buffers.push(buffer);
            }
        }
    }
}

/// [`BufferPool::take`] on this thread's `pool`; a fresh buffer once the thread's pools are
/// being destroyed.
pub fn take<T: 'static>(pool: &'static LocalKey<BufferPool<T>>) -> Vec<T> {
    pool.try_with(BufferPool::take).unwrap_or_default()
}

/// [`BufferPool::give`] on this thread's `pool`; `buffer` is freed once the thread's pools are
/// being destroyed.
pub fn give<T: 'static>(pool: &'static LocalKey<BufferPool<T>>, buffer: Vec<T>) {
    give_with(pool, buffer, BufferPool::give);
}

/// [`BufferPool::give_filled`] on this thread's `pool` (see [`give`]).
pub fn give_filled<T: 'static>(pool: &'static LocalKey<BufferPool<T>>, buffer: Vec<T>) {
    give_with(pool, buffer, BufferPool::give_filled);
}

fn give_with<T: 'static>(
    pool: &'static LocalKey<BufferPool<T>>,
    buffer: Vec<T>,
    how: fn(&BufferPool<T>, Vec<T>),
) {
    // `try_with` hands the buffer back inside the closure only when the pool exists.
    let mut buffer = Some(buffer);
    let _ = pool.try_with(|pool| {
        if let Some(buffer) = buffer.take() {
            how(pool, buffer);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static SMALL: BufferPool<u64> = const { BufferPool::new(2, 100) };
    }

    #[test]
    fn reuses_cleared_buffers_up_to_its_caps() {
        let mut a = take(&SMALL);
        a.extend(0..50u64);
        let a_ptr = a.as_ptr();
        give(&SMALL, a);
        let b = take(&SMALL);
        assert!(b.is_empty(), "a reused buffer comes back cleared");
        assert_eq!(b.as_ptr(), a_ptr, "the buffer handed back is the one reused");
        give(&SMALL, b);

        // Too large to keep: freed, and the pool still holds only the first.
        let big: Vec<u64> = Vec::with_capacity(101);
        give(&SMALL, big);
        give(&SMALL, Vec::new());
        let kept = SMALL.with(|pool| pool.buffers.borrow().len());
        assert_eq!(kept, 1);

        // At most two kept.
        for _ in 0..3 {
            give(&SMALL, Vec::with_capacity(10));
        }
        assert_eq!(SMALL.with(|pool| pool.buffers.borrow().len()), 2);
    }

    thread_local! {
        static FILLED: BufferPool<u32> = const { BufferPool::new(2, 100) };
    }

    #[test]
    fn a_filled_buffer_comes_back_as_it_was_given() {
        let mut a = take(&FILLED);
        a.extend([7u32, 8, 9]);
        let a_ptr = a.as_ptr();
        give_filled(&FILLED, a);
        let mut b = take(&FILLED);
        assert_eq!(b, [7, 8, 9], "items kept");
        assert_eq!(b.as_ptr(), a_ptr);
        // Resized, it keeps what it had and adds the fill value only past its length.
        b.resize(5, 0);
        assert_eq!(b, [7, 8, 9, 0, 0]);
        give(&FILLED, b);
        assert!(take(&FILLED).is_empty(), "`give` still clears");
        give_filled(&FILLED, Vec::with_capacity(101));
        assert_eq!(FILLED.with(|pool| pool.buffers.borrow().len()), 0, "too large: freed");
    }

    #[test]
    fn a_busy_pool_hands_out_fresh_buffers() {
        let pool: BufferPool<u8> = BufferPool::new(4, 64);
        pool.give(Vec::with_capacity(8));
        let held = pool.buffers.borrow_mut();
        assert_eq!(pool.take().capacity(), 0, "taken while borrowed: a fresh buffer");
        pool.give(Vec::with_capacity(8));
        drop(held);
        assert_eq!(pool.buffers.borrow().len(), 1, "given while borrowed: freed");
    }
}
