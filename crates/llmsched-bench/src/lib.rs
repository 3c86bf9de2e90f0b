//! The gateway benchmark harness: a native fake OpenAI engine ([`engine`]) and an open-loop
//! load generator ([`load`]), each behind a binary (`llmsched-fake-engine`,
//! `llmsched-loadgen`). `tools/bench_gateway_peers.py` drives them in front of `llmsched serve`
//! and the Rust routers it is compared with.

pub mod args;
pub mod engine;
pub mod load;
