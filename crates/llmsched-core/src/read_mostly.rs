//! A readers-writer lock whose readers write no shared memory.
//!
//! Model: each thread counts its readers in one of [`SLOTS`] reader slots, each on a cache line
//! of its own; a writer raises a flag, waits for every slot to drain and then has the data to
//! itself. A reader thus writes only its own slot and reads the flag, which stays in every
//! core's cache until a writer comes: two threads matching at once do not pass a lock word's
//! cache line back and forth. (With one lock word, as in `parking_lot::RwLock`, both threads'
//! increments and decrements of the reader count moved the line between the cores on every
//! match: on free-threaded CPython 3.14t that was about 130 ns of a 0.5 us lookup, most of what
//! two threads lost against one.)
//!
//! Complexity: a read lock is two uncontended atomic updates of the thread's slot and one
//! load; a write lock is a mutex, two stores of the flag and one load per slot (16).
//!
//! Decisions: writers are preferred (a raised flag turns new readers away until the writer is
//! done), and a reader turned away waits on the writers' mutex, parked, not spinning. A writer
//! waits for the readers already in with a short spin, then yielding its core. Threads are given
//! slots in turn, so two threads share a slot only beyond [`SLOTS`] threads (still correct:
//! a slot counts readers, whichever thread they are). A thread must not take a read lock it
//! already holds while another thread may write (the second read waits for the writer, the
//! writer for the first read), as with `parking_lot::RwLock`.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

/// Reader slots per lock.
pub const SLOTS: usize = 16;

/// The next slot to give a thread.
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's reader slot, given at its first read.
    static SLOT: usize = NEXT_SLOT.fetch_add(1, Ordering::Relaxed) % SLOTS;
}

/// A readers-writer lock for data read far more often than written, by many threads at once.
pub struct ReadMostlyLock<T> {
    readers: [CachePadded<AtomicUsize>; SLOTS],
    /// Raised while a writer waits for readers or writes.
    writing: CachePadded<AtomicBool>,
    /// Held by the writer; readers turned away by `writing` wait on it.
    writer: Mutex<()>,
    data: UnsafeCell<T>,
}

// SAFETY: the lock hands out `&T` to many threads (needs `T: Sync`) and `&mut T` to one at a
// time, possibly on another thread than the one that created it (needs `T: Send`).
unsafe impl<T: Send> Send for ReadMostlyLock<T> {}
unsafe impl<T: Send + Sync> Sync for ReadMostlyLock<T> {}

impl<T: Default> Default for ReadMostlyLock<T> {
    fn default() -> Self {
        Self::new(T::default())
    }
}

impl<T> ReadMostlyLock<T> {
    pub fn new(data: T) -> Self {
        Self {
            readers: std::array::from_fn(|_| CachePadded::new(AtomicUsize::new(0))),
            writing: CachePadded::new(AtomicBool::new(false)),
            writer: Mutex::new(()),
            data: UnsafeCell::new(data),
        }
    }

    /// Shared access; waits while a writer is in or waiting.
    pub fn read(&self) -> ReadGuard<'_, T> {
        let slot = &*self.readers[SLOT.with(|s| *s)];
        loop {
            // SeqCst on both sides (this increment then the flag's load; the writer's raise of
            // the flag then its loads of the slots): either the writer sees this reader, or
            // this reader sees the flag.
            slot.fetch_add(1, Ordering::SeqCst);
            if !self.writing.load(Ordering::SeqCst) {
                return ReadGuard { lock: self, slot };
            }
            slot.fetch_sub(1, Ordering::Release);
            // Parked until the writer (holding the mutex while it writes) is done.
            drop(self.writer.lock());
        }
    }

    /// Exclusive access; waits for the readers already in, and turns new ones away meanwhile.
    pub fn write(&self) -> WriteGuard<'_, T> {
        let writer = self.writer.lock();
        self.writing.store(true, Ordering::SeqCst);
        for slot in &self.readers {
            let mut spins = 0u32;
            while slot.load(Ordering::SeqCst) != 0 {
                if spins < 64 {
                    std::hint::spin_loop();
                    spins += 1;
                } else {
                    std::thread::yield_now();
                }
            }
        }
        WriteGuard { lock: self, writer: Some(writer) }
    }

    /// The data, without locking: `&mut self` proves no one else holds the lock.
    pub fn get_mut(&mut self) -> &mut T {
        self.data.get_mut()
    }

    pub fn into_inner(self) -> T {
        self.data.into_inner()
    }
}

