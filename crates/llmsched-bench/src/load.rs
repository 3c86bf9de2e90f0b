//! An open-loop load generator for OpenAI-compatible servers.
//!
//! Requests start on a schedule fixed in advance (uniform `1/rate` apart, or Poisson: independent
//! exponential gaps of mean `1/rate`), whatever the server's answers do: a slow server gets more
//! requests in flight, not fewer requests, so queueing shows in the latencies (no coordinated
//! omission). The dispatcher sleeps on tokio's timer, which releases arrivals with about 1 ms of
//! granularity; how late each start was against its schedule is reported (`lag_ms`).
//!
//! Per request it measures the latency (sending the request to the end of the answer), the
//! time to first token (TTFT: to the first complete SSE `data:` event of a stream, to the first
//! body byte of a JSON answer), and for streams the gaps between successive token events (ITL).
//! An error is any answer that is not a 200 with a complete body: the connection failing
//! (`connect`), a status (`status_NNN`), the body breaking off (`body`), a stream without
//! `data: [DONE]` or a JSON answer that does not parse (`incomplete`), or the per-request timeout
//! (`timeout`); requests that would pass `max_in_flight` are not sent and count as `overload`.
//!
//! With [`LoadConfig::responses`] the load is conversations on OpenAI's Responses API
//! (`POST /v1/responses`, [`conversations`]): each start continues an idle conversation with
//! `previous_response_id` or opens a new one, and the report counts the continuations sent
//! and those answered 404 (sent to an engine that does not hold the conversation). A
//! Responses stream ends with its `response.completed` event instead of `data: [DONE]`; its
//! token events are the `response.output_text.delta` ones.
//!
//! Streams from an engine that stamps its events (`llmsched-fake-engine --stamp`) are also
//! measured against the engine's clock: forward, relay and net latency ([`crate::stamp`]).
//!
//! The first `warmup` seconds of the schedule are sent but not measured. The CPU time of the
//! processes named in `cpu_pids` (every thread's run time, [`cpu_seconds`]) is read when
//! the measured window opens and again when its last request has finished, and reported per
//! measured request.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::CONTENT_TYPE;
use hyper::Request;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tokio::task::JoinSet;
use tokio::time::Instant;

pub mod conversations;

use conversations::{ConversationCounts, Conversations, Turn};

/// How arrivals are spaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrivals {
    /// Exactly `1/rate` apart.
    Uniform,
    /// Exponential gaps of mean `1/rate` (a Poisson process).
    Poisson,
}

impl std::str::FromStr for Arrivals {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "uniform" => Ok(Arrivals::Uniform),
            "poisson" => Ok(Arrivals::Poisson),
            _ => Err(format!("unknown arrivals {name:?} (uniform or poisson)")),
        }
    }
}

/// Distinct request bodies made ahead (request `k` sends body `k % BODIES`).
const BODIES: usize = 20_000;

/// A load to send.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// Base URLs (`http://127.0.0.1:8000`); request `k` goes to `urls[k % len]`.
    pub urls: Vec<String>,
    /// Requests per second.
    pub rate: f64,
    /// Seconds measured (after the warm-up).
    pub duration: f64,
    /// Seconds sent before the measured window.
    pub warmup: f64,
    /// How arrivals are spaced.
    pub arrivals: Arrivals,
    /// Chat completions (`/v1/chat/completions`) rather than completions.
    pub chat: bool,
    /// Conversations on the Responses API (`/v1/responses`, [`conversations`]) rather than
    /// completions (wins over `chat`).
    pub responses: bool,
    /// Responses: requests per conversation (the first and its continuations), at least 1.
    pub turns: usize,
    /// Responses: distinct `instructions` texts, conversation `c` taking `c % system_prompts`.
    pub system_prompts: usize,
    /// Ask for a streamed answer.
    pub stream: bool,
    /// The model named in each request.
    pub model: String,
    /// `max_tokens` of each request (`max_output_tokens` on the Responses API).
    pub max_tokens: u32,
    /// Words in each session's shared prompt opening (about one token each).
    pub prompt_words: usize,
    /// Distinct sessions (shared openings); request `k` belongs to session `k % sessions`.
    pub sessions: usize,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Requests in flight beyond which a scheduled request is not sent (counted as overload).
    pub max_in_flight: usize,
    /// Processes whose CPU time per measured request is reported, by label.
    pub cpu_pids: Vec<(String, u32)>,
    /// Seed of the Poisson arrivals.
    pub seed: u64,
    /// The slowest stamped streams (by net latency) reported event by event
    /// ([`Report::slow_streams`]); 0: none.
    pub slow_streams: usize,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            urls: Vec::new(),
            rate: 100.0,
            duration: 5.0,
            warmup: 1.0,
            arrivals: Arrivals::Poisson,
            chat: false,
            responses: false,
            turns: 4,
            system_prompts: 4,
            stream: false,
            model: "fake".into(),
            max_tokens: 4,
            prompt_words: 200,
            sessions: 64,
            timeout: Duration::from_secs(30),
            max_in_flight: 20_000,
            cpu_pids: Vec::new(),
            seed: 1,
            slow_streams: 0,
        }
    }
}

