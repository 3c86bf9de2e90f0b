//! Who a request is and what it may take: API keys (tenant and priority), per-key rate and
//! concurrency limits (token buckets, the rules of the Python plane's `ratelimit` module), the
//! bound on tenant names taken from request headers and the budget of request-body bytes
//! being received ([`BodyBudget`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The tenant of requests whose header names a tenant past `max_tenants`.
pub const OVERFLOW_TENANT: &str = "~overflow";

/// One API key and what it stands for.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// The key as presented (`Authorization: Bearer <key>` or `x-api-key`).
    pub key: String,
    /// The fairness id of every request the key signs.
    pub tenant: String,
    /// Their priority (higher first; negative: sheddable).
    #[serde(default)]
    pub priority: i32,
    /// Request rate (None: unlimited) and bucket size (default one second's worth, at least 1).
    #[serde(default)]
    pub requests_per_s: Option<f64>,
    #[serde(default)]
    pub burst_requests: Option<f64>,
    /// Token rate (prompt at admission, output at the end) and bucket size.
    #[serde(default)]
    pub tokens_per_s: Option<f64>,
    #[serde(default)]
    pub burst_tokens: Option<f64>,
    /// Requests of the key in progress at once.
    #[serde(default)]
    pub max_concurrent: Option<u64>,
}

struct Bucket {
    rate: f64,
    capacity: f64,
    level: f64,
    updated: f64,
}

impl Bucket {
    fn new(rate: f64, burst: Option<f64>, now: f64) -> Bucket {
        let capacity = burst.unwrap_or(rate.max(1.0));
        Bucket { rate, capacity, level: capacity, updated: now }
    }

    fn refill(&mut self, now: f64) {
        if now > self.updated {
            self.level = (self.level + (now - self.updated) * self.rate).min(self.capacity);
            self.updated = now;
        }
    }

    fn wait_for(&self, amount: f64) -> f64 {
        let missing = amount - self.level;
        if missing <= 0.0 {
            0.0
        } else {
            missing / self.rate
        }
    }
}

struct Buckets {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    /// Requests and tokens taken since the last [`KeyLimiter::drain_usage`] (replica sync).
    used: (f64, f64),
}

/// The limits of one key.
pub struct KeyLimiter {
    buckets: Mutex<Buckets>,
    max_concurrent: Option<u64>,
    in_progress: AtomicU64,
}

/// Why a request is over its key's limit, and the seconds to wait.
#[derive(Debug, Clone, Copy)]
pub struct OverLimit {
    /// `rate-limited` or `concurrency-limited`.
    pub reason: &'static str,
    /// Seconds until the bucket holds what the request needs.
    pub wait_s: f64,
}

impl KeyLimiter {
    fn new(config: &ApiKeyConfig, now: f64) -> Option<KeyLimiter> {
        let limited = config.requests_per_s.is_some()
            || config.tokens_per_s.is_some()
            || config.max_concurrent.is_some();
        limited.then(|| KeyLimiter {
            buckets: Mutex::new(Buckets {
                requests: config.requests_per_s.map(|r| Bucket::new(r, config.burst_requests, now)),
                tokens: config.tokens_per_s.map(|r| Bucket::new(r, config.burst_tokens, now)),
                used: (0.0, 0.0),
            }),
            max_concurrent: config.max_concurrent,
            in_progress: AtomicU64::new(0),
        })
    }

    /// Admits one request of `prompt_tokens` (counted in progress until [`KeyLimiter::release`])
    /// or says why not. A request larger than the token bucket ever holds is admitted when the
    /// bucket is full (it runs the bucket into debt).
    pub fn acquire(&self, prompt_tokens: u64, now: f64) -> Result<(), OverLimit> {
        if let Some(max) = self.max_concurrent {
            if self.in_progress.load(Ordering::Relaxed) >= max {
                return Err(OverLimit { reason: "concurrency-limited", wait_s: 1.0 });
            }
        }
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(bucket) = buckets.requests.as_mut() {
            bucket.refill(now);
            let wait_s = bucket.wait_for(1.0);
            if wait_s > 0.0 {
                return Err(OverLimit { reason: "rate-limited", wait_s });
            }
        }
        if let Some(bucket) = buckets.tokens.as_mut() {
            bucket.refill(now);
            let wait_s = bucket.wait_for((prompt_tokens as f64).min(bucket.capacity));
            if wait_s > 0.0 {
                return Err(OverLimit { reason: "rate-limited", wait_s });
            }
            bucket.level -= prompt_tokens as f64;
            buckets.used.1 += prompt_tokens as f64;
        }
        if let Some(bucket) = buckets.requests.as_mut() {
            bucket.level -= 1.0;
            buckets.used.0 += 1.0;
        }
        self.in_progress.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Ends an admitted request; its output tokens are taken from the token bucket (before
    /// its concurrency goes back: a request admitted in its place sees them taken).
    pub fn release(&self, output_tokens: u64, now: f64) {
        if output_tokens > 0 {
            let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(bucket) = buckets.tokens.as_mut() {
                bucket.refill(now);
                bucket.level -= output_tokens as f64;
                buckets.used.1 += output_tokens as f64;
            }
        }
        let _ = self
            .in_progress
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n.saturating_sub(1)));
    }

