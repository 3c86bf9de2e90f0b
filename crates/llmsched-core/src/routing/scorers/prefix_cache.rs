//! `prefix-cache-scorer`: the share of the prompt's blocks an endpoint holds,
//! `matched_blocks / prompt_blocks` (0 for a prompt shorter than a block). The match comes from
//! the shared prefix index, computed once per request.
//!
//! Parameters: `maxPrefixBlocksToMatch` caps both counts (default: no cap; llm-d caps at 256
//! blocks of 64 tokens). `blockSize` (or the older `hashBlockSize`) and `lruCapacityPerServer`
//! configure the index when the router builds its own; with a shared index `blockSize` must
//! equal the index's block size.

use serde::Deserialize;
use serde_json::Value;

use crate::routing::plugin::{Candidate, IndexHints, PluginResult, RequestContext, Scorer};
use crate::routing::registry::{decode, ParamError, Plugin};

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Params {
    block_size: Option<usize>,
    hash_block_size: Option<usize>,
    max_prefix_blocks_to_match: Option<u32>,
    lru_capacity_per_server: Option<u64>,
}

pub struct PrefixCacheScorer {
    max_blocks: u32,
    hints: IndexHints,
}

impl Scorer for PrefixCacheScorer {
    fn score(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        out: &mut [f64],
    ) -> PluginResult {
        let total = (ctx.query_blocks as u64).min(u64::from(self.max_blocks));
        for (o, c) in out.iter_mut().zip(cands) {
            let matched = c.cached_blocks.min(self.max_blocks);
            *o = if total == 0 { 0.0 } else { f64::from(matched) / total as f64 };
        }
        Ok(())
    }

    fn index_hints(&self) -> IndexHints {
        self.hints
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    let (field, block_size) = match (p.block_size, p.hash_block_size) {
        (Some(a), Some(b)) if a != b => {
            return Err(ParamError::new("hashBlockSize", "differs from blockSize"));
        }
        (Some(a), _) => ("blockSize", Some(a)),
        (None, b) => ("hashBlockSize", b),
    };
    if block_size == Some(0) {
        return Err(ParamError::new(field, "must be positive"));
    }
    if p.max_prefix_blocks_to_match == Some(0) {
        return Err(ParamError::new("maxPrefixBlocksToMatch", "must be positive"));
    }
    if p.lru_capacity_per_server == Some(0) {
        return Err(ParamError::new("lruCapacityPerServer", "must be positive"));
    }
    Ok(Plugin::scorer(PrefixCacheScorer {
        max_blocks: p.max_prefix_blocks_to_match.unwrap_or(u32::MAX),
        hints: IndexHints { block_size, worker_capacity: p.lru_capacity_per_server },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::{close, Fixture};

    #[test]
    fn table() {
        let uncapped = PrefixCacheScorer { max_blocks: u32::MAX, hints: IndexHints::default() };
        let capped = PrefixCacheScorer { max_blocks: 4, hints: IndexHints::default() };
        // 160 tokens in blocks of 16: 10 blocks.
        let f = Fixture::new(4).cached(&[0, 8, 10, 3]);
        assert!(close(&f.score(&uncapped), &[0.0, 0.8, 1.0, 0.3]));
        assert!(close(&f.score(&capped), &[0.0, 1.0, 1.0, 0.75]));
        let mut short = Fixture::new(2).cached(&[0, 0]);
        short.prompt_tokens = 10;
        assert!(close(&short.score(&uncapped), &[0.0, 0.0]));
    }

    #[test]
    fn params() {
        let bad = factory(&serde_json::json!({"blockSize": 0})).err().unwrap();
        assert_eq!(bad.path, "blockSize");
        let unknown = factory(&serde_json::json!({"blocksize": 16})).err().unwrap();
        assert!(unknown.message.contains("unknown field"), "{unknown:?}");
        let Plugin::Scorer(s) = factory(&serde_json::json!({"hashBlockSize": 64})).unwrap() else {
            panic!()
        };
        assert_eq!(s.index_hints().block_size, Some(64));
    }
}
