//! `decision-tree-filter` (the Inference Extension's; older name `decision-tree`): runs its
//! `current` filter, then one of its branches, each a filter by `pluginRef` or a nested
//! `decisionTree`:
//!
//! - success (`current` kept some endpoint): `nextOnSuccess`, else `nextOnSuccessOrFailure`,
//!   runs on the endpoints `current` kept; with neither, those endpoints are the result;
//! - failure (`current` kept none): `nextOnFailure`, else `nextOnSuccessOrFailure`, runs on the
//!   endpoints `current` was given (the failed filter's input, not its empty output); with
//!   neither, the result is empty.
//!
//! These are the Extension's branch semantics; its original default profile is a tree of
//! `low-queue-filter`, `lora-affinity-filter`, `least-queue-filter` and `least-kv-cache-filter`.
//! A fail-open filter inside a tree that would keep nothing keeps everything instead (it never
//! fails), as it would in a profile. The tree as a whole fails closed. References are resolved
//! when the whole configuration is read (see `config`), so a tree may name filters defined after
//! it, and other trees; a cycle is an error.

use std::sync::Arc;

use serde_json::{Map, Value};

use crate::routing::plugin::{Candidate, Filter, OnEmpty, PluginResult, RequestContext};
use crate::routing::registry::{ParamDoc, ParamError, Plugin, PluginDoc};
use crate::routing::rng::DecisionRng;

/// One node: a filter by name, or a nested tree.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    Ref { name: String, path: String },
    Tree(Box<TreeSpec>),
}

/// A tree as configured, its references not yet resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct TreeSpec {
    pub current: Node,
    pub on_success: Option<Node>,
    pub on_failure: Option<Node>,
    pub either: Option<Node>,
}

const KEYS: [&str; 4] = ["current", "nextOnSuccess", "nextOnFailure", "nextOnSuccessOrFailure"];

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

fn parse_tree(v: &Value, path: &str) -> Result<TreeSpec, ParamError> {
    let map = v.as_object().ok_or_else(|| ParamError::new(path, "must be a mapping"))?;
    if let Some(k) = map.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(ParamError::new(
            &join(path, k),
            format!("unknown key (expected one of {KEYS:?})"),
        ));
    }
    let node = |key: &str| -> Result<Option<Node>, ParamError> {
        map.get(key).map(|v| parse_node(v, &join(path, key))).transpose()
    };
    let current =
        node("current")?.ok_or_else(|| ParamError::new(&join(path, "current"), "is required"))?;
    Ok(TreeSpec {
        current,
        on_success: node("nextOnSuccess")?,
        on_failure: node("nextOnFailure")?,
        either: node("nextOnSuccessOrFailure")?,
    })
}

