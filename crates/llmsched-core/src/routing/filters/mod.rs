//! Filters: one file each, with its rule, its fail-open/fail-closed behaviour and a test.

pub mod decision_tree;
pub mod label;
pub mod least_kv_cache;
pub mod least_queue;
pub mod lora;
pub mod lora_affinity;
pub mod low_queue;
pub mod prefix_affinity;
pub mod role;
pub mod session;
pub mod utilization;
