//! A priority band: its flows (one per tenant) with their queues, the band's arrival order (for
//! TTL and newest-first eviction) and the band's policies. Request data lives in the slab; the
//! band only threads slot indexes.
//!
//! A flow's number is reused once the flow is reclaimed (idle past `flow_idle_s`): the lowest
//! free number goes to the next new flow, so the flow table never outgrows the flows alive at
//! one time.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;

use super::config::BandConfig;
use super::fairness::{FairnessPolicy, FlowIdx};
use super::key::{Key, QueueKey};
use super::metrics::Histogram;
use super::ordering::OrderingPolicy;
use super::registry::PolicyRegistry;
use super::request::FlowError;
use super::slab::{Chain, List, Slab, NIL};

/// Index into the controller's tenant table.
pub type TenantId = u32;

/// How a flow keeps its requests in order.
#[derive(Debug)]
enum FlowOrder {
    /// Arrival order (the ordering key is constant): an intrusive list, O(1).
    Fifo(List),
    /// By `(key, arrival sequence)`: O(log n).
    Keyed(BTreeMap<QueueKey, u32>),
}

/// The queue of one `(tenant, priority)` flow.
#[derive(Debug)]
pub struct FlowQueue {
    pub tenant: TenantId,
    order: FlowOrder,
    pub len: u64,
    pub bytes: u64,
    pub dispatched: u64,
    pub service_tokens: u64,
    /// Prompt and output tokens served since [`super::FlowController::drain_service`] last
    /// took them (what replica sync tells the other replicas).
    pub unsynced: (u64, u64),
    /// Dispatched requests of this flow not yet completed.
    pub running: u64,
    /// False once reclaimed, until the number is reused.
    pub live: bool,
    /// Bumped each time the flow turns idle, so an older idle mark is recognised as stale.
    pub idle_generation: u32,
}

impl FlowQueue {
    /// No queued and no running request.
    pub fn is_idle(&self) -> bool {
        self.len == 0 && self.running == 0
    }

    /// The first request's position and slot.
    fn head<P>(&self, slab: &Slab<P>) -> Option<(QueueKey, u32)> {
        match &self.order {
            FlowOrder::Fifo(list) if list.head != NIL => {
                let slot = slab.get(list.head);
                Some(((Key(slot.key), slot.seq), list.head))
            }
            FlowOrder::Fifo(_) => None,
            FlowOrder::Keyed(map) => map.first_key_value().map(|(key, &index)| (*key, index)),
        }
    }
}

/// One priority band.
#[derive(Debug)]
pub struct Band {
    pub priority: i32,
    pub settings: BandConfig,
    pub ceiling: f64,
    pub fairness: Box<dyn FairnessPolicy>,
    pub ordering: Box<dyn OrderingPolicy>,
    pub flows: Vec<FlowQueue>,
    /// Numbers of reclaimed flows, lowest first.
    free_flows: BinaryHeap<Reverse<FlowIdx>>,
    /// Queued slots by arrival: oldest at the head (TTL), newest at the tail (eviction).
    pub arrivals: List,
    pub queued: u64,
    pub bytes: u64,
    pub dispatched: u64,
    pub wait_s: Histogram,
}

impl Band {
    pub fn new(
        priority: i32,
        settings: &BandConfig,
        registry: &PolicyRegistry,
        buckets: Arc<[f64]>,
    ) -> Result<Self, FlowError> {
        Ok(Band {
            priority,
            settings: settings.clone(),
            ceiling: 1.0,
            fairness: registry.fairness(&settings.fairness)?.policy,
            ordering: registry.ordering(&settings.ordering)?.policy,
            flows: Vec::new(),
            free_flows: BinaryHeap::new(),
            arrivals: List::default(),
            queued: 0,
            bytes: 0,
            dispatched: 0,
            wait_s: Histogram::new(buckets),
        })
    }

    /// Adds the flow of `tenant` (the caller knows it is new), under the lowest free number.
    pub fn add_flow(&mut self, tenant: TenantId, name: &str) -> FlowIdx {
        let order = if self.ordering.is_fifo() {
            FlowOrder::Fifo(List::default())
        } else {
            FlowOrder::Keyed(BTreeMap::new())
        };
        let queue = FlowQueue {
            tenant,
            order,
            len: 0,
            bytes: 0,
            dispatched: 0,
            service_tokens: 0,
            unsynced: (0, 0),
            running: 0,
            live: true,
            idle_generation: 0,
        };
        let flow = match self.free_flows.pop() {
            Some(Reverse(flow)) => {
                let generation = self.flows[flow as usize].idle_generation;
                self.flows[flow as usize] = FlowQueue { idle_generation: generation, ..queue };
                flow
            }
            None => {
                self.flows.push(queue);
                (self.flows.len() - 1) as FlowIdx
            }
        };
        self.fairness.add_flow(flow, name);
        flow
    }

