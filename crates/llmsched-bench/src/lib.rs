//! The gateway benchmark harness: a native fake OpenAI engine ([`engine`]), an open-loop
//! load generator ([`load`]) and a reference proxy ([`bare`]), each behind a binary
//! (`llmsched-fake-engine`, `llmsched-loadgen`, `llmsched-bare-proxy`). `tools/bench_gateway_peers.py` drives them in front of `llmsched serve`
//! and the Rust routers it is compared with.

pub mod args;
pub mod bare;
pub mod engine;
pub mod load;
pub mod stamp;

/// A tokio runtime of `threads` threads: one thread is a current-thread runtime (everything on
/// the thread that runs it, no cross-thread wake-ups), more a multi-thread one.
pub fn runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(threads);
        builder
    };
    builder.enable_all().build()
}
