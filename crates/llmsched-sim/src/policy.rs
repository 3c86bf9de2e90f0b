//! Routing by a policy outside the engine: a [`PolicyHook`] the engine calls at the points the
//! reference engine calls a simulator `Policy` object (`llmsched.sim.policies.Policy`), in the
//! same order and with the same arguments; the Python bindings implement it over a Python
//! object, taking the GIL for each call only.
//!
//! The calls: `update_metrics` where a replica's metrics reach the gateway (after
//! `metrics_delay_s`), before flow control sees them; `pick` when a request is dispatched
//! (after flow control let it through, once per request: a token slice that yields or migrates
//! is not routed again); `on_first_token` when its first token is produced; `on_finished` when
//! it leaves (refused by its engine included; a request flow control refused was never picked
//! and gets no call). A request's [`RequestView`] holds its state at the moment of the call.

use std::error::Error;

/// A request as a [`PolicyHook`] sees it at a call: what the workload asked for and what has
/// happened to it so far (the fields of Python's `llmsched.sim.request.Request` a policy may
/// read; the engine's own bookkeeping, such as decode-run positions, is left out).
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// The engine's slot of the request: stable from `pick` to `on_finished`, for a hook that
    /// keeps something per request.
    pub slot: usize,
    pub id: u64,
    pub arrival: f64,
    pub prompt_len: u64,
    pub output_len: u64,
    /// Chained block hashes of the prompt followed by the output (the plan's).
    pub hashes: &'a [u64],
    pub tenant: i64,
    pub priority: i64,
    /// The session number of an agentic turn.
    pub session: Option<usize>,
    /// The session name of an open-loop request (a trace's `session`).
    pub session_name: Option<&'a str>,
    pub turn: usize,
    /// 0 waiting, 1 prefill, 2 decode, 3 done (`llmsched.sim.request`'s constants).
    pub phase: u8,
    pub target: u64,
    pub computed: u64,
    pub generated: u64,
    pub high_water: u64,
    pub kv_ready: bool,
    /// -1 until dispatched (so -1 during `pick`).
    pub dispatched: f64,
    pub first_token: f64,
    pub finish: f64,
    pub cached_tokens: i64,
    pub prefilled: u64,
    pub recomputed: u64,
    pub preemptions: u64,
    pub rejected: bool,
    pub call_end: u64,
    pub slice_start: u64,
    /// The replica whose queue it joined last (None before its first).
    pub replica: Option<usize>,
    /// Split by the policy: where it was prefilled, and where it decodes.
    pub prefill_replica: Option<usize>,
    pub decode_replica: Option<usize>,
}

/// A policy call that failed (the policy raised, or returned something the engine cannot
/// use): the message names the call and the request; `source` is the policy's own error.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PolicyFailure {
    pub message: String,
    #[source]
    pub source: Option<Box<dyn Error + Send + Sync>>,
}

impl PolicyFailure {
    /// A failure without an underlying error (a bad return value).
    pub fn new(message: impl Into<String>) -> Self {
        Self { message: message.into(), source: None }
    }
}

/// A routing policy the engine calls back (see the module docs for when).
pub trait PolicyHook: Send {
    /// A replica's metrics as the gateway now sees them, published at `now`; `kv_cache_usage`
    /// as the replica reports it (not clamped to 1).
    fn update_metrics(
        &mut self,
        replica: usize,
        waiting: u32,
        running: u32,
        kv_cache_usage: f64,
        now: f64,
    ) -> Result<(), PolicyFailure>;

    /// (replica that decodes, replica that prefills or None) for `req`. The engine checks the
    /// answer ([`check_pick`]).
    fn pick(
        &mut self,
        req: &RequestView<'_>,
        now: f64,
    ) -> Result<(usize, Option<usize>), PolicyFailure>;

    /// `req` produced its first token.
    fn on_first_token(&mut self, req: &RequestView<'_>, now: f64) -> Result<(), PolicyFailure>;

    /// `req` left the simulation (finished, or refused by its engine).
    fn on_finished(&mut self, req: &RequestView<'_>, now: f64) -> Result<(), PolicyFailure>;
}

/// Whether `pick`'s answer (`target`, `prefill`) can be served by `replicas` replicas, the
/// first `prefill_replicas` of them prefill-only: both in range, and a split (a prefill
/// replica other than the target) prefills on a prefill-only replica and decodes on another.
/// A request sent whole to any replica is served there, as in the reference engine.
pub fn check_pick(
    target: usize,
    prefill: Option<usize>,
    replicas: usize,
    prefill_replicas: usize,
) -> Result<(), String> {
    if target >= replicas {
        return Err(format!("decode replica {target} is out of range ({replicas} replicas)"));
    }
    let Some(p) = prefill.filter(|&p| p != target) else { return Ok(()) };
    if p >= replicas {
        return Err(format!("prefill replica {p} is out of range ({replicas} replicas)"));
    }
    if p >= prefill_replicas {
        return Err(format!(
            "prefill replica {p} is not a prefill replica (replicas 0..{prefill_replicas} are)"
        ));
    }
    if target < prefill_replicas {
        return Err(format!(
            "decode replica {target} of a request split off to prefill replica {p} is itself \
             a prefill replica"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_pick;

    #[test]
    fn picks_are_checked_against_the_pools() {
        assert!(check_pick(3, None, 4, 0).is_ok());
        assert!(check_pick(3, Some(3), 4, 0).is_ok());
        assert!(check_pick(0, None, 4, 1).is_ok()); // whole, on a prefill replica
        assert!(check_pick(2, Some(1), 4, 2).is_ok());
        assert!(check_pick(4, None, 4, 0).unwrap_err().contains("decode replica 4 is out"));
        assert!(check_pick(1, Some(9), 4, 1).unwrap_err().contains("prefill replica 9 is out"));
        assert!(check_pick(1, Some(2), 4, 1).unwrap_err().contains("not a prefill replica"));
        assert!(check_pick(1, Some(0), 4, 2).unwrap_err().contains("itself a prefill"));
    }
}
