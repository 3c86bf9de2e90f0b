//! The gateway's own counters, exported on `GET /metrics` under the names of the Python plane
//! (`llmsched_gateway_*`, Prometheus text format), so dashboards read either plane alike.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Every HELP text of the gateway's `/metrics`, by family name without the `llmsched_gateway_`
/// prefix (and a counter's `_total`): the one place both data planes take them from (the
/// Python plane through `llmsched._llmsched.gateway_metric_help()`), so that a text changed
/// here changes on both, and a dashboard reads either plane alike.
pub const HELP: &[(&str, &str)] = &[
    ("requests", "Requests answered, by route and HTTP status"),
    (
        "rejections",
        "Requests refused by the gateway, by reason (the dropped-reason header value for \
         flow-control refusals)",
    ),
    ("decision_seconds", "Time of one routing decision (Router.pick)"),
    (
        "overhead_seconds",
        "Time from a request's arrival to its upstream send, without flow-control queueing \
         (auth, parsing, tokenization, admission, routing)",
    ),
    ("admission_wait_seconds", "Time a request waited in flow control before dispatch"),
    (
        "upstream_errors",
        "Failed upstream attempts, by endpoint and kind (connect, timeout, status_5xx, broken, \
         truncated)",
    ),
    ("slices", "Engine calls made for sliced requests (one per slice)"),
    ("retries", "Requests re-sent to another endpoint"),
    (
        "poisoned_requests",
        "Requests that failed on two or more engines (5xx answers, connections dropped before \
         the status line) and were answered by none, counted against no engine's breaker",
    ),
    (
        "session_tokens_ignored",
        "Requests whose x-session-token was ignored (not base64 of UTF-8 text, another \
         namespace, or naming no engine of the gateway's)",
    ),
    (
        "response_lookups",
        "Requests naming a stored response (previous_response_id, or its path), by how its \
         engine was found: owner (known), located (asked of the engines), owner_unavailable \
         (its engine is out of routing, or out of the set within discovery.left_grace_s), \
         not_found",
    ),
    (
        "responses_unhashed",
        "Responses API requests routed without prefix hashing: input items or tools the \
         gateway does not turn into the engine's chat prompt",
    ),
    ("response_owners", "Stored responses whose engine the gateway knows"),
    ("routed", "Requests sent to each endpoint (the successful attempt)"),
    ("ejections", "Times an endpoint was taken down after failing its health probes"),
    ("breaker_opens", "Times an endpoint's circuit breaker opened (failure rate over the window)"),
    ("health_probes", "Health probes of endpoints, by result (ok, failed)"),
    ("endpoint_up", "1 when an endpoint is in routing, 0 when down or its breaker is open"),
    (
        "endpoint_in_flight",
        "Requests this gateway started on an endpoint and has not finished (endpoints in \
         routing; other replicas' requests are not counted)",
    ),
    ("scrape_failures", "Failed metrics scrapes of endpoints, by kind (timeout, failed)"),
    (
        "truncated_answers",
        "Engine answers cut off or timed out after their status line, by what the client got \
         (error: a 502 before any byte; reset: connection reset mid-body; sse_error: an SSE \
         error event, then the stream closed without [DONE])",
    ),
    ("admin_requests", "Admin API calls, by action and HTTP status"),
    ("tenants", "Distinct tenant names taken from request headers"),
    (
        "tenants_folded",
        "Requests whose header tenant came past limits.max_tenants (served as ~overflow)",
    ),
    ("connections", "Client connections open now"),
    (
        "body_bytes_in_flight",
        "Bytes of the request bodies being received, held against \
         limits.max_body_bytes_in_flight (a declared Content-Length counts whole from the start)",
    ),
    ("connections_refused", "Client connections refused at limits.max_connections"),
    ("engine_changes", "Engines added, removed or changed by discovery"),
    (
        "discovery_errors",
        "Discovery updates that failed: a discovery file that could not be read or checked, or \
         a set of Kubernetes engines the gateway refused (the current engines were kept)",
    ),
    ("index_blocks", "Blocks held in the prefix index"),
    ("index_workers", "Workers known to the prefix index"),
    ("index_bytes", "Estimated bytes used by the prefix index"),
    (
        "index_evicted_blocks",
        "Blocks the prefix index evicted for index.max_bytes or a worker's capacity",
    ),
    ("saturation", "Pool saturation seen by flow control"),
    ("queue_length", "Requests waiting in flow control, by priority"),
    ("running", "Dispatched requests not yet complete"),
    (
        "flow_tenants",
        "Tenants with a flow in flow control (idle flows are reclaimed after flow_idle_s)",
    ),
    ("flows_reclaimed", "Flows reclaimed after flow_idle_s without a queued or running request"),
    (
        "priorities_folded",
        "Requests queued in the nearest band below their priority, 256 bands besides the \
         configured ones being made",
    ),
    ("flow_outcomes", "Flow-control outcomes, by outcome"),
    ("kv_events", "KV-event subscriber counters"),
    (
        "kv_events_failing_sockets",
        "KV-event sockets whose bind or connect failed and has not succeeded since (retried \
         with backoff; the log names the endpoint and the error)",
    ),
    (
        "cluster_connected",
        "1 while the replica-sync bus is connected (0: routing on local state only)",
    ),
    ("cluster_peers", "Other gateway replicas heard from within cluster.load_ttl_s"),
    ("cluster", "Replica-sync counters (llmsched.cluster)"),
    (
        "config_warnings",
        "Notes about a configuration that will route badly, each logged once (logger \
         llmsched) and listed in the scheduler's warnings",
    ),
    (
        "index_block_size_mismatch",
        "Stored KV events skipped because the engine's block size is not a multiple of the \
         gateway's block_size (that engine's cache is never matched)",
    ),
    (
        "index_extra_keys",
        "Stored KV events skipped for extra keys the index cannot name (a LoRA adapter named \
         only by its number, keys beside the LoRA name and a prompt's cache salt): those \
         blocks are never matched",
    ),
    (
        "engine_block_size_mismatch",
        "The KV block size an engine's /metrics gives, where its KV events feed the index and \
         that size is not a multiple of the gateway's block_size (its cache is never matched)",
    ),
    (
        "engine_model_mismatches",
        "Models an engine serves other than the config names them (its /v1/models, checked by \
         llmsched.gateway.engine_models), by engine and kind",
    ),
    (
        "kubernetes_synced",
        "1 once the first list of pods has been offered (until then the gateway has no \
         engines)",
    ),
    ("kubernetes_engines", "Engines taken from the Ready pods last"),
    (
        "kubernetes_discovery",
        "Kubernetes discovery counters (KubernetesDiscovery.counters: lists, watches, events, \
         errors, ...)",
    ),
    ("kubernetes_skipped_pod", "Ready pods left out of the engines (1 each), with why"),
    ("tokenizer_cache_hits", "Prompt pieces whose ids came from the tokenizer cache"),
    ("tokenizer_cache_misses", "Prompt pieces encoded and put in the tokenizer cache"),
    ("tokenizer_cache_evictions", "Prompt pieces evicted from the tokenizer cache"),
    (
        "tokenizer_cache_fallbacks",
        "Chat prompts encoded whole because a piece could not be encoded alone",
    ),
    ("tokenizer_cache_entries", "Prompt pieces held in the tokenizer cache"),
    ("tokenizer_cache_bytes", "Bytes held in the tokenizer cache"),
    (
        "tokenizer_cache_capacity_bytes",
        "Bytes the tokenizer cache may hold (tokenizer_cache_bytes)",
    ),
    (
        "tokenizer_cache_enabled",
        "1 when chat prompts are encoded through the tokenizer cache; 0 with the reason",
    ),
    (
        "tokenizer_cache_chunks_enabled",
        "1 when long prompt pieces are cut into chunks cached on their own; 0 with the reason",
    ),
    (
        "tokenizer_cache_completions_enabled",
        "1 when completion prompts (special tokens added) go through the tokenizer cache",
    ),
];