fn parse_node(v: &Value, path: &str) -> Result<Node, ParamError> {
    let map: &Map<String, Value> =
        v.as_object().ok_or_else(|| ParamError::new(path, "must be a mapping"))?;
    if let Some(k) = map.keys().find(|k| !["pluginRef", "decisionTree"].contains(&k.as_str())) {
        return Err(ParamError::new(
            &join(path, k),
            "unknown key (expected pluginRef or decisionTree)",
        ));
    }
    match (map.get("pluginRef"), map.get("decisionTree")) {
        (Some(_), Some(_)) => {
            Err(ParamError::new(path, "give either pluginRef or decisionTree, not both"))
        }
        (Some(Value::String(name)), None) if !name.is_empty() => {
            Ok(Node::Ref { name: name.clone(), path: join(path, "pluginRef") })
        }
        (Some(_), None) => {
            Err(ParamError::new(&join(path, "pluginRef"), "must be a non-empty string"))
        }
        (None, Some(tree)) => {
            Ok(Node::Tree(Box::new(parse_tree(tree, &join(path, "decisionTree"))?)))
        }
        (None, None) => Err(ParamError::new(path, "needs pluginRef or decisionTree")),
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    if params.is_null() {
        return Err(ParamError::new("current", "is required"));
    }
    Ok(Plugin::Tree(Arc::new(parse_tree(params, "")?)))
}

/// Looks a referenced filter up by (name, parameter path).
pub type Resolve<'a> = dyn FnMut(&str, &str) -> Result<Arc<dyn Filter>, ParamError> + 'a;

/// The built filter.
pub struct DecisionTreeFilter {
    current: Arc<dyn Filter>,
    on_success: Option<Arc<dyn Filter>>,
    on_failure: Option<Arc<dyn Filter>>,
    either: Option<Arc<dyn Filter>>,
}

impl DecisionTreeFilter {
    /// Builds `spec`, looking every referenced filter up with `resolve(name, path)`.
    pub fn build(
        spec: &TreeSpec,
        resolve: &mut Resolve<'_>,
    ) -> Result<DecisionTreeFilter, ParamError> {
        let mut node = |n: &Node| -> Result<Arc<dyn Filter>, ParamError> {
            match n {
                Node::Ref { name, path } => resolve(name, path),
                Node::Tree(t) => Ok(Arc::new(DecisionTreeFilter::build(t, &mut *resolve)?)),
            }
        };
        let current = node(&spec.current)?;
        let mut opt = |n: &Option<Node>| n.as_ref().map(&mut node).transpose();
        Ok(DecisionTreeFilter {
            current,
            on_success: opt(&spec.on_success)?,
            on_failure: opt(&spec.on_failure)?,
            either: opt(&spec.either)?,
        })
    }
}

/// Runs `f` over `cands` into `keep` (all true on entry); a fail-open filter that keeps nothing
/// keeps everything.
fn apply(
    f: &dyn Filter,
    ctx: &RequestContext<'_>,
    cands: &[Candidate],
    keep: &mut [bool],
    rng: &mut DecisionRng,
) -> PluginResult {
    f.filter(ctx, cands, keep, rng)?;
    if !keep.contains(&true) && f.on_empty() == OnEmpty::FailOpen {
        keep.fill(true);
    }
    Ok(())
}

impl Filter for DecisionTreeFilter {
    fn filter(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        keep: &mut [bool],
        rng: &mut DecisionRng,
    ) -> PluginResult {
        let mut first = vec![true; cands.len()];
        apply(self.current.as_ref(), ctx, cands, &mut first, rng)?;
        if first.contains(&true) {
            let Some(next) = self.on_success.as_ref().or(self.either.as_ref()) else {
                keep.copy_from_slice(&first);
                return Ok(());
            };
            let kept: Vec<usize> = (0..cands.len()).filter(|&i| first[i]).collect();
            let subset: Vec<Candidate> = kept.iter().map(|&i| cands[i]).collect();
            let mut second = vec![true; subset.len()];
            apply(next.as_ref(), ctx, &subset, &mut second, rng)?;
            keep.fill(false);
            for (&i, &k) in kept.iter().zip(&second) {
                keep[i] = k;
            }
        } else {
            match self.on_failure.as_ref().or(self.either.as_ref()) {
                None => keep.fill(false),
                Some(next) => {
                    keep.fill(true);
                    apply(next.as_ref(), ctx, cands, keep, rng)?;
                }
            }
        }
        Ok(())
    }

    fn on_empty(&self) -> OnEmpty {
        OnEmpty::FailClosed
    }

    fn reads_prefix_match(&self) -> bool {
        std::iter::once(&self.current)
            .chain(&self.on_success)
            .chain(&self.on_failure)
            .chain(&self.either)
            .any(|f| f.reads_prefix_match())
    }
}

const PARAMS: &[ParamDoc] = &[
    ParamDoc::mapping("current", "`{pluginRef}` or `{decisionTree}`: the filter run first")
        .required(),
    ParamDoc::mapping("nextOnSuccess", "node run on what `current` kept"),
    ParamDoc::mapping("nextOnFailure", "node run on what `current` was given when it kept nothing"),
    ParamDoc::mapping("nextOnSuccessOrFailure", "node run when the matching branch is absent"),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new("filter", "runs `current`, then a branch on success or failure (the Inference Extension's tree); fails closed", PARAMS, Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::filters::{least_kv_cache, least_queue, low_queue};
    use crate::routing::testing::Fixture;
    use serde_json::json;

    fn filter_of(p: Plugin) -> Arc<dyn Filter> {
        match p {
            Plugin::Filter(f) => f,
            _ => panic!("not a filter"),
        }
    }

    fn build(params: Value) -> DecisionTreeFilter {
        let Plugin::Tree(spec) = factory(&params).unwrap() else { panic!() };
        DecisionTreeFilter::build(&spec, &mut |name, path| match name {
            "low" => Ok(filter_of(low_queue::factory(&json!({"threshold": 5})).unwrap())),
            "lq" => Ok(filter_of(least_queue::factory(&Value::Null).unwrap())),
            "lkv" => Ok(filter_of(least_kv_cache::factory(&Value::Null).unwrap())),
            _ => Err(ParamError::new(path, format!("no filter {name:?}"))),
        })
        .unwrap()
    }

    #[test]
    fn success_passes_the_kept_set_failure_the_input() {
        let tree = build(json!({
            "current": {"pluginRef": "low"},
            "nextOnSuccess": {"pluginRef": "lkv"},
            "nextOnFailure": {"pluginRef": "lq"}
        }));
        // Success: low keeps 0, 1 (queues <= 5); least-kv over those keeps 1 (band [0.2, 0.55]).
        let f = Fixture::new(3).waiting(&[1, 2, 9]).kv(&[0.9, 0.2, 0.0]);
        assert_eq!(f.filter(&tree), vec![1]);
        // Failure: every queue > 5; least-queue over all three keeps band [6, 6 + 12 / 3 = 10].
        let f = Fixture::new(3).waiting(&[6, 10, 18]).kv(&[0.9, 0.2, 0.0]);
        assert_eq!(f.filter(&tree), vec![0, 1]);
    }

    #[test]
    fn either_branch_and_leaves() {
        let either = build(json!({
            "current": {"pluginRef": "low"},
            "nextOnSuccessOrFailure": {"decisionTree": {"current": {"pluginRef": "lq"}}}
        }));
        let f = Fixture::new(3).waiting(&[6, 7, 30]);
        assert_eq!(f.filter(&either), vec![0, 1]); // failure: least-queue over all
        let f = Fixture::new(3).waiting(&[0, 5, 6]);
        assert_eq!(f.filter(&either), vec![0]); // success: least-queue over {0, 5}: band [0, 2]
        let leaf = build(json!({"current": {"pluginRef": "low"}}));
        assert_eq!(Fixture::new(2).waiting(&[9, 9]).filter(&leaf), Vec::<usize>::new());
        assert_eq!(Fixture::new(2).waiting(&[9, 1]).filter(&leaf), vec![1]);
        // nextOnSuccess wins over nextOnSuccessOrFailure on success, and only then.
        let both = build(json!({
            "current": {"pluginRef": "low"},
            "nextOnSuccess": {"pluginRef": "lkv"},
            "nextOnSuccessOrFailure": {"pluginRef": "lq"}
        }));
        let f = Fixture::new(2).waiting(&[0, 3]).kv(&[0.9, 0.1]);
        assert_eq!(f.filter(&both), vec![1]);
        let f = Fixture::new(2).waiting(&[6, 20]).kv(&[0.9, 0.1]);
        assert_eq!(f.filter(&both), vec![0]);
    }

    #[test]
    fn param_errors_name_the_field() {
        let cases = [
            (json!({}), "current"),
            (json!({"current": {"pluginRef": "a"}, "nextOnSucess": {}}), "nextOnSucess"),
            (json!({"current": {}}), "current"),
            (json!({"current": {"pluginRef": 3}}), "current.pluginRef"),
            (
                json!({"current": {"pluginRef": "a", "decisionTree": {"current": {"pluginRef": "b"}}}}),
                "current",
            ),
            (
                json!({"current": {"pluginRef": "a"}, "nextOnFailure": {"decisionTree": {"nextOnFailure": {"pluginRef": "b"}}}}),
                "nextOnFailure.decisionTree.current",
            ),
        ];
        for (params, path) in cases {
            let e = factory(&params).err().unwrap();
            assert_eq!(e.path, path, "{params}: {e:?}");
        }
        assert_eq!(factory(&Value::Null).err().unwrap().path, "current");
    }
}
