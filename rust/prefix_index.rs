//! The prefix index: which worker holds which cached prefix.

/// The storage tier of a cached block (vLLM's `medium`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Gpu = 0,
    Cpu = 1,
    Storage = 2,
}
