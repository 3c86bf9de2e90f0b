#![doc = include_str!("../README.md")]

pub mod buffer_pool;
pub mod flow;
pub mod hashing;
pub mod prefetch;
pub mod prefix_index;
pub mod protocols;
pub mod read_mostly;
pub mod routing;
pub mod slices;
pub mod vllm_events;
