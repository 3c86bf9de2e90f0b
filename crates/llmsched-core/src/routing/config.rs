//! Configuration in the shape of llm-d's `EndpointPickerConfig`:
//!
//! ```yaml
//! plugins:                       # plugin instances
//! - type: prefix-cache-scorer    # a registered type name
//!   name: prefix                 # optional, defaults to the type
//!   parameters: {}               # optional, decoded over the plugin's defaults
//! schedulingProfiles:
//! - name: default
//!   plugins:
//!   - pluginRef: prefix          # filters, scorers (with a weight, default 1) and one picker
//!     weight: 3
//! ```
//!
//! A profile handler is one of the plugins; without one, a single profile runs. A profile with
//! no picker gets a default `max-score-picker`. Every error names the offending key
//! (`plugins[2].parameters.threshold`). Top-level sections of llm-d's file that concern other
//! components (`featureGates`, `saturationDetector`, `flowControl`, `data`) are accepted and
//! ignored.

use std::sync::Arc;

use hashbrown::HashMap;
use serde_json::{Map, Value};
use thiserror::Error;

use super::handler::{DeciderRef, DeciderSpec, Handler, HandlerSpec};
use super::plugin::{IndexHints, Scorer};
use super::profile::{NamedFilter, Profile, WeightedScorer};
use super::registry::{Plugin, Registry};

/// A configuration problem, naming the key where it is.
#[derive(Debug, Clone, PartialEq, Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl ConfigError {
    fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError { key: key.into(), message: message.into() }
    }
}

/// A parsed configuration, ready for a router.
pub struct RouterConfig {
    pub profiles: Vec<Profile>,
    pub handler: Handler,
    /// Every scorer instance once, for commit hooks.
    pub scorers: Vec<Arc<dyn Scorer>>,
    /// What the scorers ask of the prefix index, with the key that asked for a block size.
    pub index_hints: IndexHints,
    pub block_size_key: Option<String>,
}

impl RouterConfig {
    pub fn profile_index(&self, name: &str) -> Option<usize> {
        self.profiles.iter().position(|p| p.name == name)
    }
}

const TOP_LEVEL: &[&str] = &[
    "apiVersion",
    "kind",
    "plugins",
    "schedulingProfiles",
    "featureGates",
    "saturationDetector",
    "flowControl",
    "data",
];

struct Instance {
    key: String,
    plugin: Plugin,
}

/// Parses a configuration value with the plugins of `registry`.
pub fn parse(value: &Value, registry: &Registry) -> Result<RouterConfig, ConfigError> {
    let top = object(value, "config")?;
    for key in top.keys() {
        if !TOP_LEVEL.contains(&key.as_str()) {
            return Err(ConfigError::new(key.clone(), "unknown key"));
        }
    }
    if let Some(kind) = top.get("kind") {
        if kind != "EndpointPickerConfig" {
            return Err(ConfigError::new("kind", "must be EndpointPickerConfig"));
        }
    }
    let (names, instances) = parse_plugins(top.get("plugins"), registry)?;
    let profile_values = array(top.get("schedulingProfiles"), "schedulingProfiles")?;
    if profile_values.is_empty() {
        return Err(ConfigError::new("schedulingProfiles", "needs at least one profile"));
    }
    let mut profiles = Vec::new();
    for (i, pv) in profile_values.iter().enumerate() {
        let profile = parse_profile(pv, &format!("schedulingProfiles[{i}]"), &names, &instances)?;
        if profiles.iter().any(|p: &Profile| p.name == profile.name) {
            return Err(ConfigError::new(
                format!("schedulingProfiles[{i}].name"),
                "duplicate profile name",
            ));
        }
        profiles.push(profile);
    }
    let handler = resolve_handler(&instances, &names, &profiles)?;
    let mut scorers: Vec<Arc<dyn Scorer>> = Vec::new();
    let mut index_hints = IndexHints::default();
    let mut block_size_key = None;
    for inst in &instances {
        if let Plugin::Scorer(s) = &inst.plugin {
            let hints = s.index_hints();
            if let Some(bs) = hints.block_size {
                if index_hints.block_size.is_some_and(|b| b != bs) {
                    return Err(ConfigError::new(
                        format!("{}.parameters.blockSize", inst.key),
                        "differs from another plugin's block size",
                    ));
                }
                index_hints.block_size = Some(bs);
                block_size_key = Some(format!("{}.parameters.blockSize", inst.key));
            }
            index_hints.worker_capacity = index_hints.worker_capacity.or(hints.worker_capacity);
            scorers.push(s.clone());
        }
    }
    Ok(RouterConfig { profiles, handler, scorers, index_hints, block_size_key })
}

