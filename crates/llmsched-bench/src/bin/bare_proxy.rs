//! `llmsched-bare-proxy --engine http://127.0.0.1:8001 --engine ... --listen 127.0.0.1:0`: the
//! reference proxy of the gateway benchmark (see `bare` in the crate docs); prints
//! `{"listening": "HOST:PORT"}` as one line once it listens, and serves until killed.

use std::net::SocketAddr;

use llmsched_bench::args::Args;

const USAGE: &str = "llmsched-bare-proxy --engine http://HOST:PORT [--engine ...] \
[--listen 127.0.0.1:0]";

fn main() {
    if let Err(problem) = run() {
        eprintln!("llmsched-bare-proxy: {problem}\nusage: {USAGE}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), String> {
    let args = Args::parse(std::env::args().skip(1), &["help"])?;
    if args.switch("help") {
        println!("{USAGE}");
        return Ok(());
    }
    args.only(&["engine", "listen", "help"])?;
    let engines = args
        .all::<String>("engine")?
        .iter()
        .map(|url| {
            url.strip_prefix("http://")
                .and_then(|a| a.trim_end_matches('/').parse::<SocketAddr>().ok())
                .ok_or_else(|| format!("--engine {url:?}: not http://IP:PORT"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if engines.is_empty() {
        return Err("at least one --engine is needed".into());
    }
    let listen: SocketAddr = args.get("listen", "127.0.0.1:0".parse().expect("an address"))?;
    let runtime = llmsched_bench::runtime(1).map_err(|e| e.to_string())?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        println!("{}", serde_json::json!({ "listening": addr.to_string() }));
        llmsched_bench::bare::serve(listener, &engines).await;
        Ok(())
    })
}
