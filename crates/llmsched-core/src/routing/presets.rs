//! Named configurations that reproduce the peers' policies, for comparison.

use serde_json::{json, Value};

/// The names of the presets, in a stable order.
pub const NAMES: &[&str] = &[
    "llm-d",
    "llm-d-pd",
    "sglang-cache-aware",
    "dynamo-kv",
    "round-robin",
    "random",
    "least-load",
    "prefix-only",
];

fn single(plugins: Value, refs: Value) -> Value {
    json!({"plugins": plugins, "schedulingProfiles": [{"name": "default", "plugins": refs}]})
}

/// The configuration named `name`, if it is a preset.
pub fn preset(name: &str) -> Option<Value> {
    let config = match name {
        // llm-d's default profile: queue 2, KV-cache utilization 2, prefix cache 3, max score.
        "llm-d" => single(
            json!([{"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"},
                   {"type": "prefix-cache-scorer"}, {"type": "max-score-picker"}]),
            json!([{"pluginRef": "queue-scorer", "weight": 2},
                   {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                   {"pluginRef": "prefix-cache-scorer", "weight": 3},
                   {"pluginRef": "max-score-picker"}]),
        ),
        // llm-d's P/D guide shape: the decode profile as "llm-d", a prefill profile on prefill
        // endpoints, split when 256 or more prompt tokens are not cached on the decode endpoint.
        "llm-d-pd" => json!({
            "plugins": [
                {"type": "prefill-filter"}, {"type": "decode-filter"},
                {"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"},
                {"type": "prefix-cache-scorer"}, {"type": "max-score-picker"},
                {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": 256}},
                {"type": "pd-profile-handler", "parameters": {"deciderPluginName": "prefix-based-pd-decider"}}
            ],
            "schedulingProfiles": [
                {"name": "prefill", "plugins": [
                    {"pluginRef": "prefill-filter"},
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "prefix-cache-scorer", "weight": 3},
                    {"pluginRef": "max-score-picker"}]},
                {"name": "decode", "plugins": [
                    {"pluginRef": "decode-filter"},
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                    {"pluginRef": "prefix-cache-scorer", "weight": 3},
                    {"pluginRef": "max-score-picker"}]}
            ]
        }),
        // SGLang router's cache-aware policy with its CLI defaults.
        "sglang-cache-aware" => single(
            json!([{"type": "cache-aware-picker"}]),
            json!([{"pluginRef": "cache-aware-picker"}]),
        ),
        // NVIDIA Dynamo's KV router cost at temperature 0.
        "dynamo-kv" => single(
            json!([{"type": "softmax-cost-picker"}]),
            json!([{"pluginRef": "softmax-cost-picker"}]),
        ),
        "round-robin" => single(
            json!([{"type": "round-robin-picker"}]),
            json!([{"pluginRef": "round-robin-picker"}]),
        ),
        "random" => {
            single(json!([{"type": "random-picker"}]), json!([{"pluginRef": "random-picker"}]))
        }
        // Fewest queued (scraped) and fewest in flight (router-side), equally weighted.
        "least-load" => single(
            json!([{"type": "queue-scorer"}, {"type": "active-request-scorer"}, {"type": "max-score-picker"}]),
            json!([{"pluginRef": "queue-scorer", "weight": 1}, {"pluginRef": "active-request-scorer", "weight": 1},
                   {"pluginRef": "max-score-picker"}]),
        ),
        "prefix-only" => single(
            json!([{"type": "prefix-cache-scorer"}, {"type": "max-score-picker"}]),
            json!([{"pluginRef": "prefix-cache-scorer", "weight": 1}, {"pluginRef": "max-score-picker"}]),
        ),
        _ => return None,
    };
    Some(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::config::parse;
    use crate::routing::registry::Registry;

    #[test]
    fn every_preset_parses() {
        for name in NAMES {
            parse(&preset(name).unwrap(), &Registry::builtin())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        assert!(preset("nope").is_none());
    }

    #[test]
    fn only_prefix_aware_presets_read_the_prefix_match() {
        let reads = |name: &str| {
            parse(&preset(name).unwrap(), &Registry::builtin()).unwrap().reads_prefix_match()
        };
        for name in ["llm-d", "llm-d-pd", "sglang-cache-aware", "dynamo-kv", "prefix-only"] {
            assert!(reads(name), "{name}");
        }
        for name in ["round-robin", "random", "least-load"] {
            assert!(!reads(name), "{name}");
        }
    }

    #[test]
    fn a_token_load_scorer_or_a_prefix_filter_in_a_tree_reads_the_match() {
        let reads = |config: serde_json::Value| {
            parse(&config, &Registry::builtin()).unwrap().reads_prefix_match()
        };
        // In-flight uncached tokens depend on the match at commit.
        assert!(reads(single(
            serde_json::json!([{"type": "token-load-scorer"}, {"type": "max-score-picker"}]),
            serde_json::json!([{"pluginRef": "token-load-scorer"}, {"pluginRef": "max-score-picker"}]),
        )));
        let tree = |inner: &str| {
            single(
                serde_json::json!([
                    {"type": inner, "name": "inner"},
                    {"type": "decision-tree-filter", "name": "tree",
                     "parameters": {"current": {"pluginRef": "inner"}}},
                    {"type": "random-picker"}]),
                serde_json::json!([{"pluginRef": "tree"}, {"pluginRef": "random-picker"}]),
            )
        };
        assert!(reads(tree("prefix-cache-affinity-filter")));
        assert!(!reads(tree("least-queue-filter")));
    }
}
