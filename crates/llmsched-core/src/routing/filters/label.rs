//! Label filters. Both fail closed (a selector that matches nothing means no endpoint).
//!
//! - `by-label`: keeps endpoints whose label `label` has one of `validValues`; endpoints without
//!   the label are kept only with `allowsNoLabel: true`.
//! - `label-selector-filter` (llm-d's current name; `by-label-selector` is its earlier one): a
//!   Kubernetes-style selector: every `matchLabels` pair must match, and
//!   every `matchExpressions` entry (`key`, `operator` In / NotIn / Exists / DoesNotExist,
//!   `values`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, Filter, OnEmpty, PluginResult, RequestContext};
use crate::routing::registry::{decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct ByLabelParams {
    label: String,
    valid_values: Vec<String>,
    allows_no_label: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Expression {
    key: String,
    operator: Operator,
    #[serde(default)]
    values: Vec<String>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct SelectorParams {
    match_labels: BTreeMap<String, String>,
    match_expressions: Vec<Expression>,
}

enum Rule {
    ByLabel(ByLabelParams),
    Selector(SelectorParams),
}

pub struct LabelFilter {
    rule: Rule,
}

impl LabelFilter {
    fn admits(&self, labels: &BTreeMap<String, String>) -> bool {
        match &self.rule {
            Rule::ByLabel(p) => match labels.get(&p.label) {
                Some(v) => p.valid_values.contains(v),
                None => p.allows_no_label,
            },
            Rule::Selector(p) => {
                p.match_labels.iter().all(|(k, v)| labels.get(k) == Some(v))
                    && p.match_expressions.iter().all(|e| {
                        let value = labels.get(&e.key);
                        match e.operator {
                            Operator::In => value.is_some_and(|v| e.values.contains(v)),
                            Operator::NotIn => !value.is_some_and(|v| e.values.contains(v)),
                            Operator::Exists => value.is_some(),
                            Operator::DoesNotExist => value.is_none(),
                        }
                    })
            }
        }
    }
}

impl Filter for LabelFilter {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn filter(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        keep: &mut [bool],
        _: &mut DecisionRng,
    ) -> PluginResult {
        for (k, c) in keep.iter_mut().zip(cands) {
            *k = self.admits(&ctx.endpoint(c).labels);
        }
        Ok(())
    }

    fn on_empty(&self) -> OnEmpty {
        OnEmpty::FailClosed
    }
}

pub fn by_label_factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: ByLabelParams = decode(params)?;
    if p.label.is_empty() {
        return Err(ParamError::new("label", "is required"));
    }
    Ok(Plugin::filter(LabelFilter { rule: Rule::ByLabel(p) }))
}

pub fn selector_factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: SelectorParams = decode(params)?;
    for (i, e) in p.match_expressions.iter().enumerate() {
        let needs_values = matches!(e.operator, Operator::In | Operator::NotIn);
        if needs_values == e.values.is_empty() {
            let msg = if needs_values { "In/NotIn need values" } else { "takes no values" };
            return Err(ParamError::new(&format!("matchExpressions[{i}].values"), msg));
        }
    }
    Ok(Plugin::filter(LabelFilter { rule: Rule::Selector(p) }))
}

const BY_LABEL_PARAMS: &[ParamDoc] = &[
    ParamDoc::string("label", "the label key").required(),
    ParamDoc::list("validValues", "accepted values of the label"),
    ParamDoc::boolean("allowsNoLabel", "keep endpoints without the label"),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn by_label_doc() -> PluginDoc {
    PluginDoc::new(
        "filter",
        "keeps endpoints whose label `label` has one of `validValues`; fails closed",
        BY_LABEL_PARAMS,
        defaults_of::<ByLabelParams>(),
    )
}

const SELECTOR_PARAMS: &[ParamDoc] = &[
    ParamDoc::mapping("matchLabels", "label pairs that must all match"),
    ParamDoc::list(
        "matchExpressions",
        "`{key, operator: In | NotIn | Exists | DoesNotExist, values}` entries that must all hold",
    ),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn selector_doc() -> PluginDoc {
    PluginDoc::new(
        "filter",
        "keeps endpoints matching a Kubernetes-style label selector; fails closed",
        SELECTOR_PARAMS,
        defaults_of::<SelectorParams>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::endpoint::Endpoint;
    use crate::routing::pool::{Member, Members};
    use crate::routing::testing::Fixture;
    use serde_json::json;
    use std::sync::Arc;

    fn fixture() -> Fixture {
        let labels: [&[(&str, &str)]; 4] =
            [&[("tier", "gold")], &[("tier", "silver")], &[], &[("tier", "gold"), ("zone", "a")]];
        let mut f = Fixture::new(4);
        let list = f
            .members
            .list
            .iter()
            .zip(labels)
            .map(|(m, ls)| {
                let labels = ls.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
                Arc::new(Member::new(Endpoint { labels, ..m.endpoint.clone() }))
            })
            .collect();
        f.members = Members::build(list);
        f
    }

    fn build(factory: impl Fn(&Value) -> Result<Plugin, ParamError>, p: &Value) -> Arc<dyn Filter> {
        match factory(p) {
            Ok(Plugin::Filter(f)) => f,
            _ => panic!("{p}"),
        }
    }

    #[test]
    fn table() {
        let f = fixture();
        type Factory = fn(&Value) -> Result<Plugin, ParamError>;
        let cases: Vec<(Factory, Value, Vec<usize>)> = vec![
            (by_label_factory, json!({"label": "tier", "validValues": ["gold"]}), vec![0, 3]),
            (
                by_label_factory,
                json!({"label": "tier", "validValues": ["silver"], "allowsNoLabel": true}),
                vec![1, 2],
            ),
            (selector_factory, json!({"matchLabels": {"tier": "gold", "zone": "a"}}), vec![3]),
            (
                selector_factory,
                json!({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["gold"]}]}),
                vec![1, 2],
            ),
            (
                selector_factory,
                json!({"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]}),
                vec![0, 1, 2],
            ),
            (
                selector_factory,
                json!({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}),
                vec![0, 1, 3],
            ),
        ];
        for (factory, params, want) in cases {
            assert_eq!(f.filter(&*build(factory, &params)), want, "{params}");
        }
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(by_label_factory(&json!({})).err().unwrap().path, "label");
        let e = selector_factory(&json!({"matchExpressions": [{"key": "a", "operator": "In"}]}));
        assert_eq!(e.err().unwrap().path, "matchExpressions[0].values");
        let e = selector_factory(&json!({"matchExpressions": [{"key": "a", "operator": "Eq"}]}));
        assert_eq!(e.err().unwrap().path, "matchExpressions[0].operator");
    }
}
