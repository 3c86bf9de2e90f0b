//! What a request is admitted with and holds until its answer ends: its identity (tenant,
//! priority, API key), the key's rate and concurrency limits, and flow control's slot.

use std::sync::Arc;

use crate::refusal::Refusal;
use crate::{flow, guards, monotonic};

pub(crate) struct Identity {
    pub(crate) tenant: Arc<str>,
    pub(crate) priority: i32,
    pub(crate) limiter: Option<Arc<guards::KeyLimiter>>,
}

/// The key's limits (`identity`'s) taken for a request of `prompt_tokens`: held until its
/// answer ends, or a 429 naming the limit reached.
pub(crate) fn limited(
    identity: &Identity,
    prompt_tokens: u64,
) -> Result<Option<LimiterGuard>, Refusal> {
    let Some(limiter) = &identity.limiter else { return Ok(None) };
    limiter.acquire(prompt_tokens, monotonic()).map_err(|over| {
        let what =
            if over.reason == "concurrency-limited" { "requests in progress" } else { "rate" };
        Refusal::new(429, "rate_limit_exceeded", format!("this key's {what} limit is reached"))
            .dropped(over.reason, (over.wait_s.ceil() as u64).max(1).to_string())
    })?;
    Ok(Some(LimiterGuard(limiter.clone(), 0)))
}

/// What an answer holds until its end: the flow-control slot and the key's concurrency.
pub(crate) struct Guards {
    pub(crate) slot: Option<flow::Slot>,
    pub(crate) limiter: Option<LimiterGuard>,
}

impl Guards {
    pub(crate) fn output_tokens(&mut self, tokens: u64) {
        if let Some(slot) = self.slot.as_mut() {
            slot.output_tokens = tokens;
        }
        if let Some(limiter) = self.limiter.as_mut() {
            limiter.1 = tokens;
        }
    }
}

pub(crate) struct LimiterGuard(Arc<guards::KeyLimiter>, pub(crate) u64);

impl Drop for LimiterGuard {
    fn drop(&mut self) {
        self.0.release(self.1, monotonic());
    }
}
