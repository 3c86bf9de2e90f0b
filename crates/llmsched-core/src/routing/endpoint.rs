//! An endpoint (one model-server replica) and the metrics snapshot the router reads.

use std::collections::BTreeMap;

use crate::prefix_index::WorkerKey;

/// What an endpoint does in a prefill/decode split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Prefill,
    Decode,
    Both,
}

impl Role {
    /// Parses "prefill", "decode" or "both" (any case).
    pub fn parse(name: &str) -> Option<Role> {
        match name.to_ascii_lowercase().as_str() {
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            "both" => Some(Role::Both),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
}

/// The static description of an endpoint. Its id is the worker name it has in the prefix index.
#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    pub id: WorkerKey,
    pub address: String,
    /// None: no role label (serves both phases, but is not picked by a prefill filter).
    pub role: Option<Role>,
    pub labels: BTreeMap<String, String>,
    /// The base model served; None serves any request.
    pub model: Option<String>,
}

impl Endpoint {
    pub fn new(id: WorkerKey) -> Self {
        Endpoint { id, address: String::new(), role: None, labels: BTreeMap::new(), model: None }
    }
}

/// A snapshot of an endpoint's load, as scraped from its metrics (vLLM names in brackets).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Metrics {
    /// Requests queued (`vllm:num_requests_waiting`).
    pub waiting: u32,
    /// Requests running (`vllm:num_requests_running`).
    pub running: u32,
    /// KV-cache use in 0..=1 (`vllm:kv_cache_usage_perc`).
    pub kv_cache_usage: f64,
    /// The most requests the engine runs at once; 0 when unknown.
    pub max_concurrency: u32,
    /// When the snapshot was taken, on the router's clock; -inf when never.
    pub timestamp: f64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            waiting: 0,
            running: 0,
            kv_cache_usage: 0.0,
            max_concurrency: 0,
            timestamp: f64::NEG_INFINITY,
        }
    }
}

/// LoRA adapters an endpoint has loaded (`vllm:lora_requests_info`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraState {
    /// Adapters with running requests.
    pub active: Vec<String>,
    /// Adapters with waiting requests.
    pub waiting: Vec<String>,
    /// The most adapters the endpoint holds at once; 0 when unknown.
    pub max_loras: u32,
}

impl LoraState {
    pub fn is_active(&self, adapter: &str) -> bool {
        self.active.iter().any(|a| a == adapter)
    }

    pub fn is_waiting(&self, adapter: &str) -> bool {
        self.waiting.iter().any(|a| a == adapter)
    }

    /// Distinct adapters active or waiting.
    pub fn loaded(&self) -> usize {
        self.active.len() + self.waiting.iter().filter(|w| !self.is_active(w)).count()
    }

    /// Whether another adapter fits.
    pub fn has_room(&self) -> bool {
        (self.loaded() as u64) < u64::from(self.max_loras)
    }
}
