//! The gateway's own counters, exported on `GET /metrics` under the names of the Python plane
//! (`llmsched_gateway_*`, Prometheus text format), so dashboards read either plane alike.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Counters keyed by their label values, rendered in key order.
#[derive(Default, Debug)]
pub struct Family {
    /// Sorted by label values: found by binary search against borrowed labels, so counting a
    /// request allocates nothing once its label values have been seen.
    samples: Mutex<Vec<(Vec<String>, u64)>>,
}

fn position(samples: &[(Vec<String>, u64)], labels: &[&str]) -> Result<usize, usize> {
    samples.binary_search_by(|(key, _)| key.iter().map(String::as_str).cmp(labels.iter().copied()))
}

impl Family {
    /// Adds `n` to the sample with these label values.
    pub fn add(&self, labels: &[&str], n: u64) {
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        match position(&samples, labels) {
            Ok(at) => samples[at].1 += n,
            Err(at) => samples.insert(at, (labels.iter().map(|l| l.to_string()).collect(), n)),
        }
    }

    /// Adds one.
    pub fn inc(&self, labels: &[&str]) {
        self.add(labels, 1);
    }

    /// The sample with these label values (0 when absent).
    pub fn get(&self, labels: &[&str]) -> u64 {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        position(&samples, labels).map_or(0, |at| samples[at].1)
    }

    /// The sum over every label value.
    pub fn total(&self) -> u64 {
        self.samples.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(_, n)| n).sum()
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &[&str]) {
        let _ = writeln!(out, "# HELP {name}_total {help}\n# TYPE {name}_total counter");
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        for (values, count) in samples.iter() {
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

/// The help text of `llmsched_gateway_session_tokens_ignored_total`, as the Python plane's.
const SESSION_TOKENS_HELP: &str = "Requests whose x-session-token was ignored (not base64 of \
     UTF-8 text, another namespace, or naming no engine of the gateway's)";

/// The help text of `llmsched_gateway_poisoned_requests_total`, as the Python plane's.
const POISONED_HELP: &str = "Requests that failed on two or more engines (5xx answers, \
     connections dropped before the status line) and were answered by none, counted against \
     no engine's breaker";

impl Counters {
    /// Requests answered with `status` on `route`.
    pub fn answered(&self, route: &str, status: u16) -> u64 {
        self.requests.get(&[route, &status.to_string()])
    }

    /// The counters' exposition text (gauges of other components are appended by the caller).
    pub fn render(&self, out: &mut String) {
        const P: &str = "llmsched_gateway";
        self.requests.render(
            out,
            &format!("{P}_requests"),
            "Requests answered, by route and HTTP status",
            &["route", "status"],
        );
        self.rejections.render(
            out,
            &format!("{P}_rejections"),
            "Requests refused by the gateway, by reason (the dropped-reason header value for \
             flow-control refusals)",
            &["reason"],
        );
        self.upstream_errors.render(
            out,
            &format!("{P}_upstream_errors"),
            "Failed upstream attempts, by endpoint and kind (connect, timeout, status_5xx, broken, \
             truncated)",
            &["endpoint", "kind"],
        );
        let plain = |out: &mut String, name: &str, help: &str, value: &AtomicU64| {
            let value = value.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "# HELP {P}_{name}_total {help}\n# TYPE {P}_{name}_total counter\n\
                 {P}_{name}_total {value}.0"
            );
        };
        plain(out, "retries", "Requests re-sent to another endpoint", &self.retries);
        plain(out, "poisoned_requests", POISONED_HELP, &self.poisoned);
        plain(out, "slices", "Engine calls made for sliced requests (one per slice)", &self.slices);
        plain(out, "session_tokens_ignored", SESSION_TOKENS_HELP, &self.session_tokens_ignored);
        self.routed.render(
            out,
            &format!("{P}_routed"),
            "Requests sent to each endpoint (the successful attempt)",
            &["endpoint"],
        );
        self.ejections.render(
            out,
            &format!("{P}_ejections"),
            "Times an endpoint was taken down after failing its health probes",
            &["endpoint"],
        );
        self.breaker_opens.render(
            out,
            &format!("{P}_breaker_opens"),
            "Times an endpoint's circuit breaker opened (failure rate over the window)",
            &["endpoint"],
        );
        self.probes.render(
            out,
            &format!("{P}_health_probes"),
            "Health probes of endpoints, by result (ok, failed)",
            &["endpoint", "result"],
        );
        self.scrape_failures.render(
            out,
            &format!("{P}_scrape_failures"),
            "Failed metrics scrapes of endpoints, by kind (timeout, failed)",
            &["endpoint", "kind"],
        );
        self.truncated.render(
            out,
            &format!("{P}_truncated_answers"),
            "Engine answers cut off or timed out after their status line, by what the client \
             got (error: a 502 before any byte; reset: connection reset mid-body; sse_error: an \
             SSE error event, then the stream closed without [DONE])",
            &["endpoint", "outcome"],
        );
        plain(
            out,
            "tenants_folded",
            "Requests whose header tenant came past limits.max_tenants (served as ~overflow)",
            &self.tenants_folded,
        );
        let connections = self.connections.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP {P}_connections Client connections open now\n# TYPE {P}_connections gauge\n\
             {P}_connections {connections}.0"
        );
        plain(
            out,
            "connections_refused",
            "Client connections refused at limits.max_connections",
            &self.connections_refused,
        );
        plain(
            out,
            "engine_changes",
            "Engines added, removed or changed by discovery",
            &self.engine_changes,
        );
        self.admin_requests.render(
            out,
            &format!("{P}_admin_requests"),
            "Admin API calls, by action and HTTP status",
            &["action", "status"],
        );
        self.response_lookups.render(
            out,
            &format!("{P}_response_lookups"),
            "Requests naming a stored response (previous_response_id, or its path), by how its \
             engine was found: owner (known), located (asked of the engines), owner_unavailable \
             (its engine is out of routing, or out of the set within discovery.left_grace_s), \
             not_found",
            &["outcome"],
        );
        plain(
            out,
            "responses_unhashed",
            "Responses API requests routed without prefix hashing: input items or tools the \
             gateway does not turn into the engine's chat prompt",
            &self.responses_unhashed,
        );
        self.histograms.render(out);
    }
}

/// Appends one gauge sample (with its HELP and TYPE lines when `first`).
pub fn gauge(out: &mut String, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
    let name = format!("llmsched_gateway_{name}");
    if !out.contains(&format!("# TYPE {name} gauge")) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
    }
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

    /// Appends the histogram's exposition text.
    pub fn render(&self, out: &mut String, name: &str, help: &str) {
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
        self.decision.render(out, "decision_seconds", "Time of one routing decision (Router.pick)");
        self.overhead.render(
            out,
            "overhead_seconds",
            "Time from a request's arrival to its upstream send, without flow-control queueing \
             (auth, parsing, tokenization, admission, routing)",
        );
        self.admission_wait.render(
            out,
            "admission_wait_seconds",
            "Time a request waited in flow control before dispatch",
        );
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
}
