//! Routing decisions: which endpoint serves a request, balancing cache affinity against load.
//!
//! Layout, one file per concept: [`endpoint`] (an endpoint and its metrics), [`pool`] (the
//! endpoints, updated from any thread, with the staleness policy), [`inflight`] (router-side
//! accounting), [`plugin`] (the Filter / Scorer / Picker interfaces and the per-request
//! context), [`filters`], [`scorers`], [`pickers`] (one file per plugin), [`profile`] (running
//! one profile), [`handler`] (which profiles run: single or prefill/decode), [`data`] (data producers and
//! the data layer), [`config`] (llm-d's
//! `EndpointPickerConfig` shape), [`registry`] (type names to factories), [`presets`] (named
//! peer policies), [`router`] (the decision), [`sessions`] (session bindings),
//! [`replica_sync`] (what router replicas share over a bus), [`metrics_text`] (vLLM / SGLang
//! metrics).

pub mod config;
pub mod data;
pub mod endpoint;
pub mod filters;
pub mod handler;
pub mod inflight;
pub mod metrics_text;
pub mod pickers;
pub mod plugin;
pub mod pool;
pub mod presets;
pub mod profile;
pub mod registry;
pub mod replica_sync;
pub mod rng;
pub mod router;
pub mod scorers;
pub mod sessions;

#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;

use thiserror::Error;

pub use config::{ConfigError, RouterConfig};
pub use endpoint::{Endpoint, LoraState, Metrics, Role};
pub use inflight::{InFlightSnapshot, Ticket};
pub use plugin::{PluginError, RequestMeta};
pub use pool::{EndpointPool, MetricsUpdate, StaleMode, StalePolicy};
pub use registry::Registry;
pub use router::{Decision, PdNote, PdReason, Router, RouterOptions};

use crate::prefix_index::{IndexError, WorkerKey};

/// Errors from routing. Nothing changes when one is returned.
#[derive(Debug, Error)]
pub enum RoutingError {
    #[error("invalid routing configuration at {0}")]
    Config(#[from] ConfigError),
    #[error("no endpoint for the request in profile {profile:?}: {detail}")]
    NoEndpoint { profile: String, detail: String },
    #[error("unknown endpoint {0}")]
    UnknownEndpoint(WorkerKey),
    #[error("{0}")]
    InvalidValue(String),
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error(transparent)]
    Plugin(#[from] PluginError),
}

/// Parses a configuration value with the built-in plugins.
pub fn parse_config(value: &serde_json::Value) -> Result<RouterConfig, ConfigError> {
    config::parse(value, &Registry::builtin())
}

impl std::error::Error for PluginError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.source.as_ref())
    }
}