/// Quantiles of one measure, in milliseconds.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Summary {
    /// Samples.
    pub n: usize,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Summary {
    /// Summarises samples in seconds (nearest-rank quantiles).
    pub fn of(mut seconds: Vec<f64>) -> Self {
        if seconds.is_empty() {
            return Summary::default();
        }
        seconds.sort_by(f64::total_cmp);
        let n = seconds.len();
        let at = |q: f64| {
            let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
            round3(seconds[rank - 1] * 1e3)
        };
        Summary {
            n,
            mean: round3(seconds.iter().sum::<f64>() / n as f64 * 1e3),
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: round3(seconds[n - 1] * 1e3),
        }
    }
}

fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

/// What a load measured.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Report {
    /// Requests scheduled in the measured window.
    pub scheduled: usize,
    /// Of those, answered with a 200 and a complete body.
    pub ok: usize,
    /// Of those, failed, by kind.
    pub errors: BTreeMap<String, usize>,
    /// Measured requests per second actually started.
    pub achieved_rate: f64,
    /// Latency of successful requests.
    pub latency_ms: Summary,
    /// Time to first token of successful requests.
    pub ttft_ms: Summary,
    /// Gaps between successive token events of successful streams.
    pub itl_ms: Summary,
    /// How late each measured start was against its schedule.
    pub lag_ms: Summary,
    /// Streams whose engine stamped its events ([`crate::stamp`]; empty otherwise): the
    /// client's start to the engine's reading of the request.
    pub forward_ms: Summary,
    /// Stamped streams: each event's hand-over at the engine to its arrival here.
    pub relay_ms: Summary,
    /// Stamped streams: the latency less the engine's own time (see [`crate::stamp`]).
    pub net_latency_ms: Summary,
    /// CPU milliseconds per measured request of the processes in `cpu_pids`, summed by label.
    pub cpu_ms_per_request: BTreeMap<String, f64>,
    /// The `slow_streams` measured stamped streams of the highest net latency, slowest first,
    /// event by event.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub slow_streams: Vec<crate::stamp::StreamTrace>,
    /// Responses loads ([`LoadConfig::responses`]; absent otherwise): conversations and
    /// continuations in the measured window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversations: Option<ConversationCounts>,
}

/// One finished request.
struct Record {
    measured: bool,
    /// Which turn of a conversation it was (Responses loads).
    turn: Option<Turn>,
    outcome: Result<Timing, String>,
}

struct Timing {
    /// The response id read from the answer (Responses loads).
    response_id: Option<String>,
    latency: f64,
    ttft: f64,
    gaps: Vec<f64>,
    stamped: Option<crate::stamp::StreamTimes>,
    trace: Option<crate::stamp::StreamTrace>,
}

/// CPU seconds (user + system, every thread) of process `pid`: the nanosecond run times of
/// its threads (`/proc/PID/task/*/schedstat`), or where that is missing the 10 ms ticks of
/// `/proc/PID/stat` (a load of a few thousand requests at 0.1 ms each spans a few dozen ticks).
/// A thread that ends during the window takes its time with it (none of the gateways measured
/// starts or ends threads under load).
pub fn cpu_seconds(pid: u32) -> io::Result<f64> {
    match run_time_ns(pid) {
        Ok(ns) => Ok(ns as f64 * 1e-9),
        Err(_) => ticks_seconds(pid),
    }
}

fn run_time_ns(pid: u32) -> io::Result<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let path = task?.path().join("schedstat");
        // A thread gone since the listing ran no more.
        let Ok(text) = std::fs::read_to_string(path) else { continue };
        let ns = text.split_whitespace().next().and_then(|f| f.parse::<u64>().ok());
        total += ns.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad schedstat"))?;
    }
    Ok(total)
}