    /// Whether the key has a request or token rate (what replicas share; concurrency stays
    /// per replica).
    pub fn limits_rates(&self) -> bool {
        let buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        buckets.requests.is_some() || buckets.tokens.is_some()
    }

    /// Requests and tokens this gateway took from the buckets since the last call.
    pub fn drain_usage(&self) -> (f64, f64) {
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut buckets.used)
    }

    /// What other replicas admitted for this key: taken from the buckets as if admitted here,
    /// so the key's rate holds across replicas (the buckets may go below zero).
    pub fn charge_remote(&self, requests: f64, tokens: f64, now: f64) {
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(bucket) = buckets.requests.as_mut().filter(|_| requests > 0.0) {
            bucket.refill(now);
            bucket.level -= requests;
        }
        if let Some(bucket) = buckets.tokens.as_mut().filter(|_| tokens > 0.0) {
            bucket.refill(now);
            bucket.level -= tokens;
        }
    }
}

/// A key's identity.
pub struct Identity {
    /// The fairness id.
    pub tenant: Arc<str>,
    /// The priority.
    pub priority: i32,
    /// Its limits (None: unlimited).
    pub limiter: Option<Arc<KeyLimiter>>,
}

/// The configured keys, looked up by their SHA-256 (a lookup by digest does not reveal how
/// much of a guessed key matched).
#[derive(Default)]
pub struct Keys {
    by_digest: HashMap<[u8; 32], Identity>,
}