/// Shared access to a [`ReadMostlyLock`]'s data, released when dropped.
pub struct ReadGuard<'a, T> {
    lock: &'a ReadMostlyLock<T>,
    slot: &'a AtomicUsize,
}

impl<T> Deref for ReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this reader is counted in its slot and saw no writer: a writer waits for the
        // slot to drain before it takes `&mut T`.
        unsafe { &*self.lock.data.get() }
    }
}

impl<T> Drop for ReadGuard<'_, T> {
    fn drop(&mut self) {
        // Release: this reader's reads happen before the writer that sees the slot drained.
        self.slot.fetch_sub(1, Ordering::Release);
    }
}

/// Exclusive access to a [`ReadMostlyLock`]'s data, released when dropped.
pub struct WriteGuard<'a, T> {
    lock: &'a ReadMostlyLock<T>,
    /// Taken out only by [`WriteGuard::unlock_fair`].
    writer: Option<parking_lot::MutexGuard<'a, ()>>,
}

impl<T> WriteGuard<'_, T> {
    /// Releases the lock and hands it to a thread waiting for it, if any, rather than letting
    /// this thread take it straight back: a writer that works in steps, taking the lock for
    /// each, calls this between steps so that readers turned away get in.
    pub fn unlock_fair(mut self) {
        self.lock.writing.store(false, Ordering::Release);
        if let Some(writer) = self.writer.take() {
            parking_lot::MutexGuard::unlock_fair(writer);
        }
    }
}

impl<T> Deref for WriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the writer holds the mutex and every slot drained while the flag was up.
        unsafe { &*self.lock.data.get() }
    }
}

impl<T> DerefMut for WriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as for `deref`; `&mut self` makes this the only access through the guard.
        unsafe { &mut *self.lock.data.get() }
    }
}

impl<T> Drop for WriteGuard<'_, T> {
    fn drop(&mut self) {
        // Release: the writes happen before any reader that then sees the flag down. The mutex
        // is released after this (the field drops after `drop`), so a reader parked on it
        // finds the flag down when it retries. After `unlock_fair` the flag is not touched:
        // another writer may hold the lock by then.
        if self.writer.is_some() {
            self.lock.writing.store(false, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn readers_share_and_writers_exclude() {
        let lock = ReadMostlyLock::new(0u64);
        {
            let a = lock.read();
            let b = lock.read();
            assert_eq!(*a + *b, 0);
        }
        *lock.write() += 5;
        assert_eq!(*lock.read(), 5);
        let mut lock = lock;
        *lock.get_mut() += 1;
        assert_eq!(lock.into_inner(), 6);
    }

    /// Writers keep two counters equal under the write lock; readers on other threads must
    /// never see them differ, and no increment may be lost.
    #[test]
    fn concurrent_readers_never_see_a_half_write() {
        let lock = Arc::new(ReadMostlyLock::new((0u64, 0u64)));
        let threads: Vec<_> = (0..6)
            .map(|t| {
                let lock = Arc::clone(&lock);
                std::thread::spawn(move || {
                    for i in 0..20_000u64 {
                        if t < 2 && i % 4 == 0 {
                            let mut w = lock.write();
                            w.0 += 1;
                            std::hint::black_box(&mut *w);
                            w.1 += 1;
                        } else {
                            let r = lock.read();
                            assert_eq!(r.0, r.1, "a reader saw a write in progress");
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.read(), (10_000, 10_000));
    }

    #[test]
    fn a_reader_waits_for_the_writer() {
        let lock = Arc::new(ReadMostlyLock::new(0u32));
        let w = lock.write();
        let reader = {
            let lock = Arc::clone(&lock);
            std::thread::spawn(move || *lock.read())
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut w = w;
        *w = 7;
        drop(w);
        assert_eq!(reader.join().unwrap(), 7);
    }
}
