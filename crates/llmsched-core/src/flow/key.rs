//! Totally ordered float keys for the ordered indexes.

use std::cmp::Ordering;

/// An `f64` ordered by `total_cmp`, so it can key a `BTreeMap`. Callers reject NaN on input.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Key(pub f64);

impl Eq for Key {}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// The position of a queued request inside its flow: the ordering policy's key, then arrival
/// sequence (so equal keys are served first come, first served).
pub type QueueKey = (Key, u64);
