//! `precise-prefix-cache-scorer` (llm-d's; also `prefix-cache-scorer` with
//! `mode: cache_tracking`): scores endpoints by the prompt blocks the engines report holding in
//! their KV-cache events, as llm-d does: among the endpoints holding at least one leading block,
//! `(hits - min) / (max - min)` (1 for all when they hold equally many), 0 for the others.
//!
//! The scorer reads the shared prefix index; what makes it precise is what feeds that index.
//! The configuration therefore describes wiring the caller must do, returned as a
//! [`PreciseSpec`]: the engines publish KV events (vLLM `--kv-events-config`) hashed with
//! `sha256_cbor` over blocks of `tokenProcessorConfig.blockSize` tokens with `hashSeed` as
//! `PYTHONHASHSEED`, and a subscriber (`kvEventsConfig`: `zmqEndpoint`, `topicFilter`) applies
//! them to the index. The index re-hashes each event's tokens in its own namespace, so matching
//! does not depend on the seed; the seed and block size tell the caller how to configure the
//! engines and let it check their block hashes.
//!
//! Parameters (llm-d's names): `tokenProcessorConfig` {`blockSize` (16), `hashSeed` ("")}, also
//! accepted inside `indexerConfig` where older releases put it; `indexerConfig`
//! {`kvBlockIndexConfig`, `tokenizersPoolConfig`, `prefixStoreConfig`, `speculativeIndexing`,
//! `kvCacheBackendConfigs`}; `kvEventsConfig` {`zmqEndpoint` ("tcp://*:5557"), `topicFilter`
//! ("kv@"), `concurrency`, `discoverPods`, `podDiscoveryConfig`}; `speculativeIndexing`,
//! `speculativeTTL`. Settings that llmsched does elsewhere are accepted with a note saying
//! where; a Redis or Valkey index backend is refused.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, IndexHints, PluginResult, RequestContext, Scorer};
use crate::routing::registry::{decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};

/// vLLM's seed string when `PYTHONHASHSEED` is unset (recent releases).
pub const VLLM_DEFAULT_SEED: &str = "vllm-none-hash";

/// The KV-event subscription the configuration asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsSpec {
    /// Where the subscriber binds (with `*`) or connects.
    pub zmq_endpoint: String,
    /// Topic prefix; llm-d's engines publish on `kv@<pod address>@<model>`.
    pub topic_filter: String,
    /// llm-d's per-pod subscription mode (each engine binds its own publisher).
    pub discover_pods: bool,
}

