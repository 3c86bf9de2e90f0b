//! Profile handlers: which profiles run for a request.
//!
//! `single-profile-handler` runs the only profile. `pd-profile-handler` runs the decode profile,
//! then decides disaggregation with a decider:
//! - `prefix-based-pd-decider` (llm-d's rule): split iff the prompt tokens not cached on the
//!   chosen decode endpoint are at least `nonCachedTokens` (0: always split);
//! - `load-aware-pd-decider` (ours): the same test, then the prefill profile runs and its choice
//!   is kept only if its queue (waiting requests plus the router's requests not yet past their
//!   first token; a saturated endpoint counts as infinitely long) is at most the decode
//!   endpoint's queue plus `queueMargin` (default 0). Otherwise the decode endpoint prefills.
//!
//! A prefill profile that finds no endpoint means no split, not an error.
//!
//! `disagg-profile-handler` is llm-d's current handler: the decode profile always runs; the
//! prefill profile runs when a prefill decider is configured (`deciders.prefill`), the profile
//! exists and the decider says so. Without a prefill decider it runs the decode profile alone.
//! Its earlier flat parameters (`decodeProfile`, `prefillProfile`, `prefillDeciderPluginName`,
//! `deciderPluginName`) are read with a note naming the current ones; mixing both is an error.
//! Encode disaggregation (`deciders.encode`, multimodal encoders) is refused by name.
//!
//! `disagg-headers-handler` (earlier `prefill-header-handler`) sets llm-d's prefill header
//! (`x-prefiller-host-port`) from the prefill profile's choice; the gateway sets it
//! (`pd.header`). llm-d's current `disagg-profile-handler` sets it too.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::plugin::Candidate;
use super::registry::{check_range, decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};

/// A profile handler as configured (profile names resolved later).
#[derive(Debug, Clone, PartialEq)]
pub enum HandlerSpec {
    Single,
    Pd {
        decode_profile: String,
        prefill_profile: String,
        decider: DeciderRef,
    },
    /// llm-d's `disagg-profile-handler`: no decider means the decode profile alone; `notes`
    /// are earlier parameter names read (path under `parameters`, message).
    Disagg {
        decode_profile: String,
        prefill_profile: String,
        decider: Option<String>,
        notes: Vec<(String, String)>,
    },
}

/// llm-d's prefill header.
pub const PREFILL_HEADER: &str = "x-prefiller-host-port";

/// `disagg-headers-handler`: the profile whose choice goes into [`PREFILL_HEADER`].
#[derive(Debug, Clone, PartialEq)]
pub struct HeadersSpec {
    pub prefill_profile: String,
    /// Parameters read without effect (path under `parameters`, why).
    pub notes: Vec<(String, String)>,
}

/// How a P/D handler names its decider.
#[derive(Debug, Clone, PartialEq)]
pub enum DeciderRef {
    /// A decider plugin, by name.
    Plugin(String),
    /// The legacy `threshold` parameter of the handler itself.
    Inline(DeciderSpec),
    /// Neither given: the plugin named `prefix-based-pd-decider` when one is declared (llm-d's
    /// default `deciderPluginName`), else an inline decider with `nonCachedTokens` 0.
    Default,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeciderSpec {
    PrefixBased { non_cached_tokens: u64 },
    LoadAware { non_cached_tokens: u64, queue_margin: f64 },
}

impl DeciderSpec {
    /// Whether a prompt with `uncached` tokens not cached on the decode endpoint should split.
    pub fn wants_prefill(&self, uncached: u64) -> bool {
        let (DeciderSpec::PrefixBased { non_cached_tokens }
        | DeciderSpec::LoadAware { non_cached_tokens, .. }) = *self;
        uncached >= non_cached_tokens
    }

