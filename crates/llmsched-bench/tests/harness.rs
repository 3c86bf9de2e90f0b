//! The fake engine and the load generator over loopback, driven through their binaries: what
//! the engine answers (streams end with `[DONE]`, faults happen as scripted, bounds hold) and
//! what the generator counts (successes, each kind of error). No timing is asserted.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Fake engines in a child process, killed on drop.
struct Engines {
    child: Child,
    ports: Vec<u16>,
}

impl Engines {
    fn start(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_llmsched-fake-engine"))
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("the fake engine starts");
        let ports = first_line(&mut child);
        let ports = ports["ports"].as_array().unwrap().iter().map(|p| p.as_u64().unwrap() as u16);
        Engines { ports: ports.collect(), child }
    }
}

/// The JSON line a child prints once it listens.
fn first_line(child: &mut Child) -> Value {
    let mut line = Vec::new();
    let stdout = child.stdout.as_mut().unwrap();
    let mut byte = [0u8; 1];
    while stdout.read(&mut byte).expect("reads the first line") == 1 && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    serde_json::from_slice(&line).expect("a JSON line")
}

impl Drop for Engines {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request on a fresh connection (`Connection: close`); the raw answer up to the close, or
/// up to a read that waits longer than `patience` (then `timed_out`).
struct Raw {
    bytes: Vec<u8>,
    timed_out: bool,
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

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(self.body()).expect("a JSON body")
    }
}

fn connect(port: u16) -> TcpStream {
    TcpStream::connect(("127.0.0.1", port)).expect("connects")
}

fn request(port: u16, method: &str, path: &str, body: &str) -> Raw {
    request_on(&mut connect(port), method, path, body, Duration::from_secs(10))
}

fn request_on(
    stream: &mut TcpStream,
    method: &str,
    path: &str,
    body: &str,
    patience: Duration,
) -> Raw {
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body.as_bytes()).unwrap();
    stream.set_read_timeout(Some(patience)).unwrap();
    let mut bytes = Vec::new();
    let mut buffer = [0u8; 8192];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return Raw { bytes, timed_out: false },
            Ok(n) => bytes.extend_from_slice(&buffer[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Raw { bytes, timed_out: true };
            }
            Err(_) => return Raw { bytes, timed_out: false },
        }
    }
}

/// The data payloads of a chunked SSE answer, in order.
fn events(raw: &Raw) -> Vec<String> {
    let text = String::from_utf8_lossy(raw.body()).into_owned();
    text.lines()
        .filter(|line| line.starts_with("data: "))
        .map(|line| line["data: ".len()..].to_string())
        .collect()
}

fn stats(port: u16) -> Value {
    request(port, "GET", "/stats", "").json()
}

