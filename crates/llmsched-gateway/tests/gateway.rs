//! The native gateway in front of the native fake engines, over loopback: routing, streaming
//! pass-through, retries before the first byte, upstream cancel on client disconnect, bounds
//! and configuration errors. No timing is asserted.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use llmsched_bench::engine::{self, Counters as EngineCounters, EngineConfig, Mode};
use llmsched_gateway::{start, Counters, GatewayConfig};
use serde_json::{json, Value};

struct Fleet {
    runtime: tokio::runtime::Runtime,
    engines: Vec<(SocketAddr, Arc<EngineCounters>)>,
}

impl Fleet {
    fn new(configs: Vec<EngineConfig>) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let engines = configs
            .into_iter()
            .map(|config| {
                let handle = runtime.block_on(engine::start(local(), config)).unwrap();
                (handle.addr, handle.counters)
            })
            .collect();
        Fleet { runtime, engines }
    }

    fn urls(&self) -> Vec<String> {
        self.engines.iter().map(|(addr, _)| format!("http://{addr}")).collect()
    }

    fn gateway(&self, config: GatewayConfig) -> (SocketAddr, Arc<Counters>) {
        let handle = self.runtime.block_on(start(local(), config)).expect("the gateway starts");
        (handle.addr, handle.counters)
    }

    fn completed(&self, i: usize) -> u64 {
        self.engines[i].1.completed.load(Ordering::Relaxed)
    }
}

fn local() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn ok_engine() -> EngineConfig {
    EngineConfig { model: "tiny".into(), ..EngineConfig::default() }
}

fn config(urls: Vec<String>, router: &str) -> GatewayConfig {
    GatewayConfig {
        engines: urls.into_iter().map(Into::into).collect(),
        router: json!(router),
        scrape_interval_s: None,
        ..GatewayConfig::default()
    }
}

struct Raw {
    bytes: Vec<u8>,
}

impl Raw {
    fn status(&self) -> u16 {
        let text = String::from_utf8_lossy(&self.bytes);
        text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
    }

    fn body(&self) -> &[u8] {
        match self.bytes.windows(4).position(|w| w == b"\r\n\r\n") {
            Some(at) => &self.bytes[at + 4..],
            None => &[],
        }
    }

    fn json(&self) -> Value {
        serde_json::from_slice(self.body()).expect("a JSON body")
    }

    fn data_events(&self) -> Vec<String> {
        String::from_utf8_lossy(self.body())
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").map(str::to_owned))
            .collect()
    }
}

fn send(stream: &mut TcpStream, path: &str, body: &str) {
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body.as_bytes()).unwrap();
}

fn post(addr: SocketAddr, path: &str, body: &str) -> Raw {
    let mut stream = TcpStream::connect(addr).unwrap();
    send(&mut stream, path, body);
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut bytes = Vec::new();
    let _ = stream.read_to_end(&mut bytes);
    Raw { bytes }
}