impl Keys {
    /// The keys of `configs` (checked: a key of at least 8 characters, a non-empty tenant,
    /// positive rates); the problem names the tenant, never the key.
    pub fn new(configs: &[ApiKeyConfig], now: f64) -> Result<Keys, String> {
        let mut by_digest = HashMap::new();
        for config in configs {
            if config.key.chars().count() < 8 {
                return Err("api_keys: every key must be a str of at least 8 characters".into());
            }
            if config.tenant.is_empty() {
                return Err("api_keys.<key>.tenant: must be a non-empty str".into());
            }
            for (name, value) in [
                ("requests_per_s", config.requests_per_s),
                ("burst_requests", config.burst_requests),
                ("tokens_per_s", config.tokens_per_s),
                ("burst_tokens", config.burst_tokens),
            ] {
                if value.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
                    return Err(format!(
                        "api_keys.<key {}>.{name}: must be a number > 0 or null",
                        config.tenant
                    ));
                }
            }
            if config.max_concurrent == Some(0) {
                return Err(format!(
                    "api_keys.<key {}>.max_concurrent: must be an int >= 1 or null",
                    config.tenant
                ));
            }
            let identity = Identity {
                tenant: Arc::from(config.tenant.as_str()),
                priority: config.priority,
                limiter: KeyLimiter::new(config, now).map(Arc::new),
            };
            by_digest.insert(digest(&config.key), identity);
        }
        Ok(Keys { by_digest })
    }

    /// Whether requests must carry a key.
    pub fn enabled(&self) -> bool {
        !self.by_digest.is_empty()
    }

    /// The identity of a presented key.
    pub fn identify(&self, key: &str) -> Option<&Identity> {
        self.by_digest.get(&digest(key))
    }

    /// Every key with limits, by its SHA-256 (the id replicas share, never the key).
    pub fn limiters(&self) -> impl Iterator<Item = (&[u8; 32], &Arc<KeyLimiter>)> {
        self.by_digest.iter().filter_map(|(d, i)| i.limiter.as_ref().map(|l| (d, l)))
    }

    /// The limits of the key with this SHA-256.
    pub fn limiter_of(&self, digest: &[u8; 32]) -> Option<&Arc<KeyLimiter>> {
        self.by_digest.get(digest).and_then(|i| i.limiter.as_ref())
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Tenant names taken from request headers, at most `max` seen within `idle_s`: later names
/// share [`OVERFLOW_TENANT`], so flow control's per-tenant flows stay bounded.
pub struct Tenants {
    max: usize,
    idle_s: f64,
    /// hashbrown's map (foldhash, seeded per process): a header name is hashed on every
    /// request, and std's SipHash cost several times more for these short keys; the map is
    /// bounded by `max`, so a crafted set of names cannot grow it.
    seen: Mutex<hashbrown::HashMap<Arc<str>, f64>>,
}

impl Tenants {
    /// A bound of `max` names, each held `idle_s` after it was last seen.
    pub fn new(max: usize, idle_s: f64) -> Tenants {
        Tenants { max: max.max(1), idle_s, seen: Mutex::new(hashbrown::HashMap::new()) }
    }

    /// The tenant a header name is served as; `true` when it was folded into the overflow.
    pub fn admit(&self, name: &str, now: f64) -> (Arc<str>, bool) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        // One lookup for a name seen before (its time updated in place).
        if let Some((key, at)) = seen.get_key_value_mut(name) {
            *at = now;
            return (key.clone(), false);
        }
        if seen.len() >= self.max {
            let idle_s = self.idle_s;
            seen.retain(|_, at| now - *at < idle_s);
        }
        if seen.len() >= self.max {
            return (Arc::from(OVERFLOW_TENANT), true);
        }
        let key: Arc<str> = Arc::from(name);
        seen.insert(key.clone(), now);
        (key, false)
    }

    /// Distinct names held now.
    pub fn len(&self) -> usize {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no name is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The bytes of the request bodies being received, bounded over all connections
/// (`limits.max_body_bytes_in_flight`): per-connection limits alone let slow uploads hold
/// `max_connections` x `max_body` for `body_timeout_s`. A body takes its declared length at
/// once (or its frames as they arrive, when chunked) through a [`BodyHold`], which gives them
/// back when dropped, on every way out of reading (read whole, refused, timed out, client
/// gone), so the count never leaks and never goes below zero.
#[derive(Debug)]
pub struct BodyBudget {
    limit: u64,
    held: AtomicU64,
}

impl BodyBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> BodyBudget {
        BodyBudget { limit, held: AtomicU64::new(0) }
    }

    /// The bytes held now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// A hold of nothing yet, for one body.
    pub fn hold(&self) -> BodyHold<'_> {
        BodyHold { budget: self, bytes: 0 }
    }
}

/// One body's share of a [`BodyBudget`], given back when dropped.
#[derive(Debug)]
pub struct BodyHold<'a> {
    budget: &'a BodyBudget,
    bytes: u64,
}