/// Polls `/stats` until `field` reaches `want` (a bounded wait for the engine to notice a
/// client leaving; the value, not the time it took, is what is checked).
fn stat_reaches(port: u16, field: &str, want: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let seen = stats(port)[field].as_u64().unwrap();
        if seen >= want || Instant::now() > deadline {
            return seen;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn streams_end_with_done_and_carry_the_asked_tokens() {
    let engines = Engines::start(&["--model", "tiny", "--answer-tokens", "6"]);
    let port = engines.ports[0];
    let body = r#"{"model":"tiny","prompt":"hi","stream":true,"max_tokens":3}"#;
    let raw = request(port, "POST", "/v1/completions", body);
    assert_eq!(raw.status(), 200);
    assert!(raw.text().to_ascii_lowercase().contains("content-type: text/event-stream"));
    let streamed = events(&raw);
    assert_eq!(streamed.last().map(String::as_str), Some("[DONE]"));
    let texts: Vec<String> = streamed[..streamed.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].to_string())
        .collect();
    assert_eq!(texts, [r#"" t0""#, r#"" t1""#, r#"" t2""#]);

    let chat = r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"stream":true,
                   "stream_options":{"include_usage":true}}"#;
    let events = events(&request(port, "POST", "/v1/chat/completions", chat));
    assert_eq!(events.len(), 6 + 2, "six tokens, the usage event and [DONE]");
    assert_eq!(events[7], "[DONE]");
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["content"], " t0");
    let usage: Value = serde_json::from_str(&events[6]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    assert_eq!(stats(port)["completed"], 2);
}

#[test]
fn json_answers_continue_the_count_and_report_usage() {
    let engines = Engines::start(&["--model", "tiny"]);
    let port = engines.ports[0];
    let answer = request(port, "POST", "/v1/completions", r#"{"model":"tiny","prompt":"a t0 t1"}"#);
    assert_eq!(answer.status(), 200);
    let answer = answer.json();
    assert_eq!(answer["choices"][0]["text"], " t2 t3 t4 t5");
    assert_eq!(answer["usage"]["completion_tokens"], 4);
    let ids = r#"{"model":"tiny","prompt":[1,2,1000],"max_tokens":2,"return_token_ids":true}"#;
    let answer = request(port, "POST", "/v1/completions", ids).json();
    assert_eq!(answer["choices"][0]["token_ids"], serde_json::json!([1001, 1002]));
    let chat = r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"max_tokens":1}"#;
    let answer = request(port, "POST", "/v1/chat/completions", chat).json();
    assert_eq!(answer["choices"][0]["message"]["content"], " t0");
    assert_eq!(answer["object"], "chat.completion");
}

#[test]
fn serves_models_health_and_vllm_metrics() {
    let engines = Engines::start(&["--engines", "2", "--model", "tiny"]);
    assert_eq!(engines.ports.len(), 2);
    assert_ne!(engines.ports[0], engines.ports[1]);
    let port = engines.ports[1];
    assert_eq!(request(port, "GET", "/health", "").status(), 200);
    assert_eq!(request(port, "GET", "/v1/models", "").json()["data"][0]["id"], "tiny");
    request(port, "POST", "/v1/completions", r#"{"model":"tiny","prompt":"x"}"#);
    let metrics = request(port, "GET", "/metrics", "").text();
    assert!(metrics.contains("vllm:num_requests_running{model_name=\"tiny\"} 0.0"), "{metrics}");
    assert!(metrics.contains("vllm:kv_cache_usage_perc{model_name=\"tiny\"}"), "{metrics}");
    assert!(metrics.contains("vllm:generation_tokens_total{model_name=\"tiny\"} 4.0"), "{metrics}");
    assert_eq!(request(port, "GET", "/nowhere", "").status(), 404);
}

#[test]
fn refuses_what_vllm_refuses_and_bounds_the_body() {
    let engines = Engines::start(&["--max-body", "200"]);
    let port = engines.ports[0];
    for (path, body) in [
        ("/v1/completions", r#"{"prompt":"x","max_tokens":0}"#),
        ("/v1/completions", r#"{"prompt":"x","stream":"yes"}"#),
        ("/v1/completions", r#"{"max_tokens":2}"#),
        ("/v1/chat/completions", r#"{"messages":"hello"}"#),
        ("/v1/completions", "not json"),
        ("/v1/completions", r#"{"prompt":"x","x_fake_mode":"explode"}"#),
    ] {
        let raw = request(port, "POST", path, body);
        assert_eq!(raw.status(), 400, "{body}: {}", raw.text());
        assert!(raw.json()["error"]["message"].is_string());
    }
    let big = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(500));
    assert_eq!(request(port, "POST", "/v1/completions", &big).status(), 413);
    let counted = stats(port);
    assert_eq!((counted["received"].as_u64(), counted["rejected"].as_u64()), (Some(0), Some(7)));
}

#[test]
fn faults_happen_as_scripted() {
    let engines = Engines::start(&[]);
    let port = engines.ports[0];
    let with = |mode: &str, stream: bool| {
        format!(r#"{{"prompt":"x","stream":{stream},"x_fake_mode":"{mode}"}}"#)
    };
    let raw = request(port, "POST", "/v1/completions", &with("error500", false));
    assert_eq!(raw.status(), 500);
    assert_eq!(request(port, "POST", "/v1/completions", &with("error503", true)).status(), 503);

    // drop: the connection closes with no answer at all.
    let raw = request(port, "POST", "/v1/completions", &with("drop", false));
    assert!(raw.bytes.is_empty() && !raw.timed_out, "{}", raw.text());

    // cut, streamed: the status and the first event, then a close without [DONE].
    let raw = request(port, "POST", "/v1/completions", &with("cut", true));
    assert!(!raw.timed_out);
    assert_eq!(raw.status(), 200);
    let cut = events(&raw);
    assert_eq!(cut.len(), 1, "{}", raw.text());
    assert!(cut[0].contains(" t0"));

    // cut, JSON: less than the declared length arrives before the close.
    let raw = request(port, "POST", "/v1/completions", &with("cut", false));
    let text = raw.text().to_ascii_lowercase();
    let declared: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|n| n.trim().parse().ok())
        .expect("a declared length");
    assert!(!raw.timed_out && !raw.body().is_empty() && raw.body().len() < declared);

    // hang: the first event, then silence (the connection stays open).
    let patience = Duration::from_millis(300);
    let raw =
        request_on(&mut connect(port), "POST", "/v1/completions", &with("hang", true), patience);
    assert!(raw.timed_out);
    assert_eq!(events(&raw).len(), 1);

    // headers: the status line and headers, then silence.
    let raw =
        request_on(&mut connect(port), "POST", "/v1/completions", &with("headers", true), patience);
    assert!(raw.timed_out && raw.status() == 200 && raw.body().is_empty(), "{}", raw.text());

    // stall: nothing at all until the client leaves, which the engine counts.
    let before = stats(port)["disconnects"].as_u64().unwrap();
    let mut stream = connect(port);
    let raw = request_on(&mut stream, "POST", "/v1/completions", &with("stall", false), patience);
    assert!(raw.timed_out && raw.bytes.is_empty());
    stream.shutdown(Shutdown::Both).unwrap();
    drop(stream);
    assert!(stat_reaches(port, "disconnects", before + 1) > before);
    assert_eq!(stats(port)["faults"], 8);
}

#[test]
fn every_nth_request_faults_when_scripted() {
    let engines = Engines::start(&["--fault", "error503:3", "--fault", "drop:5"]);
    let port = engines.ports[0];
    let statuses: Vec<u16> = (0..10)
        .map(|_| request(port, "POST", "/v1/completions", r#"{"prompt":"x"}"#).status())
        .collect();
    // 3, 6 and 9 answer 503; 5 and 10 drop (status 0: no answer).
    assert_eq!(statuses, [200, 200, 503, 200, 0, 503, 200, 200, 503, 0]);
}

#[test]
fn unknown_fault_flags_are_refused() {
    for args in
        [&["--fault", "error500"][..], &["--fault", "boom:2"], &["--mode", "x"], &["--nope", "1"]]
    {
        let out =
            Command::new(env!("CARGO_BIN_EXE_llmsched-fake-engine")).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(!out.stderr.is_empty());
    }
}

/// The named events of a Responses stream: (name, data) in order.
fn named_events(raw: &Raw) -> Vec<(String, Value)> {
    let text = String::from_utf8_lossy(raw.body()).into_owned();
    let mut found = Vec::new();
    let mut name = String::new();
    for line in text.lines() {
        if let Some(event) = line.strip_prefix("event: ") {
            name = event.to_string();
        } else if let Some(data) = line.strip_prefix("data: ") {
            found.push((std::mem::take(&mut name), serde_json::from_str(data).expect("JSON data")));
        }
    }
    found
}

#[test]
fn responses_answer_json_with_the_id_first_and_store_it() {
    let engines = Engines::start(&["--model", "tiny", "--answer-tokens", "4"]);
    let port = engines.ports[0];
    let body = r#"{"model":"tiny","input":"hi","instructions":"be brief","max_output_tokens":3}"#;
    let raw = request(port, "POST", "/v1/responses", body);
    assert_eq!(raw.status(), 200, "{}", raw.text());
    assert!(raw.body().starts_with(b"{\"id\":\"resp_"), "{}", raw.text());
    let answer = raw.json();
    assert_eq!(answer["object"], "response");
    assert_eq!(answer["status"], "completed");
    assert_eq!(answer["instructions"], "be brief");
    assert_eq!(answer["output"][0]["type"], "message");
    assert_eq!(answer["output"][0]["content"][0]["text"], " t0 t1 t2");
    assert_eq!(answer["usage"]["output_tokens"], 3);
    let usage = &answer["usage"];
    assert_eq!(usage["total_tokens"].as_u64(), Some(usage["input_tokens"].as_u64().unwrap() + 3));
    // Kept: GET answers it as it was sent.
    let id = answer["id"].as_str().unwrap();
    let got = request(port, "GET", &format!("/v1/responses/{id}"), "");
    assert_eq!(got.status(), 200);
    assert_eq!(got.json(), answer);
    let missing = request(port, "GET", "/v1/responses/resp_none", "");
    assert_eq!(missing.status(), 404);
    // "store": false: answered, not kept.
    let unstored = request(port, "POST", "/v1/responses", r#"{"input":"x","store":false}"#).json();
    let path = format!("/v1/responses/{}", unstored["id"].as_str().unwrap());
    assert_eq!(request(port, "GET", &path, "").status(), 404);
    let counted = stats(port);
    assert_eq!(counted["responses"], 2);
    assert_eq!(counted["retrievals"], 1);
    assert_eq!(counted["retrievals_missed"], 2);
    assert_eq!(counted["stored"], 1);
    // Input items as messages are taken; what vLLM refuses is a 400.
    let items = r#"{"input":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(request(port, "POST", "/v1/responses", items).status(), 200);
    for bad in [r#"{"input":3}"#, r#"{"input":"x","max_output_tokens":0}"#, "[]"] {
        assert_eq!(request(port, "POST", "/v1/responses", bad).status(), 400, "{bad}");
    }
    assert_eq!(request(port, "GET", "/v1/responses", "").status(), 405);
}

#[test]
fn responses_stream_named_events_ending_with_completed() {
    let engines = Engines::start(&["--answer-tokens", "3", "--stamp"]);
    let port = engines.ports[0];
    let raw = request(port, "POST", "/v1/responses", r#"{"input":"hi","stream":true}"#);
    assert_eq!(raw.status(), 200);
    assert!(raw.text().to_ascii_lowercase().contains("content-type: text/event-stream"));
    assert!(!raw.text().contains("[DONE]"), "no [DONE] in a Responses stream");
    let streamed = named_events(&raw);
    let names: Vec<&str> = streamed.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.completed",
        ]
    );
    for (i, (name, data)) in streamed.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], i);
        assert!(data["x_sent_ns"].as_u64().is_some(), "stamped: {data}");
    }
    // The id comes first in the first event.
    let first = raw.body().windows(6).position(|w| w == b"data: ").unwrap();
    assert!(raw.body()[first..].starts_with(b"data: {\"response\":{\"id\":\"resp_"));
    let id = &streamed[0].1["response"]["id"];
    let completed = &streamed[6].1["response"];
    assert_eq!(&completed["id"], id);
    assert_eq!(completed["output"][0]["content"][0]["text"], " t0 t1 t2");
    assert_eq!(completed["usage"]["output_tokens"], 3);
    let deltas: Vec<&str> =
        streamed[2..5].iter().map(|(_, d)| d["delta"].as_str().unwrap()).collect();
    assert_eq!(deltas, [" t0", " t1", " t2"]);
    let path = format!("/v1/responses/{}", id.as_str().unwrap());
    assert_eq!(request(port, "GET", &path, "").json()["status"], "completed");
    // A scripted cut: the first event, then the close.
    let cut = request(
        port,
        "POST",
        "/v1/responses",
        r#"{"input":"x","stream":true,"x_fake_mode":"cut"}"#,
    );
    assert_eq!(named_events(&cut).len(), 1);
    // Broken off before its `response.completed`: never stored (vLLM stores a stream as it
    // completes, just before that event).
    let cut_id = named_events(&cut)[0].1["response"]["id"].as_str().unwrap().to_string();
    assert_eq!(request(port, "GET", &format!("/v1/responses/{cut_id}"), "").status(), 404);
}

#[test]
fn a_stored_response_asked_as_a_stream_is_cut_after_the_head_as_vllm_does() {
    let engines = Engines::start(&["--answer-tokens", "2"]);
    let port = engines.ports[0];
    let made = request(port, "POST", "/v1/responses", r#"{"input":"hi"}"#).json();
    let path = format!("/v1/responses/{}", made["id"].as_str().unwrap());
    // vLLM replays the events of background streams only: for any other response its
    // generator fails after the head, and the connection closes mid-body.
    for query in ["?stream=true", "?starting_after=0&stream=1"] {
        let raw = request(port, "GET", &format!("{path}{query}"), "");
        assert_eq!(raw.status(), 200, "{}", raw.text());
        assert!(raw.text().to_ascii_lowercase().contains("content-type: text/event-stream"));
        assert!(!raw.timed_out, "the connection closes");
        assert!(!raw.body().ends_with(b"0\r\n\r\n"), "the chunked body never ends");
    }
    assert_eq!(request(port, "GET", &format!("{path}?stream=false"), "").json(), made);
    assert_eq!(request(port, "GET", &format!("{path}?stream=maybe"), "").status(), 400);
    assert_eq!(request(port, "GET", "/v1/responses/resp_none?stream=true", "").status(), 404);
}

#[test]
fn continuations_reach_only_the_engine_that_holds_them() {
    let engines = Engines::start(&["--engines", "2"]);
    let (a, b) = (engines.ports[0], engines.ports[1]);
    let first = request(a, "POST", "/v1/responses", r#"{"input":"hi"}"#).json();
    let id = first["id"].as_str().unwrap();
    let next = format!(r#"{{"input":"go on","previous_response_id":"{id}"}}"#);
    let held = request(a, "POST", "/v1/responses", &next);
    assert_eq!(held.status(), 200);
    assert_eq!(held.json()["previous_response_id"], id);
    // The other engine never made it: vLLM's 404.
    let lost = request(b, "POST", "/v1/responses", &next);
    assert_eq!(lost.status(), 404);
    let error = &lost.json()["error"];
    assert_eq!(error["message"], format!("Response with id '{id}' not found."));
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(error["param"], "response_id");
    assert_eq!(error["code"], 404);
    let (sa, sb) = (stats(a), stats(b));
    assert_eq!(
        (sa["continuations"].as_u64(), sa["continuations_missed"].as_u64()),
        (Some(1), Some(0))
    );
    assert_eq!(
        (sb["continuations"].as_u64(), sb["continuations_missed"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(sb["responses"], 0);
    // A bounded store forgets the oldest.
    let small = Engines::start(&["--response-store", "1"]);
    let port = small.ports[0];
    let old = request(port, "POST", "/v1/responses", r#"{"input":"1"}"#).json();
    request(port, "POST", "/v1/responses", r#"{"input":"2"}"#);
    let path = format!("/v1/responses/{}", old["id"].as_str().unwrap());
    assert_eq!(request(port, "GET", &path, "").status(), 404);
}

fn load(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_llmsched-loadgen"))
        .args(["--json", "--warmup", "0"])
        .args(args)
        .output()
        .expect("the load generator runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("a JSON report")
}

fn url(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

#[test]
fn the_generator_counts_successes_and_measures_streams() {
    let engines = Engines::start(&["--engines", "2", "--answer-tokens", "5"]);
    let (a, b) = (url(engines.ports[0]), url(engines.ports[1]));
    let report = load(&[
        "--url",
        &a,
        "--url",
        &b,
        "--rate",
        "200",
        "--duration",
        "0.5",
        "--arrivals",
        "uniform",
        "--stream",
        "--max-tokens",
        "5",
        "--chat",
    ]);
    let scheduled = report["scheduled"].as_u64().unwrap();
    assert_eq!(scheduled, 100);
    assert_eq!(report["ok"].as_u64(), Some(scheduled));
    assert_eq!(report["errors"], serde_json::json!({}));
    assert_eq!(report["latency_ms"]["n"].as_u64(), Some(scheduled));
    // Five tokens: four gaps per stream.
    assert_eq!(report["itl_ms"]["n"].as_u64(), Some(4 * scheduled));
    let served: u64 = engines.ports.iter().map(|&p| stats(p)["completed"].as_u64().unwrap()).sum();
    assert_eq!(served, scheduled);
    assert_eq!(stats(engines.ports[0])["completed"].as_u64(), Some(scheduled / 2));
}

#[test]
fn the_generator_holds_conversations_on_the_responses_api() {
    let engines = Engines::start(&["--engines", "2", "--answer-tokens", "3"]);
    let (a, b) = (url(engines.ports[0]), url(engines.ports[1]));
    let common = ["--rate", "200", "--duration", "0.5", "--arrivals", "uniform", "--responses"];
    for stream in [false, true] {
        let mut args = vec!["--url", &a, "--url", &b, "--turns", "3"];
        args.extend(common);
        if stream {
            args.push("--stream");
        }
        let report = load(&args);
        assert_eq!(report["scheduled"], 100);
        assert_eq!(report["ok"], 100, "{report}");
        let counts = &report["conversations"];
        // Each conversation stays on its first turn's URL: none is lost.
        assert_eq!(counts["continuations_lost"], 0, "{report}");
        assert_eq!(counts["ids_unread"], 0, "{report}");
        let started = counts["started"].as_u64().unwrap();
        let continued = counts["continuations"].as_u64().unwrap();
        assert_eq!(started + continued, 100);
        assert!(continued > 0 && continued <= 2 * started, "{report}");
        if stream {
            // Three deltas: two gaps per stream.
            assert_eq!(report["itl_ms"]["n"].as_u64(), Some(200));
        }
    }
    let continuations: u64 =
        engines.ports.iter().map(|&p| stats(p)["continuations"].as_u64().unwrap()).sum();
    assert!(continuations > 0);
    assert!(engines.ports.iter().all(|&p| stats(p)["continuations_missed"] == 0));

    // An engine that keeps nothing: every continuation is lost, and its conversation ends.
    let forgetful = Engines::start(&["--response-store", "0"]);
    let mut args = vec!["--url".to_string(), url(forgetful.ports[0])];
    args.extend(common.iter().map(|a| a.to_string()));
    let report = load(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let counts = &report["conversations"];
    let lost = counts["continuations_lost"].as_u64().unwrap();
    assert!(lost > 0, "{report}");
    assert_eq!(counts["continuations"].as_u64(), Some(lost));
    assert_eq!(report["errors"]["status_404"].as_u64(), Some(lost));
    assert_eq!(stats(forgetful.ports[0])["continuations_missed"].as_u64(), Some(lost));
    // The other modes report no conversations.
    let plain = load(&["--url", &a, "--rate", "100", "--duration", "0.1"]);
    assert!(plain.get("conversations").is_none());
}

#[test]
fn the_generator_counts_each_kind_of_error() {
    let engines = Engines::start(&["--fault", "error500:4"]);
    let report = load(&[
        "--url",
        &url(engines.ports[0]),
        "--rate",
        "100",
        "--duration",
        "0.4",
        "--arrivals",
        "uniform",
    ]);
    assert_eq!(report["scheduled"], 40);
    assert_eq!(report["errors"], serde_json::json!({"status_500": 10}));
    assert_eq!(report["ok"], 30);

    let engines = Engines::start(&["--fault", "cut:2"]);
    let report = load(&[
        "--url",
        &url(engines.ports[0]),
        "--rate",
        "100",
        "--duration",
        "0.4",
        "--arrivals",
        "uniform",
        "--stream",
    ]);
    assert_eq!(report["ok"], 20);
    let errors = report["errors"].as_object().unwrap();
    let broken: u64 = errors.values().map(|n| n.as_u64().unwrap()).sum();
    assert_eq!(broken, 20, "{errors:?}");
    assert!(errors.keys().all(|k| k == "body" || k == "incomplete"), "{errors:?}");

    let engines = Engines::start(&["--mode", "stall"]);
    let report = load(&[
        "--url",
        &url(engines.ports[0]),
        "--rate",
        "50",
        "--duration",
        "0.2",
        "--arrivals",
        "uniform",
        "--timeout-s",
        "0.2",
    ]);
    assert_eq!(report["errors"], serde_json::json!({"timeout": 10}));

    // Nothing listens on a port the engines held: every request fails to connect.
    let closed = engines.ports[0];
    drop(engines);
    let report = load(&["--url", &url(closed), "--rate", "50", "--duration", "0.2"]);
    assert_eq!(report["ok"], 0);
    assert_eq!(report["errors"]["connect"], report["scheduled"]);
}

#[test]
fn the_generator_reports_cpu_per_request_of_a_process() {
    let engines = Engines::start(&[]);
    let pid = engines.child.id().to_string();
    let report = load(&[
        "--url",
        &url(engines.ports[0]),
        "--rate",
        "100",
        "--duration",
        "0.3",
        "--cpu",
        &format!("engine={pid}"),
    ]);
    assert!(report["cpu_ms_per_request"]["engine"].as_f64().is_some_and(|ms| ms >= 0.0));
    let out = Command::new(env!("CARGO_BIN_EXE_llmsched-loadgen"))
        .args(["--url", "http://127.0.0.1:1", "--cpu", "nolabel"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn the_bare_proxy_relays_json_and_streams_to_each_engine_in_turn() {
    let engines = Engines::start(&["--engines", "2", "--answer-tokens", "3"]);
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_llmsched-bare-proxy"))
        .args(["--engine", &url(engines.ports[0]), "--engine", &url(engines.ports[1])])
        .args(["--engine", &url(closed)])
        .stdout(Stdio::piped())
        .spawn()
        .expect("the proxy starts");
    let listening = first_line(&mut child);
    let port: u16 =
        listening["listening"].as_str().unwrap().rsplit(':').next().unwrap().parse().unwrap();
    // Through the proxy, with the load generator's keep-alive connections: the two engines
    // answer, the unreachable third is a 502.
    let report = load(&["--url", &url(port), "--rate", "60", "--duration", "0.5", "--stream"]);
    let statuses = report["errors"].as_object().unwrap();
    assert!(report["ok"].as_u64().unwrap() > 0, "{report}");
    assert!(statuses.keys().all(|k| k == "status_502"), "{report}");
    let json = request(port, "POST", "/v1/completions", r#"{"prompt":"x","max_tokens":3}"#);
    assert!(matches!(json.status(), 200 | 502), "{}", json.text());
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn stamped_streams_carry_the_engine_clock_and_the_generator_reads_it() {
    let engines = Engines::start(&["--model", "tiny", "--answer-tokens", "3", "--stamp"]);
    let port = engines.ports[0];
    let body = r#"{"model":"tiny","prompt":"hi","stream":true,"max_tokens":3}"#;
    let streamed = events(&request(port, "POST", "/v1/completions", body));
    assert_eq!(streamed.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> =
        streamed[..streamed.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks.len(), 3);
    let received = chunks[0]["x_received_ns"].as_u64().unwrap();
    let mut last = received;
    for chunk in &chunks {
        assert_eq!(chunk["x_received_ns"].as_u64(), Some(received), "one reading per request");
        let sent = chunk["x_sent_ns"].as_u64().unwrap();
        assert!(sent >= last, "sent after the request was read, in order");
        last = sent;
    }
    // A JSON answer is left as it was (its declared length holds).
    let json = request(port, "POST", "/v1/completions", r#"{"model":"tiny","prompt":"hi"}"#);
    assert_eq!(json.status(), 200);
    assert!(!json.text().contains("x_sent_ns"));

    let engine_url = url(port);
    let stream_args = [
        "--url",
        &engine_url,
        "--rate",
        "100",
        "--duration",
        "0.3",
        "--arrivals",
        "uniform",
        "--stream",
        "--max-tokens",
        "3",
    ];
    let report = load(&stream_args);
    let ok = report["ok"].as_u64().unwrap();
    assert_eq!(ok, 30);
    assert_eq!(report["net_latency_ms"]["n"].as_u64(), Some(ok));
    assert_eq!(report["forward_ms"]["n"].as_u64(), Some(ok));
    assert_eq!(report["relay_ms"]["n"].as_u64(), Some(3 * ok), "every token event");
    // The net latency leaves the engine's schedule out: never more than the latency.
    assert!(report["net_latency_ms"]["p50"].as_f64() <= report["latency_ms"]["p50"].as_f64());

    assert!(report.get("slow_streams").is_none(), "only when asked");

    // --slow-streams: the slowest streams, slowest first, event by event.
    let report = load(&[&stream_args[..], &["--slow-streams", "4"]].concat());
    let slow = report["slow_streams"].as_array().unwrap();
    assert_eq!(slow.len(), 4);
    let nets: Vec<f64> = slow.iter().map(|s| s["net_ms"].as_f64().unwrap()).collect();
    assert!(nets.windows(2).all(|w| w[0] >= w[1]), "slowest first: {nets:?}");
    assert!((nets[0] - report["net_latency_ms"]["max"].as_f64().unwrap()).abs() < 1e-3);
    for stream in slow {
        assert_eq!(stream["relay_ms"].as_array().unwrap().len(), 3);
        assert_eq!(stream["engine_gap_ms"].as_array().unwrap().len(), 2);
        assert!(stream["started_ns"].as_u64().unwrap() > 0);
        let parts = stream["forward_ms"].as_f64().unwrap()
            + stream["relay_ms"][2].as_f64().unwrap()
            + stream["tail_ms"].as_f64().unwrap();
        assert!((parts - stream["net_ms"].as_f64().unwrap()).abs() < 1e-6);
    }

    // Unstamped streams report no stamped figures.
    let plain = Engines::start(&["--model", "tiny"]);
    let report =
        load(&["--url", &url(plain.ports[0]), "--rate", "100", "--duration", "0.2", "--stream"]);
    assert_eq!(report["net_latency_ms"]["n"], 0);
    assert_eq!(report["relay_ms"]["n"], 0);
}
