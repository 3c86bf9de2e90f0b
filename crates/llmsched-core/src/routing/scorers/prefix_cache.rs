//! `prefix-cache-scorer`: the share of the prompt's blocks an endpoint holds,
//! `matched_blocks / prompt_blocks` (0 for a prompt shorter than a block). The match comes from
//! the shared prefix index, computed once per request.
//!
//! Parameters: `maxPrefixBlocksToMatch` caps both counts (default: no cap; llm-d caps at 256
//! blocks of 64 tokens); `maxPrefixTokensToMatch` (llm-d's current name) caps them at that many
//! tokens in the index's blocks and wins over `maxPrefixBlocksToMatch`, as there. `blockSize`
//! (or the older `hashBlockSize`, or llm-d's current `blockSizeTokens`) and
//! `lruCapacityPerServer` configure the index when the router builds its own; with a shared
//! index `blockSize` must equal the index's block size. `autoTune` (llm-d's: take the block
//! size from the engines' metrics) is accepted with a note: the index's block size holds.
//!
//! `mode` (llm-d's): `estimate` (the default, above) or `cache_tracking`, which makes this the
//! precise scorer (see `precise_prefix`) configured by `indexerConfig` and `kvEventsConfig`;
//! the estimate-mode parameters are refused in that mode.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::hashing::MAX_BLOCK_SIZE;
use crate::routing::plugin::{Candidate, IndexHints, PluginResult, RequestContext, Scorer};
use crate::routing::registry::{decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Params {
    block_size: Option<usize>,
    hash_block_size: Option<usize>,
    block_size_tokens: Option<usize>,
    max_prefix_blocks_to_match: Option<u32>,
    max_prefix_tokens_to_match: Option<u64>,
    auto_tune: Option<bool>,
    lru_capacity_per_server: Option<u64>,
    mode: Option<String>,
    indexer_config: Option<Value>,
    kv_events_config: Option<Value>,
}

pub struct PrefixCacheScorer {
    max_blocks: u32,
    /// `maxPrefixTokensToMatch`: a cap in tokens, turned into blocks of the index's size.
    max_tokens: Option<u64>,
    hints: IndexHints,
}

impl Scorer for PrefixCacheScorer {
    fn score(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        out: &mut [f64],
    ) -> PluginResult {
        // llm-d: maxBlocks = maxPrefixTokensToMatch / blockSize (integer division).
        let cap = match self.max_tokens {
            Some(t) => u32::try_from(t / ctx.block_size.max(1) as u64).unwrap_or(u32::MAX),
            None => self.max_blocks,
        };
        let total = (ctx.query_blocks as u64).min(u64::from(cap));
        for (o, c) in out.iter_mut().zip(cands) {
            let matched = c.cached_blocks.min(cap);
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
    match p.mode.as_deref() {
        None | Some("estimate") => {}
        Some("cache_tracking") => return cache_tracking(&p),
        Some(other) => {
            return Err(ParamError::new(
                "mode",
                format!("must be \"estimate\" or \"cache_tracking\", got {other:?}"),
            ));
        }
    }
    for (set, field) in [
        (p.indexer_config.is_some(), "indexerConfig"),
        (p.kv_events_config.is_some(), "kvEventsConfig"),
    ] {
        if set {
            return Err(ParamError::new(field, "is read only with mode: cache_tracking"));
        }
    }
    let given: Vec<(&str, usize)> = [
        ("blockSize", p.block_size),
        ("hashBlockSize", p.hash_block_size),
        ("blockSizeTokens", p.block_size_tokens),
    ]
    .into_iter()
    .filter_map(|(field, v)| v.map(|v| (field, v)))
    .collect();
    if let Some(&(field, _)) = given.iter().find(|&&(_, v)| v != given[0].1) {
        return Err(ParamError::new(field, format!("differs from {}", given[0].0)));
    }
    let (field, block_size) = given.first().map_or(("blockSize", None), |&(f, v)| (f, Some(v)));
    match block_size {
        Some(0) => return Err(ParamError::new(field, "must be positive")),
        Some(n) if n > MAX_BLOCK_SIZE => {
            return Err(ParamError::new(field, format!("must be at most {MAX_BLOCK_SIZE}")));
        }
        _ => {}
    }
    if p.max_prefix_blocks_to_match == Some(0) {
        return Err(ParamError::new("maxPrefixBlocksToMatch", "must be positive"));
    }
    if p.max_prefix_tokens_to_match == Some(0) {
        return Err(ParamError::new("maxPrefixTokensToMatch", "must be positive"));
    }
    if p.lru_capacity_per_server == Some(0) {
        return Err(ParamError::new("lruCapacityPerServer", "must be positive"));
    }
    Ok(Plugin::scorer(PrefixCacheScorer {
        max_blocks: p.max_prefix_blocks_to_match.unwrap_or(u32::MAX),
        max_tokens: p.max_prefix_tokens_to_match,
        hints: IndexHints {
            block_size,
            worker_capacity: p.lru_capacity_per_server,
            max_tokens: p.max_prefix_tokens_to_match,
        },
    }))
}

/// `mode: cache_tracking`: the precise scorer with this plugin's `indexerConfig` and
/// `kvEventsConfig`.
fn cache_tracking(p: &Params) -> Result<Plugin, ParamError> {
    let estimate = [
        (p.block_size.is_some(), "blockSize"),
        (p.hash_block_size.is_some(), "hashBlockSize"),
        (p.block_size_tokens.is_some(), "blockSizeTokens"),
        (p.max_prefix_blocks_to_match.is_some(), "maxPrefixBlocksToMatch"),
        (p.max_prefix_tokens_to_match.is_some(), "maxPrefixTokensToMatch"),
        (p.auto_tune.is_some(), "autoTune"),
        (p.lru_capacity_per_server.is_some(), "lruCapacityPerServer"),
    ];
    if let Some((_, field)) = estimate.iter().find(|(set, _)| *set) {
        return Err(ParamError::new(
            field,
            "is an estimate-mode parameter; with mode: cache_tracking the block size is \
             indexerConfig.tokenProcessorConfig.blockSize",
        ));
    }
    let mut inner = serde_json::Map::new();
    if let Some(v) = &p.indexer_config {
        inner.insert("indexerConfig".into(), v.clone());
    }
    if let Some(v) = &p.kv_events_config {
        inner.insert("kvEventsConfig".into(), v.clone());
    }
    super::precise_prefix::factory(&Value::Object(inner))
}

const PARAMS: &[ParamDoc] = &[
    ParamDoc::int(
        "blockSize",
        "tokens per block of the index the router builds (absent: the index's)",
    )
    .min(1.0)
    .max(65_536.0),
    ParamDoc::int("hashBlockSize", "older name of `blockSize`").min(1.0).max(65_536.0),
    ParamDoc::int("blockSizeTokens", "llm-d's current name of `blockSize`").min(1.0).max(65_536.0),
    ParamDoc::int("maxPrefixBlocksToMatch", "cap on matched and prompt blocks (absent: no cap)")
        .min(1.0),
    ParamDoc::int(
        "maxPrefixTokensToMatch",
        "cap in tokens, in the index's blocks; wins over `maxPrefixBlocksToMatch` (absent: none)",
    )
    .min(1.0),
    ParamDoc::boolean(
        "autoTune",
        "accepted for llm-d configs; no effect (the index's block size holds)",
    ),
    ParamDoc::int(
        "lruCapacityPerServer",
        "blocks per worker in the index the router builds (absent: unbounded)",
    )
    .min(1.0),
    ParamDoc::string(
        "mode",
        "`estimate` (absent: the same), or `cache_tracking` for the precise scorer",
    )
    .choices(&["estimate", "cache_tracking"]),
    ParamDoc::mapping(
        "indexerConfig",
        "with `mode: cache_tracking`: as in `precise-prefix-cache-scorer`",
    ),
    ParamDoc::mapping(
        "kvEventsConfig",
        "with `mode: cache_tracking`: as in `precise-prefix-cache-scorer`",
    ),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "scorer",
        "share of the prompt's blocks the endpoint holds in the prefix index",
        PARAMS,
        defaults_of::<Params>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::{close, Fixture};

    #[test]
    fn table() {
        let uncapped = PrefixCacheScorer {
            max_blocks: u32::MAX,
            max_tokens: None,
            hints: IndexHints::default(),
        };
        let capped =
            PrefixCacheScorer { max_blocks: 4, max_tokens: None, hints: IndexHints::default() };
        // 160 tokens in blocks of 16: 10 blocks.
        let f = Fixture::new(4).cached(&[0, 8, 10, 3]);
        assert!(close(&f.score(&uncapped), &[0.0, 0.8, 1.0, 0.3]));
        assert!(close(&f.score(&capped), &[0.0, 1.0, 1.0, 0.75]));
        let mut short = Fixture::new(2).cached(&[0, 0]);
        short.prompt_tokens = 10;
        assert!(close(&short.score(&uncapped), &[0.0, 0.0]));
    }

    #[test]
    fn llm_d_current_parameters() {
        // llm-d's current prefix-cache-scorer (approximateprefix/types.go): blockSizeTokens,
        // maxPrefixTokensToMatch (maxBlocks = tokens / blockSize, winning over
        // maxPrefixBlocksToMatch) and autoTune; these were refused as unknown fields (probe 54 F1).
        let v = serde_json::json!({"blockSizeTokens": 16, "autoTune": false,
            "maxPrefixBlocksToMatch": 256, "maxPrefixTokensToMatch": 64});
        let Plugin::Scorer(s) = factory(&v).unwrap() else { panic!() };
        assert_eq!(s.index_hints().block_size, Some(16));
        // 160 tokens in blocks of 16: 10 blocks; the cap is 64 / 16 = 4 blocks.
        let f = Fixture::new(4).cached(&[0, 8, 10, 3]);
        assert!(close(&f.score(s.as_ref()), &[0.0, 1.0, 1.0, 0.75]));
        let clash = factory(&serde_json::json!({"blockSize": 16, "blockSizeTokens": 32}));
        assert_eq!(clash.err().unwrap().path, "blockSizeTokens");
        let zero = factory(&serde_json::json!({"maxPrefixTokensToMatch": 0}));
        assert_eq!(zero.err().unwrap().path, "maxPrefixTokensToMatch");
        let tracking = factory(&serde_json::json!({"mode": "cache_tracking", "autoTune": true}));
        assert_eq!(tracking.err().unwrap().path, "autoTune");
    }

    #[test]
    fn params() {
        let bad = factory(&serde_json::json!({"blockSize": 0})).err().unwrap();
        assert_eq!(bad.path, "blockSize");
        // Probe 49 F8: past the largest block size, a ConfigError naming the key, not a
        // bare InvalidValueError when the router builds its index.
        let huge = factory(&serde_json::json!({"hashBlockSize": 1u64 << 40})).err().unwrap();
        assert_eq!(huge.path, "hashBlockSize");
        assert!(huge.message.contains("at most 65536"), "{huge:?}");
        assert!(factory(&serde_json::json!({"blockSize": MAX_BLOCK_SIZE})).is_ok());
        let unknown = factory(&serde_json::json!({"blocksize": 16})).err().unwrap();
        assert!(unknown.message.contains("unknown field"), "{unknown:?}");
        let Plugin::Scorer(s) = factory(&serde_json::json!({"hashBlockSize": 64})).unwrap() else {
            panic!()
        };
        assert_eq!(s.index_hints().block_size, Some(64));
        assert!(s.precise().is_none());
    }

    #[test]
    fn cache_tracking_mode_is_the_precise_scorer() {
        let v = serde_json::json!({"mode": "cache_tracking", "indexerConfig": {
            "tokenProcessorConfig": {"blockSize": 64, "hashSeed": "42"}}});
        let Plugin::Scorer(s) = factory(&v).unwrap() else { panic!() };
        let spec = s.precise().unwrap();
        assert_eq!((spec.block_size, spec.vllm_seed.as_str()), (64, "42"));
        assert_eq!(s.index_hints().block_size, Some(64));
        let cases = [
            (serde_json::json!({"mode": "exact"}), "mode"),
            (serde_json::json!({"indexerConfig": {}}), "indexerConfig"),
            (serde_json::json!({"mode": "cache_tracking", "hashBlockSize": 64}), "hashBlockSize"),
            (
                serde_json::json!({"mode": "cache_tracking", "indexerConfig": {"tokenProcessorConfig": {"blockSize": 0}}}),
                "indexerConfig.tokenProcessorConfig.blockSize",
            ),
        ];
        for (params, path) in cases {
            assert_eq!(factory(&params).err().unwrap().path, path, "{params}");
        }
    }
}
