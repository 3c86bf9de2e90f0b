//! A scheduling profile: filters, weighted scorers and a picker, run over the candidates.
//!
//! Filters run in order and stop early when the set is empty (a fail-open filter that would
//! empty it is skipped instead). Each scorer scores the survivors; the framework clamps every
//! score to [0, 1] (NaN counts as 0), multiplies it by the scorer's weight and sums:
//! `total = sum(clamp(score, 0, 1) * weight)`, not divided by the weight sum (as llm-d).
//! Saturated candidates get 0 from scorers that read metrics.

use std::sync::Arc;

use super::plugin::{Candidate, Filter, OnEmpty, Picker, PluginError, RequestContext, Scorer};
use super::rng::DecisionRng;

pub struct NamedFilter {
    pub name: String,
    pub filter: Arc<dyn Filter>,
}

pub struct WeightedScorer {
    pub name: String,
    pub scorer: Arc<dyn Scorer>,
    pub weight: f64,
}

pub struct Profile {
    pub name: String,
    pub filters: Vec<NamedFilter>,
    pub scorers: Vec<WeightedScorer>,
    pub picker_name: String,
    pub picker: Arc<dyn Picker>,
}

/// Marks a candidate no filter removed.
pub const KEPT: u16 = u16::MAX;

thread_local! {
    /// The list [`Profile::run`] hands its picker, kept for the thread's next run (its
    /// allocation reused; a picker's list is as long as the candidates at most).
    static PICKED: std::cell::Cell<Vec<usize>> = const { std::cell::Cell::new(Vec::new()) };
}

/// What one profile run did, for the decision and for `explain`.
#[derive(Debug, Clone, Default)]
pub struct ProfileOutcome {
    /// Index of the profile in the router's configuration.
    pub profile: usize,
    /// Per base candidate: the index of the filter that removed it, or [`KEPT`].
    pub removed_by: Vec<u16>,
    /// Filters skipped because they would have removed every candidate (fail-open).
    pub skipped_filters: Vec<usize>,
    /// Base indices of the candidates that reached the scorers.
    pub kept: Vec<u32>,
    /// Clamped scores, one column per scorer: `scores[j * kept.len() + i]`.
    pub scores: Vec<f64>,
    /// Weighted totals per kept candidate.
    pub totals: Vec<f64>,
    /// Base indices in picked order: the chosen one first, then fallbacks.
    pub order: Vec<u32>,
}

impl ProfileOutcome {
    /// Base index of the chosen candidate.
    pub fn chosen(&self) -> Option<usize> {
        self.order.first().map(|&i| i as usize)
    }

    /// The clamped score of scorer `j` for kept candidate `i`.
    pub fn score(&self, j: usize, i: usize) -> f64 {
        self.scores[j * self.kept.len() + i]
    }

    /// Per base candidate (`base` of them): its position in [`kept`](Self::kept) and its rank
    /// in [`order`](Self::order), in one pass over each (an explanation of a large pool reads
    /// every row: searching both lists per row was quadratic).
    pub fn positions(&self, base: usize) -> Vec<(Option<usize>, Option<usize>)> {
        let mut out = vec![(None, None); base];
        for (i, &b) in self.kept.iter().enumerate() {
            if let Some(row) = out.get_mut(b as usize) {
                row.0 = Some(i);
            }
        }
        for (rank, &b) in self.order.iter().enumerate() {
            if let Some(row) = out.get_mut(b as usize) {
                row.1 = Some(rank);
            }
        }
        out
    }
}

impl Profile {
    pub fn run(
        &self,
        index: usize,
        ctx: &RequestContext<'_>,
        base: &[Candidate],
        rng: &mut DecisionRng,
    ) -> Result<ProfileOutcome, PluginError> {
        self.run_into(ProfileOutcome::default(), index, ctx, base, rng)
    }