fn object<'a>(v: &'a Value, key: &str) -> Result<&'a Map<String, Value>, ConfigError> {
    v.as_object().ok_or_else(|| ConfigError::new(key, "must be a mapping"))
}

fn array<'a>(v: Option<&'a Value>, key: &str) -> Result<&'a [Value], ConfigError> {
    match v {
        None => Err(ConfigError::new(key, "is required")),
        Some(v) => v
            .as_array()
            .map(|a| a.as_slice())
            .ok_or_else(|| ConfigError::new(key, "must be a list")),
    }
}

fn string<'a>(v: Option<&'a Value>, key: &str) -> Result<Option<&'a str>, ConfigError> {
    match v {
        None => Ok(None),
        Some(Value::String(s)) if !s.is_empty() => Ok(Some(s)),
        Some(_) => Err(ConfigError::new(key, "must be a non-empty string")),
    }
}

fn check_keys(map: &Map<String, Value>, allowed: &[&str], at: &str) -> Result<(), ConfigError> {
    match map.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(ConfigError::new(
            format!("{at}.{k}"),
            format!("unknown key (expected one of {allowed:?})"),
        )),
        None => Ok(()),
    }
}

fn parse_plugins(
    v: Option<&Value>,
    registry: &Registry,
) -> Result<(HashMap<String, usize>, Vec<Instance>), ConfigError> {
    let mut names = HashMap::new();
    let mut instances = Vec::new();
    for (i, pv) in array(v, "plugins")?.iter().enumerate() {
        let at = format!("plugins[{i}]");
        let map = object(pv, &at)?;
        check_keys(map, &["type", "name", "parameters"], &at)?;
        let type_key = format!("{at}.type");
        let type_name = string(map.get("type"), &type_key)?
            .ok_or_else(|| ConfigError::new(&type_key, "is required"))?;
        let name = string(map.get("name"), &format!("{at}.name"))?.unwrap_or(type_name).to_string();
        let factory = registry.get(type_name).ok_or_else(|| {
            ConfigError::new(
                &type_key,
                format!(
                    "unknown plugin type {type_name:?}; known types: {}",
                    registry.type_names().join(", ")
                ),
            )
        })?;
        let params = map.get("parameters").unwrap_or(&Value::Null);
        let plugin = factory(params).map_err(|e| {
            let key = if e.path.is_empty() {
                format!("{at}.parameters")
            } else {
                format!("{at}.parameters.{}", e.path)
            };
            ConfigError::new(key, e.message)
        })?;
        if names.insert(name.clone(), instances.len()).is_some() {
            return Err(ConfigError::new(
                format!("{at}.name"),
                format!("duplicate plugin name {name:?}"),
            ));
        }
        instances.push(Instance { key: at, plugin });
    }
    Ok((names, instances))
}

fn parse_profile(
    v: &Value,
    at: &str,
    names: &HashMap<String, usize>,
    instances: &[Instance],
) -> Result<Profile, ConfigError> {
    let map = object(v, at)?;
    check_keys(map, &["name", "plugins"], at)?;
    let name_key = format!("{at}.name");
    let name = string(map.get("name"), &name_key)?
        .ok_or_else(|| ConfigError::new(&name_key, "is required"))?;
    let mut profile = Profile {
        name: name.to_string(),
        filters: Vec::new(),
        scorers: Vec::new(),
        picker_name: String::new(),
        picker: Arc::new(super::pickers::max_score::MaxScorePicker {
            limit: super::pickers::DEFAULT_MAX_ENDPOINTS,
        }),
    };
    let mut has_picker = false;
    for (j, rv) in array(map.get("plugins"), &format!("{at}.plugins"))?.iter().enumerate() {
        let rat = format!("{at}.plugins[{j}]");
        let rmap = object(rv, &rat)?;
        check_keys(rmap, &["pluginRef", "weight"], &rat)?;
        let ref_key = format!("{rat}.pluginRef");
        let plugin_ref = string(rmap.get("pluginRef"), &ref_key)?
            .ok_or_else(|| ConfigError::new(&ref_key, "is required"))?;
        let &idx = names
            .get(plugin_ref)
            .ok_or_else(|| ConfigError::new(&ref_key, format!("no plugin named {plugin_ref:?}")))?;
        let weight_key = format!("{rat}.weight");
        let weight = match rmap.get("weight") {
            None => None,
            Some(w) => match w.as_f64() {
                Some(w) if w.is_finite() && w >= 0.0 => Some(w),
                _ => return Err(ConfigError::new(weight_key, "must be a finite number >= 0")),
            },
        };
        let plugin = &instances[idx].plugin;
        if weight.is_some() && !matches!(plugin, Plugin::Scorer(_)) {
            return Err(ConfigError::new(
                weight_key,
                format!("only scorers take a weight; {plugin_ref:?} is a {}", plugin.kind()),
            ));
        }
        match plugin {
            Plugin::Filter(f) => profile
                .filters
                .push(NamedFilter { name: plugin_ref.to_string(), filter: f.clone() }),
            Plugin::Scorer(s) => profile.scorers.push(WeightedScorer {
                name: plugin_ref.to_string(),
                scorer: s.clone(),
                weight: weight.unwrap_or(1.0),
            }),
            Plugin::Picker(p) => {
                if has_picker {
                    return Err(ConfigError::new(ref_key, "a profile takes one picker"));
                }
                has_picker = true;
                profile.picker = p.clone();
                profile.picker_name = plugin_ref.to_string();
            }
            Plugin::Handler(_) | Plugin::Decider(_) => {
                return Err(ConfigError::new(
                    ref_key,
                    format!("a {} belongs in plugins, not in a profile", plugin.kind()),
                ));
            }
        }
    }
    if !has_picker {
        profile.picker_name = "max-score-picker".into();
    }
    Ok(profile)
}