    /// Whether the prefill endpoint chosen should be used, given the decode endpoint.
    pub fn keeps_prefill(&self, decode: &Candidate, prefill: &Candidate) -> bool {
        match *self {
            DeciderSpec::PrefixBased { .. } => true,
            DeciderSpec::LoadAware { queue_margin, .. } => {
                queue(prefill) <= queue(decode) + queue_margin
            }
        }
    }
}

/// Waiting requests plus the router's requests still prefilling; infinite when saturated.
pub fn queue(c: &Candidate) -> f64 {
    if c.saturated {
        f64::INFINITY
    } else {
        f64::from(c.metrics.waiting) + c.inflight.prefill_requests as f64
    }
}

/// A resolved handler: profile indices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Handler {
    Single { profile: usize },
    Pd { decode: usize, prefill: usize, decider: DeciderSpec },
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct SingleParams {}

pub fn single_factory(params: &Value) -> Result<Plugin, ParamError> {
    let _: SingleParams = decode(params)?;
    Ok(Plugin::Handler(HandlerSpec::Single))
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct PdParams {
    decode_profile: String,
    prefill_profile: String,
    decider_plugin_name: Option<String>,
    threshold: Option<u64>,
    hash_block_size: Option<usize>,
    // llm-d's current parameters without an effect here (noted, see `config`).
    primary_port: Option<u64>,
    prefix_plugin_type: Option<String>,
    prefix_plugin_name: Option<String>,
}

impl Default for PdParams {
    fn default() -> Self {
        PdParams {
            decode_profile: "decode".into(),
            prefill_profile: "prefill".into(),
            decider_plugin_name: None,
            threshold: None,
            hash_block_size: None,
            primary_port: None,
            prefix_plugin_type: None,
            prefix_plugin_name: None,
        }
    }
}

pub fn pd_factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: PdParams = decode(params)?;
    // Accepted with a note (see `config`).
    let _ = (p.hash_block_size, p.primary_port, p.prefix_plugin_type, p.prefix_plugin_name);
    let decider = match (p.decider_plugin_name, p.threshold) {
        (Some(_), Some(_)) => {
            return Err(ParamError::new("threshold", "give either threshold or deciderPluginName"));
        }
        (Some(name), None) => DeciderRef::Plugin(name),
        (None, Some(t)) => DeciderRef::Inline(DeciderSpec::PrefixBased { non_cached_tokens: t }),
        (None, None) => DeciderRef::Default,
    };
    if p.decode_profile == p.prefill_profile {
        return Err(ParamError::new("prefillProfile", "must differ from decodeProfile"));
    }
    Ok(Plugin::Handler(HandlerSpec::Pd {
        decode_profile: p.decode_profile,
        prefill_profile: p.prefill_profile,
        decider,
    }))
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
struct DisaggProfiles {
    decode: Option<String>,
    prefill: Option<String>,
    encode: Option<String>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
struct DisaggDeciders {
    prefill: Option<String>,
    encode: Option<String>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct DisaggParams {
    profiles: Option<DisaggProfiles>,
    deciders: Option<DisaggDeciders>,
    // Earlier flat names.
    decode_profile: Option<String>,
    prefill_profile: Option<String>,
    encode_profile: Option<String>,
    prefill_decider_plugin_name: Option<String>,
    encode_decider_plugin_name: Option<String>,
    decider_plugin_name: Option<String>,
}

const ENCODE_REFUSED: &str = "encode disaggregation (multimodal encoder endpoints) is not \
                              supported; the decode and prefill stages are";

/// `disagg-profile-handler`: `profiles.decode` / `prefill` / `encode` (defaults "decode",
/// "prefill", "encode"), `deciders.prefill`, and the earlier flat names.
pub fn disagg_factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: DisaggParams = decode(params)?;
    let flat = [
        ("decodeProfile", p.decode_profile.is_some()),
        ("prefillProfile", p.prefill_profile.is_some()),
        ("encodeProfile", p.encode_profile.is_some()),
        ("prefillDeciderPluginName", p.prefill_decider_plugin_name.is_some()),
        ("encodeDeciderPluginName", p.encode_decider_plugin_name.is_some()),
        ("deciderPluginName", p.decider_plugin_name.is_some()),
    ];
    let nested = p.profiles.is_some() || p.deciders.is_some();
    if let (true, Some((name, _))) = (nested, flat.iter().find(|(_, set)| *set)) {
        return Err(ParamError::new(
            name,
            "is an earlier flat parameter; give either profiles / deciders or the flat \
             parameters, not both",
        ));
    }
    let profiles = p.profiles.unwrap_or_default();
    let deciders = p.deciders.unwrap_or_default();
    let mut notes = Vec::new();
    let current = |flat: &str| match flat {
        "decodeProfile" => "profiles.decode",
        "prefillProfile" => "profiles.prefill",
        "encodeProfile" => "profiles.encode",
        "encodeDeciderPluginName" => "deciders.encode",
        _ => "deciders.prefill",
    };
    for (name, set) in flat {
        if set {
            notes.push((
                name.to_string(),
                format!("is an earlier name: read as {}, its current name", current(name)),
            ));
        }
    }
    if deciders.encode.is_some() {
        return Err(ParamError::new("deciders.encode", ENCODE_REFUSED));
    }
    if p.encode_decider_plugin_name.is_some() {
        return Err(ParamError::new("encodeDeciderPluginName", ENCODE_REFUSED));
    }
    if profiles.encode.is_some() {
        notes.push(("profiles.encode".into(), format!("has no effect: {ENCODE_REFUSED}")));
    }
    if p.encode_profile.is_some() {
        notes.push(("encodeProfile".into(), format!("has no effect: {ENCODE_REFUSED}")));
    }
    let decode_profile =
        profiles.decode.or(p.decode_profile).unwrap_or_else(|| "decode".to_string());
    let prefill_profile =
        profiles.prefill.or(p.prefill_profile).unwrap_or_else(|| "prefill".to_string());
    // The prefill decider's earlier names: prefillDeciderPluginName wins over deciderPluginName.
    let decider = deciders.prefill.or(p.prefill_decider_plugin_name).or(p.decider_plugin_name);
    if decode_profile.is_empty() || prefill_profile.is_empty() {
        return Err(ParamError::new("profiles", "profile names must not be empty"));
    }
    if decode_profile == prefill_profile {
        return Err(ParamError::new("profiles.prefill", "must differ from profiles.decode"));
    }
    Ok(Plugin::Handler(HandlerSpec::Disagg { decode_profile, prefill_profile, decider, notes }))
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct HeadersParams {
    prefill_profile: String,
    encode_profile: Option<String>,
}

impl Default for HeadersParams {
    fn default() -> Self {
        HeadersParams { prefill_profile: "prefill".into(), encode_profile: None }
    }
}

/// `disagg-headers-handler` / `prefill-header-handler`: `prefillProfile` (default
/// "prefill"), `encodeProfile` (accepted without effect).
pub fn headers_factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: HeadersParams = decode(params)?;
    if p.prefill_profile.is_empty() {
        return Err(ParamError::new("prefillProfile", "must not be empty"));
    }
    let mut notes = Vec::new();
    if p.encode_profile.is_some() {
        notes.push(("encodeProfile".to_string(), format!("has no effect: {ENCODE_REFUSED}")));
    }
    Ok(Plugin::Headers(HeadersSpec { prefill_profile: p.prefill_profile, notes }))
}

/// `always-disagg-pd-decider`: every request splits.
pub fn always_decider_factory(params: &Value) -> Result<Plugin, ParamError> {
    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct NoParams {}
    let _: NoParams = decode(params)?;
    Ok(Plugin::Decider(DeciderSpec::PrefixBased { non_cached_tokens: 0 }))
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct PrefixDeciderParams {
    non_cached_tokens: u64,
}

pub fn prefix_decider_factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: PrefixDeciderParams = decode(params)?;
    Ok(Plugin::Decider(DeciderSpec::PrefixBased { non_cached_tokens: p.non_cached_tokens }))
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct LoadAwareDeciderParams {
    non_cached_tokens: u64,
    queue_margin: f64,
}

pub fn load_aware_decider_factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: LoadAwareDeciderParams = decode(params)?;
    check_range("queueMargin", p.queue_margin, 0.0, f64::MAX)?;
    Ok(Plugin::Decider(DeciderSpec::LoadAware {
        non_cached_tokens: p.non_cached_tokens,
        queue_margin: p.queue_margin,
    }))
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn single_doc() -> PluginDoc {
    PluginDoc::new("profile handler", "runs the only profile", &[], defaults_of::<SingleParams>())
}

const PD_PARAMS: &[ParamDoc] = &[
    ParamDoc::string("decodeProfile", "the decode profile's name"),
    ParamDoc::string("prefillProfile", "the prefill profile's name (must differ)"),
    ParamDoc::string(
        "deciderPluginName",
        "the decider plugin (absent: the plugin named `prefix-based-pd-decider` when declared, \
         else an inline one)",
    ),
    ParamDoc::int("threshold", "the inline decider's `nonCachedTokens` (absent: 0)"),
    ParamDoc::int("hashBlockSize", "accepted for older configs; no effect"),
    ParamDoc::int("primaryPort", "accepted for llm-d configs; no effect"),
    ParamDoc::string("prefixPluginType", "accepted for llm-d configs; no effect"),
    ParamDoc::string("prefixPluginName", "accepted for llm-d configs; no effect"),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn pd_doc() -> PluginDoc {
    PluginDoc::new(
        "profile handler",
        "runs the decode profile, then the prefill profile when its decider splits the request",
        PD_PARAMS,
        defaults_of::<PdParams>(),
    )
}

const PREFIX_DECIDER_PARAMS: &[ParamDoc] =
    &[ParamDoc::int("nonCachedTokens", "uncached prompt tokens that make a split (0: always)")];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn prefix_decider_doc() -> PluginDoc {
    PluginDoc::new("decider", "splits when at least `nonCachedTokens` prompt tokens are not cached on the decode endpoint", PREFIX_DECIDER_PARAMS, defaults_of::<PrefixDeciderParams>())
}

const LOAD_AWARE_DECIDER_PARAMS: &[ParamDoc] = &[
    ParamDoc::int("nonCachedTokens", "uncached prompt tokens that make a split (0: always)"),
    ParamDoc::number("queueMargin", "how much longer the prefill queue may be").min(0.0),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn load_aware_decider_doc() -> PluginDoc {
    PluginDoc::new("decider", "the prefix rule, then keeps the prefill choice only if its queue is no longer than decode's plus `queueMargin`", LOAD_AWARE_DECIDER_PARAMS, defaults_of::<LoadAwareDeciderParams>())
}

const DISAGG_PARAMS: &[ParamDoc] = &[
    ParamDoc::string("profiles.decode", "the decode profile's name (absent: \"decode\")"),
    ParamDoc::string("profiles.prefill", "the prefill profile's name (absent: \"prefill\")"),
    ParamDoc::string("profiles.encode", "the encode profile: accepted without effect"),
    ParamDoc::string("deciders.prefill", "the prefill decider plugin (absent: decode alone)"),
    ParamDoc::string("deciders.encode", "an encode decider: refused (no encode stage)"),
    ParamDoc::string("decodeProfile", "earlier name of `profiles.decode`"),
    ParamDoc::string("prefillProfile", "earlier name of `profiles.prefill`"),
    ParamDoc::string("encodeProfile", "earlier name of `profiles.encode`"),
    ParamDoc::string("prefillDeciderPluginName", "earlier name of `deciders.prefill`"),
    ParamDoc::string("encodeDeciderPluginName", "earlier name of `deciders.encode`"),
    ParamDoc::string("deciderPluginName", "earlier name of `deciders.prefill`"),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn disagg_doc() -> PluginDoc {
    PluginDoc::new(
        "profile handler",
        "runs the decode profile, then the prefill profile when the prefill decider splits",
        DISAGG_PARAMS,
        defaults_of::<DisaggParams>(),
    )
}

const HEADERS_PARAMS: &[ParamDoc] = &[
    ParamDoc::string("prefillProfile", "the profile whose pick goes in the prefill header"),
    ParamDoc::string("encodeProfile", "accepted without effect (no encode stage)"),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn headers_doc() -> PluginDoc {
    PluginDoc::new(
        "pre-request plugin",
        "names the prefill endpoint in the `x-prefiller-host-port` header",
        HEADERS_PARAMS,
        defaults_of::<HeadersParams>(),
    )
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn always_decider_doc() -> PluginDoc {
    PluginDoc::new("decider", "splits every request", &[], Value::Object(Default::default()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    #[test]
    fn threshold_edges() {
        let d = DeciderSpec::PrefixBased { non_cached_tokens: 256 };
        assert!(!d.wants_prefill(255));
        assert!(d.wants_prefill(256));
        assert!(d.wants_prefill(257));
        assert!(DeciderSpec::PrefixBased { non_cached_tokens: 0 }.wants_prefill(0));
    }

    #[test]
    fn load_aware_compares_queues() {
        let d = DeciderSpec::LoadAware { non_cached_tokens: 16, queue_margin: 1.0 };
        let f = Fixture::new(2).waiting(&[3, 4]);
        let (dec, pre) = (&f.candidates[0], &f.candidates[1]);
        assert!(d.keeps_prefill(dec, pre)); // 4 <= 3 + 1
        let f = Fixture::new(2).waiting(&[3, 5]);
        assert!(!d.keeps_prefill(&f.candidates[0], &f.candidates[1]));
        let mut f = Fixture::new(2);
        f.candidates[1].saturated = true;
        assert!(!d.keeps_prefill(&f.candidates[0], &f.candidates[1]));
        assert!(DeciderSpec::PrefixBased { non_cached_tokens: 0 }
            .keeps_prefill(&f.candidates[0], &f.candidates[1]));
    }
}