/// The HELP text of family `name` (without the `llmsched_gateway_` prefix and a counter's
/// `_total`), from [`HELP`]; a name missing there is a bug, caught by the tests.
pub fn help(name: &str) -> &'static str {
    HELP.iter().find(|(n, _)| *n == name).map_or("", |(_, text)| text)
}

/// Counters keyed by their label values, rendered in key order.
#[derive(Default, Debug)]
pub struct Family {
    samples: Mutex<Samples>,
}

/// A family's samples in the order first counted (sorted only when rendered), and past
/// [`Samples::SCANNED`] of them an index by their labels' hash. A few samples (a request's
/// route and status, its engine among a few) are found by comparing their labels in turn,
/// which costs less than hashing them; a sorted list searched by halves cost about 140
/// instructions a count in its string comparisons (three counts a proxied request).
#[derive(Default)]
struct Samples {
    list: Vec<(Vec<String>, u64)>,
    /// Positions in `list` by the hash of their labels (filled once `list` is past
    /// [`Samples::SCANNED`]).
    index: hashbrown::HashTable<usize>,
    hasher: hashbrown::DefaultHashBuilder,
}

impl std::fmt::Debug for Samples {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.list.iter().map(|(k, v)| (k, v))).finish()
    }
}

fn same(key: &[String], labels: &[&str]) -> bool {
    key.len() == labels.len() && key.iter().zip(labels).all(|(have, want)| have == want)
}

