//! A priority band: its flows (one per tenant), their ordered queues, the band's arrival order
//! (for TTL and newest-first eviction) and the band's policies.

use std::collections::BTreeMap;
use std::sync::Arc;

use hashbrown::HashMap;

use super::config::BandConfig;
use super::fairness::{FairnessPolicy, FlowIdx};
use super::key::QueueKey;
use super::metrics::Histogram;
use super::ordering::OrderingPolicy;
use super::registry::PolicyRegistry;
use super::request::{FlowError, RequestId};

/// Index into the controller's tenant table.
pub type TenantId = u32;

/// The queue of one `(tenant, priority)` flow.
#[derive(Debug)]
pub struct FlowQueue {
    pub tenant: TenantId,
    pub items: BTreeMap<QueueKey, RequestId>,
    pub bytes: u64,
    pub dispatched: u64,
    pub service_tokens: u64,
}

impl FlowQueue {
    fn head(&self) -> Option<QueueKey> {
        self.items.first_key_value().map(|(key, _)| *key)
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
    flow_of_tenant: HashMap<TenantId, FlowIdx>,
    /// Queued requests by arrival sequence: oldest first (TTL), newest last (eviction).
    pub arrivals: BTreeMap<u64, RequestId>,
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
            flow_of_tenant: HashMap::new(),
            arrivals: BTreeMap::new(),
            queued: 0,
            bytes: 0,
            dispatched: 0,
            wait_s: Histogram::new(buckets),
        })
    }

    /// The flow of `tenant`, created on first use.
    pub fn flow(&mut self, tenant: TenantId, name: &str) -> FlowIdx {
        if let Some(&flow) = self.flow_of_tenant.get(&tenant) {
            return flow;
        }
        let flow = self.flows.len() as FlowIdx;
        self.flows.push(FlowQueue {
            tenant,
            items: BTreeMap::new(),
            bytes: 0,
            dispatched: 0,
            service_tokens: 0,
        });
        self.flow_of_tenant.insert(tenant, flow);
        self.fairness.add_flow(flow, name);
        flow
    }

    /// Whether one more request of `bytes` stays within the band's own limits.
    pub fn fits(&self, bytes: u64) -> bool {
        Self::fits_limits(&self.settings, self.queued, self.bytes, bytes)
    }

    /// The same check for a band that does not exist yet (or does, given its counts).
    pub fn fits_limits(settings: &BandConfig, queued: u64, held: u64, bytes: u64) -> bool {
        settings.max_requests.is_none_or(|max| queued < max)
            && settings
                .max_bytes
                .is_none_or(|max| held.saturating_add(bytes) <= max)
    }

    pub fn push(&mut self, flow: FlowIdx, key: QueueKey, id: RequestId, bytes: u64) {
        let queue = &mut self.flows[flow as usize];
        let old_head = queue.head();
        queue.items.insert(key, id);
        queue.bytes += bytes;
        self.arrivals.insert(key.1, id);
        self.queued += 1;
        self.bytes += bytes;
        if old_head.is_none_or(|head| key < head) {
            self.fairness.head_changed(flow, Some(key));
        }
    }

    /// Removes a queued request. With `served = Some((tokens, now))` it is being dispatched: the
    /// fairness policy is charged before it learns the new head.
    pub fn remove(&mut self, flow: FlowIdx, key: QueueKey, bytes: u64, served: Option<(u64, f64)>) {
        let queue = &mut self.flows[flow as usize];
        let was_head = queue.head() == Some(key);
        queue.items.remove(&key);
        queue.bytes -= bytes;
        self.arrivals.remove(&key.1);
        self.queued -= 1;
        self.bytes -= bytes;
        if let Some((tokens, now)) = served {
            queue.dispatched += 1;
            queue.service_tokens += tokens;
            self.dispatched += 1;
            self.fairness.charge(flow, tokens, 0, now);
        }
        if was_head {
            let head = self.flows[flow as usize].head();
            self.fairness.head_changed(flow, head);
        }
    }

    /// The next request of the flow the fairness policy picks.
    pub fn next(&mut self) -> Option<(FlowIdx, QueueKey, RequestId)> {
        let flow = self.fairness.pick()?;
        let (&key, &id) = self.flows.get(flow as usize)?.items.first_key_value()?;
        Some((flow, key, id))
    }
}
