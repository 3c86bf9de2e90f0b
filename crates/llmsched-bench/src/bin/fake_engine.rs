//! `llmsched-fake-engine --engines 4`: serves fake OpenAI engines on 127.0.0.1 until killed and
//! prints `{"ports": [...]}` as one line once every engine listens. See `engine` in the crate
//! docs for the answers and the faults.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use llmsched_bench::args::Args;
use llmsched_bench::engine::{self, EngineConfig, Fault, Mode};

const USAGE: &str = "llmsched-fake-engine [--engines N] [--host 127.0.0.1] [--port P (first \
port, 0 = free ones)] [--model NAME] [--answer-tokens N] [--first-token-delay-ms MS] \
[--token-delay-ms MS] [--slow-delay-ms MS] [--mode MODE] [--fault MODE:EVERY ...] \
[--max-body BYTES] [--response-store N (responses kept, the oldest dropped)] [--threads N] \
[--stamp (engine timestamps in streamed events)]\nmodes: ok drop error500 error503 stall headers slow cut hang";

fn main() {
    if let Err(problem) = run() {
        eprintln!("llmsched-fake-engine: {problem}\nusage: {USAGE}");
        std::process::exit(2);
    }
}

fn ms(value: f64, name: &str) -> Result<Duration, String> {
    Duration::try_from_secs_f64(value / 1e3).map_err(|_| format!("--{name}: must be >= 0"))
}

fn run() -> Result<(), String> {
    let args = Args::parse(std::env::args().skip(1), &["help", "stamp"])?;
    if args.switch("help") {
        println!("{USAGE}");
        return Ok(());
    }
    args.only(&[
        "engines",
        "host",
        "port",
        "model",
        "answer-tokens",
        "first-token-delay-ms",
        "token-delay-ms",
        "slow-delay-ms",
        "mode",
        "fault",
        "max-body",
        "response-store",
        "threads",
        "help",
        "stamp",
    ])?;
    let engines: usize = args.get("engines", 1)?;
    let host: IpAddr = args.get("host", IpAddr::from([127, 0, 0, 1]))?;
    let port: u16 = args.get("port", 0)?;
    let threads: usize = args.get("threads", 1)?;
    if engines == 0 || threads == 0 {
        return Err("--engines and --threads must be >= 1".into());
    }
    let config = EngineConfig {
        model: args.get("model", "fake".to_string())?,
        answer_tokens: args.get("answer-tokens", 4)?,
        first_token_delay: ms(args.get("first-token-delay-ms", 0.0)?, "first-token-delay-ms")?,
        token_delay: ms(args.get("token-delay-ms", 0.0)?, "token-delay-ms")?,
        slow_delay: ms(args.get("slow-delay-ms", 50.0)?, "slow-delay-ms")?,
        mode: args.get("mode", Mode::Ok)?,
        faults: args.all::<Fault>("fault")?,
        max_body: args.get("max-body", 16usize << 20)?,
        stamp: args.switch("stamp"),
        response_store: args.get("response-store", EngineConfig::default().response_store)?,
        ..EngineConfig::default()
    };
    let runtime = llmsched_bench::runtime(threads).map_err(|e| e.to_string())?;
    runtime.block_on(async move {
        let mut ports = Vec::with_capacity(engines);
        for i in 0..engines {
            let port = if port == 0 { 0 } else { port + i as u16 };
            let handle = engine::start(SocketAddr::new(host, port), config.clone())
                .await
                .map_err(|e| format!("cannot listen on {host}:{port}: {e}"))?;
            ports.push(handle.addr.port());
        }
        println!("{}", serde_json::json!({ "ports": ports }));
        let _ = tokio::signal::ctrl_c().await;
        Ok(())
    })
}