fn ticks_seconds(pid: u32) -> io::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| -> io::Result<f64> {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "malformed /proc stat"))
    };
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    Ok((field(11)? + field(12)?) / clock_ticks())
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions; it returns -1 for an unknown name.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

/// A splitmix64 stream: the Poisson gaps (no dependency for one exponential draw per request).
struct SplitMix(u64);

impl SplitMix {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        // In (0, 1]: never 0, so ln is finite.
        ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
}

/// The body of request `k`: session `k % sessions`'s shared opening, then a turn of its own.
pub fn request_body(config: &LoadConfig, k: usize) -> Value {
    let session = k % config.sessions.max(1);
    let opening = format!("Session {session}: {}", "context ".repeat(config.prompt_words));
    let turn = format!("turn {}", k / config.sessions.max(1));
    let mut body = if config.chat {
        json!({"model": config.model, "messages": [
            {"role": "system", "content": opening},
            {"role": "user", "content": turn},
        ]})
    } else {
        json!({"model": config.model, "prompt": format!("{opening}{turn}")})
    };
    body["max_tokens"] = json!(config.max_tokens);
    if config.stream {
        body["stream"] = json!(true);
    }
    body
}

/// Sends the load and measures it. Fails only when the configuration is unusable (no URL, a
/// rate or duration that is not positive, a URL that does not parse).
pub async fn run(config: LoadConfig) -> Result<Report, String> {
    if config.urls.is_empty() {
        return Err("no URL to load".into());
    }
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if !positive(config.rate) || !positive(config.duration) {
        return Err("rate and duration must be positive".into());
    }
    if !config.warmup.is_finite() || config.warmup < 0.0 {
        return Err("warmup must be >= 0".into());
    }
    let path = if config.responses {
        "/v1/responses"
    } else if config.chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let uris: Vec<hyper::Uri> = config
        .urls
        .iter()
        .map(|u| format!("{}{path}", u.trim_end_matches('/')).parse())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("bad URL: {e}"))?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector);
    // Bodies are made before the clock starts, so building them costs no schedule time.
    let horizon = config.warmup + config.duration;
    let expected = (config.rate * horizon * 1.2) as usize + 16;
    let mut plan = if config.responses {
        Plan::Conversations(Conversations::new(&config, expected.min(BODIES), uris.len()))
    } else {
        let bodies = (0..expected.min(BODIES))
            .map(|s| Bytes::from(serde_json::to_vec(&request_body(&config, s)).unwrap()))
            .collect();
        Plan::Fixed(bodies)
    };
    let records: Arc<Mutex<Vec<Record>>> = Arc::new(Mutex::new(Vec::with_capacity(expected)));
    let mut rng = SplitMix(config.seed);
    let mut tasks = JoinSet::new();
    let mut lags = Vec::with_capacity(expected);
    let mut scheduled = 0usize;
    let mut overload = 0usize;
    let mut cpu_before: Vec<Option<f64>> = Vec::new();
    let mut window_open = false;
    let expect = Expect {
        stream: config.stream,
        trace: config.slow_streams > 0,
        responses: config.responses,
    };
    let t0 = Instant::now();
    let mut at = 0.0f64;
    let mut k = 0usize;
    while at < horizon {
        let due = t0 + Duration::from_secs_f64(at);
        tokio::time::sleep_until(due).await;
        let measured = at >= config.warmup;
        if measured && !window_open {
            window_open = true;
            cpu_before = config.cpu_pids.iter().map(|(_, pid)| cpu_seconds(*pid).ok()).collect();
        }
        while tasks.try_join_next().is_some() {}
        if measured {
            scheduled += 1;
            lags.push(Instant::now().saturating_duration_since(due).as_secs_f64());
        }
        if tasks.len() >= config.max_in_flight {
            overload += usize::from(measured);
        } else {
            let (target, body, turn) = plan.next(k, uris.len());
            let request = Request::post(uris[target].clone())
                .header(CONTENT_TYPE, "application/json")
                .body(Full::new(body))
                .expect("a valid request");
            let client = client.clone();
            let records = records.clone();
            let conversations = plan.shared();
            let timeout = config.timeout;
            tasks.spawn(async move {
                let sent = send(&client, request, expect);
                let outcome = match tokio::time::timeout(timeout, sent).await {
                    Ok(outcome) => outcome,
                    Err(_) => Err("timeout".to_string()),
                };
                if let (Some(conversations), Some(turn)) = (conversations, &turn) {
                    let id = outcome.as_ref().ok().and_then(|t| t.response_id.clone());
                    conversations.finished(turn, id);
                }
                records.lock().unwrap().push(Record { measured, turn, outcome });
            });
        }
        k += 1;
        at = match config.arrivals {
            Arrivals::Uniform => k as f64 / config.rate,
            Arrivals::Poisson => at - rng.unit().ln() / config.rate,
        };
    }
    let window_start = t0 + Duration::from_secs_f64(config.warmup);
    let window = Instant::now().saturating_duration_since(window_start).as_secs_f64();
    while tasks.join_next().await.is_some() {}
    let cpu_after: Vec<Option<f64>> =
        config.cpu_pids.iter().map(|(_, pid)| cpu_seconds(*pid).ok()).collect();
    let records = std::mem::take(&mut *records.lock().unwrap());
    let mut report = Report { scheduled, ..Report::default() };
    if overload > 0 {
        report.errors.insert("overload".into(), overload);
    }
    if config.responses {
        report.conversations = Some(ConversationCounts::of(
            records.iter().filter(|r| r.measured).map(|r| (r.turn.as_ref(), &r.outcome)),
        ));
    }
    summarise(&mut report, records, lags, config.slow_streams);
    report.achieved_rate = if window > 0.0 { round3(scheduled as f64 / window) } else { 0.0 };
    let sent = (scheduled - overload).max(1) as f64;
    for (((label, _), before), after) in config.cpu_pids.iter().zip(cpu_before).zip(cpu_after) {
        if let (Some(before), Some(after)) = (before, after) {
            // Several processes under one label add up (a gateway and its workers).
            *report.cpu_ms_per_request.entry(label.clone()).or_default() +=
                (after - before) / sent * 1e3;
        }
    }
    for ms in report.cpu_ms_per_request.values_mut() {
        *ms = round3(*ms);
    }
    Ok(report)
}