fn get(addr: SocketAddr, path: &str) -> Raw {
    let mut stream = TcpStream::connect(addr).unwrap();
    let head = format!("GET {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    let mut bytes = Vec::new();
    let _ = stream.read_to_end(&mut bytes);
    Raw { bytes }
}

/// Polls `read` until it reaches `want` (bounded); returns the last value seen.
fn reaches(want: u64, read: impl Fn() -> u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let seen = read();
        if seen >= want || Instant::now() > deadline {
            return seen;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn round_robin_spreads_json_answers_and_passes_them_through() {
    let fleet = Fleet::new(vec![ok_engine(), ok_engine()]);
    let (addr, counters) = fleet.gateway(config(fleet.urls(), "round-robin"));
    for i in 0..6 {
        let raw = post(addr, "/v1/completions", &format!(r#"{{"model":"tiny","prompt":"p{i}"}}"#));
        assert_eq!(raw.status(), 200);
        assert_eq!(raw.json()["choices"][0]["text"], " t0 t1 t2 t3");
    }
    assert_eq!((fleet.completed(0), fleet.completed(1)), (3, 3));
    assert_eq!(reaches(6, || counters.completed.load(Ordering::Relaxed)), 6);
    assert_eq!(get(addr, "/health").status(), 200);
    assert_eq!(get(addr, "/v1/models").json()["data"][0]["id"], "tiny");
    let metrics = String::from_utf8(get(addr, "/metrics").bytes).unwrap();
    let six = r#"llmsched_gateway_requests_total{route="completions",status="200"} 6.0"#;
    assert!(metrics.contains(six), "{metrics}");
    assert_eq!(get(addr, "/elsewhere").status(), 404);
    // A known path asked with another method: 405, naming the method it takes.
    for (path, allowed) in [("/v1/completions", "POST"), ("/v1/chat/completions", "POST")] {
        let raw = get(addr, path);
        assert_eq!(raw.status(), 405, "{path}");
        assert_eq!(raw.json()["error"]["type"], "method_not_allowed");
        let head = String::from_utf8_lossy(&raw.bytes).to_ascii_lowercase();
        assert!(head.contains(&format!("allow: {}\r\n", allowed.to_ascii_lowercase())), "{head}");
    }
    for path in ["/health", "/metrics", "/v1/models", "/ready"] {
        assert_eq!(post(addr, path, "{}").status(), 405, "{path}");
    }
    assert_eq!((fleet.completed(0), fleet.completed(1)), (3, 3));
}

#[test]
fn streams_pass_through_to_done() {
    let fleet = Fleet::new(vec![EngineConfig { answer_tokens: 5, ..ok_engine() }]);
    let (addr, counters) = fleet.gateway(config(fleet.urls(), "llm-d"));
    let chat = r#"{"model":"tiny","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
    let raw = post(addr, "/v1/chat/completions", chat);
    assert_eq!(raw.status(), 200);
    let events = raw.data_events();
    assert_eq!(events.len(), 6);
    assert_eq!(events[5], "[DONE]");
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["content"], " t0");
    assert_eq!(reaches(1, || counters.completed.load(Ordering::Relaxed)), 1);
}

#[test]
fn a_stream_tail_passes_whole_usage_included() {
    // The last token, the usage event and `[DONE]` come together and leave together (the
    // relay holds the tail for what follows it): none is lost or repeated.
    let fleet = Fleet::new(vec![EngineConfig { answer_tokens: 3, ..ok_engine() }]);
    let (addr, counters) = fleet.gateway(config(fleet.urls(), "round-robin"));
    let body = r#"{"prompt":"x","stream":true,"stream_options":{"include_usage":true}}"#;
    let raw = post(addr, "/v1/completions", body);
    assert_eq!(raw.status(), 200);
    let events = raw.data_events();
    assert_eq!(events.len(), 5, "{events:?}");
    assert!(events[2].contains(r#""finish_reason":"length""#), "{events:?}");
    assert!(events[3].contains(r#""completion_tokens":3"#), "{events:?}");
    assert_eq!(events[4], "[DONE]");
    assert!(raw.body().ends_with(b"0\r\n\r\n"), "a complete chunked answer");
    assert_eq!(reaches(1, || counters.completed.load(Ordering::Relaxed)), 1);
}

#[test]
fn a_stream_cut_after_its_last_token_passes_that_token_then_the_error() {
    // The single event is the last token's, held back for what follows it; the cut that
    // follows still sends it, then the error event, and never a complete answer.
    let cut = EngineConfig { mode: Mode::Cut, answer_tokens: 1, ..ok_engine() };
    let fleet = Fleet::new(vec![cut]);
    let (addr, counters) = fleet.gateway(config(fleet.urls(), "round-robin"));
    let raw = post(addr, "/v1/completions", r#"{"prompt":"x","stream":true}"#);
    assert_eq!(raw.status(), 200);
    let events = raw.data_events();
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(events[0].contains(r#""finish_reason":"length""#), "{events:?}");
    assert!(events[1].contains("cut off"), "{events:?}");
    assert!(!raw.body().ends_with(b"0\r\n\r\n"));
    assert_eq!(reaches(1, || counters.truncated.total()), 1);
    assert_eq!(counters.completed.load(Ordering::Relaxed), 0);
}

#[test]
fn llm_d_keeps_a_shared_prefix_on_one_engine() {
    let fleet = Fleet::new(vec![ok_engine(), ok_engine(), ok_engine()]);
    let (addr, _) = fleet.gateway(config(fleet.urls(), "llm-d"));
    let opening = "You are a helpful assistant. ".repeat(40);
    for turn in 0..8 {
        let body = json!({"model": "tiny", "prompt": format!("{opening} turn {turn}")});
        assert_eq!(post(addr, "/v1/completions", &body.to_string()).status(), 200);
    }
    let served: Vec<u64> = (0..3).map(|i| fleet.completed(i)).collect();
    assert!(served.contains(&8), "every turn on the engine holding the opening: {served:?}");
}

#[test]
fn retries_before_the_first_byte() {
    let failing = EngineConfig { mode: Mode::Error503, ..ok_engine() };
    let fleet = Fleet::new(vec![failing, ok_engine()]);
    let (addr, counters) = fleet.gateway(config(fleet.urls(), "round-robin"));
    for _ in 0..4 {
        assert_eq!(post(addr, "/v1/completions", r#"{"prompt":"x"}"#).status(), 200);
    }
    assert_eq!(fleet.completed(1), 4);
    assert_eq!(counters.retries.load(Ordering::Relaxed), 2, "half the picks land on the 503");

    // A refused connection moves on too.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let urls = vec![format!("http://{closed}"), fleet.urls()[1].clone()];
    let (addr, counters) = fleet.gateway(config(urls, "round-robin"));
    for _ in 0..4 {
        assert_eq!(post(addr, "/v1/completions", r#"{"prompt":"x"}"#).status(), 200);
    }
    assert_eq!(counters.retries.load(Ordering::Relaxed), 2);

    // When every endpoint fails, the client gets a 502 (no engine's error is passed on).
    let fleet = Fleet::new(vec![
        EngineConfig { mode: Mode::Error500, ..ok_engine() },
        EngineConfig { mode: Mode::Error500, ..ok_engine() },
    ]);
    let (addr, counters) = fleet.gateway(config(fleet.urls(), "round-robin"));
    assert_eq!(post(addr, "/v1/completions", r#"{"prompt":"x"}"#).status(), 502);
    assert_eq!(counters.upstream_errors.total(), 2, "one failed attempt per engine");
    assert_eq!(counters.answered("completions", 502), 1);
    let (addr, _) =
        fleet.gateway(GatewayConfig { retries: 0, ..config(fleet.urls(), "round-robin") });
    assert_eq!(post(addr, "/v1/completions", r#"{"prompt":"x"}"#).status(), 502);
    // Without retrying 5xx answers, the engine's own answer is relayed.
    let relay = GatewayConfig { retry_on_5xx: false, ..config(fleet.urls(), "round-robin") };
    let (addr, _) = fleet.gateway(relay);
    assert_eq!(post(addr, "/v1/completions", r#"{"prompt":"x"}"#).status(), 500);
    let received: u64 = fleet.engines.iter().map(|e| e.1.received.load(Ordering::Relaxed)).sum();
    assert_eq!(received, 4, "two tries, one without retries, one relayed");
}

#[test]
fn a_client_that_leaves_cancels_the_upstream_request() {
    let slow =
        EngineConfig { answer_tokens: 50, token_delay: Duration::from_millis(50), ..ok_engine() };
    let fleet = Fleet::new(vec![slow]);
    let (addr, counters) = fleet.gateway(config(fleet.urls(), "round-robin"));
    let mut stream = TcpStream::connect(addr).unwrap();
    send(&mut stream, "/v1/completions", r#"{"prompt":"x","stream":true}"#);
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut seen = Vec::new();
    let mut buffer = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains(" t0") {
        match stream.read(&mut buffer) {
            Ok(0) => panic!("closed before the first token"),
            Ok(n) => seen.extend_from_slice(&buffer[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => panic!("{e}"),
        }
    }
    drop(stream);
    let engine = &fleet.engines[0].1;
    assert_eq!(reaches(1, || engine.disconnects.load(Ordering::Relaxed)), 1);
    assert_eq!(reaches(1, || counters.disconnects.load(Ordering::Relaxed)), 1);
    assert_eq!(engine.completed.load(Ordering::Relaxed), 0);
}

#[test]
fn the_read_timeout_counts_silence_between_frames_not_the_whole_stream() {
    // Twelve tokens 40 ms apart take longer than the 0.3 s read timeout, but no gap does.
    let steady =
        EngineConfig { answer_tokens: 12, token_delay: Duration::from_millis(40), ..ok_engine() };
    let silent = EngineConfig { mode: Mode::Hang, ..ok_engine() };
    let fleet = Fleet::new(vec![steady, silent]);
    let timeouts = |urls: Vec<String>| GatewayConfig {
        read_timeout_s: Some(0.3),
        ..config(urls, "round-robin")
    };
    let (addr, counters) = fleet.gateway(timeouts(vec![fleet.urls()[0].clone()]));
    let answer = post(addr, "/v1/completions", r#"{"prompt":"x","stream":true}"#);
    let body = String::from_utf8_lossy(answer.body()).to_string();
    assert!(body.contains(" t11") && body.contains("[DONE]"), "{body}");
    assert_eq!(counters.truncated.total(), 0);
    // Silent after its first event: cut, and counted.
    let (addr, counters) = fleet.gateway(timeouts(vec![fleet.urls()[1].clone()]));
    let answer = post(addr, "/v1/completions", r#"{"prompt":"x","stream":true}"#);
    let body = String::from_utf8_lossy(answer.body()).to_string();
    assert!(body.contains("upstream_error") && !body.contains("[DONE]"), "{body}");
    assert_eq!(counters.truncated.total(), 1);
}

#[test]
fn refuses_bad_requests_without_sending_them() {
    let fleet = Fleet::new(vec![ok_engine()]);
    let (addr, counters) =
        fleet.gateway(GatewayConfig { max_body: 100, ..config(fleet.urls(), "llm-d") });
    assert_eq!(post(addr, "/v1/completions", "not json").status(), 400);
    assert_eq!(post(addr, "/v1/completions", r#"{"prompt":7}"#).status(), 400);
    assert_eq!(post(addr, "/v1/chat/completions", r#"{"messages":[]}"#).status(), 400);
    let big = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(200));
    let raw = post(addr, "/v1/completions", &big);
    assert_eq!(raw.status(), 413);
    assert!(raw.json()["error"]["message"].as_str().unwrap().contains("too large"));
    assert_eq!(counters.rejections.total(), 4);
    assert_eq!(counters.answered("completions", 400), 2);
    assert_eq!(fleet.engines[0].1.received.load(Ordering::Relaxed), 0);
}

#[test]
fn configuration_problems_name_the_key() {
    let fleet = Fleet::new(vec![ok_engine()]);
    let problem = |config: GatewayConfig| {
        fleet.runtime.block_on(start(local(), config)).err().expect("refused").to_string()
    };
    assert!(problem(config(vec![], "llm-d")).starts_with("engines:"));
    assert!(problem(config(fleet.urls(), "no-such-preset")).contains("not a preset"));
    assert!(problem(config(vec!["ftp://x".into()], "llm-d")).contains("not an http:// URL"));
    let twice = vec![fleet.urls()[0].clone(), fleet.urls()[0].clone()];
    assert!(problem(config(twice, "llm-d")).contains("listed twice"));
    let bad = GatewayConfig { router: json!({"plugins": 3}), ..config(fleet.urls(), "x") };
    assert!(problem(bad).starts_with("router:"));
    for threads in [0, llmsched_gateway::MAX_THREADS + 1, 100_000] {
        let bad = GatewayConfig { threads, ..config(fleet.urls(), "llm-d") };
        assert!(problem(bad).contains("threads"), "{threads}");
    }
    let bad =
        GatewayConfig { max_body: 2048, max_body_in_flight: 2047, ..config(fleet.urls(), "x") };
    assert!(problem(bad).starts_with("max_body_in_flight: must be at least max_body (2048)"));
}

/// The `body_bytes_in_flight` gauge of a gateway's `/metrics`.
fn body_bytes(addr: SocketAddr) -> u64 {
    let raw = get(addr, "/metrics");
    let text = String::from_utf8_lossy(raw.body()).into_owned();
    let line = text.lines().find(|l| l.starts_with("llmsched_gateway_body_bytes_in_flight "));
    let value = line.and_then(|l| l.rsplit(' ').next()).expect("the gauge is rendered");
    value.parse::<f64>().expect("a number") as u64
}

/// Polls the gauge until it is `want` (bounded); returns the last value seen.
fn body_bytes_reach(addr: SocketAddr, want: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let seen = body_bytes(addr);
        if seen == want || Instant::now() > deadline {
            return seen;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sends a request head declaring `len` body bytes and `sent` of them; the connection.
fn partial_body(addr: SocketAddr, len: usize, sent: usize) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n\
         Content-Length: {len}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&vec![b' '; sent]).unwrap();
    stream
}

#[test]
fn bodies_being_read_share_one_budget_given_back_on_every_way_out() {
    // Probe 47 F15: per-connection limits alone let slow uploads hold max_connections x
    // max_body. Budget 3 KiB, bodies of at most 2 KiB.
    let fleet = Fleet::new(vec![ok_engine()]);
    let (addr, counters) = fleet.gateway(GatewayConfig {
        max_body: 2048,
        max_body_in_flight: 3072,
        body_timeout_s: 3.0,
        ..config(fleet.urls(), "round-robin")
    });
    let held = partial_body(addr, 2048, 100);
    assert_eq!(body_bytes_reach(addr, 2048), 2048, "a declared length counts whole at once");
    // Declared past what is left: refused at once, its rest read and dropped, so a client
    // that sent it whole reads its 503 (no reset).
    assert_eq!(send_whole_then_read(addr, 2000, ""), Ok(503));
    let raw = post(addr, "/v1/completions", &format!(r#"{{"prompt":"{}"}}"#, "x".repeat(1100)));
    assert_eq!(raw.status(), 503);
    let text = String::from_utf8_lossy(&raw.bytes).to_ascii_lowercase();
    assert!(text.contains("x-llmsched-dropped-reason: body-capacity"), "{text}");
    assert!(text.contains("retry-after: 1"), "{text}");
    assert_eq!(counters.rejections.get(&["body-capacity"]), 2);
    // A body that fits is served, and gives its bytes back when read whole (the request
    // itself is bounded by flow control, not by this budget).
    assert_eq!(post(addr, "/v1/completions", r#"{"prompt":"hi"}"#).status(), 200);
    assert_eq!(body_bytes(addr), 2048);
    // A client leaving mid-body gives its bytes back.
    drop(held);
    assert_eq!(body_bytes_reach(addr, 0), 0);
    // A chunked body takes its chunks as they come, and is refused when one passes.
    let held = partial_body(addr, 2048, 10);
    assert_eq!(body_bytes_reach(addr, 2048), 2048);
    let mut chunked = TcpStream::connect(addr).unwrap();
    chunked.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    chunked
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n",
        )
        .unwrap();
    let chunk = format!("200\r\n{}\r\n", " ".repeat(0x200));
    chunked.write_all(chunk.as_bytes()).unwrap(); // 512 of the 1024 left
    assert_eq!(body_bytes_reach(addr, 2560), 2560);
    chunked.write_all(chunk.repeat(2).as_bytes()).unwrap(); // 1024 more: past the budget
    let mut bytes = Vec::new();
    let _ = chunked.read_to_end(&mut bytes);
    assert_eq!(Raw { bytes }.status(), 503);
    assert_eq!(body_bytes_reach(addr, 2048), 2048, "the refused chunked body gave its back");
    // A body that times out (408) gives its bytes back.
    let mut stream = held;
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut bytes = Vec::new();
    let _ = stream.read_to_end(&mut bytes);
    assert_eq!(Raw { bytes }.status(), 408);
    assert_eq!(body_bytes_reach(addr, 0), 0);
    assert_eq!(counters.rejections.get(&["body-capacity"]), 3);
}

#[test]
fn an_answer_cut_upstream_is_never_passed_off_as_complete() {
    let fleet = Fleet::new(vec![EngineConfig { mode: Mode::Cut, ..ok_engine() }]);
    let (addr, counters) = fleet.gateway(config(fleet.urls(), "round-robin"));
    let raw = post(addr, "/v1/completions", r#"{"prompt":"x","stream":true}"#);
    assert_eq!(raw.status(), 200, "the status line had been passed on");
    let events = raw.data_events();
    assert_eq!(events.len(), 2, "the first event, then an error event: {events:?}");
    assert!(events[1].contains("cut off"), "{events:?}");
    assert!(!events.contains(&"[DONE]".to_string()));
    // The chunked answer ends without its last chunk, so the client sees the break too.
    assert!(!raw.body().ends_with(b"0\r\n\r\n"));
    assert_eq!(reaches(1, || counters.truncated.total()), 1);
    assert_eq!(counters.upstream_errors.total(), 1);
    assert_eq!(counters.completed.load(Ordering::Relaxed), 0);
    assert_eq!(counters.retries.load(Ordering::Relaxed), 0, "never re-sent once passed on");
}

#[test]
fn a_connection_over_the_cap_reads_its_503_after_sending_a_request() {
    let fleet = Fleet::new(vec![ok_engine()]);
    let (addr, counters) =
        fleet.gateway(GatewayConfig { max_connections: 1, ..config(fleet.urls(), "round-robin") });
    let held = TcpStream::connect(addr).unwrap();
    assert_eq!(reaches(1, || counters.connections.load(Ordering::Relaxed)), 1);
    // A request the gateway never reads: closing over it unread would reset the connection,
    // and the client would lose the 503 it had not read yet.
    for _ in 0..5 {
        let prompt = "x".repeat(200_000);
        let raw = post(addr, "/v1/completions", &format!(r#"{{"prompt":"{prompt}"}}"#));
        assert_eq!(raw.status(), 503, "{:?}", String::from_utf8_lossy(&raw.bytes));
    }
    assert_eq!(counters.connections_refused.load(Ordering::Relaxed), 5);
    drop(held);
}

/// An engine that answers every POST with `answer` (raw bytes, then closes the connection)
/// and anything else (a health probe) with an empty 200.
fn scripted_engine(answer: &'static [u8]) -> String {
    paced_engine(vec![answer], Duration::ZERO)
}

/// [`scripted_engine`] writing its answer in `parts`, `pause` apart (so each comes in a read
/// of its own).
fn paced_engine(parts: Vec<&'static [u8]>, pause: Duration) -> String {
    lingering_engine(parts, pause, Duration::ZERO)
}

/// [`paced_engine`], silent for `linger` after its last part before it closes.
fn lingering_engine(parts: Vec<&'static [u8]>, pause: Duration, linger: Duration) -> String {
    let listener = std::net::TcpListener::bind(local()).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let parts = parts.clone();
            std::thread::spawn(move || {
                let mut read = Vec::new();
                let mut buf = [0u8; 4096];
                let head_end = loop {
                    if let Some(at) = read.windows(4).position(|w| w == b"\r\n\r\n") {
                        break at + 4;
                    }
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => read.extend_from_slice(&buf[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&read[..head_end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                while read.len() < head_end + length {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => read.extend_from_slice(&buf[..n]),
                    }
                }
                if !head.starts_with("post") {
                    let reply =
                        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
                    let _ = stream.write_all(reply);
                    return;
                }
                for (i, part) in parts.iter().enumerate() {
                    if i > 0 {
                        std::thread::sleep(pause);
                    }
                    if stream.write_all(part).is_err() {
                        return;
                    }
                }
                std::thread::sleep(linger);
            });
        }
    });
    format!("http://{addr}")
}

fn one_scripted(answer: &'static [u8]) -> (Fleet, SocketAddr, Arc<Counters>) {
    let fleet = Fleet::new(vec![]);
    let (addr, counters) = fleet.gateway(config(vec![scripted_engine(answer)], "round-robin"));
    (fleet, addr, counters)
}

const CLOSE_JSON: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n";
const CLOSE_SSE: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
const EVENT: &str =
    "data: {\"choices\":[{\"index\":0,\"text\":\" t0\",\"finish_reason\":null}]}\n\n";

#[test]
fn a_json_answer_ended_by_the_connection_closing_passes_only_whole() {
    // No Content-Length and not chunked: the body ends where the engine closes, so a cut looks
    // like an end. The JSON must parse, or the client gets a 502.
    let cut: &'static str =
        Box::leak(format!("{CLOSE_JSON}{{\"choices\":[{{\"text\":\"hel").into_boxed_str());
    for stream in [false, true] {
        let (_fleet, addr, counters) = one_scripted(cut.as_bytes());
        let body = format!(r#"{{"prompt":"x","stream":{stream}}}"#);
        let raw = post(addr, "/v1/completions", &body);
        assert_eq!(raw.status(), 502, "{:?}", String::from_utf8_lossy(&raw.bytes));
        assert!(raw.json()["error"]["message"].as_str().unwrap().contains("cut off"));
        assert_eq!(counters.truncated.total(), 1);
        assert_eq!(counters.completed.load(Ordering::Relaxed), 0);
    }
    let whole: &'static str = Box::leak(
        format!("{CLOSE_JSON}{{\"choices\":[{{\"text\":\"hello\"}}],\"usage\":{{\"completion_tokens\":1}}}}")
            .into_boxed_str(),
    );
    let (_fleet, addr, counters) = one_scripted(whole.as_bytes());
    let raw = post(addr, "/v1/completions", r#"{"prompt":"x"}"#);
    assert_eq!(raw.status(), 200);
    assert_eq!(raw.json()["choices"][0]["text"], "hello");
    assert_eq!(counters.truncated.total(), 0);
}

#[test]
fn an_event_stream_ended_by_the_connection_closing_needs_its_done() {
    let cut: &'static str = Box::leak(format!("{CLOSE_SSE}{EVENT}{EVENT}").into_boxed_str());
    let (_fleet, addr, counters) = one_scripted(cut.as_bytes());
    let raw = post(addr, "/v1/completions", r#"{"prompt":"x","stream":true}"#);
    assert_eq!(raw.status(), 200, "the status line had been passed on");
    let events = raw.data_events();
    assert_eq!(events.len(), 3, "{events:?}");
    assert!(events[2].contains("cut off"), "{events:?}");
    assert!(!raw.body().ends_with(b"0\r\n\r\n"), "the client sees the break");
    assert_eq!(reaches(1, || counters.truncated.total()), 1);
    assert_eq!(counters.completed.load(Ordering::Relaxed), 0);

    let whole: &'static str =
        Box::leak(format!("{CLOSE_SSE}{EVENT}{EVENT}data: [DONE]\n\n").into_boxed_str());
    let (_fleet, addr, counters) = one_scripted(whole.as_bytes());
    let raw = post(addr, "/v1/completions", r#"{"prompt":"x","stream":true}"#);
    assert_eq!(raw.status(), 200);
    assert_eq!(raw.data_events().last().map(String::as_str), Some("[DONE]"));
    assert!(raw.body().ends_with(b"0\r\n\r\n"), "a whole stream ends with its last chunk");
    assert_eq!(reaches(1, || counters.completed.load(Ordering::Relaxed)), 1);
    assert_eq!(counters.truncated.total(), 0);
}

/// The data of each chunk of a chunked body, in order (None: not a whole chunked body).
fn chunks(body: &[u8]) -> Option<Vec<&[u8]>> {
    let mut found = Vec::new();
    let mut rest = body;
    loop {
        let line = rest.windows(2).position(|w| w == b"\r\n")?;
        let size = usize::from_str_radix(std::str::from_utf8(&rest[..line]).ok()?, 16).ok()?;
        rest = &rest[line + 2..];
        if size == 0 {
            return (rest == b"\r\n").then_some(found);
        }
        found.push(rest.get(..size)?);
        rest = rest.get(size..)?.strip_prefix(b"\r\n")?;
    }
}

#[test]
fn events_read_together_leave_together_whole_and_in_order() {
    // The engine writes four events, `[DONE]` and the body's end at once, a chunk each; hyper's
    // client hands them to the relay a frame at a time. The relay gathers what was read
    // together (`GATHER_YIELDS`), so the client gets the first event with the answer's head and
    // the rest in one write (one chunk), none lost, repeated or reordered. The gateway runs on
    // one current-thread runtime, as `llmsched serve` runs it, so the turns are deterministic.
    let events = sse_events(4);
    let answer = format!("{CHUNKED_SSE}{}0\r\n\r\n", as_chunks(&events));
    let engine = scripted_engine(Box::leak(answer.into_boxed_str()).as_bytes());
    let (addr, counters) = one_thread_gateway(engine);
    let raw = post(addr, "/v1/completions", r#"{"prompt":"x","stream":true}"#);
    assert_eq!(raw.status(), 200);
    let body = chunks(raw.body()).expect("a complete chunked answer");
    let sent: Vec<&[u8]> = events.iter().map(|e| e.as_bytes()).collect();
    assert_eq!(body.concat(), sent.concat(), "every event once, in order");
    assert_eq!(
        body.len(),
        2,
        "{:?}",
        body.iter().map(|c| String::from_utf8_lossy(c)).collect::<Vec<_>>()
    );
    assert_eq!(body[0], sent[0], "the first event goes out with the head");
    assert_eq!(reaches(1, || counters.completed.load(Ordering::Relaxed)), 1);
    assert_eq!(counters.truncated.total(), 0);
}

/// A gateway on one current-thread runtime (as `llmsched serve` runs it, so the turns are
/// deterministic) in front of `engine`.
fn one_thread_gateway(engine: String) -> (SocketAddr, Arc<Counters>) {
    one_thread_gateway_with(config(vec![engine], "round-robin"))
}

/// [`one_thread_gateway`] with this configuration.
fn one_thread_gateway_with(config: GatewayConfig) -> (SocketAddr, Arc<Counters>) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async move {
            let handle = start(local(), config).await.unwrap();
            tx.send((handle.addr, handle.counters)).unwrap();
            std::future::pending::<()>().await
        });
    });
    rx.recv().unwrap()
}

/// `n` SSE events of a completion stream (no `finish_reason`), then `[DONE]`.
fn sse_events(n: usize) -> Vec<String> {
    let mut events: Vec<String> = (0..n)
        .map(|i| format!("data: {{\"choices\":[{{\"index\":0,\"text\":\" t{i}\",\"finish_reason\":null}}]}}\n\n"))
        .collect();
    events.push("data: [DONE]\n\n".into());
    events
}

/// `events` as the chunks of a chunked body.
fn as_chunks(events: &[String]) -> String {
    events.iter().map(|event| format!("{:x}\r\n{event}\r\n", event.len())).collect()
}

const CHUNKED_SSE: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
    transfer-encoding: chunked\r\nconnection: close\r\n\r\n";

#[test]
fn events_read_together_after_the_head_leave_together() {
    // The head and the first event in one write, then the other events, `[DONE]` and the
    // body's end in a second write, read by hyper in one read after the head's: the relay
    // counts what it was handed of that read (framing included) against the read's bytes, so
    // it keeps gathering while hyper holds more of it, and the client gets them in one write.
    let events = sse_events(3);
    let first = format!("{CHUNKED_SSE}{}", as_chunks(&events[..1]));
    let rest = format!("{}0\r\n\r\n", as_chunks(&events[1..]));
    let parts: Vec<&'static [u8]> = vec![
        Box::leak(first.into_boxed_str()).as_bytes(),
        Box::leak(rest.into_boxed_str()).as_bytes(),
    ];
    let (addr, counters) = one_thread_gateway(paced_engine(parts, Duration::from_millis(50)));
    let raw = post(addr, "/v1/completions", r#"{"prompt":"x","stream":true}"#);
    assert_eq!(raw.status(), 200);
    let body = chunks(raw.body()).expect("a complete chunked answer");
    let sent: Vec<&[u8]> = events.iter().map(|e| e.as_bytes()).collect();
    assert_eq!(body.concat(), sent.concat(), "every event once, in order");
    let shown = || body.iter().map(|c| String::from_utf8_lossy(c)).collect::<Vec<_>>();
    assert_eq!(body.len(), 2, "{:?}", shown());
    assert_eq!(body[0], sent[0], "{:?}", shown());
    assert_eq!(reaches(1, || counters.completed.load(Ordering::Relaxed)), 1);
}

#[test]
fn a_stream_that_falls_silent_after_its_timer_moved_on_is_cut() {
    // Four events 120 ms apart under a 0.3 s read timeout: the timer fires mid-stream, finds a
    // frame since, and is moved on (polled between frames only once it fires); then the
    // engine falls silent without `[DONE]` and holds the connection open for longer than the
    // client waits: only the timer can end the answer, with the events and the error event.
    let events = sse_events(4);
    let mut parts: Vec<&'static [u8]> = vec![CHUNKED_SSE.as_bytes()];
    for event in &events[..4] {
        parts.push(Box::leak(as_chunks(std::slice::from_ref(event)).into_boxed_str()).as_bytes());
    }
    let engine = lingering_engine(parts, Duration::from_millis(120), Duration::from_secs(30));
    let (addr, counters) = one_thread_gateway_with(GatewayConfig {
        read_timeout_s: Some(0.3),
        ..config(vec![engine], "round-robin")
    });
    let raw = post(addr, "/v1/completions", r#"{"prompt":"x","stream":true}"#);
    assert_eq!(raw.status(), 200);
    let body = String::from_utf8_lossy(raw.body()).to_string();
    for i in 0..4 {
        assert!(body.contains(&format!("\" t{i}\"")), "{body}");
    }
    assert!(body.contains("upstream_error") && !body.contains("[DONE]"), "{body}");
    assert_eq!(reaches(1, || counters.truncated.total()), 1);
}

#[test]
fn events_read_apart_leave_apart() {
    // Each event in a write (and a read) of its own, 30 ms apart: nothing is held for the
    // next, which is the network's; `[DONE]` and the body's end, written together, leave
    // together.
    let events = sse_events(3);
    let mut parts: Vec<&'static [u8]> = vec![CHUNKED_SSE.as_bytes()];
    for (i, event) in events.iter().enumerate() {
        let mut part = as_chunks(std::slice::from_ref(event));
        if i + 1 == events.len() {
            part.push_str("0\r\n\r\n");
        }
        parts.push(Box::leak(part.into_boxed_str()).as_bytes());
    }
    let (addr, counters) = one_thread_gateway(paced_engine(parts, Duration::from_millis(30)));
    let raw = post(addr, "/v1/completions", r#"{"prompt":"x","stream":true}"#);
    assert_eq!(raw.status(), 200);
    let body = chunks(raw.body()).expect("a complete chunked answer");
    let sent: Vec<&[u8]> = events.iter().map(|e| e.as_bytes()).collect();
    assert_eq!(body, sent, "one write an event");
    assert_eq!(reaches(1, || counters.completed.load(Ordering::Relaxed)), 1);
}

#[test]
fn a_content_length_beside_transfer_encoding_is_not_passed_on() {
    // Chunked wins (RFC 9112 6.3); the Content-Length passed on would cut the answer short.
    let (_fleet, addr, _counters) = one_scripted(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5\r\n\
          transfer-encoding: chunked\r\n\r\n11\r\n{\"choices\":[1,2]}\r\n0\r\n\r\n",
    );
    let raw = post(addr, "/v1/completions", r#"{"prompt":"x","stream":true}"#);
    assert_eq!(raw.status(), 200);
    let head = String::from_utf8_lossy(&raw.bytes).to_ascii_lowercase();
    assert!(!head.contains("content-length: 5"), "{head}");
    assert!(String::from_utf8_lossy(raw.body()).contains(r#"{"choices":[1,2]}"#), "{head}");
}

#[test]
fn a_final_informational_answer_is_no_answer() {
    let (_fleet, addr, counters) = one_scripted(
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n",
    );
    let raw = post(addr, "/v1/completions", r#"{"prompt":"x"}"#);
    assert_eq!(raw.status(), 502, "{:?}", String::from_utf8_lossy(&raw.bytes));
    assert_eq!(counters.upstream_errors.total(), 1);
}

/// Sends a request with a `len`-byte body whole before reading anything (as Python's
/// `urllib` does); the status read back, or the error sending or reading met.
fn send_whole_then_read(addr: SocketAddr, len: usize, extra: &str) -> Result<u16, String> {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n\
         Content-Length: {len}\r\nConnection: close\r\n{extra}\r\n"
    );
    stream.write_all(head.as_bytes()).map_err(|e| format!("head: {e}"))?;
    let mut body = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(len - 13)).into_bytes();
    body.truncate(len);
    stream.write_all(&body).map_err(|e| format!("body: {e}"))?;
    let mut bytes = Vec::new();
    stream.read_to_end(&mut bytes).map_err(|e| format!("answer: {e}"))?;
    Ok(Raw { bytes }.status())
}

#[test]
fn a_client_that_sends_its_whole_body_first_reads_its_early_refusal() {
    // Refused before its body is read (too large by its Content-Length, or no key): the
    // gateway reads the body meanwhile and drops it, so closing does not reset the
    // connection under a client still sending, which would never see its 413 or 401.
    let fleet = Fleet::new(vec![ok_engine()]);
    let max_body = 16 << 20;
    let (addr, _) =
        fleet.gateway(GatewayConfig { max_body, ..config(fleet.urls(), "round-robin") });
    assert_eq!(send_whole_then_read(addr, max_body + 1, ""), Ok(413));
    let keys = vec![serde_json::from_value(json!({"key": "secret-key-1", "tenant": "t"})).unwrap()];
    let (addr, _) = fleet.gateway(GatewayConfig {
        max_body: 2 * max_body,
        api_keys: keys,
        ..config(fleet.urls(), "round-robin")
    });
    assert_eq!(send_whole_then_read(addr, max_body, ""), Ok(401));
    assert_eq!(send_whole_then_read(addr, max_body, "Authorization: Bearer nope\r\n"), Ok(401));
}

#[test]
fn the_binary_refuses_unknown_flags_and_thread_counts_out_of_range() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_llmsched-gateway"))
            .args(args)
            .output()
            .expect("the binary runs");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = run(&["--bogus"]);
    assert_eq!(code, Some(2));
    assert!(err.starts_with("llmsched-gateway: unknown flag --bogus"), "{err}");
    let (code, err) = run(&["--engine", "http://127.0.0.1:9", "--bogus", "x"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("unknown flag --bogus"), "{err}");
    let (_, err) = run(&["--engine"]);
    assert!(err.contains("--engine needs a value"), "{err}");
    for threads in ["0", "65", "100000"] {
        let (code, err) = run(&["--engine", "http://127.0.0.1:9", "--threads", threads]);
        assert_eq!(code, Some(2), "{threads}");
        assert!(err.contains(&format!("--threads {threads}: must be 1 to 64")), "{err}");
    }
}
