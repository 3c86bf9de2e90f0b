//! Request storage: one slab of slots, reused through a free list, threaded by two intrusive
//! doubly-linked lists per slot (the band's arrival order and, for FIFO orderings, the flow's
//! queue). Linking, unlinking and popping are O(1) and allocate nothing.

use super::fairness::FlowIdx;
use super::request::RequestId;

/// "No slot".
pub const NIL: u32 = u32::MAX;

/// What a slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    Queued,
    Running,
    Free,
}

/// Which of a slot's two lists.
#[derive(Debug, Clone, Copy)]
pub enum Chain {
    /// Arrival order within the band.
    Band,
    /// Queue order within a FIFO flow.
    Flow,
}

#[derive(Debug, Clone, Copy)]
struct Links {
    prev: u32,
    next: u32,
}

const UNLINKED: Links = Links { prev: NIL, next: NIL };

/// One request, queued or running.
#[derive(Debug)]
pub struct Slot<P> {
    pub id: RequestId,
    /// Arrival sequence while queued; dispatch sequence while running.
    pub seq: u64,
    pub arrival: f64,
    /// The ordering policy's key.
    pub key: f64,
    pub tokens: u64,
    pub bytes: u64,
    pub band: u32,
    pub flow: FlowIdx,
    pub priority: i32,
    pub state: SlotState,
    pub payload: Option<P>,
    /// The caller's ticket given at enqueue, kept while queued and running: a release that
    /// names it acts only on this request, not on a later one under the same id.
    pub ticket: Option<u64>,
    band_links: Links,
    flow_links: Links,
}

/// The head, tail and length of one intrusive list.
#[derive(Debug, Clone, Copy)]
pub struct List {
    pub head: u32,
    pub tail: u32,
}

impl Default for List {
    fn default() -> Self {
        List { head: NIL, tail: NIL }
    }
}

/// The slab.
#[derive(Debug)]
pub struct Slab<P> {
    slots: Vec<Slot<P>>,
    free: Vec<u32>,
}

impl<P> Default for Slab<P> {
    fn default() -> Self {
        Slab { slots: Vec::new(), free: Vec::new() }
    }
}

/// The fields of a new slot.
pub struct NewSlot<P> {
    pub id: RequestId,
    pub seq: u64,
    pub arrival: f64,
    pub key: f64,
    pub tokens: u64,
    pub bytes: u64,
    pub band: u32,
    pub flow: FlowIdx,
    pub priority: i32,
    pub payload: P,
    pub ticket: Option<u64>,
}

impl<P> Slab<P> {
    pub fn insert(&mut self, new: NewSlot<P>) -> u32 {
        let slot = Slot {
            id: new.id,
            seq: new.seq,
            arrival: new.arrival,
            key: new.key,
            tokens: new.tokens,
            bytes: new.bytes,
            band: new.band,
            flow: new.flow,
            priority: new.priority,
            state: SlotState::Queued,
            payload: Some(new.payload),
            ticket: new.ticket,
            band_links: UNLINKED,
            flow_links: UNLINKED,
        };
        match self.free.pop() {
            Some(index) => {
                self.slots[index as usize] = slot;
                index
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// Releases a slot (its payload must have been taken already, or is dropped here).
    pub fn release(&mut self, index: u32) {
        let slot = &mut self.slots[index as usize];
        slot.state = SlotState::Free;
        slot.payload = None;
        self.free.push(index);
    }

    pub fn get(&self, index: u32) -> &Slot<P> {
        &self.slots[index as usize]
    }

    pub fn get_mut(&mut self, index: u32) -> &mut Slot<P> {
        &mut self.slots[index as usize]
    }

    fn links(&mut self, index: u32, chain: Chain) -> &mut Links {
        let slot = &mut self.slots[index as usize];
        match chain {
            Chain::Band => &mut slot.band_links,
            Chain::Flow => &mut slot.flow_links,
        }
    }

    fn links_of(&self, index: u32, chain: Chain) -> Links {
        let slot = &self.slots[index as usize];
        match chain {
            Chain::Band => slot.band_links,
            Chain::Flow => slot.flow_links,
        }
    }

    pub fn push_back(&mut self, list: &mut List, index: u32, chain: Chain) {
        *self.links(index, chain) = Links { prev: list.tail, next: NIL };
        if list.tail == NIL {
            list.head = index;
        } else {
            self.links(list.tail, chain).next = index;
        }
        list.tail = index;
    }

    pub fn unlink(&mut self, list: &mut List, index: u32, chain: Chain) {
        let Links { prev, next } = self.links_of(index, chain);
        if prev == NIL {
            list.head = next;
        } else {
            self.links(prev, chain).next = next;
        }
        if next == NIL {
            list.tail = prev;
        } else {
            self.links(next, chain).prev = prev;
        }
        *self.links(index, chain) = UNLINKED;
    }

    /// The slot before `index` in `chain` (towards the head).
    pub fn prev(&self, index: u32, chain: Chain) -> u32 {
        self.links_of(index, chain).prev
    }

    /// Allocated slots, free or not (for memory reports).
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(id: RequestId) -> NewSlot<()> {
        NewSlot {
            id,
            seq: id,
            arrival: 0.0,
            key: 0.0,
            tokens: 0,
            bytes: 0,
            band: 0,
            flow: 0,
            priority: 0,
            payload: (),
            ticket: None,
        }
    }

    fn walk(slab: &Slab<()>, list: &List) -> Vec<RequestId> {
        let mut out = Vec::new();
        let mut at = list.tail;
        while at != NIL {
            out.push(slab.get(at).id);
            at = slab.prev(at, Chain::Band);
        }
        out.reverse();
        out
    }

    #[test]
    fn lists_link_unlink_and_reuse_slots() {
        let mut slab = Slab::default();
        let mut list = List::default();
        let ids: Vec<u32> = (1..=4).map(|id| slab.insert(slot(id))).collect();
        for &i in &ids {
            slab.push_back(&mut list, i, Chain::Band);
        }
        slab.unlink(&mut list, ids[1], Chain::Band);
        slab.unlink(&mut list, ids[3], Chain::Band);
        assert_eq!(walk(&slab, &list), vec![1, 3]);
        slab.release(ids[1]);
        let again = slab.insert(slot(9));
        assert_eq!(again, ids[1]);
        slab.push_back(&mut list, again, Chain::Band);
        slab.unlink(&mut list, ids[0], Chain::Band);
        assert_eq!(walk(&slab, &list), vec![3, 9]);
        assert_eq!(slab.get(list.head).id, 3);
    }
}