fn resolve_handler(
    instances: &[Instance],
    names: &HashMap<String, usize>,
    profiles: &[Profile],
) -> Result<Handler, ConfigError> {
    let handlers: Vec<&Instance> =
        instances.iter().filter(|i| matches!(i.plugin, Plugin::Handler(_))).collect();
    if handlers.len() > 1 {
        return Err(ConfigError::new(
            handlers[1].key.clone(),
            "only one profile handler may be configured",
        ));
    }
    let profile = |name: &str, key: String| {
        profiles
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| ConfigError::new(key, format!("no scheduling profile named {name:?}")))
    };
    match handlers.first() {
        None | Some(Instance { plugin: Plugin::Handler(HandlerSpec::Single), .. }) => {
            if profiles.len() != 1 {
                let key =
                    handlers.first().map_or("schedulingProfiles".to_string(), |h| h.key.clone());
                return Err(ConfigError::new(key, format!("{} profiles need a pd-profile-handler; a single profile handler runs exactly one", profiles.len())));
            }
            Ok(Handler::Single { profile: 0 })
        }
        Some(Instance {
            key,
            plugin: Plugin::Handler(HandlerSpec::Pd { decode_profile, prefill_profile, decider }),
        }) => {
            let decode = profile(decode_profile, format!("{key}.parameters.decodeProfile"))?;
            let prefill = profile(prefill_profile, format!("{key}.parameters.prefillProfile"))?;
            let decider = match decider {
                DeciderRef::Inline(spec) => *spec,
                DeciderRef::Plugin(name) => {
                    let dkey = format!("{key}.parameters.deciderPluginName");
                    match names.get(name).map(|&i| &instances[i].plugin) {
                        Some(Plugin::Decider(spec)) => *spec,
                        Some(other) => {
                            return Err(ConfigError::new(
                                dkey,
                                format!("{name:?} is a {}, not a decider", other.kind()),
                            ))
                        }
                        None => {
                            return Err(ConfigError::new(dkey, format!("no plugin named {name:?}")))
                        }
                    }
                }
            };
            let _: DeciderSpec = decider;
            Ok(Handler::Pd { decode, prefill, decider })
        }
        Some(_) => unreachable!("filtered to handlers"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(v: Value) -> ConfigError {
        match parse(&v, &Registry::builtin()) {
            Err(e) => e,
            Ok(_) => panic!("accepted {v}"),
        }
    }

    fn llm_d() -> Value {
        json!({
            "plugins": [
                {"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"},
                {"type": "prefix-cache-scorer"}, {"type": "max-score-picker"}
            ],
            "schedulingProfiles": [{"name": "default", "plugins": [
                {"pluginRef": "queue-scorer", "weight": 2},
                {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "max-score-picker"}
            ]}]
        })
    }

    #[test]
    fn parses_llm_d_shape() {
        let c = parse(&llm_d(), &Registry::builtin()).unwrap();
        assert_eq!(c.profiles.len(), 1);
        let weights: Vec<f64> = c.profiles[0].scorers.iter().map(|s| s.weight).collect();
        assert_eq!(weights, vec![2.0, 2.0, 3.0]);
        assert_eq!(c.handler, Handler::Single { profile: 0 });
    }

    #[test]
    fn errors_name_the_key() {
        let cases: Vec<(Value, &str)> = vec![
            (json!([]), "config"),
            (json!({"plugins": [], "schedulingProfiles": [], "extra": 1}), "extra"),
            (
                json!({"plugins": [{"type": "nope-scorer"}], "schedulingProfiles": []}),
                "plugins[0].type",
            ),
            (
                json!({"plugins": [{"type": "queue-scorer", "parameters": {"x": 1}}], "schedulingProfiles": []}),
                "plugins[0].parameters.x",
            ),
            (
                json!({"plugins": [{"type": "load-aware-scorer", "parameters": {"threshold": "a"}}], "schedulingProfiles": []}),
                "plugins[0].parameters.threshold",
            ),
            (
                json!({"plugins": [{"type": "queue-scorer", "nmae": "q"}], "schedulingProfiles": []}),
                "plugins[0].nmae",
            ),
            (
                json!({"plugins": [{"type": "queue-scorer"}, {"type": "queue-scorer"}], "schedulingProfiles": []}),
                "plugins[1].name",
            ),
            (
                json!({"plugins": [{"type": "queue-scorer"}], "schedulingProfiles": []}),
                "schedulingProfiles",
            ),
            (
                json!({"plugins": [{"type": "queue-scorer"}], "schedulingProfiles": [{"name": "a", "plugins": [{"pluginRef": "missing"}]}]}),
                "schedulingProfiles[0].plugins[0].pluginRef",
            ),
            (
                json!({"plugins": [{"type": "queue-scorer"}], "schedulingProfiles": [{"name": "a", "plugins": [{"pluginRef": "queue-scorer", "weight": -1}]}]}),
                "schedulingProfiles[0].plugins[0].weight",
            ),
            (
                json!({"plugins": [{"type": "queue-scorer"}], "schedulingProfiles": [{"name": "a", "plugins": [{"pluginRef": "queue-scorer", "weight": "2"}]}]}),
                "schedulingProfiles[0].plugins[0].weight",
            ),
            (
                json!({"plugins": [{"type": "decode-filter"}], "schedulingProfiles": [{"name": "a", "plugins": [{"pluginRef": "decode-filter", "weight": 1}]}]}),
                "schedulingProfiles[0].plugins[0].weight",
            ),
            (
                json!({"plugins": [{"type": "random-picker"}, {"type": "max-score-picker"}], "schedulingProfiles": [{"name": "a", "plugins": [{"pluginRef": "random-picker"}, {"pluginRef": "max-score-picker"}]}]}),
                "schedulingProfiles[0].plugins[1].pluginRef",
            ),
            (
                json!({"plugins": [], "schedulingProfiles": [{"name": "a", "plugins": []}, {"name": "b", "plugins": []}]}),
                "schedulingProfiles",
            ),
            (
                json!({"plugins": [], "schedulingProfiles": [{"name": "a", "plugins": []}, {"name": "a", "plugins": []}]}),
                "schedulingProfiles[1].name",
            ),
            (
                json!({"plugins": [{"type": "pd-profile-handler"}], "schedulingProfiles": [{"name": "decode", "plugins": []}, {"name": "prefil", "plugins": []}]}),
                "plugins[0].parameters.prefillProfile",
            ),
            (
                json!({"plugins": [{"type": "pd-profile-handler", "parameters": {"deciderPluginName": "d"}}], "schedulingProfiles": [{"name": "decode", "plugins": []}, {"name": "prefill", "plugins": []}]}),
                "plugins[0].parameters.deciderPluginName",
            ),
            (
                json!({"plugins": [{"type": "prefix-cache-scorer", "name": "a", "parameters": {"blockSize": 16}}, {"type": "prefix-cache-scorer", "name": "b", "parameters": {"blockSize": 64}}], "schedulingProfiles": [{"name": "x", "plugins": []}]}),
                "plugins[1].parameters.blockSize",
            ),
            (json!({"kind": "Other", "plugins": [], "schedulingProfiles": []}), "kind"),
        ];
        for (v, key) in cases {
            let e = err(v.clone());
            assert_eq!(e.key, key, "{v} -> {e}");
        }
    }

    #[test]
    fn pd_handler_resolves_profiles_and_decider() {
        let v = json!({
            "plugins": [
                {"type": "prefill-filter"}, {"type": "decode-filter"},
                {"type": "load-aware-pd-decider", "name": "d", "parameters": {"nonCachedTokens": 32, "queueMargin": 2}},
                {"type": "pd-profile-handler", "parameters": {"deciderPluginName": "d"}}
            ],
            "schedulingProfiles": [
                {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}]},
                {"name": "decode", "plugins": [{"pluginRef": "decode-filter"}]}
            ]
        });
        let c = parse(&v, &Registry::builtin()).unwrap();
        assert_eq!(
            c.handler,
            Handler::Pd {
                decode: 1,
                prefill: 0,
                decider: DeciderSpec::LoadAware { non_cached_tokens: 32, queue_margin: 2.0 }
            }
        );
    }
}
