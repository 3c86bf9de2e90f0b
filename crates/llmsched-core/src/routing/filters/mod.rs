//! Filters: one file each, with its rule, its fail-open/fail-closed behaviour and a test.

pub mod label;
pub mod lora;
pub mod prefix_affinity;
pub mod role;
pub mod session;
pub mod utilization;