/// What precise prefix routing needs wired around the router.
#[derive(Debug, Clone, PartialEq)]
pub struct PreciseSpec {
    /// Tokens per block: the engines' block size, and the index's.
    pub block_size: usize,
    /// `hashSeed` as configured ("" when unset).
    pub hash_seed: String,
    /// The seed string vLLM hashes into its first block's parent (`hashSeed`, or vLLM's default
    /// when empty).
    pub vllm_seed: String,
    pub kv_events: KvEventsSpec,
    /// (parameter path, message) for settings accepted without effect here.
    pub notes: Vec<(String, String)>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct TokenProcessor {
    block_size: usize,
    hash_seed: String,
}

impl Default for TokenProcessor {
    fn default() -> Self {
        TokenProcessor { block_size: 16, hash_seed: String::new() }
    }
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct BlockIndex {
    enable_metrics: Option<bool>,
    metrics_logging_interval: Option<Value>,
    in_memory_config: Option<Value>,
    cost_aware_memory_config: Option<Value>,
    redis_config: Option<Value>,
    valkey_config: Option<Value>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Indexer {
    token_processor_config: Option<TokenProcessor>,
    kv_block_index_config: Option<BlockIndex>,
    tokenizers_pool_config: Option<Value>,
    prefix_store_config: Option<Value>,
    speculative_indexing: Option<bool>,
    kv_cache_backend_configs: Option<Value>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct KvEvents {
    zmq_endpoint: String,
    topic_filter: String,
    concurrency: Option<u32>,
    discover_pods: bool,
    pod_discovery_config: Option<Value>,
}

impl Default for KvEvents {
    fn default() -> Self {
        KvEvents {
            zmq_endpoint: "tcp://*:5557".into(),
            topic_filter: "kv@".into(),
            concurrency: None,
            discover_pods: false,
            pod_discovery_config: None,
        }
    }
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Params {
    token_processor_config: Option<TokenProcessor>,
    indexer_config: Option<Indexer>,
    kv_events_config: Option<KvEvents>,
    speculative_indexing: Option<bool>, // current place; older releases: indexerConfig
    #[serde(rename = "speculativeTTL")]
    speculative_ttl: Option<Value>,
}

pub struct PrecisePrefixScorer {
    spec: PreciseSpec,
}

impl Scorer for PrecisePrefixScorer {
    fn score(&self, _: &RequestContext<'_>, cands: &[Candidate], out: &mut [f64]) -> PluginResult {
        let hits = cands.iter().map(|c| c.cached_blocks).filter(|&h| h > 0);
        let (lo, hi) = hits.fold((u32::MAX, 0), |(lo, hi), h| (lo.min(h), hi.max(h)));
        for (o, c) in out.iter_mut().zip(cands) {
            *o = match c.cached_blocks {
                0 => 0.0,
                _ if hi == lo => 1.0,
                h => f64::from(h - lo) / f64::from(hi - lo),
            };
        }
        Ok(())
    }

    fn index_hints(&self) -> IndexHints {
        IndexHints { block_size: Some(self.spec.block_size), ..IndexHints::default() }
    }

    fn precise(&self) -> Option<&PreciseSpec> {
        Some(&self.spec)
    }
}

const TOKENIZE: &str =
    "has no effect here: the caller tokenizes the prompt (the gateway's `tokenizer`)";

/// Builds the scorer from llm-d's parameters.
pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    let indexer = p.indexer_config.unwrap_or_default();
    let tp = match (p.token_processor_config, indexer.token_processor_config) {
        (Some(_), Some(_)) => {
            return Err(ParamError::new(
                "indexerConfig.tokenProcessorConfig",
                "give tokenProcessorConfig once (at the top, where current releases read it)",
            ));
        }
        (Some(t), None) => (t, "tokenProcessorConfig"),
        (None, Some(t)) => (t, "indexerConfig.tokenProcessorConfig"),
        (None, None) => (TokenProcessor::default(), "tokenProcessorConfig"),
    };
    let (tp, tp_path) = tp;
    if !(1..=65_536).contains(&tp.block_size) {
        return Err(ParamError::new(
            &format!("{tp_path}.blockSize"),
            format!("must be between 1 and 65536, got {}", tp.block_size),
        ));
    }
    let mut notes = Vec::new();
    let mut note = |path: &str, msg: &str| notes.push((path.to_string(), msg.to_string()));
    if let Some(bi) = indexer.kv_block_index_config {
        let at = "indexerConfig.kvBlockIndexConfig";
        for (set, key) in [
            (bi.redis_config.is_some(), "redisConfig"),
            (bi.valkey_config.is_some(), "valkeyConfig"),
        ] {
            if set {
                return Err(ParamError::new(
                    &format!("{at}.{key}"),
                    "a shared Redis / Valkey index is not supported: llmsched keeps the index in \
                     memory (PrefixIndex; share one per process, snapshot it with dumps / loads)",
                ));
            }
        }
        if bi.enable_metrics.is_some() || bi.metrics_logging_interval.is_some() {
            note(at, "metrics settings have no effect: index statistics are always in PrefixIndex.stats() and the gateway's /metrics");
        }
        if bi.in_memory_config.is_some() || bi.cost_aware_memory_config.is_some() {
            note(at, "size settings have no effect: bound the index with PrefixIndex(max_bytes=..., worker_capacity=...)");
        }
    }
    if indexer.tokenizers_pool_config.is_some() {
        note("indexerConfig.tokenizersPoolConfig", TOKENIZE);
    }
    if indexer.prefix_store_config.is_some() {
        note("indexerConfig.prefixStoreConfig", TOKENIZE);
    }
    if indexer.kv_cache_backend_configs.is_some() {
        note(
            "indexerConfig.kvCacheBackendConfigs",
            "has no effect: every tier an engine reports counts as a hit",
        );
    }
    for (set, path) in [
        (indexer.speculative_indexing.is_some(), "indexerConfig.speculativeIndexing"),
        (p.speculative_indexing.is_some(), "speculativeIndexing"),
        (p.speculative_ttl.is_some(), "speculativeTTL"),
    ] {
        if set {
            note(path, "has no effect: the router always records a routed request's blocks until an engine confirms them, for Router(record_ttl_s=...) seconds");
        }
    }
    let ev = p.kv_events_config.unwrap_or_default();
    if ev.zmq_endpoint.is_empty() {
        return Err(ParamError::new("kvEventsConfig.zmqEndpoint", "must be a ZMQ endpoint"));
    }
    if ev.concurrency.is_some() {
        note(
            "kvEventsConfig.concurrency",
            "has no effect: events are applied by one subscriber thread, a batch at a time",
        );
    }
    if ev.pod_discovery_config.is_some() {
        note("kvEventsConfig.podDiscoveryConfig", "has no effect: engines are listed in the gateway's `engines` (or discovery file), each with its `kv_events` endpoint");
    }
    let vllm_seed =
        if tp.hash_seed.is_empty() { VLLM_DEFAULT_SEED.to_string() } else { tp.hash_seed.clone() };
    Ok(Plugin::scorer(PrecisePrefixScorer {
        spec: PreciseSpec {
            block_size: tp.block_size,
            hash_seed: tp.hash_seed,
            vllm_seed,
            kv_events: KvEventsSpec {
                zmq_endpoint: ev.zmq_endpoint,
                topic_filter: ev.topic_filter,
                discover_pods: ev.discover_pods,
            },
            notes,
        },
    }))
}

const PARAMS: &[ParamDoc] = &[
    ParamDoc::int("tokenProcessorConfig.blockSize", "tokens per block the engines hash").min(1.0).max(65_536.0),
    ParamDoc::string("tokenProcessorConfig.hashSeed", "the engines' `PYTHONHASHSEED`"),
    ParamDoc::mapping("indexerConfig", "llm-d's indexer settings (older home of `tokenProcessorConfig`; Redis and Valkey backends refused)"),
    ParamDoc::string("kvEventsConfig.zmqEndpoint", "where the KV-event subscriber listens or connects"),
    ParamDoc::string("kvEventsConfig.topicFilter", "topic prefix of the engines' KV events"),
    ParamDoc::int("kvEventsConfig.concurrency", "accepted; no effect"),
    ParamDoc::boolean("kvEventsConfig.discoverPods", "accepted; engines come from the caller"),
    ParamDoc::mapping("kvEventsConfig.podDiscoveryConfig", "accepted; no effect"),
    ParamDoc::boolean("speculativeIndexing", "accepted; the router records its own decisions"),
    ParamDoc::string("speculativeTTL", "accepted; see `Router(record_ttl_s=...)`"),
];

/// The nested defaults the factory decodes over.
fn precise_defaults() -> Value {
    let mut d = defaults_of::<Params>();
    if let Value::Object(map) = &mut d {
        map.insert("tokenProcessorConfig".into(), defaults_of::<TokenProcessor>());
        map.insert("kvEventsConfig".into(), defaults_of::<KvEvents>());
    }
    d
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new("scorer", "blocks the engines report holding (KV events), min-max normalised among endpoints with a hit", PARAMS, precise_defaults())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::{close, Fixture};
    use serde_json::json;

    fn spec(params: Value) -> PreciseSpec {
        let Plugin::Scorer(s) = factory(&params).unwrap() else { panic!() };
        s.precise().unwrap().clone()
    }

    #[test]
    fn scores_min_max_over_endpoints_with_hits() {
        let s = PrecisePrefixScorer { spec: spec(Value::Null) };
        let cases: &[(&[u32], &[f64])] = &[
            (&[0, 2, 6, 4], &[0.0, 0.0, 1.0, 0.5]),
            (&[0, 3, 3], &[0.0, 1.0, 1.0]),
            (&[0, 5], &[0.0, 1.0]),
            (&[0, 0], &[0.0, 0.0]),
        ];
        for (hits, want) in cases {
            assert!(close(&Fixture::new(hits.len()).cached(hits).score(&s), want), "{hits:?}");
        }
    }

    #[test]
    fn defaults_and_both_places_of_the_token_processor() {
        let d = spec(Value::Null);
        assert_eq!(
            (d.block_size, d.hash_seed.as_str(), d.vllm_seed.as_str()),
            (16, "", VLLM_DEFAULT_SEED)
        );
        assert_eq!(d.kv_events.zmq_endpoint, "tcp://*:5557");
        assert_eq!(d.kv_events.topic_filter, "kv@");
        let top = spec(json!({"tokenProcessorConfig": {"blockSize": 64, "hashSeed": "42"}}));
        let old = spec(
            json!({"indexerConfig": {"tokenProcessorConfig": {"blockSize": 64, "hashSeed": "42"}}}),
        );
        assert_eq!((top.block_size, top.vllm_seed.as_str()), (64, "42"));
        assert_eq!(top, old);
    }

    #[test]
    fn notes_and_refusals_name_the_field() {
        let s = spec(json!({"indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": true},
                                              "tokenizersPoolConfig": {"modelName": "m"}},
                            "kvEventsConfig": {"concurrency": 4}}));
        let paths: Vec<&str> = s.notes.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "indexerConfig.kvBlockIndexConfig",
                "indexerConfig.tokenizersPoolConfig",
                "kvEventsConfig.concurrency"
            ]
        );
        let cases = [
            (
                json!({"indexerConfig": {"kvBlockIndexConfig": {"valkeyConfig": {}}}}),
                "indexerConfig.kvBlockIndexConfig.valkeyConfig",
            ),
            (json!({"tokenProcessorConfig": {"blockSize": 0}}), "tokenProcessorConfig.blockSize"),
            (
                json!({"indexerConfig": {"tokenProcessorConfig": {"blockSize": 0}}}),
                "indexerConfig.tokenProcessorConfig.blockSize",
            ),
            (json!({"tokenProcessorConfig": {"blocksize": 16}}), "tokenProcessorConfig.blocksize"),
            (json!({"kvEventsConfig": {"zmqEndpoint": ""}}), "kvEventsConfig.zmqEndpoint"),
            (
                json!({"tokenProcessorConfig": {}, "indexerConfig": {"tokenProcessorConfig": {}}}),
                "indexerConfig.tokenProcessorConfig",
            ),
        ];
        for (params, path) in cases {
            let e = factory(&params).err().unwrap();
            assert!(e.path == path || e.path.starts_with(path), "{params}: {e:?}");
        }
    }
}