/// Where the load's bodies come from.
enum Plan {
    /// Request `k` sends body `k % len` to URL `k % urls` (completions and chats).
    Fixed(Vec<Bytes>),
    /// Turns of conversations (Responses).
    Conversations(Conversations),
}

impl Plan {
    /// The URL index, body and conversation turn of request `k`.
    fn next(&mut self, k: usize, urls: usize) -> (usize, Bytes, Option<Turn>) {
        match self {
            Plan::Fixed(bodies) => (k % urls, bodies[k % bodies.len()].clone(), None),
            Plan::Conversations(conversations) => {
                let (turn, body) = conversations.next();
                (turn.target, body, Some(turn))
            }
        }
    }

    /// What a finished request reports back to (conversations only).
    fn shared(&self) -> Option<Arc<conversations::Idle>> {
        match self {
            Plan::Fixed(_) => None,
            Plan::Conversations(conversations) => Some(conversations.idle()),
        }
    }
}

/// Fills the latency, TTFT, ITL, stamp and lag summaries and the error counts from the records.
fn summarise(report: &mut Report, records: Vec<Record>, lags: Vec<f64>, slow_streams: usize) {
    let (mut latencies, mut ttfts, mut gaps) = (Vec::new(), Vec::new(), Vec::new());
    let (mut forwards, mut relays, mut nets) = (Vec::new(), Vec::new(), Vec::new());
    let mut traces = Vec::new();
    for record in records.into_iter().filter(|r| r.measured) {
        match record.outcome {
            Ok(timing) => {
                report.ok += 1;
                latencies.push(timing.latency);
                ttfts.push(timing.ttft);
                gaps.extend(timing.gaps);
                if let Some(stamped) = timing.stamped {
                    forwards.push(stamped.forward);
                    relays.extend(stamped.relay);
                    nets.push(stamped.net_latency);
                }
                traces.extend(timing.trace);
            }
            Err(kind) => *report.errors.entry(kind).or_default() += 1,
        }
    }
    report.latency_ms = Summary::of(latencies);
    report.ttft_ms = Summary::of(ttfts);
    report.itl_ms = Summary::of(gaps);
    report.lag_ms = Summary::of(lags);
    report.forward_ms = Summary::of(forwards);
    report.relay_ms = Summary::of(relays);
    report.net_latency_ms = Summary::of(nets);
    traces.sort_by(|a: &crate::stamp::StreamTrace, b| b.net_ms.total_cmp(&a.net_ms));
    traces.truncate(slow_streams);
    report.slow_streams = traces;
}

/// What a request's answer should be.
#[derive(Clone, Copy, Debug)]
struct Expect {
    /// A stream (else a JSON answer).
    stream: bool,
    /// Keep the stream's stamps event by event ([`LoadConfig::slow_streams`]).
    trace: bool,
    /// A Responses answer: named events ending with `response.completed`, its id read.
    responses: bool,
}