impl Samples {
    /// Samples found by comparing labels in turn, at most; more are found by hash.
    const SCANNED: usize = 8;

    fn hash(&self, labels: &[&str]) -> u64 {
        // A `[&str]` hashes as the `Vec<String>` of the same values.
        std::hash::BuildHasher::hash_one(&self.hasher, labels)
    }

    fn position(&self, labels: &[&str]) -> Option<usize> {
        if self.list.len() <= Self::SCANNED {
            return self.list.iter().position(|(key, _)| same(key, labels));
        }
        let list = &self.list;
        self.index.find(self.hash(labels), |&at| same(&list[at].0, labels)).copied()
    }

    fn add(&mut self, labels: &[&str], n: u64) {
        if let Some(at) = self.position(labels) {
            self.list[at].1 += n;
            return;
        }
        self.list.push((labels.iter().map(|l| l.to_string()).collect(), n));
        if self.list.len() == Self::SCANNED + 1 {
            // Past the scanned few: every sample indexed from now on.
            for at in 0..self.list.len() {
                self.index_at(at);
            }
        } else if self.list.len() > Self::SCANNED + 1 {
            self.index_at(self.list.len() - 1);
        }
    }

    fn index_at(&mut self, at: usize) {
        // A `Vec<String>` hashes as the `[&str]` of the same values.
        let (list, hasher) = (&self.list, &self.hasher);
        let hash = |&i: &usize| std::hash::BuildHasher::hash_one(hasher, &list[i].0);
        self.index.insert_unique(hash(&at), at, hash);
    }
}

impl Family {
    /// Adds `n` to the sample with these label values.
    pub fn add(&self, labels: &[&str], n: u64) {
        self.samples.lock().unwrap_or_else(|e| e.into_inner()).add(labels, n);
    }

    /// Adds one.
    pub fn inc(&self, labels: &[&str]) {
        self.add(labels, 1);
    }

    /// The sample with these label values (0 when absent).
    pub fn get(&self, labels: &[&str]) -> u64 {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        samples.position(labels).map_or(0, |at| samples.list[at].1)
    }

    /// The sum over every label value.
    pub fn total(&self) -> u64 {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        samples.list.iter().map(|(_, n)| n).sum()
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &[&str]) {
        let _ = writeln!(out, "# HELP {name}_total {help}\n# TYPE {name}_total counter");
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let mut sorted: Vec<&(Vec<String>, u64)> = samples.list.iter().collect();
        sorted.sort_unstable();
        for (values, count) in sorted {
            let _ = writeln!(out, "{name}_total{} {count}.0", label_text(labels, values));
        }
    }
}

fn label_text(names: &[&str], values: &[String]) -> String {
    if names.is_empty() {
        return String::new();
    }
    let pairs: Vec<String> =
        names.iter().zip(values).map(|(n, v)| format!("{n}=\"{}\"", escaped(v))).collect();
    format!("{{{}}}", pairs.join(","))
}