impl BodyHold<'_> {
    /// Takes `bytes` more if the budget has room for them (false, and nothing taken, else).
    pub fn take(&mut self, bytes: u64) -> bool {
        let limit = self.budget.limit;
        let taken = self.budget.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            held.checked_add(bytes).filter(|&total| total <= limit)
        });
        if taken.is_ok() {
            self.bytes += bytes;
        }
        taken.is_ok()
    }

    /// The bytes this hold has taken.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for BodyHold<'_> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            let before = self.budget.held.fetch_sub(self.bytes, Ordering::AcqRel);
            debug_assert!(before >= self.bytes, "a body hold gave back more than it took");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(requests_per_s: Option<f64>, max_concurrent: Option<u64>) -> ApiKeyConfig {
        ApiKeyConfig {
            key: "sk-test-0001".into(),
            tenant: "acme".into(),
            priority: 3,
            requests_per_s,
            burst_requests: Some(2.0),
            tokens_per_s: None,
            burst_tokens: None,
            max_concurrent,
        }
    }

    #[test]
    fn keys_are_found_by_digest_and_checked() {
        let keys = Keys::new(&[key(None, None)], 0.0).unwrap();
        let found = keys.identify("sk-test-0001").unwrap();
        assert_eq!((&*found.tenant, found.priority), ("acme", 3));
        assert!(found.limiter.is_none());
        assert!(keys.identify("sk-test-0002").is_none());
        let short = ApiKeyConfig { key: "short".into(), ..key(None, None) };
        let problem = Keys::new(&[short], 0.0).err().unwrap();
        assert!(problem.contains("8 characters") && !problem.contains("short"));
    }

    #[test]
    fn a_request_bucket_refills_at_its_rate() {
        let limiter = KeyLimiter::new(&key(Some(1.0), None), 0.0).unwrap();
        assert!(limiter.acquire(0, 0.0).is_ok());
        assert!(limiter.acquire(0, 0.0).is_ok());
        let over = limiter.acquire(0, 0.0).unwrap_err();
        assert_eq!(over.reason, "rate-limited");
        assert!((over.wait_s - 1.0).abs() < 1e-9);
        assert!(limiter.acquire(0, 1.0).is_ok());
    }

    #[test]
    fn usage_is_drained_once_and_remote_usage_is_charged() {
        let limiter = KeyLimiter::new(&key(Some(1.0), None), 0.0).unwrap();
        assert!(limiter.limits_rates());
        assert!(limiter.acquire(0, 0.0).is_ok());
        assert_eq!(limiter.drain_usage(), (1.0, 0.0));
        assert_eq!(limiter.drain_usage(), (0.0, 0.0));
        limiter.charge_remote(1.0, 0.0, 0.0);
        assert_eq!(limiter.acquire(0, 0.0).unwrap_err().reason, "rate-limited");
        assert_eq!(limiter.drain_usage(), (0.0, 0.0), "remote usage is not ours to share");
    }

    #[test]
    fn concurrency_is_given_back_on_release() {
        let limiter = KeyLimiter::new(&key(None, Some(1)), 0.0).unwrap();
        assert!(limiter.acquire(0, 0.0).is_ok());
        assert_eq!(limiter.acquire(0, 0.0).unwrap_err().reason, "concurrency-limited");
        limiter.release(0, 0.0);
        assert!(limiter.acquire(0, 0.0).is_ok());
    }

    #[test]
    fn a_body_hold_takes_within_the_budget_and_gives_back_on_drop() {
        let budget = BodyBudget::new(100);
        let mut a = budget.hold();
        assert!(a.take(60));
        let mut b = budget.hold();
        assert!(!b.take(41), "past the budget: refused, nothing taken");
        assert_eq!((budget.held(), b.bytes()), (60, 0));
        assert!(b.take(40));
        assert!(!b.take(1));
        assert!(!b.take(u64::MAX), "an overflowing take is refused");
        drop(a);
        assert_eq!(budget.held(), 40);
        assert!(b.take(60));
        drop(b);
        assert_eq!(budget.held(), 0);
        drop(budget.hold()); // nothing taken, nothing given back
        assert_eq!(budget.held(), 0);
    }

    proptest::proptest! {
        /// Whatever holds take and in whatever order they drop, the budget holds the sum of
        /// the live holds' takes, never more than its limit, and nothing once all are gone.
        #[test]
        fn body_holds_never_leak_nor_pass_the_limit(
            steps in proptest::collection::vec((0usize..4, 0u64..64, proptest::bool::ANY), 1..64)
        ) {
            let budget = BodyBudget::new(100);
            let mut holds: Vec<Option<BodyHold<'_>>> = (0..4).map(|_| None).collect();
            for (slot, bytes, drop_it) in steps {
                if drop_it {
                    holds[slot] = None;
                } else {
                    let hold = holds[slot].get_or_insert_with(|| budget.hold());
                    let before = budget.held();
                    let took = hold.take(bytes);
                    proptest::prop_assert_eq!(took, before + bytes <= 100);
                }
                let live: u64 = holds.iter().flatten().map(BodyHold::bytes).sum();
                proptest::prop_assert_eq!(budget.held(), live);
                proptest::prop_assert!(budget.held() <= 100);
            }
            holds.clear();
            proptest::prop_assert_eq!(budget.held(), 0);
        }
    }

    #[test]
    fn tenant_names_past_the_bound_fold_until_one_goes_idle() {
        let tenants = Tenants::new(2, 10.0);
        assert_eq!(tenants.admit("a", 0.0), (Arc::from("a"), false));
        assert_eq!(tenants.admit("b", 0.0), (Arc::from("b"), false));
        assert_eq!(tenants.admit("c", 1.0), (Arc::from(OVERFLOW_TENANT), true));
        assert_eq!(tenants.admit("a", 5.0), (Arc::from("a"), false));
        // "b" was last seen at 0: idle past 10 s at 11, it gives its place to "c".
        assert_eq!(tenants.admit("c", 11.0), (Arc::from("c"), false));
        assert_eq!(tenants.len(), 2);
    }
}