/// What one complete streamed event is to the generator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    /// The stream's last event (`data: [DONE]`, a Responses `response.completed`).
    Done,
    /// A token (any other `data:` event; a Responses `response.output_text.delta`).
    Token,
    /// Anything else (a Responses lifecycle event, a comment).
    Other,
}

/// What `event` (its bytes without the blank line that ends it) is.
fn classify(event: &[u8], responses: bool) -> Event {
    if !responses {
        return if event.starts_with(b"data: [DONE]") {
            Event::Done
        } else if event.starts_with(b"data:") {
            Event::Token
        } else {
            Event::Other
        };
    }
    let name = event.strip_prefix(b"event:").map(|rest| {
        let end = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
        rest[..end].trim_ascii()
    });
    match name {
        Some(b"response.output_text.delta") => Event::Token,
        Some(b"response.completed") => Event::Done,
        _ => Event::Other,
    }
}

/// Sends one request and reads its answer to the end.
async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    request: Request<Full<Bytes>>,
    expect: Expect,
) -> Result<Timing, String> {
    let stream = expect.stream;
    let started = Instant::now();
    let started_ns = crate::stamp::monotonic_ns();
    // Stamped events (received, sent) with their arrival here, nanoseconds.
    let mut stamps: Vec<((u64, u64), u64)> = Vec::new();
    let response = client.request(request).await.map_err(|_| "connect".to_string())?;
    let status = response.status();
    let mut body = response.into_body();
    let mut first: Option<Instant> = None;
    let mut events: Vec<Instant> = Vec::new();
    let mut pending: Vec<u8> = Vec::new();
    let mut done = false;
    let mut response_id: Option<String> = None;
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| "body".to_string())?;
        let Some(data) = frame.data_ref() else { continue };
        let now = Instant::now();
        let now_ns = if stream { crate::stamp::monotonic_ns() } else { 0 };
        if !stream {
            first.get_or_insert(now);
            pending.extend_from_slice(data);
            continue;
        }
        pending.extend_from_slice(data);
        // Complete events end with a blank line.
        let mut start = 0;
        while let Some(end) = find(&pending[start..], b"\n\n") {
            let event = &pending[start..start + end];
            if expect.responses && seen == 0 {
                // vLLM writes the response id first in the first event.
                response_id = conversations::first_id(event);
            }
            seen += 1;
            match classify(event, expect.responses) {
                Event::Done => done = true,
                Event::Token => events.push(now),
                Event::Other => {}
            }
            if expect.responses || event.starts_with(b"data:") {
                if let Some(stamp) = crate::stamp::read(event) {
                    stamps.push((stamp, now_ns));
                }
            }
            start += end + 2;
        }
        pending.drain(..start);
    }
    let finished = Instant::now();
    let finished_ns = crate::stamp::monotonic_ns();
    if !status.is_success() {
        return Err(format!("status_{}", status.as_u16()));
    }
    if stream {
        if !done {
            return Err("incomplete".into());
        }
        first = events.first().copied();
    } else if expect.responses {
        response_id = Some(conversations::json_id(&pending).ok_or("incomplete")?);
    } else if serde_json::from_slice::<serde::de::IgnoredAny>(&pending).is_err() {
        return Err("incomplete".into());
    }
    let since = |t: Instant| t.saturating_duration_since(started).as_secs_f64();
    Ok(Timing {
        response_id,
        latency: since(finished),
        ttft: since(first.unwrap_or(finished)),
        gaps: events.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect(),
        stamped: crate::stamp::stream_times(started_ns, finished_ns, &stamps),
        trace: if expect.trace {
            crate::stamp::stream_trace(started_ns, finished_ns, &stamps)
        } else {
            None
        },
    })
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_seconds_reads_this_process_in_nanoseconds() {
        let pid = std::process::id();
        assert!(run_time_ns(pid).is_ok_and(|ns| ns > 0));
        let before = cpu_seconds(pid).unwrap();
        // Work until the count moves (bounded): nanoseconds move well before a 10 ms tick.
        let mut x = 0u64;
        let mut after = before;
        for _ in 0..10_000 {
            for _ in 0..10_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
            }
            after = cpu_seconds(pid).unwrap();
            if after > before {
                break;
            }
        }
        assert!(after > before);
        assert!(ticks_seconds(pid).is_ok());
        assert!(cpu_seconds(u32::MAX).is_err());
    }
}
