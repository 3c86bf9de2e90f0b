//! Hashing many prompts in one call.
//!
//! Algorithm: the prompts are cut into at most `threads` contiguous runs of about equal token
//! count; each run is hashed on its own scoped thread (the first on the caller's). Results come
//! back in input order. If any prompt fails, the call returns only the error of the
//! lowest-numbered failing prompt and no output.
//!
//! Complexity: O(total tokens) work, split across threads; one O(prompts) pass to cut the runs.
//! Spawning and joining a thread costs tens of microseconds, so [`auto_threads`] only goes
//! parallel from [`PARALLEL_MIN_TOKENS`] tokens. Measured on the 2-core development machine
//! while other jobs kept it busy (min of many runs, 16-token blocks): 2 threads took 2x longer
//! at 16,000 tokens, 0.7x as fast at 256,000, 1.2x faster at 640,000 and 1.6x at 2.5 million
//! (`benches/test_bench_hashing.py::test_batch_threads` repeats this).

use std::fmt;

use super::{HashError, TokenSlice};

/// Smallest batch, in tokens, that [`auto_threads`] hashes on more than one thread.
pub const PARALLEL_MIN_TOKENS: usize = 1 << 19;

/// Most threads [`auto_threads`] picks.
pub const MAX_AUTO_THREADS: usize = 2;

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

/// The thread count for a batch of `total_tokens` tokens: one below [`PARALLEL_MIN_TOKENS`],
/// else up to [`MAX_AUTO_THREADS`] as the machine allows.
pub fn auto_threads(total_tokens: usize) -> usize {
    if total_tokens < PARALLEL_MIN_TOKENS {
        return 1;
    }
    std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_AUTO_THREADS))
}

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

    #[test]
    fn auto_threads_stays_single_for_small_batches() {
        assert_eq!(auto_threads(PARALLEL_MIN_TOKENS - 1), 1);
        assert!((1..=MAX_AUTO_THREADS).contains(&auto_threads(PARALLEL_MIN_TOKENS)));
    }
}
