//! `llmsched-loadgen --url http://127.0.0.1:8000 --rate 1000 --duration 5 [--stream]`: an open-loop
//! load at a fixed rate; prints a summary, or with `--json` one JSON line (see `load` in the
//! crate docs for what is measured).

use std::time::Duration;

use llmsched_bench::args::Args;
use llmsched_bench::load::{self, Arrivals, LoadConfig};

const USAGE: &str = "llmsched-loadgen --url URL [--url URL ...] [--rate R] [--duration S] \
[--warmup S] [--arrivals poisson|uniform] [--chat] [--responses (conversations on \
/v1/responses)] [--turns N (requests per conversation)] [--system-prompts N] [--stream] [--model NAME] [--max-tokens N] \
[--prompt-words N] [--sessions N] [--timeout-s S] [--max-in-flight N] [--cpu LABEL=PID ...] \
[--seed N] [--threads N] [--slow-streams N (the N slowest stamped streams, event by event, \
in the JSON)] [--json]";

fn main() {
    match run() {
        Ok(()) => {}
        Err(problem) => {
            eprintln!("llmsched-loadgen: {problem}\nusage: {USAGE}");
            std::process::exit(2);
        }
    }
}

fn run() -> Result<(), String> {
    let args =
        Args::parse(std::env::args().skip(1), &["chat", "responses", "stream", "json", "help"])?;
    if args.switch("help") {
        println!("{USAGE}");
        return Ok(());
    }
    args.only(&[
        "url",
        "rate",
        "duration",
        "warmup",
        "arrivals",
        "chat",
        "responses",
        "turns",
        "system-prompts",
        "stream",
        "model",
        "max-tokens",
        "prompt-words",
        "sessions",
        "timeout-s",
        "max-in-flight",
        "cpu",
        "seed",
        "threads",
        "slow-streams",
        "json",
        "help",
    ])?;
    let defaults = LoadConfig::default();
    let mut cpu_pids = Vec::new();
    for spec in args.all::<String>("cpu")? {
        let (label, pid) =
            spec.split_once('=').ok_or_else(|| format!("--cpu {spec:?}: not LABEL=PID"))?;
        let pid: u32 = pid.parse().map_err(|_| format!("--cpu {spec:?}: PID is not a number"))?;
        cpu_pids.push((label.to_string(), pid));
    }
    let timeout: f64 = args.get("timeout-s", defaults.timeout.as_secs_f64())?;
    let config = LoadConfig {
        urls: args.all("url")?,
        rate: args.get("rate", defaults.rate)?,
        duration: args.get("duration", defaults.duration)?,
        warmup: args.get("warmup", defaults.warmup)?,
        arrivals: args.get("arrivals", Arrivals::Poisson)?,
        chat: args.switch("chat"),
        responses: args.switch("responses"),
        turns: args.get("turns", defaults.turns)?,
        system_prompts: args.get("system-prompts", defaults.system_prompts)?,
        stream: args.switch("stream"),
        model: args.get("model", defaults.model.clone())?,
        max_tokens: args.get("max-tokens", defaults.max_tokens)?,
        prompt_words: args.get("prompt-words", defaults.prompt_words)?,
        sessions: args.get("sessions", defaults.sessions)?,
        timeout: Duration::try_from_secs_f64(timeout).map_err(|_| "--timeout-s: must be >= 0")?,
        max_in_flight: args.get("max-in-flight", defaults.max_in_flight)?,
        cpu_pids,
        seed: args.get("seed", defaults.seed)?,
        slow_streams: args.get("slow-streams", defaults.slow_streams)?,
    };
    let threads: usize = args.get("threads", 1)?;
    let runtime = llmsched_bench::runtime(threads.max(1)).map_err(|e| e.to_string())?;
    let report = runtime.block_on(load::run(config))?;
    if args.switch("json") {
        println!("{}", serde_json::to_string(&report).expect("a report serialises"));
    } else {
        println!(
            "scheduled {} ok {} errors {:?} rate {:.0}/s\nlatency ms {:?}\nttft ms {:?}\n\
             itl ms {:?}\nlag ms {:?}\ncpu ms/request {:?}",
            report.scheduled,
            report.ok,
            report.errors,
            report.achieved_rate,
            report.latency_ms,
            report.ttft_ms,
            report.itl_ms,
            report.lag_ms,
            report.cpu_ms_per_request
        );
        if let Some(counts) = &report.conversations {
            println!(
                "conversations {} continuations {} lost (404) {} ids unread {}",
                counts.started, counts.continuations, counts.continuations_lost, counts.ids_unread
            );
        }
    }
    Ok(())
}