/// A label value as the text format spells it: backslash, double quote and line feed
/// escaped (a raw line feed would end the sample's line).
fn escaped(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A bucket bound as the Python plane (`prometheus_client`, Go's formatting) spells it:
/// `1e-05`, not Rust's `1e-5`, so that one bucket is one series whichever plane serves it
/// (for values below 1e6, where Go's formatting and Python's `repr` agree: the bounds here).
fn go_float(value: f64) -> String {
    let text = format!("{value:?}");
    match text.split_once('e') {
        Some((mantissa, exponent)) => {
            let (sign, digits) = match exponent.strip_prefix('-') {
                Some(digits) => ('-', digits),
                None => ('+', exponent),
            };
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => text,
    }
}

/// Every counter of the gateway.
#[derive(Default, Debug)]
pub struct Counters {
    /// Requests answered, by route and HTTP status.
    pub requests: Family,
    /// Requests refused by the gateway, by reason.
    pub rejections: Family,
    /// Failed upstream attempts, by endpoint and kind (connect, timeout, status_5xx, truncated).
    pub upstream_errors: Family,
    /// Requests re-sent to another endpoint.
    pub retries: AtomicU64,
    /// Requests that failed on two or more engines (5xx answers, connections dropped before
    /// the status line) and were answered by none: counted against no engine's health.
    pub poisoned: AtomicU64,
    /// Engine calls made for sliced requests (one per slice).
    pub slices: AtomicU64,
    /// Admin API calls, by action and HTTP status.
    pub admin_requests: Family,
    /// Approximate prefix blocks dropped because the attempt that recorded them failed (in
    /// `NativeGateway.counters()`, not in `/metrics`: the Python plane counts them in its
    /// scheduler's stats).
    pub records_removed: AtomicU64,
    /// Requests sent to each endpoint (the successful attempt).
    pub routed: Family,
    /// Endpoints taken down after failing their health probes.
    pub ejections: Family,
    /// Circuit breakers opened.
    pub breaker_opens: Family,
    /// Health probes, by endpoint and result.
    pub probes: Family,
    /// Failed metrics scrapes, by endpoint and kind (`timeout`: no answer in time, which
    /// only starts confirming probes; `failed`: refused, an error status or unreadable,
    /// which takes the engine out of routing until a scrape answers).
    pub scrape_failures: Family,
    /// Answers cut off after their status line, by endpoint and what the client got.
    pub truncated: Family,
    /// Requests whose header tenant came past `max_tenants`.
    pub tenants_folded: AtomicU64,
    /// Client connections open now.
    pub connections: AtomicU64,
    /// Client connections refused at `max_connections`.
    pub connections_refused: AtomicU64,
    /// Engines added, removed or changed by discovery.
    pub engine_changes: AtomicU64,
    /// Completion requests received (before any check).
    pub received: AtomicU64,
    /// Answers passed on to their end.
    pub completed: AtomicU64,
    /// Answers the client left before their end.
    pub disconnects: AtomicU64,
    /// Requests naming a stored response (`previous_response_id`, or its path), by how its
    /// engine was found: `owner`, `located`, `owner_unavailable`, `not_found`.
    pub response_lookups: Family,
    /// Responses API requests routed without prefix hashing (input the gateway does not turn
    /// into the engine's chat prompt).
    pub responses_unhashed: AtomicU64,
    /// Requests whose `x-session-token` was ignored (not base64 of UTF-8 text, another
    /// namespace, or naming no engine of the gateway's).
    pub session_tokens_ignored: AtomicU64,
    /// Latency histograms.
    pub histograms: Histograms,
}

impl Counters {
    /// Requests answered with `status` on `route`.
    pub fn answered(&self, route: &str, status: u16) -> u64 {
        self.requests.get(&[route, &status.to_string()])
    }

    /// The counters' exposition text (gauges of other components are appended by the caller).
    pub fn render(&self, out: &mut String) {
        const P: &str = "llmsched_gateway";
        let family = |out: &mut String, name: &str, values: &Family, labels: &[&str]| {
            values.render(out, &format!("{P}_{name}"), help(name), labels);
        };
        let plain = |out: &mut String, name: &str, value: &AtomicU64| {
            let value = value.load(Ordering::Relaxed);
            let help = help(name);
            let _ = writeln!(
                out,
                "# HELP {P}_{name}_total {help}\n# TYPE {P}_{name}_total counter\n\
                 {P}_{name}_total {value}.0"
            );
        };
        family(out, "requests", &self.requests, &["route", "status"]);
        family(out, "rejections", &self.rejections, &["reason"]);
        family(out, "upstream_errors", &self.upstream_errors, &["endpoint", "kind"]);
        plain(out, "retries", &self.retries);
        plain(out, "poisoned_requests", &self.poisoned);
        plain(out, "slices", &self.slices);
        plain(out, "session_tokens_ignored", &self.session_tokens_ignored);
        family(out, "routed", &self.routed, &["endpoint"]);
        family(out, "ejections", &self.ejections, &["endpoint"]);
        family(out, "breaker_opens", &self.breaker_opens, &["endpoint"]);
        family(out, "health_probes", &self.probes, &["endpoint", "result"]);
        family(out, "scrape_failures", &self.scrape_failures, &["endpoint", "kind"]);
        family(out, "truncated_answers", &self.truncated, &["endpoint", "outcome"]);
        plain(out, "tenants_folded", &self.tenants_folded);
        let connections = self.connections.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP {P}_connections {}\n# TYPE {P}_connections gauge\n\
             {P}_connections {connections}.0",
            help("connections")
        );
        plain(out, "connections_refused", &self.connections_refused);
        plain(out, "engine_changes", &self.engine_changes);
        family(out, "admin_requests", &self.admin_requests, &["action", "status"]);
        family(out, "response_lookups", &self.response_lookups, &["outcome"]);
        plain(out, "responses_unhashed", &self.responses_unhashed);
        self.histograms.render(out);
    }
}

/// Appends one gauge sample of family `name` (with its HELP, from [`HELP`], and TYPE lines
/// when it is the family's first).
pub fn gauge(out: &mut String, name: &str, labels: &[(&str, &str)], value: f64) {
    let family = format!("llmsched_gateway_{name}");
    if !out.contains(&format!("# TYPE {family} gauge")) {
        let _ = writeln!(out, "# HELP {family} {}\n# TYPE {family} gauge", help(name));
    }
    let name = family;
    let names: Vec<&str> = labels.iter().map(|(n, _)| *n).collect();
    let values: Vec<String> = labels.iter().map(|(_, v)| v.to_string()).collect();
    let _ = writeln!(out, "{name}{} {value:?}", label_text(&names, &values));
}

/// A Prometheus histogram with fixed upper bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
    count: AtomicU64,
}

/// Decisions take tens of microseconds; requests through the gateway take milliseconds.
pub const DECISION_BUCKETS: &[f64] =
    &[1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1];
/// Waits in flow control.
pub const WAIT_BUCKETS: &[f64] =
    &[5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.5, 10.0, 60.0];

impl Histogram {
    /// An empty histogram with `bounds` (ascending).
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Records one observation in seconds.
    pub fn observe(&self, seconds: f64) {
        let seconds = seconds.max(0.0);
        if let Some(i) = self.bounds.iter().position(|b| seconds <= *b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_ns.fetch_add((seconds * 1e9) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Appends the histogram's exposition text (family `name`, its HELP from [`HELP`]).
    pub fn render(&self, out: &mut String, name: &str) {
        let help = help(name);
        let name = format!("llmsched_gateway_{name}");
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count.load(Ordering::Relaxed);
            let bound = go_float(*bound);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}.0");
        }
        let count = self.count();
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 * 1e-9;
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {count}.0\n{name}_count {count}.0\n{name}_sum {sum:?}"
        );
    }
}

/// The gateway's histograms.
#[derive(Debug)]
pub struct Histograms {
    /// One routing decision.
    pub decision: Histogram,
    /// Arrival to upstream send, without flow-control queueing.
    pub overhead: Histogram,
    /// Waits in flow control.
    pub admission_wait: Histogram,
}

impl Default for Histograms {
    fn default() -> Self {
        Histograms {
            decision: Histogram::new(DECISION_BUCKETS),
            overhead: Histogram::new(DECISION_BUCKETS),
            admission_wait: Histogram::new(WAIT_BUCKETS),
        }
    }
}

impl Histograms {
    /// Appends their exposition text.
    pub fn render(&self, out: &mut String) {
        self.decision.render(out, "decision_seconds");
        self.overhead.render(out, "overhead_seconds");
        self.admission_wait.render(out, "admission_wait_seconds");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn family_counts_by_label_values_and_renders_them_in_order() {
        let family = Family::default();
        for labels in [["chat", "200"], ["completions", "200"], ["chat", "429"], ["chat", "200"]] {
            family.inc(&labels);
        }
        family.add(&["a", "500"], 3);
        assert_eq!(family.get(&["chat", "200"]), 2);
        assert_eq!(family.get(&["chat", "201"]), 0);
        assert_eq!(family.total(), 7);
        let mut out = String::new();
        family.render(&mut out, "x", "help", &["route", "status"]);
        let samples: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            samples,
            [
                "x_total{route=\"a\",status=\"500\"} 3.0",
                "x_total{route=\"chat\",status=\"200\"} 2.0",
                "x_total{route=\"chat\",status=\"429\"} 1.0",
                "x_total{route=\"completions\",status=\"200\"} 1.0",
            ]
        );
    }

    #[test]
    fn family_tells_apart_label_values_that_join_alike_and_keeps_many() {
        let family = Family::default();
        family.inc(&["ab", "c"]);
        family.add(&["a", "bc"], 2);
        family.add(&["abc", ""], 4);
        assert_eq!(family.get(&["ab", "c"]), 1);
        assert_eq!(family.get(&["a", "bc"]), 2);
        assert_eq!(family.get(&["abc", ""]), 4);
        assert_eq!(family.get(&["abc"]), 0);
        // Past any initial capacity: every sample kept, found and rendered in order.
        for i in (0..200).rev() {
            family.add(&["e", &format!("{i:03}")], i);
        }
        for i in 0..200 {
            assert_eq!(family.get(&["e", &format!("{i:03}")]), i);
        }
        // The first few, counted before the index was made, are found through it too.
        family.inc(&["ab", "c"]);
        assert_eq!(family.get(&["ab", "c"]), 2);
        assert_eq!(family.get(&["a", "bc"]), 2);
        assert_eq!(family.get(&["abc"]), 0);
        family.add(&["ab", "c"], 0);
        assert_eq!(family.total(), 8 + (0..200).sum::<u64>());
        let mut out = String::new();
        family.render(&mut out, "x", "help", &["route", "status"]);
        let samples: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(samples.len(), 203);
        assert_eq!(samples[0], "x_total{route=\"a\",status=\"bc\"} 2.0");
        assert_eq!(samples[1], "x_total{route=\"ab\",status=\"c\"} 2.0");
        assert_eq!(samples[3], "x_total{route=\"e\",status=\"000\"} 0.0");
        assert_eq!(samples[202], "x_total{route=\"e\",status=\"199\"} 199.0");
    }

    #[test]
    fn label_values_are_escaped_and_bounds_spelled_as_go_spells_them() {
        let family = Family::default();
        family.inc(&["a\"b\\c\nd é"]);
        let mut out = String::new();
        family.render(&mut out, "x", "help", &["endpoint"]);
        assert!(out.ends_with("x_total{endpoint=\"a\\\"b\\\\c\\nd é\"} 1.0\n"), "{out}");
        let spelled: Vec<String> =
            [1e-5, 2.5e-5, 1e-4, 0.1, 60.0, 1e16, 1.5e17].into_iter().map(go_float).collect();
        assert_eq!(spelled, ["1e-05", "2.5e-05", "0.0001", "0.1", "60.0", "1e+16", "1.5e+17"]);
    }

    #[test]
    fn every_help_text_comes_from_the_one_table() {
        let mut names: Vec<&str> = HELP.iter().map(|(n, _)| *n).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), HELP.len(), "a family named twice in HELP");
        assert!(HELP.iter().all(|(_, text)| !text.is_empty() && !text.contains('\n')));
        let counters = Counters::default();
        let mut out = String::new();
        counters.render(&mut out);
        gauge(&mut out, "tenants", &[], 1.0);
        let mut seen = 0;
        for line in out.lines().filter_map(|l| l.strip_prefix("# HELP llmsched_gateway_")) {
            let (family, text) = line.split_once(' ').unwrap();
            let name = family.strip_suffix("_total").unwrap_or(family);
            assert_eq!(text, help(name), "{family}");
            assert!(!text.is_empty(), "{family} has no entry in HELP");
            seen += 1;
        }
        assert!(seen > 20, "{seen}");
        assert_eq!(help("no_such_family"), "");
    }
}
