//! An indexed binary min-heap over flows: each flow has at most one entry, whose key can be
//! changed or removed in O(log F) through a position table. Fairness policies keep their
//! backlogged flows here; it allocates only when a band gains flows, and beats a `BTreeSet`
//! (remove + insert per key change) by a wide margin at the sizes a band sees.

use super::fairness::FlowIdx;

const ABSENT: u32 = u32::MAX;

/// Min-heap of `(key, flow)`; ties go to the lower flow index.
#[derive(Debug)]
pub struct FlowHeap<K> {
    entries: Vec<(K, FlowIdx)>,
    position: Vec<u32>,
}

impl<K> Default for FlowHeap<K> {
    fn default() -> Self {
        FlowHeap { entries: Vec::new(), position: Vec::new() }
    }
}

impl<K: Ord + Copy> FlowHeap<K> {
    pub fn contains(&self, flow: FlowIdx) -> bool {
        self.position.get(flow as usize).is_some_and(|&p| p != ABSENT)
    }

    /// The least `(key, flow)`.
    pub fn peek(&self) -> Option<(K, FlowIdx)> {
        self.entries.first().copied()
    }

    /// Inserts `flow` or changes its key.
    pub fn set(&mut self, flow: FlowIdx, key: K) {
        if self.position.len() <= flow as usize {
            self.position.resize(flow as usize + 1, ABSENT);
        }
        let at = self.position[flow as usize];
        if at == ABSENT {
            self.entries.push((key, flow));
            let last = self.entries.len() - 1;
            self.position[flow as usize] = last as u32;
            self.sift_up(last);
        } else {
            let at = at as usize;
            let old = self.entries[at].0;
            self.entries[at].0 = key;
            if key < old {
                self.sift_up(at);
            } else {
                self.sift_down(at);
            }
        }
    }

    pub fn remove(&mut self, flow: FlowIdx) {
        let Some(&at) = self.position.get(flow as usize) else {
            return;
        };
        if at == ABSENT {
            return;
        }
        let at = at as usize;
        let last = self.entries.len() - 1;
        self.swap(at, last);
        self.entries.pop();
        self.position[flow as usize] = ABSENT;
        if at < self.entries.len() {
            self.sift_down(at);
            self.sift_up(at);
        }
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.entries.swap(a, b);
        self.position[self.entries[a].1 as usize] = a as u32;
        self.position[self.entries[b].1 as usize] = b as u32;
    }

    fn sift_up(&mut self, mut at: usize) {
        while at > 0 {
            let parent = (at - 1) / 2;
            if self.entries[at] >= self.entries[parent] {
                break;
            }
            self.swap(at, parent);
            at = parent;
        }
    }

    fn sift_down(&mut self, mut at: usize) {
        loop {
            let left = 2 * at + 1;
            if left >= self.entries.len() {
                break;
            }
            let right = left + 1;
            let child = if right < self.entries.len() && self.entries[right] < self.entries[left] {
                right
            } else {
                left
            };
            if self.entries[child] >= self.entries[at] {
                break;
            }
            self.swap(at, child);
            at = child;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        #[test]
        fn agrees_with_a_btreeset(ops in proptest::collection::vec((0u32..12, 0u8..3, 0i32..20), 1..300)) {
            let mut heap = FlowHeap::default();
            let mut model: BTreeSet<(i32, u32)> = BTreeSet::new();
            for (flow, op, key) in ops {
                if op == 0 {
                    model.retain(|&(_, f)| f != flow);
                    heap.remove(flow);
                } else {
                    model.retain(|&(_, f)| f != flow);
                    model.insert((key, flow));
                    heap.set(flow, key);
                }
                prop_assert_eq!(heap.peek(), model.first().copied());
                prop_assert_eq!(heap.contains(flow), model.iter().any(|&(_, f)| f == flow));
            }
        }
    }
}
