//! `llmsched-gateway --engine http://127.0.0.1:8001 --engine ... --router llm-d`: the native data
//! plane in front of the engines; prints `{"listening": "HOST:PORT"}` as one line once it
//! listens, and serves until killed. See the crate docs for what it does and does not do.

use std::net::SocketAddr;

use llmsched_gateway::GatewayConfig;
use serde_json::Value;

const USAGE: &str = "llmsched-gateway --engine URL [--engine URL ...] [--listen 127.0.0.1:0] \
[--router PRESET | --router-file FILE.json] [--block-size 16] [--max-body BYTES] [--retries 2] \
[--scrape-interval-ms 200 (0: off)] [--seed 0] [--threads 1] [--config GATEWAY.json (every \
field of GatewayConfig; flags after it override)]";

fn main() {
    if let Err(problem) = run() {
        eprintln!("llmsched-gateway: {problem}\nusage: {USAGE}");
        std::process::exit(2);
    }
}

/// The flags `run` reads, each followed by its value.
const FLAGS: [&str; 11] = [
    "engine",
    "listen",
    "router",
    "router-file",
    "block-size",
    "max-body",
    "retries",
    "scrape-interval-ms",
    "seed",
    "threads",
    "config",
];

fn parse<T: std::str::FromStr>(name: &str, text: &str) -> Result<T, String> {
    text.parse().map_err(|_| format!("--{name} {text:?}: not a valid value"))
}

fn run() -> Result<(), String> {
    let mut config = GatewayConfig::default();
    let mut listen: SocketAddr = "127.0.0.1:0".parse().expect("an address");
    let mut threads = 1usize;
    let mut argv = std::env::args().skip(1);
    while let Some(flag) = argv.next() {
        if flag == "--help" {
            println!("{USAGE}");
            return Ok(());
        }
        let name =
            flag.strip_prefix("--").ok_or_else(|| format!("unexpected argument {flag:?}"))?;
        if !FLAGS.contains(&name) {
            return Err(format!("unknown flag --{name} (--help lists them)"));
        }
        let value = argv.next().ok_or_else(|| format!("--{name} needs a value"))?;
        match name {
            "engine" => config.engines.push(value.into()),
            "listen" => listen = parse(name, &value)?,
            "router" => config.router = Value::String(value),
            "router-file" => {
                let text = std::fs::read_to_string(&value)
                    .map_err(|e| format!("--router-file {value:?}: {e}"))?;
                config.router = serde_json::from_str(&text)
                    .map_err(|e| format!("--router-file {value:?}: not JSON: {e}"))?;
            }
            "block-size" => config.block_size = parse(name, &value)?,
            "max-body" => config.max_body = parse(name, &value)?,
            "retries" => config.retries = parse(name, &value)?,
            "scrape-interval-ms" => {
                let ms: u64 = parse(name, &value)?;
                config.scrape_interval_s = (ms > 0).then(|| ms as f64 / 1000.0);
            }
            "seed" => config.seed = parse(name, &value)?,
            "threads" => {
                threads = parse(name, &value)?;
                if !(1..=llmsched_gateway::MAX_THREADS).contains(&threads) {
                    let most = llmsched_gateway::MAX_THREADS;
                    return Err(format!("--threads {threads}: must be 1 to {most}"));
                }
            }
            "config" => {
                let text = std::fs::read_to_string(&value)
                    .map_err(|e| format!("--config {value:?}: {e}"))?;
                config =
                    serde_json::from_str(&text).map_err(|e| format!("--config {value:?}: {e}"))?;
            }
            _ => return Err(format!("unknown flag --{name}")),
        }
    }
    let runtime = llmsched_gateway::runtime_builder(threads)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async move {
        let handle = llmsched_gateway::start(listen, config).await.map_err(|e| e.to_string())?;
        println!("{}", serde_json::json!({ "listening": handle.addr.to_string() }));
        let _ = tokio::signal::ctrl_c().await;
        Ok(())
    })
}