    /// [`Profile::run`], writing into `out`, an earlier outcome whose lists' allocations are
    /// reused (whatever it held is cleared first: the outcome is the one `run` gives).
    pub(crate) fn run_into(
        &self,
        mut out: ProfileOutcome,
        index: usize,
        ctx: &RequestContext<'_>,
        base: &[Candidate],
        rng: &mut DecisionRng,
    ) -> Result<ProfileOutcome, PluginError> {
        out.profile = index;
        out.removed_by.clear();
        out.removed_by.resize(base.len(), KEPT);
        out.skipped_filters.clear();
        out.kept.clear();
        out.kept.extend(0..base.len() as u32);
        out.scores.clear();
        out.totals.clear();
        out.order.clear();
        // Without filters the candidates are the base ones: read in place, not copied.
        let filtered;
        let current: &[Candidate] = if self.filters.is_empty() {
            base
        } else {
            let mut kept = base.to_vec();
            self.apply_filters(ctx, &mut kept, &mut out, rng)?;
            filtered = kept;
            &filtered
        };
        let k = current.len();
        if k == 0 {
            return Ok(out);
        }
        // Filled rather than `vec![0.0; n]`: glibc's `calloc` costs some 300 instructions more
        // than `malloc` for the few words a decision needs.
        out.scores.resize(k * self.scorers.len(), 0.0);
        out.totals.resize(k, 0.0);
        for (j, ws) in self.scorers.iter().enumerate() {
            let column = &mut out.scores[j * k..(j + 1) * k];
            run_scorer(ws, ctx, current, column)?;
            for (t, s) in out.totals.iter_mut().zip(column.iter_mut()) {
                *s = if s.is_nan() { 0.0 } else { s.clamp(0.0, 1.0) };
                *t += *s * ws.weight;
            }
        }
        // The picker's list, on the thread's reused one (a run nested in a plugin finds it
        // taken, and makes its own): only the decision's own list is allocated per run.
        let mut order = PICKED.take();
        order.clear();
        let picked = self.picker.pick(ctx, current, &out.totals, rng, &mut order);
        order.truncate(self.picker.limit());
        if picked.is_ok() {
            out.order.extend(order.iter().filter(|&&i| i < k).map(|&i| out.kept[i]));
        }
        order.clear();
        PICKED.set(order);
        picked.map_err(|source| PluginError { plugin: self.picker_name.clone(), source })?;
        Ok(out)
    }

    fn apply_filters(
        &self,
        ctx: &RequestContext<'_>,
        current: &mut Vec<Candidate>,
        out: &mut ProfileOutcome,
        rng: &mut DecisionRng,
    ) -> Result<(), PluginError> {
        for (f, nf) in self.filters.iter().enumerate() {
            if current.is_empty() {
                break;
            }
            let mut keep = vec![true; current.len()];
            nf.filter
                .filter(ctx, current, &mut keep, rng)
                .map_err(|source| PluginError { plugin: nf.name.clone(), source })?;
            if !keep.iter().any(|&k| k) && nf.filter.on_empty() == OnEmpty::FailOpen {
                out.skipped_filters.push(f);
                continue;
            }
            let mut i = 0;
            current.retain(|_| {
                i += 1;
                keep[i - 1]
            });
            let mut i = 0;
            out.kept.retain(|&b| {
                i += 1;
                if !keep[i - 1] {
                    out.removed_by[b as usize] = f as u16;
                }
                keep[i - 1]
            });
        }
        Ok(())
    }
}

/// Runs one scorer; saturated candidates get 0 from scorers that read metrics, and the scorer
/// sees only the fresh ones (so min-max normalisation ignores stale values).
fn run_scorer(
    ws: &WeightedScorer,
    ctx: &RequestContext<'_>,
    current: &[Candidate],
    column: &mut [f64],
) -> Result<(), PluginError> {
    let wrap = |source| PluginError { plugin: ws.name.clone(), source };
    if !(ws.scorer.reads_metrics() && current.iter().any(|c| c.saturated)) {
        return ws.scorer.score(ctx, current, column).map_err(wrap);
    }
    let fresh: Vec<Candidate> = current.iter().filter(|c| !c.saturated).copied().collect();
    let mut fresh_scores = vec![0.0; fresh.len()];
    if !fresh.is_empty() {
        ws.scorer.score(ctx, &fresh, &mut fresh_scores).map_err(wrap)?;
    }
    let mut next = fresh_scores.into_iter();
    for (s, c) in column.iter_mut().zip(current) {
        *s = if c.saturated { 0.0 } else { next.next().unwrap_or(0.0) };
    }
    Ok(())
}