    /// Frees an idle flow's number; its service history is forgotten.
    pub fn reclaim_flow(&mut self, flow: FlowIdx) {
        let queue = &mut self.flows[flow as usize];
        debug_assert!(queue.live && queue.is_idle());
        queue.live = false;
        queue.idle_generation = queue.idle_generation.wrapping_add(1);
        self.free_flows.push(Reverse(flow));
    }

    /// Flows alive now.
    pub fn live_flows(&self) -> impl Iterator<Item = (FlowIdx, &FlowQueue)> {
        self.flows.iter().enumerate().filter(|(_, q)| q.live).map(|(i, q)| (i as FlowIdx, q))
    }

    /// Whether one more request of `bytes` stays within the band's own limits.
    pub fn fits(&self, bytes: u64) -> bool {
        Self::fits_limits(&self.settings, self.queued, self.bytes, bytes)
    }

    /// The same check for a band that does not exist yet (or does, given its counts).
    pub fn fits_limits(settings: &BandConfig, queued: u64, held: u64, bytes: u64) -> bool {
        settings.max_requests.is_none_or(|max| queued < max)
            && settings.max_bytes.is_none_or(|max| held.saturating_add(bytes) <= max)
    }

    /// Queues the slot `index` (its band, flow, key and bytes are set).
    pub fn push<P>(&mut self, slab: &mut Slab<P>, index: u32) {
        let slot = slab.get(index);
        let (flow, key, bytes) = (slot.flow, (Key(slot.key), slot.seq), slot.bytes);
        let queue = &mut self.flows[flow as usize];
        // A FIFO arrival goes last, so it becomes the head only of an empty flow.
        let becomes_head = match &mut queue.order {
            FlowOrder::Fifo(list) => {
                let was_empty = list.head == NIL;
                slab.push_back(list, index, Chain::Flow);
                was_empty
            }
            FlowOrder::Keyed(map) => {
                let becomes_head = map.first_key_value().is_none_or(|(head, _)| key < *head);
                map.insert(key, index);
                becomes_head
            }
        };
        queue.len += 1;
        queue.bytes = queue.bytes.saturating_add(bytes);
        slab.push_back(&mut self.arrivals, index, Chain::Band);
        self.queued += 1;
        self.bytes = self.bytes.saturating_add(bytes);
        if becomes_head {
            self.fairness.head_changed(flow, Some(key));
        }
    }

    /// Unqueues the slot `index`. With `served = Some((tokens, now))` it is being dispatched:
    /// the fairness policy is charged before it learns the new head.
    pub fn remove<P>(&mut self, slab: &mut Slab<P>, index: u32, served: Option<(u64, f64)>) {
        let slot = slab.get(index);
        let (flow, key, bytes) = (slot.flow, (Key(slot.key), slot.seq), slot.bytes);
        let queue = &mut self.flows[flow as usize];
        let was_head = match &mut queue.order {
            FlowOrder::Fifo(list) => {
                let was_head = list.head == index;
                slab.unlink(list, index, Chain::Flow);
                was_head
            }
            FlowOrder::Keyed(map) => {
                let was_head = map.first_key_value().is_some_and(|(head, _)| *head == key);
                map.remove(&key);
                was_head
            }
        };
        queue.len -= 1;
        queue.bytes = queue.bytes.saturating_sub(bytes);
        slab.unlink(&mut self.arrivals, index, Chain::Band);
        self.queued -= 1;
        self.bytes = self.bytes.saturating_sub(bytes);
        if let Some((tokens, now)) = served {
            queue.dispatched += 1;
            queue.service_tokens = queue.service_tokens.saturating_add(tokens);
            queue.unsynced.0 = queue.unsynced.0.saturating_add(tokens);
            self.dispatched += 1;
            self.fairness.charge(flow, tokens, 0, now);
        }
        if was_head {
            let head = self.flows[flow as usize].head(slab).map(|(head, _)| head);
            self.fairness.head_changed(flow, head);
        }
    }

    /// The slot the fairness policy serves next.
    pub fn next<P>(&mut self, slab: &Slab<P>) -> Option<u32> {
        let flow = self.fairness.pick()?;
        self.flows.get(flow as usize)?.head(slab).map(|(_, index)| index)
    }
}
