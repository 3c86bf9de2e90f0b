//! llmsched: the decisions an LLM gateway makes on every request, fast enough for its hot path.
//!
//! One module per concept. The PyO3 layer lives in [`py`] (behind the `python` feature), so
//! `cargo test` and `cargo bench` never need a Python interpreter.

pub mod flow;
pub mod hashing;
pub mod prefix_index;
pub mod routing;
pub mod sim;
pub mod slices;
pub mod vllm_events;

#[cfg(feature = "python")]
mod py;
