//! Pickers: one file each. A picker orders candidates: the first is chosen, the next ones are
//! the fallbacks, at most `maxNumOfEndpoints` in all (default [`DEFAULT_MAX_ENDPOINTS`]). Every
//! random choice draws from the decision's seeded generator.

use std::cmp::Ordering;

use serde::{Deserialize, Serialize};

use super::registry::ParamError;

pub mod cache_aware;
pub mod max_score;
pub mod power_of_two;
pub mod random;
pub mod round_robin;
pub mod softmax_cost;
pub mod weighted_random;

/// The chosen endpoint and three fallbacks. (llm-d's default is 1: it uses no fallbacks.)
pub const DEFAULT_MAX_ENDPOINTS: usize = 4;

/// The parameter every picker has.
#[derive(Debug, Clone, Copy, Deserialize, Serialize)]
#[serde(transparent)]
pub struct MaxEndpoints(pub usize);

impl Default for MaxEndpoints {
    fn default() -> Self {
        MaxEndpoints(DEFAULT_MAX_ENDPOINTS)
    }
}

impl MaxEndpoints {
    pub fn check(self) -> Result<usize, ParamError> {
        if self.0 == 0 {
            return Err(ParamError::new("maxNumOfEndpoints", "must be at least 1"));
        }
        Ok(self.0)
    }
}

/// The first `limit` of `0..n` in the order `cmp`, sorted. O(n + limit log limit).
pub(crate) fn top_k(
    n: usize,
    limit: usize,
    mut cmp: impl FnMut(&usize, &usize) -> Ordering,
    order: &mut Vec<usize>,
) {
    let k = limit.min(n);
    if k == 0 {
        return;
    }
    let mut idx: Vec<usize> = (0..n).collect();
    if k < n {
        idx.select_nth_unstable_by(k - 1, &mut cmp);
        idx.truncate(k);
    }
    idx.sort_unstable_by(&mut cmp);
    order.extend_from_slice(&idx);
}

/// Descending by `key`, ties by the random `tie` (ascending).
pub(crate) fn desc_then_tie(key: &[f64], tie: &[u64], a: usize, b: usize) -> Ordering {
    key[b].total_cmp(&key[a]).then(tie[a].cmp(&tie[b]))
}
