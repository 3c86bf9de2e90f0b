//! What enters and leaves the flow controller: requests, terminal outcomes and errors.

use std::sync::Arc;

use thiserror::Error;

/// A caller-chosen request id, unique among queued and running requests.
pub type RequestId = u64;

/// A request asking to be dispatched.
///
/// `priority`: higher is served first; negative priorities are sheddable. `tenant` is the fairness
/// id; the flow of a request is `(tenant, priority)`. `tokens` is the prompt size (fairness cost
/// at dispatch and the in-flight token count); `bytes` counts against byte capacities.
#[derive(Debug, Clone)]
pub struct FlowRequest<'a, P> {
    pub id: RequestId,
    pub priority: i32,
    pub tenant: &'a str,
    pub tokens: u64,
    pub bytes: u64,
    /// Absolute deadline on the caller's clock (used by the `edf` ordering).
    pub deadline: Option<f64>,
    /// Time-to-first-token target in seconds (used by the `slo-deadline` ordering).
    pub ttft_target: Option<f64>,
    pub payload: P,
}

impl<P> FlowRequest<'_, P> {
    /// Rejects values that no policy can interpret; runs before anything changes.
    pub(crate) fn validate(&self) -> Result<(), FlowError> {
        if let Some(deadline) = self.deadline {
            if !deadline.is_finite() {
                return Err(FlowError::InvalidInput(format!(
                    "deadline of request {} must be a finite number, got {deadline}",
                    self.id
                )));
            }
        }
        if let Some(target) = self.ttft_target {
            if !(target.is_finite() && target >= 0.0) {
                return Err(FlowError::InvalidInput(format!(
                    "ttft_target of request {} must be a finite number >= 0, got {target}",
                    self.id
                )));
            }
        }
        Ok(())
    }
}

/// The one terminal outcome every request ends in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    Dispatched,
    RejectedCapacity,
    RejectedShed,
    RejectedNoEndpoints,
    EvictedTtl,
    EvictedPreempted,
    EvictedCancelled,
}

impl Outcome {
    /// Every outcome, in declaration order.
    pub const ALL: [Outcome; 7] = [
        Outcome::Dispatched,
        Outcome::RejectedCapacity,
        Outcome::RejectedShed,
        Outcome::RejectedNoEndpoints,
        Outcome::EvictedTtl,
        Outcome::EvictedPreempted,
        Outcome::EvictedCancelled,
    ];

    /// A stable snake_case name (metrics keys, logs).
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Dispatched => "dispatched",
            Outcome::RejectedCapacity => "rejected_capacity",
            Outcome::RejectedShed => "rejected_shed",
            Outcome::RejectedNoEndpoints => "rejected_no_endpoints",
            Outcome::EvictedTtl => "evicted_ttl",
            Outcome::EvictedPreempted => "evicted_preempted",
            Outcome::EvictedCancelled => "evicted_cancelled",
        }
    }

    /// The HTTP status a gateway answers with: capacity, shedding, TTL and preemption say "try
    /// again later" (429); no endpoints and cancellation are 503, as llm-d maps them.
    pub fn http_status(self) -> u16 {
        match self {
            Outcome::Dispatched => 200,
            Outcome::RejectedCapacity
            | Outcome::RejectedShed
            | Outcome::EvictedTtl
            | Outcome::EvictedPreempted => 429,
            Outcome::RejectedNoEndpoints | Outcome::EvictedCancelled => 503,
        }
    }

    /// The dropped-reason header value; empty for a dispatched request.
    pub fn reason(self) -> &'static str {
        match self {
            Outcome::Dispatched => "",
            Outcome::RejectedCapacity => "queue-capacity",
            Outcome::RejectedShed => "load-shed",
            Outcome::RejectedNoEndpoints => "no-endpoints",
            Outcome::EvictedTtl => "ttl-expired",
            Outcome::EvictedPreempted => "preempted",
            Outcome::EvictedCancelled => "cancelled",
        }
    }

    /// Position in [`Outcome::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// A request leaving the queue (or refused at the door) with its outcome and payload.
#[derive(Debug, Clone)]
pub struct FlowDecision<P> {
    pub id: RequestId,
    pub outcome: Outcome,
    pub priority: i32,
    pub tenant: Arc<str>,
    pub tokens: u64,
    pub bytes: u64,
    /// Seconds between enqueue and this decision (0 for rejections at arrival).
    pub waited_s: f64,
    pub payload: P,
}

/// Errors for input the controller cannot act on; nothing has changed when one is returned.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum FlowError {
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    InvalidInput(String),
    #[error("request {0} is already queued or running")]
    DuplicateRequest(RequestId),
    #[error("request {0} is not running")]
    UnknownRequest(RequestId),
}

/// Checks a caller-supplied time.
pub(crate) fn check_time(name: &str, value: f64) -> Result<f64, FlowError> {
    if value.is_finite() {
        Ok(value)
    } else {
        Err(FlowError::InvalidInput(format!("{name} must be a finite number, got {value}")))
    }
}
