//! Hashing many prompts in one call.
//!
//! Algorithm: the prompts are cut into at most `threads` contiguous runs of about equal token
//! count; each run is hashed on its own scoped thread (the first on the caller's). Results come
//! back in input order. If any prompt fails, the call returns only the error of the
//! lowest-numbered failing prompt and no output.
//!
//! Complexity: O(total tokens) work, split across threads; one O(prompts) pass to cut the runs.
//!
//! Threads are the caller's choice, one by default: spawning and joining a thread costs tens of
//! microseconds, and on the 2-core development machine, busy with other jobs, a second thread
//! ran slower up to 640,000 tokens (16-token blocks; medians 0.4x at 64,000, 0.8x at 640,000)
//! and from 0.96x to 1.6x faster at 2.5 million, varying run to run. A gateway with idle cores
//! may gain on large batches; `benches/test_bench_hashing.py::test_batch_threads` measures it.

use std::fmt;

use super::{HashError, TokenSlice};

/// A batch failed: `error` occurred in prompt number `prompt`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchError {
    pub prompt: usize,
    pub error: HashError,
}

impl fmt::Display for BatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "prompt {}: {}", self.prompt, self.error)
    }
}

impl std::error::Error for BatchError {}

/// Applies `hash_one` to every prompt on up to `threads` threads (see the module docs).
pub fn hash_batch<O, F>(
    prompts: &[TokenSlice<'_>],
    threads: usize,
    hash_one: F,
) -> Result<Vec<O>, BatchError>
where
    O: Send,
    F: Fn(&TokenSlice<'_>) -> Result<O, HashError> + Sync,
{
    let runs = split_runs(prompts, threads);
    let hash_run = |first: usize, run: &[TokenSlice<'_>]| -> Result<Vec<O>, BatchError> {
        run.iter()
            .enumerate()
            .map(|(i, p)| hash_one(p).map_err(|error| BatchError { prompt: first + i, error }))
            .collect()
    };
    let results: Vec<Result<Vec<O>, BatchError>> = std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(runs.len().saturating_sub(1));
        for &(start, end) in runs.iter().skip(1) {
            let hash_run = &hash_run;
            handles.push(scope.spawn(move || hash_run(start, &prompts[start..end])));
        }
        let mut results = Vec::with_capacity(runs.len());
        if let Some(&(start, end)) = runs.first() {
            results.push(hash_run(start, &prompts[start..end]));
        }
        for handle in handles {
            match handle.join() {
                Ok(result) => results.push(result),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        results
    });
    let mut out = Vec::with_capacity(prompts.len());
    for result in results {
        out.extend(result?);
    }
    Ok(out)
}

/// Cuts `prompts` into at most `threads` non-empty contiguous runs `(start, end)` of about equal
/// token count (a prompt of no tokens still counts as one, so the runs stay balanced in calls).
fn split_runs(prompts: &[TokenSlice<'_>], threads: usize) -> Vec<(usize, usize)> {
    let threads = threads.clamp(1, prompts.len().max(1));
    let weight = |p: &TokenSlice<'_>| p.len().max(1);
    let total: usize = prompts.iter().map(weight).sum();
    let mut runs = Vec::with_capacity(threads);
    let (mut start, mut acc) = (0, 0);
    for (i, p) in prompts.iter().enumerate() {
        acc += weight(p);
        // Close run k once it holds k/threads of the total weight.
        let k = runs.len() + 1;
        if k < threads && acc * threads >= total * k {
            runs.push((start, i + 1));
            start = i + 1;
        }
    }
    if start < prompts.len() {
        runs.push((start, prompts.len()));
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::super::{chain_hashes, ChainHashes};
    use super::*;

    fn prompts(lens: &[usize]) -> Vec<Vec<u32>> {
        lens.iter()
            .enumerate()
            .map(|(i, &n)| (0..n as u32).map(|t| t ^ i as u32).collect())
            .collect()
    }

    #[test]
    fn runs_cover_every_prompt_in_order() {
        for lens in [vec![], vec![5], vec![1, 1, 1, 1, 1], vec![100, 1, 1, 1], vec![0, 0, 7]] {
            let owned = prompts(&lens);
            let slices: Vec<TokenSlice<'_>> = owned.iter().map(|p| TokenSlice::U32(p)).collect();
            for threads in 1..5 {
                let runs = split_runs(&slices, threads);
                assert!(runs.len() <= threads.max(1));
                let mut next = 0;
                for (start, end) in runs {
                    assert_eq!(start, next);
                    assert!(end > start);
                    next = end;
                }
                assert_eq!(next, lens.len());
            }
        }
    }

    #[test]
    fn parallel_equals_sequential() {
        let owned = prompts(&[40, 3, 0, 100, 17, 64, 1]);
        let slices: Vec<TokenSlice<'_>> = owned.iter().map(|p| TokenSlice::U32(p)).collect();
        let visitor = ChainHashes { block_size: 4, chain_seed: 11 };
        let expect: Vec<Vec<u64>> = owned.iter().map(|p| chain_hashes(p, 4, 11).unwrap()).collect();
        for threads in 1..4 {
            assert_eq!(hash_batch(&slices, threads, |s| s.visit(visitor)).unwrap(), expect);
        }
    }

    #[test]
    fn reports_the_lowest_failing_prompt() {
        let good: Vec<i64> = (0..32).collect();
        let bad: Vec<i64> = vec![1, -5, 3, 4];
        let slices = [
            TokenSlice::I64(&good),
            TokenSlice::I64(&bad),
            TokenSlice::I64(&good),
            TokenSlice::I64(&bad),
        ];
        let visitor = ChainHashes { block_size: 2, chain_seed: 0 };
        for threads in 1..4 {
            let err = hash_batch(&slices, threads, |s| s.visit(visitor)).unwrap_err();
            assert_eq!(err.prompt, 1);
            assert_eq!(err.error, HashError::TokenOutOfRange { position: 1, value: -5 });
            assert_eq!(err.to_string(), format!("prompt 1: {}", err.error));
        }
    }
}
