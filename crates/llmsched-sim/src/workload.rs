//! Workload plans built natively: the per-request work of the Python workload classes
//! (`llmsched.sim.workloads`), drawn from the same random streams in the same order, so the
//! plan equals the one those classes build for the same seed (the Python classes stay the
//! oracle; `tests/test_sim_workloads.py` compares the two for every workload kind).
//!
//! What stays in Python is what is cheap and vectorised there: the arrival times (numpy's
//! exponential and gamma draws go through its ziggurat tables), the per-request class draws,
//! the shared prompts of `shared_prefix` and the system prompts of `agentic`. Python hands over
//! those arrays and the numpy generator's state after them; everything per request or per
//! session (token content, block hashes, lengths, think times) happens here.
//!
//! Cost: one PCG64 draw per two tokens and one xxh3 per block; a trace block named by a
//! `hash_ids` id is generated once per distinct (prefix, id) pair that more than one request
//! uses, and once per request otherwise.

use std::ops::Range;
use std::sync::Arc;

use hashbrown::HashMap;
use llmsched_core::hashing::{chain_hashes_into, check_block_size};
use serde_json::Value;

use crate::plan::{Contents, OpenRequest, Plan, Session, Turn};
use crate::rng::{words, Pcg64, PyRandom};

/// Token ids are drawn below this (`llmsched.sim.workloads.VOCAB`).
pub const VOCAB: u32 = 128_000;
/// Fresh block ids are drawn in `[1, U64_TOP)` (`workloads.U64_TOP`, numpy's int64 max).
pub const U64_TOP: i64 = i64::MAX;
/// The longest prompt or output a trace line may ask for (tokens).
pub const MAX_TRACE_TOKENS: u64 = 1 << 24;

/// Why a workload cannot be built (`ConfigError` in Python).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct WorkloadError(pub String);

fn err<T>(message: impl Into<String>) -> Result<T, WorkloadError> {
    Err(WorkloadError(message.into()))
}

/// A growing token sequence's chained block hashes (`workloads.Conversation` without its
/// tokens): the hashes go to the plan's array, only the unhashed tail is kept.
#[derive(Debug, Clone, Default)]
struct Conv {
    length: usize,
    tail: Vec<u32>,
    /// The last hash of the chain, or the chain seed while there is none.
    last: u64,
    /// Hashes written so far.
    blocks: usize,
}

impl Conv {
    fn new(chain_seed: u64) -> Self {
        Conv { last: chain_seed, ..Conv::default() }
    }

    /// Hashes the full blocks of the tail (after tokens were pushed onto it) into `out`.
    fn settle(&mut self, block_size: usize, out: &mut Vec<u64>) -> Result<(), WorkloadError> {
        let full = self.tail.len() - self.tail.len() % block_size;
        if full == 0 {
            return Ok(());
        }
        let before = out.len();
        chain_hashes_into(&self.tail[..full], block_size, self.last, out)
            .map_err(|e| WorkloadError(e.to_string()))?;
        self.blocks += out.len() - before;
        self.last = out[out.len() - 1];
        self.tail.drain(..full);
        Ok(())
    }

    /// `append(_tokens(rng, n))`: `n` random tokens.
    fn append_random(
        &mut self,
        rng: &mut Pcg64,
        n: usize,
        block_size: usize,
        out: &mut Vec<u64>,
    ) -> Result<(), WorkloadError> {
        rng.fill_u32(0, VOCAB, n, &mut self.tail);
        self.length += n;
        self.settle(block_size, out)
    }

    /// `append(tokens)`.
    fn append(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        out: &mut Vec<u64>,
    ) -> Result<(), WorkloadError> {
        self.tail.extend_from_slice(tokens);
        self.length += tokens.len();
        self.settle(block_size, out)
    }
}

/// `_Base._single`'s fresh ids: the blocks of prompt plus output beyond `have` get random ids.
fn fresh_blocks(
    rng: &mut Pcg64,
    prompt_len: u64,
    output_len: u64,
    have: usize,
    block_size: usize,
    out: &mut Vec<u64>,
) {
    let full = ((prompt_len + output_len) / block_size as u64) as usize;
    if full > have {
        rng.fill_i64(1, U64_TOP, full - have, out);
    }
}

/// `workloads._length`: a gamma-distributed positive length (`cv <= 0`: the mean).
pub fn length(rng: &mut PyRandom, mean: f64, cv: f64) -> Result<u64, WorkloadError> {
    let value = if cv <= 0.0 {
        mean.round_ties_even()
    } else {
        if !(mean > 0.0 && mean.is_finite() && cv.is_finite()) {
            return err(format!("a mean length must be > 0 with length_cv > 0, got {mean}"));
        }
        let shape = 1.0 / (cv * cv);
        rng.gammavariate(shape, mean / shape).round_ties_even()
    };
    if value.is_nan() {
        return err(format!("mean length must be a number, got {mean}"));
    }
    // Python's max(1, round(x)); the cap keeps absurd means from allocating without bound.
    let value = value.max(1.0);
    if value > MAX_TRACE_TOKENS as f64 {
        return err(format!("a drawn length {value} is above {MAX_TRACE_TOKENS} tokens"));
    }
    Ok(value as u64)
}

fn check(block_size: usize) -> Result<(), WorkloadError> {
    check_block_size(block_size).map_err(|e| WorkloadError(e.to_string()))
}

/// Independent single-turn requests (`long_short`, `priority`): each request's prompt is
/// `length(mean_input)` fresh tokens and its output `length(mean_output)`.
#[derive(Debug, Clone, Copy)]
pub struct Independent<'a> {
    pub arrival: &'a [f64],
    pub mean_input: &'a [f64],
    pub mean_output: &'a [f64],
    pub tenant: &'a [i64],
    pub priority: &'a [i64],
    pub length_cv: f64,
}

/// The plan of [`Independent`] requests: tokens and fresh ids from `rng` (the workload's
/// generator after the arrival and class draws), lengths from `scalar` (`random.Random(seed)`).
pub fn independent_plan(
    spec: Independent<'_>,
    mut rng: Pcg64,
    mut scalar: PyRandom,
    block_size: usize,
    chain_seed: u64,
) -> Result<Plan<'static>, WorkloadError> {
    check(block_size)?;
    let n = spec.arrival.len();
    if [spec.mean_input.len(), spec.mean_output.len(), spec.tenant.len(), spec.priority.len()]
        .iter()
        .any(|&len| len != n)
    {
        return err("workload arrays differ in length");
    }
    let mut plan = Plan::default();
    plan.open.reserve(n);
    for i in 0..n {
        let start = plan.hashes.len();
        let mut conv = Conv::new(chain_seed);
        let input = length(&mut scalar, spec.mean_input[i], spec.length_cv)?;
        conv.append_random(&mut rng, input as usize, block_size, plan.hashes.to_mut())?;
        let output = length(&mut scalar, spec.mean_output[i], spec.length_cv)?;
        fresh_blocks(&mut rng, input, output, conv.blocks, block_size, plan.hashes.to_mut());
        plan.open.push(OpenRequest {
            arrival: spec.arrival[i],
            prompt_len: input,
            output_len: output,
            tenant: spec.tenant[i],
            priority: spec.priority[i],
            session: None,
            hashes: start..plan.hashes.len(),
        });
    }
    Ok(plan)
}

/// Requests over prompts built beforehand (`shared_prefix`): request `i` asks prompt
/// `pick[i]` (whose hashes are `prompt_hashes[prompt_spans[pick[i]]]`).
#[derive(Debug, Clone, Copy)]
pub struct Prompted<'a> {
    pub prompt_hashes: &'a [u64],
    pub prompt_spans: &'a [Range<usize>],
    pub prompt_len: &'a [u64],
    pub arrival: &'a [f64],
    pub pick: &'a [usize],
    pub tenant: &'a [i64],
    pub output_len: u64,
}

/// The plan of [`Prompted`] requests; the outputs' fresh ids come from `rng`.
pub fn prompted_plan(
    spec: Prompted<'_>,
    mut rng: Pcg64,
    block_size: usize,
) -> Result<Plan<'static>, WorkloadError> {
    check(block_size)?;
    let n = spec.arrival.len();
    if spec.pick.len() != n
        || spec.tenant.len() != n
        || spec.prompt_len.len() != spec.prompt_spans.len()
    {
        return err("workload arrays differ in length");
    }
    if spec.prompt_spans.iter().any(|s| s.start > s.end || s.end > spec.prompt_hashes.len()) {
        return err("prompt hash ranges out of bounds");
    }
    let mut plan = Plan::default();
    plan.open.reserve(n);
    for i in 0..n {
        let Some(span) = spec.prompt_spans.get(spec.pick[i]) else {
            return err(format!("request {i} picks prompt {} of {}", spec.pick[i], n));
        };
        let start = plan.hashes.len();
        plan.hashes.to_mut().extend_from_slice(&spec.prompt_hashes[span.clone()]);
        let prompt_len = spec.prompt_len[spec.pick[i]];
        fresh_blocks(
            &mut rng,
            prompt_len,
            spec.output_len,
            span.len(),
            block_size,
            plan.hashes.to_mut(),
        );
        plan.open.push(OpenRequest {
            arrival: spec.arrival[i],
            prompt_len,
            output_len: spec.output_len,
            tenant: spec.tenant[i],
            priority: 0,
            session: None,
            hashes: start..plan.hashes.len(),
        });
    }
    Ok(plan)
}

/// `AgenticConfig`'s numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Agentic {
    pub sessions: usize,
    pub first_input: f64,
    pub first_output: f64,
    pub followup_turns: usize,
    pub followup_input: f64,
    pub followup_output: f64,
    pub length_cv: f64,
    pub think_time_s: f64,
    pub system_prompt_len: f64,
}

/// Requests a planned workload may make (`llmsched.sim.workloads.MAX_REQUESTS`).
pub const MAX_REQUESTS: usize = 10_000_000;

/// The session scripts of an agentic workload (`AgenticWorkload.script` for every session):
/// session `sid` draws its tokens from `default_rng([seed, sid])` and its tenant, lengths and
/// think times from `random.Random(seed * 1_000_003 + sid)`. `systems` are the system prompts'
/// tokens, `starts` the start times the arrival stream gives.
pub fn agentic_plan(
    cfg: Agentic,
    systems: &[Vec<u32>],
    starts: Vec<f64>,
    closed: bool,
    seed: u64,
    block_size: usize,
    chain_seed: u64,
) -> Result<Plan<'static>, WorkloadError> {
    check(block_size)?;
    if systems.is_empty() || u32::try_from(systems.len()).is_err() {
        return err("agentic: system_prompts must be >= 1");
    }
    // Written out in full before the run: an unchecked count would be an allocation that
    // aborts the process.
    let requests = cfg.followup_turns.checked_add(1).and_then(|t| t.checked_mul(cfg.sessions));
    if requests.is_none_or(|r| r > MAX_REQUESTS) {
        return err(format!(
            "agentic: {} sessions of {} follow-up turns: more than {MAX_REQUESTS} requests",
            cfg.sessions, cfg.followup_turns
        ));
    }
    // The system prompts once: their hashes, and the state a session's conversation copies.
    let mut system_hashes = Vec::with_capacity(systems.len());
    let mut system_convs = Vec::with_capacity(systems.len());
    for tokens in systems {
        let mut hashes = Vec::new();
        let mut conv = Conv::new(chain_seed);
        conv.append(tokens, block_size, &mut hashes)?;
        system_hashes.push(hashes);
        system_convs.push(conv);
    }
    let user_mean = cfg.first_input - cfg.system_prompt_len;
    let mut plan = Plan { starts, closed, ..Plan::default() };
    plan.sessions.reserve(cfg.sessions);
    for sid in 0..cfg.sessions {
        let entropy: Vec<u32> =
            words(u128::from(seed)).into_iter().chain(words(sid as u128)).collect();
        let mut rng = Pcg64::from_entropy(&entropy);
        let mut scalar = PyRandom::new(u128::from(seed) * 1_000_003 + sid as u128);
        let tenant = scalar.randbelow(systems.len() as u32) as usize;
        let start = plan.hashes.len();
        plan.hashes.to_mut().extend_from_slice(&system_hashes[tenant]);
        let mut conv = system_convs[tenant].clone();
        let user = length(&mut scalar, user_mean, cfg.length_cv)?;
        conv.append_random(&mut rng, user as usize, block_size, plan.hashes.to_mut())?;
        let mut output = length(&mut scalar, cfg.first_output, cfg.length_cv)?;
        let mut turns = Vec::with_capacity(cfg.followup_turns + 1);
        for turn in 0..=cfg.followup_turns {
            if turn > 0 {
                let message = length(&mut scalar, cfg.followup_input, cfg.length_cv)?;
                conv.append_random(&mut rng, message as usize, block_size, plan.hashes.to_mut())?;
                output = length(&mut scalar, cfg.followup_output, cfg.length_cv)?;
            }
            let prompt_len = conv.length as u64;
            conv.append_random(&mut rng, output as usize, block_size, plan.hashes.to_mut())?;
            let think = if cfg.think_time_s > 0.0 {
                scalar.expovariate(1.0 / cfg.think_time_s)
            } else {
                0.0
            };
            turns.push(Turn { prompt_len, output_len: output, blocks: conv.blocks, think });
        }
        plan.sessions.push(Session {
            tenant: tenant as i64,
            hashes: start..plan.hashes.len(),
            turns,
        });
    }
    Ok(plan)
}

// -- traces -----------------------------------------------------------------------------------

/// A timestamp as JSON wrote it: Python subtracts integers exactly and floats as floats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Stamp {
    Int(i64),
    Float(f64),
}

impl Stamp {
    fn as_f64(self) -> f64 {
        match self {
            Stamp::Int(i) => i as f64,
            Stamp::Float(f) => f,
        }
    }

    /// `a - b` as Python computes it for ints and floats.
    fn minus(self, other: Stamp) -> f64 {
        match (self, other) {
            (Stamp::Int(a), Stamp::Int(b)) => (i128::from(a) - i128::from(b)) as f64,
            _ => self.as_f64() - other.as_f64(),
        }
    }

    fn cmp(self, other: Stamp) -> std::cmp::Ordering {
        match (self, other) {
            (Stamp::Int(a), Stamp::Int(b)) => a.cmp(&b),
            _ => self.as_f64().total_cmp(&other.as_f64()),
        }
    }
}

/// One trace line, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRow {
    pub timestamp: Stamp,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
    pub tenant: i64,
    pub priority: i64,
    pub session: Option<String>,
}

/// `TraceConfig`'s replay settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceSpec {
    /// Timestamps in milliseconds (else seconds).
    pub millis: bool,
    pub time_scale: f64,
    pub hash_block: usize,
    pub limit: Option<usize>,
}

/// A non-negative JSON number (not a bool), as Python's trace checks accept it.
fn number(value: Option<&Value>) -> Option<Stamp> {
    let Some(Value::Number(n)) = value else { return None };
    if n.is_i64() || n.is_u64() {
        // Python takes integers up to numpy's int64 max.
        return n.as_i64().filter(|&i| i >= 0).map(Stamp::Int);
    }
    let f = n.as_f64()?;
    (f >= 0.0 && f.is_finite()).then_some(Stamp::Float(f))
}

fn shown(value: Option<&Value>) -> String {
    value.map_or_else(|| "None".to_string(), Value::to_string)
}

/// The JSON text of `key` in `line` when that value is an integer literal too large for an
/// `i64` or `u64` (serde_json reads those as floats; Python reads them as ints), else `None`.
/// Only such a float is looked up (a second parse of the line), so a trace of ordinary rows
/// is parsed once.
fn big_int_literal(line: &str, value: Option<&Value>, key: &str) -> Option<String> {
    let Some(Value::Number(n)) = value else { return None };
    if !n.is_f64() || n.as_f64().is_some_and(|f| f.abs() < 9.2e18) {
        return None;
    }
    let mut raw: std::collections::HashMap<String, Box<serde_json::value::RawValue>> =
        serde_json::from_str(line).ok()?;
    let text = raw.remove(key)?.get().trim().to_string();
    let digits = text.strip_prefix('-').unwrap_or(&text);
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())).then_some(text)
}

/// [`shown`], with an integer literal past 64 bits written as in the file (as Python shows it).
fn shown_in(line: &str, value: Option<&Value>, key: &str) -> String {
    big_int_literal(line, value, key).unwrap_or_else(|| shown(value))
}

fn tokens(value: Stamp) -> u64 {
    match value {
        Stamp::Int(i) => i as u64,
        Stamp::Float(f) => f as u64, // whole (read_trace refuses a fraction)
    }
}

fn small_int(value: Option<&Value>) -> Option<Option<i64>> {
    match value {
        None | Some(Value::Null) => Some(None),
        Some(Value::Number(n)) => n.as_i64().map(Some),
        _ => None,
    }
}

/// Prompt and output tokens a trace's lines may ask for in all (`workloads.MAX_PLAN_TOKENS`):
/// the plan writes every one out, about 22 bytes a 16-token block.
pub const MAX_PLAN_TOKENS: u64 = 1 << 32;

/// The rows of a JSONL trace with the checks of `workloads._read_trace` (the same messages),
/// sorted by timestamp (stable), keeping the first `limit` lines; refused at the line where
/// the prompts and outputs pass [`MAX_PLAN_TOKENS`].
pub fn read_trace(
    text: &str,
    name: &str,
    spec: &TraceSpec,
) -> Result<Vec<TraceRow>, WorkloadError> {
    read_lines(text.lines().map(Ok), name, spec)
}

fn read_lines<S: AsRef<str>>(
    lines: impl Iterator<Item = Result<S, WorkloadError>>,
    name: &str,
    spec: &TraceSpec,
) -> Result<Vec<TraceRow>, WorkloadError> {
    let mut rows = Vec::new();
    let mut total: u64 = 0;
    for (n, line) in lines.enumerate() {
        let n = n + 1;
        let line = line?;
        let line = line.as_ref();
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(line)
            .map_err(|e| WorkloadError(format!("trace {name}:{n}: not JSON: {e}")))?;
        let Value::Object(row) = value else {
            return err(format!("trace {name}:{n}: each line must be an object"));
        };
        let mut nums = [Stamp::Int(0); 3];
        for (slot, key) in nums.iter_mut().zip(["timestamp", "input_length", "output_length"]) {
            let value = row.get(key);
            // An integer of 2**64 or more is a float to serde_json: refuse it as Python does
            // rather than take it as a huge timestamp or length.
            let big = big_int_literal(line, value, key);
            let number = if big.is_some() { None } else { number(value) };
            *slot = number.ok_or_else(|| {
                WorkloadError(match (value, big) {
                    (_, Some(x)) if !x.starts_with('-') => format!(
                        "trace {name}:{n}: {key} is out of range: an integer must be below \
                         2**63, got {x}"
                    ),
                    (Some(Value::Number(x)), _) if x.is_u64() => format!(
                        "trace {name}:{n}: {key} is out of range: an integer must be below \
                         2**63, got {x}"
                    ),
                    (_, big) => format!(
                        "trace {name}:{n}: {key} must be a number >= 0, got {}",
                        big.unwrap_or_else(|| shown(value))
                    ),
                })
            })?;
            if let (Stamp::Float(f), true) = (*slot, key != "timestamp") {
                if f.fract() != 0.0 {
                    return err(format!(
                        "trace {name}:{n}: {key} must be a whole number of tokens, got {}",
                        shown(value)
                    ));
                }
            }
        }
        let [timestamp, input, output] = nums;
        let (input_length, output_length) = (tokens(input), tokens(output));
        if input_length < 1 {
            return err(format!("trace {name}:{n}: input_length must be >= 1"));
        }
        if input_length > MAX_TRACE_TOKENS || output_length > MAX_TRACE_TOKENS {
            return err(format!(
                "trace {name}:{n}: input_length and output_length must be <= {MAX_TRACE_TOKENS}"
            ));
        }
        // Each length is at most 2**24: no overflow before the sum passes 2**32.
        total += input_length + output_length;
        if total > MAX_PLAN_TOKENS {
            return err(format!(
                "trace {name}:{n}: the lines up to here ask for {total} tokens of prompts and \
                 outputs, more than the simulator writes out (MAX_PLAN_TOKENS, \
                 {MAX_PLAN_TOKENS}); replay fewer lines (limit)"
            ));
        }
        let hash_ids = match row.get("hash_ids") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(ids)) => {
                ids.iter().map(|id| id.as_u64()).collect::<Option<Vec<u64>>>().ok_or_else(|| {
                    WorkloadError(format!(
                        "trace {name}:{n}: hash_ids must be a list of ints in [0, 2**64)"
                    ))
                })?
            }
            Some(_) => {
                return err(format!(
                    "trace {name}:{n}: hash_ids must be a list of ints in [0, 2**64)"
                ))
            }
        };
        let hb = spec.hash_block as u64;
        if !hash_ids.is_empty() && (hash_ids.len() as u64).saturating_mul(hb) + hb < input_length {
            return err(format!(
                "trace {name}:{n}: {} hash_ids cannot cover {input_length} input tokens in \
                 blocks of {hb}",
                hash_ids.len()
            ));
        }
        let mut ints = [0i64; 2];
        for (slot, key) in ints.iter_mut().zip(["tenant", "priority"]) {
            *slot = small_int(row.get(key))
                .ok_or_else(|| {
                    WorkloadError(format!(
                        "trace {name}:{n}: {key} must be an integer, got {}",
                        shown_in(line, row.get(key), key)
                    ))
                })?
                .unwrap_or(0);
        }
        let session = match row.get("session") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.is_empty() => {
                return err(format!("trace {name}:{n}: session must not be an empty string"))
            }
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Number(x)) if x.is_i64() || x.is_u64() => Some(x.to_string()),
            Some(other) => {
                return err(format!(
                    "trace {name}:{n}: session must be a string or an integer, got {}",
                    shown_in(line, Some(other), "session")
                ))
            }
        };
        rows.push(TraceRow {
            timestamp,
            input_length,
            output_length,
            hash_ids,
            tenant: ints[0],
            priority: ints[1],
            session,
        });
        if spec.limit.is_some_and(|limit| rows.len() >= limit) {
            break;
        }
    }
    rows.sort_by(|a, b| a.timestamp.cmp(b.timestamp));
    Ok(rows)
}

/// [`read_trace`] on the file at `path`, read a line at a time.
pub fn load_trace(path: &str, spec: &TraceSpec) -> Result<Vec<TraceRow>, WorkloadError> {
    use std::io::BufRead;
    let cannot = |e: std::io::Error| WorkloadError(format!("trace {path}: cannot read: {e}"));
    let file = std::fs::File::open(path).map_err(cannot)?;
    let lines = std::io::BufReader::new(file).lines().map(|line| line.map_err(cannot));
    read_lines(lines, path, spec)
}

/// The dense content ids of a plan's hashes as the builder appends them (see
/// [`Contents::from_parts`], which checks the result): content the builder makes fresh gets
/// new ids, content it repeats (a trace block shared by several lines) its first id.
#[derive(Debug, Default)]
struct Numbering {
    ids: Vec<u32>,
    unique: Vec<u64>,
}

impl Numbering {
    fn new_id(&mut self, h: u64) -> u32 {
        self.unique.push(h);
        (self.unique.len() - 1) as u32
    }

    /// Numbers `hashes[self.ids.len()..]` as fresh content.
    fn fresh(&mut self, hashes: &[u64]) {
        for &h in &hashes[self.ids.len()..] {
            let id = self.new_id(h);
            self.ids.push(id);
        }
    }

    fn finish(self, hashes: &[u64]) -> Contents {
        // A 64-bit collision between different contents (about one in 10^4 for a 100,000-line
        // trace) makes the shortcut wrong; the hash-map numbering is exact.
        Contents::from_parts(hashes, self.ids, self.unique)
            .unwrap_or_else(|| Contents::number(hashes))
    }
}

const UNNUMBERED: u32 = u32::MAX;

/// Ids (masked as the content is seeded) on more than one line, or twice on one: the blocks
/// worth keeping.
fn reused_ids(rows: &[TraceRow]) -> HashMap<u64, ()> {
    let mut seen: HashMap<u64, bool> = HashMap::new();
    for row in rows {
        for &id in &row.hash_ids {
            seen.entry(id & U64_TOP as u64).and_modify(|again| *again = true).or_insert(false);
        }
    }
    seen.into_iter().filter(|&(_, again)| again).map(|(id, _)| (id, ())).collect()
}

/// The hashes of the blocks a trace's `hash_ids` name: each id's `hash_block` tokens come from
/// `default_rng(id & U64_TOP)`, and their hashes continue the chain of the ids before it.
/// Blocks of reused ids are kept by (parent hash, id).
struct IdHasher<'a> {
    per_id: usize,
    hash_block: usize,
    block_size: usize,
    reused: &'a HashMap<u64, ()>,
    memo: HashMap<(u64, u64), usize>,
    store: Vec<u64>,
    tokens: Vec<u32>,
}

impl<'a> IdHasher<'a> {
    fn new(reused: &'a HashMap<u64, ()>, hash_block: usize, block_size: usize) -> Self {
        IdHasher {
            per_id: hash_block / block_size,
            hash_block,
            block_size,
            reused,
            memo: HashMap::new(),
            store: Vec::new(),
            tokens: Vec::with_capacity(hash_block),
        }
    }

    /// Writes the first `out.len()` (at most `per_id`) hashes of `id`'s blocks after the chain
    /// ending in `parent`; returns the id's last hash.
    fn write(&mut self, parent: u64, id: u64, out: &mut [u64]) -> Result<u64, WorkloadError> {
        let id = id & U64_TOP as u64;
        let per_id = self.per_id;
        if let Some(&at) = self.memo.get(&(parent, id)) {
            out.copy_from_slice(&self.store[at..at + out.len()]);
            return Ok(self.store[at + per_id - 1]);
        }
        self.tokens.clear();
        let mut rng = Pcg64::from_entropy(&words(u128::from(id)));
        rng.fill_u32(0, VOCAB, self.hash_block, &mut self.tokens);
        let at = self.store.len();
        chain_hashes_into(&self.tokens, self.block_size, parent, &mut self.store)
            .map_err(|e| WorkloadError(e.to_string()))?;
        out.copy_from_slice(&self.store[at..at + out.len()]);
        let last = self.store[at + per_id - 1];
        if self.reused.contains_key(&id) {
            self.memo.insert((parent, id), at);
        } else {
            self.store.truncate(at);
        }
        Ok(last)
    }
}

/// Where one trace line's hashes go and how they are made.
#[derive(Debug, Clone, Copy)]
struct Layout {
    /// Start of the line's hashes in the plan's array.
    start: usize,
    /// Leading hashes that come from `hash_ids` blocks.
    named: usize,
    /// Ids those come from.
    ids: usize,
    /// Full prompt blocks (named plus fresh-token blocks).
    prompt_blocks: usize,
    /// Fresh tokens drawn after the named blocks.
    fresh_tokens: usize,
    end: usize,
}

/// The request of trace line `row` laid out at `l`, arriving `scale` seconds per time unit after
/// the first line's `t0`.
fn open_request(row: &TraceRow, l: &Layout, t0: Stamp, scale: f64) -> OpenRequest {
    OpenRequest {
        arrival: row.timestamp.minus(t0) * scale,
        prompt_len: row.input_length,
        // `Request` generates at least one token (the fresh ids counted none).
        output_len: row.output_length.max(1),
        tenant: row.tenant,
        priority: row.priority,
        session: row.session.clone(),
        hashes: l.start..l.end,
    }
}

fn layout(rows: &[TraceRow], hash_block: usize, block_size: usize) -> Vec<Layout> {
    let per_id = hash_block / block_size;
    let mut start = 0;
    rows.iter()
        .map(|row| {
            let prompt = row.input_length as usize;
            let shared_len = row.hash_ids.len() * hash_block;
            let prompt_blocks = prompt / block_size;
            let (named, ids, fresh_tokens) = if shared_len >= prompt {
                (prompt_blocks, prompt_blocks.div_ceil(per_id), 0)
            } else {
                (row.hash_ids.len() * per_id, row.hash_ids.len(), prompt - shared_len)
            };
            let total = ((row.input_length + row.output_length) / block_size as u64) as usize;
            let l = Layout { start, named, ids, prompt_blocks, fresh_tokens, end: start + total };
            start = l.end;
            l
        })
        .collect()
}

/// The named blocks of `rows` into `out` (the rows' hash ranges, starting at `base`), and each
/// row's last named hash (the chain seed when it has none).
fn named_blocks(
    rows: &[TraceRow],
    lay: &[Layout],
    base: usize,
    out: &mut [u64],
    hasher: &mut IdHasher<'_>,
    chain_seed: u64,
) -> Result<Vec<u64>, WorkloadError> {
    let per_id = hasher.per_id;
    let mut lasts = Vec::with_capacity(rows.len());
    for (row, l) in rows.iter().zip(lay) {
        let mut last = chain_seed;
        let at = l.start - base;
        for (k, &id) in row.hash_ids[..l.ids].iter().enumerate() {
            let take = per_id.min(l.named - k * per_id);
            let from = at + k * per_id;
            last = hasher.write(last, id, &mut out[from..from + take])?;
        }
        lasts.push(last);
    }
    Ok(lasts)
}

/// Fresh tokens drawn per chunk of lines before they are handed over for hashing.
const FRESH_CHUNK_TOKENS: usize = 1 << 16;

/// One chunk of fresh draws: lines `lines`, their fresh tokens back to back, and their fresh
/// block ids back to back.
struct FreshChunk {
    lines: Range<usize>,
    tokens: Vec<u32>,
    ids: Vec<u64>,
}

/// Every line's fresh tokens (hashed after its named blocks, from `lasts`) and fresh block ids
/// into `out`. This thread draws them in line order from `rng`, the one generator; a second
/// thread hashes the tokens and writes both, so drawing and hashing overlap.
fn fresh_draws(
    lay: &[Layout],
    lasts: &[u64],
    rng: &mut Pcg64,
    block_size: usize,
    out: &mut [u64],
) -> Result<(), WorkloadError> {
    let (to_writer, chunks) = std::sync::mpsc::sync_channel::<FreshChunk>(2);
    let (to_drawer, spares) = std::sync::mpsc::channel::<FreshChunk>();
    std::thread::scope(|scope| {
        let writer = scope.spawn(move || -> Result<(), WorkloadError> {
            for chunk in chunks {
                let mut at = 0;
                let mut ids_at = 0;
                for i in chunk.lines.clone() {
                    let l = &lay[i];
                    let named_end = l.start + l.named;
                    let tail_blocks = l.fresh_tokens / block_size;
                    if l.fresh_tokens > 0 {
                        let tokens = &chunk.tokens[at..at + tail_blocks * block_size];
                        let mut hashes = Vec::with_capacity(tail_blocks);
                        chain_hashes_into(tokens, block_size, lasts[i], &mut hashes)
                            .map_err(|e| WorkloadError(e.to_string()))?;
                        out[named_end..named_end + tail_blocks].copy_from_slice(&hashes);
                        at += l.fresh_tokens;
                    }
                    let fresh = l.end - l.start - l.prompt_blocks;
                    out[l.start + l.prompt_blocks..l.end]
                        .copy_from_slice(&chunk.ids[ids_at..ids_at + fresh]);
                    ids_at += fresh;
                }
                // The drawer may have finished and dropped its end: the spare is not needed.
                let _ = to_drawer.send(chunk);
            }
            Ok(())
        });
        let mut chunk = FreshChunk { lines: 0..0, tokens: Vec::new(), ids: Vec::new() };
        for (i, l) in lay.iter().enumerate() {
            rng.fill_u32(0, VOCAB, l.fresh_tokens, &mut chunk.tokens);
            let fresh = l.end - l.start - l.prompt_blocks;
            if fresh > 0 {
                rng.fill_i64(1, U64_TOP, fresh, &mut chunk.ids);
            }
            chunk.lines.end = i + 1;
            if chunk.tokens.len() >= FRESH_CHUNK_TOKENS || i + 1 == lay.len() {
                let mut next = spares.try_recv().unwrap_or_else(|_| FreshChunk {
                    lines: 0..0,
                    tokens: Vec::new(),
                    ids: Vec::new(),
                });
                next.tokens.clear();
                next.ids.clear();
                next.lines = i + 1..i + 1;
                let full = std::mem::replace(&mut chunk, next);
                if to_writer.send(full).is_err() {
                    break; // the writer stopped on an error, which join returns
                }
            }
        }
        drop(to_writer);
        writer.join().unwrap_or_else(|_| err("trace plan writer failed"))
    })
}

/// The plan of a trace (`TraceWorkload.arrivals`): a line's blocks named by its `hash_ids`
/// get the ids' content, the rest of its prompt fresh tokens from `rng` (the workload's
/// generator, `default_rng(seed)`), and its output fresh ids.
///
/// Every line's hash count is known from its lengths, so the named blocks (most of a
/// Mooncake trace's work: 512 tokens drawn and hashed per id) are built on two threads, each
/// over half of the lines; the fresh tokens and ids then come from the one generator in line
/// order, hashed on a second thread while the next lines are drawn. The plan comes numbered ([`Plan::contents`]) from what the builder knows is shared
/// (blocks of the same id after the same prefix), checked by [`Contents::from_parts`].
pub fn trace_plan(
    rows: &[TraceRow],
    spec: &TraceSpec,
    mut rng: Pcg64,
    block_size: usize,
    chain_seed: u64,
) -> Result<Plan<'static>, WorkloadError> {
    check_trace(spec, block_size)?;
    let hash_block = spec.hash_block;
    let mut plan = Plan::default();
    let Some(first) = rows.first() else {
        plan.contents = Some(Arc::new(Contents::number(&plan.hashes)));
        return Ok(plan);
    };
    let per_id = hash_block / block_size;
    let lay = layout(rows, hash_block, block_size);
    let total = lay.last().map_or(0, |l| l.end);
    plan.hashes = vec![0; total].into();
    let reused = reused_ids(rows);

    // The named blocks, on two threads split where half of the ids are done.
    let all_ids: usize = lay.iter().map(|l| l.ids).sum();
    let mut seen = 0;
    let split = lay
        .iter()
        .position(|l| {
            seen += l.ids;
            seen * 2 >= all_ids
        })
        .map_or(rows.len(), |i| i + 1);
    let split_at = lay.get(split).map_or(total, |l| l.start);
    let (low, high) = plan.hashes.to_mut().split_at_mut(split_at);
    let (lasts_low, lasts_high) = std::thread::scope(|scope| {
        let reused = &reused;
        let (rows_high, lay_high) = (&rows[split..], &lay[split..]);
        let worker = scope.spawn(move || {
            let mut hasher = IdHasher::new(reused, hash_block, block_size);
            named_blocks(rows_high, lay_high, split_at, high, &mut hasher, chain_seed)
        });
        let mut hasher = IdHasher::new(reused, hash_block, block_size);
        let low = named_blocks(&rows[..split], &lay[..split], 0, low, &mut hasher, chain_seed);
        let high = worker.join().unwrap_or_else(|_| err("trace plan worker failed"));
        (low, high)
    });
    let lasts: Vec<u64> = lasts_low?.into_iter().chain(lasts_high?).collect();

    // The fresh tokens and ids, from the one generator in line order; the tokens are hashed
    // on a second thread, a chunk of lines behind.
    fresh_draws(&lay, &lasts, &mut rng, block_size, plan.hashes.to_mut())?;

    // Content ids by first appearance: a named block repeats the first block of its id after
    // the same prefix, everything else is new.
    let mut num = Numbering::default();
    num.ids.reserve(total);
    let mut first_ids: HashMap<(u64, u64), usize> = HashMap::new();
    let mut slots: Vec<u32> = Vec::new();
    for (row, l) in rows.iter().zip(&lay) {
        let mut parent = chain_seed;
        for (k, &id) in row.hash_ids[..l.ids].iter().enumerate() {
            let from = l.start + k * per_id;
            let take = per_id.min(l.named - k * per_id);
            let id = id & U64_TOP as u64;
            if reused.contains_key(&id) {
                let at = *first_ids.entry((parent, id)).or_insert_with(|| {
                    slots.resize(slots.len() + per_id, UNNUMBERED);
                    slots.len() - per_id
                });
                for j in 0..take {
                    let h = plan.hashes[from + j];
                    if slots[at + j] == UNNUMBERED {
                        slots[at + j] = num.new_id(h);
                    }
                    num.ids.push(slots[at + j]);
                }
            } else {
                num.fresh(&plan.hashes[..from + take]);
            }
            // The next id's parent is this id's last hash, which a truncated last id (the only
            // one that can be truncated) does not need.
            parent = if take == per_id { plan.hashes[from + per_id - 1] } else { parent };
        }
        num.fresh(&plan.hashes[..l.end]);
    }

    let scale = (if spec.millis { 1e-3 } else { 1.0 }) / spec.time_scale;
    let t0 = first.timestamp;
    plan.open = rows.iter().zip(&lay).map(|(row, l)| open_request(row, l, t0, scale)).collect();
    plan.contents = Some(Arc::new(num.finish(&plan.hashes)));
    Ok(plan)
}

fn check_trace(spec: &TraceSpec, block_size: usize) -> Result<(), WorkloadError> {
    check(block_size)?;
    let hash_block = spec.hash_block;
    if hash_block == 0 || hash_block % block_size != 0 {
        return err(format!(
            "hash_block {hash_block} must be a positive multiple of block size {block_size}"
        ));
    }
    if spec.time_scale.is_nan() || spec.time_scale <= 0.0 {
        return err(format!("time_scale must be > 0, got {}", spec.time_scale));
    }
    Ok(())
}

/// Where [`TraceLines::build`] puts each line, in line order: its block hashes, their content
/// ids, the contents it numbers first (ids counted on from those of earlier lines), its
/// request, and where its private blocks begin.
///
/// Private blocks: from the line's first block numbered fresh (a trace id no other line names,
/// fresh tokens, the output) to its end. When the numbering is exact ([`Contents::exact`]),
/// no other line holds any of them: a fresh block's id is used once, and a block after it
/// chains on it (a reused id's blocks after a private block take ids no other line takes).
pub trait LineSink {
    fn line(
        &mut self,
        hashes: &[u64],
        ids: &[u32],
        new_contents: &[u64],
        request: OpenRequest,
        private_from: usize,
    ) -> Result<(), WorkloadError>;
}

/// A trace checked and laid out (every line's block count is known from its lengths), to be
/// built line by line in order on one thread: the plan [`trace_plan`] builds, bit for bit,
/// handed over a line at a time so that a simulation can start on the first lines while the
/// rest are built (`crate::stream`). The same draws in the same order: named blocks from their
/// ids' own generators, then the line's fresh tokens and fresh ids from the one generator.
pub struct TraceLines<'r> {
    rows: &'r [TraceRow],
    lay: Vec<Layout>,
    reused: HashMap<u64, ()>,
    spec: TraceSpec,
    block_size: usize,
    chain_seed: u64,
}

impl<'r> TraceLines<'r> {
    /// Checks the settings and lays the lines out (one pass, and one over the ids).
    pub fn new(
        rows: &'r [TraceRow],
        spec: &TraceSpec,
        block_size: usize,
        chain_seed: u64,
    ) -> Result<Self, WorkloadError> {
        check_trace(spec, block_size)?;
        Ok(TraceLines {
            rows,
            lay: layout(rows, spec.hash_block, block_size),
            reused: reused_ids(rows),
            spec: *spec,
            block_size,
            chain_seed,
        })
    }

    /// Lines (requests) in all.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the trace has no lines.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Block hashes in all.
    pub fn blocks(&self) -> usize {
        self.lay.last().map_or(0, |l| l.end)
    }

    /// Builds every line in order into `sink`; `rng` is the workload's generator.
    pub fn build(&self, mut rng: Pcg64, sink: &mut dyn LineSink) -> Result<(), WorkloadError> {
        let Some(first) = self.rows.first() else { return Ok(()) };
        let (bs, chain_seed) = (self.block_size, self.chain_seed);
        let mut hasher = IdHasher::new(&self.reused, self.spec.hash_block, bs);
        let per_id = hasher.per_id;
        let scale = (if self.spec.millis { 1e-3 } else { 1.0 }) / self.spec.time_scale;
        let hash_err = |e: llmsched_core::hashing::HashError| WorkloadError(e.to_string());
        let (mut hashes, mut ids, mut new, mut tokens, mut draws) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut first_ids: HashMap<(u64, u64), usize> = HashMap::new();
        let mut slots: Vec<u32> = Vec::new();
        let mut contents = 0usize;
        for (row, l) in self.rows.iter().zip(&self.lay) {
            hashes.clear();
            hashes.resize(l.end - l.start, 0);
            let mut last = chain_seed;
            for (k, &id) in row.hash_ids[..l.ids].iter().enumerate() {
                let take = per_id.min(l.named - k * per_id);
                last = hasher.write(last, id, &mut hashes[k * per_id..k * per_id + take])?;
            }
            // Drawn as `trace_plan`'s drawer draws: all fresh tokens (a partial last block
            // included), then the output's fresh ids.
            tokens.clear();
            rng.fill_u32(0, VOCAB, l.fresh_tokens, &mut tokens);
            if l.fresh_tokens > 0 {
                let tail = l.fresh_tokens / bs;
                draws.clear();
                chain_hashes_into(&tokens[..tail * bs], bs, last, &mut draws).map_err(hash_err)?;
                hashes[l.named..l.named + tail].copy_from_slice(&draws);
            }
            if l.end - l.start > l.prompt_blocks {
                draws.clear();
                rng.fill_i64(1, U64_TOP, l.end - l.start - l.prompt_blocks, &mut draws);
                hashes[l.prompt_blocks..].copy_from_slice(&draws);
            }

            // Numbered as `trace_plan` numbers: a reused id's blocks after the same prefix
            // take their first ids, everything else is new.
            ids.clear();
            new.clear();
            let fresh_to = |end: usize, ids: &mut Vec<u32>, new: &mut Vec<u64>| {
                for &h in &hashes[ids.len()..end] {
                    ids.push((contents + new.len()) as u32);
                    new.push(h);
                }
            };
            let mut parent = chain_seed;
            let mut private_from = None;
            for (k, &id) in row.hash_ids[..l.ids].iter().enumerate() {
                let from = k * per_id;
                let take = per_id.min(l.named - from);
                let id = id & U64_TOP as u64;
                if private_from.is_none() && !self.reused.contains_key(&id) && take > 0 {
                    private_from = Some(from);
                }
                if self.reused.contains_key(&id) {
                    let at = *first_ids.entry((parent, id)).or_insert_with(|| {
                        slots.resize(slots.len() + per_id, UNNUMBERED);
                        slots.len() - per_id
                    });
                    for j in 0..take {
                        if slots[at + j] == UNNUMBERED {
                            slots[at + j] = (contents + new.len()) as u32;
                            new.push(hashes[from + j]);
                        }
                        ids.push(slots[at + j]);
                    }
                } else {
                    fresh_to(from + take, &mut ids, &mut new);
                }
                parent = if take == per_id { hashes[from + per_id - 1] } else { parent };
            }
            let private_from = private_from.unwrap_or(ids.len());
            fresh_to(hashes.len(), &mut ids, &mut new);
            contents += new.len();
            if contents >= UNNUMBERED as usize {
                return err("a trace plan with more than 2**32 - 1 distinct blocks");
            }
            let request = open_request(row, l, first.timestamp, scale);
            sink.line(&hashes, &ids, &new, request, private_from)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: TraceSpec =
        TraceSpec { millis: true, time_scale: 1.0, hash_block: 512, limit: None };

    #[test]
    fn an_agentic_plan_past_the_request_bound_is_refused_not_allocated() {
        let cfg = |sessions, followup_turns| Agentic {
            sessions,
            first_input: 100.0,
            first_output: 10.0,
            followup_turns,
            followup_input: 20.0,
            followup_output: 5.0,
            length_cv: 0.3,
            think_time_s: 1.0,
            system_prompt_len: 50.0,
        };
        let systems = vec![vec![1u32; 50]];
        for (sessions, turns) in [(100_000_000_000, 5), (2, 100_000_000_000), (2, usize::MAX)] {
            let plan = agentic_plan(cfg(sessions, turns), &systems, vec![], false, 0, 16, 0);
            let Err(e) = plan else { panic!("{sessions} x {turns} planned") };
            assert!(e.to_string().contains("requests"), "{e}");
        }
        let plan = agentic_plan(cfg(3, 2), &systems, vec![0.0; 3], false, 0, 16, 0).unwrap();
        assert_eq!(plan.sessions.len(), 3);
    }

    #[test]
    fn rows_sort_and_rebase() {
        let text = "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 2}\n\n\
                    {\"timestamp\": 1, \"input_length\": 20, \"output_length\": 0}\n";
        let rows = read_trace(text, "t", &SPEC).unwrap();
        assert_eq!(rows[0].input_length, 20);
        let plan = trace_plan(&rows, &SPEC, Pcg64::from_entropy(&[0]), 16, 0).unwrap();
        assert_eq!(plan.open[1].arrival, 0.004);
        assert_eq!(plan.open[0].hashes.len(), 1); // 20 tokens: one full block
        plan.validate().unwrap();
    }

    #[test]
    fn long_prompts_need_no_hash_ids() {
        let text = "{\"timestamp\": 0, \"input_length\": 5000, \"output_length\": 1}";
        let rows = read_trace(text, "t", &SPEC).unwrap();
        let plan = trace_plan(&rows, &SPEC, Pcg64::from_entropy(&[0]), 16, 0).unwrap();
        assert_eq!(plan.open[0].hashes.len(), 5001 / 16);
    }

    #[test]
    fn shared_ids_share_blocks() {
        let text = "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 0, \"hash_ids\": [1, 2]}\n\
                    {\"timestamp\": 1, \"input_length\": 1000, \"output_length\": 0, \"hash_ids\": [1, 3]}";
        let rows = read_trace(text, "t", &SPEC).unwrap();
        let plan = trace_plan(&rows, &SPEC, Pcg64::from_entropy(&[0]), 16, 0).unwrap();
        let (a, b) = (&plan.open[0].hashes, &plan.open[1].hashes);
        assert_eq!(plan.hashes[a.start..a.start + 32], plan.hashes[b.start..b.start + 32]);
        assert_ne!(plan.hashes[a.start + 32], plan.hashes[b.start + 32]);
        assert_eq!(b.len(), 1000 / 16);
        assert_eq!(plan.contents.as_deref(), Some(&Contents::number(&plan.hashes)));
    }

    #[test]
    fn bad_lines_name_the_line() {
        for (line, what) in [
            ("nope", "not JSON"),
            ("[1]", "object"),
            ("{\"timestamp\": true, \"input_length\": 1, \"output_length\": 1}", "timestamp"),
            ("{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1}", "input_length"),
            (
                "{\"timestamp\": 0, \"input_length\": 5000, \"output_length\": 1, \"hash_ids\": [1]}",
                "cannot cover",
            ),
            ("{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"tenant\": \"a\"}", "tenant"),
            (
                "{\"timestamp\": 0, \"input_length\": 10.9, \"output_length\": 1}",
                "input_length must be a whole number of tokens, got 10.9",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 0.5}",
                "output_length must be a whole number of tokens, got 0.5",
            ),
            (
                "{\"timestamp\": 9223372036854775808, \"input_length\": 1, \"output_length\": 1}",
                "timestamp is out of range: an integer must be below 2**63, got 9223372036854775808",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"session\": \"\"}",
                "session must not be an empty string",
            ),
            // Integers of 2**64 or more were floats to serde_json: a timestamp of 2**64 was
            // taken, a length said "must be <=".
            (
                "{\"timestamp\": 18446744073709551616, \"input_length\": 1, \"output_length\": 1}",
                "timestamp is out of range: an integer must be below 2**63, got 18446744073709551616",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 100000000000000000000000}",
                "output_length is out of range: an integer must be below 2**63, got 100000000000000000000000",
            ),
            (
                "{\"timestamp\": -9223372036854775809, \"input_length\": 1, \"output_length\": 1}",
                "timestamp must be a number >= 0, got -9223372036854775809",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"tenant\": 18446744073709551616}",
                "tenant must be an integer, got 18446744073709551616",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"session\": 18446744073709551616}",
                "session must be a string or an integer, got 18446744073709551616",
            ),
        ] {
            let text = format!("{{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1}}\n{line}");
            let e = read_trace(&text, "t", &SPEC).unwrap_err().0;
            assert!(e.starts_with("trace t:2: ") && e.contains(what), "{e}");
        }
    }

    #[test]
    fn a_trace_past_max_plan_tokens_is_refused_at_the_line_that_passes_it() {
        // 128 lines of 2**24 + 2**24 tokens make 2**32 exactly; the 129th passes it.
        let line = format!(
            "{{\"timestamp\": 0, \"input_length\": {0}, \"output_length\": {0}}}\n",
            MAX_TRACE_TOKENS
        );
        let text = line.repeat(129);
        let e = read_trace(&text, "t", &SPEC).unwrap_err().0;
        assert!(
            e.starts_with("trace t:129: the lines up to here ask for 4328521728 tokens"),
            "{e}"
        );
        assert!(e.contains("(MAX_PLAN_TOKENS, 4294967296)"), "{e}");
        assert_eq!(read_trace(&line.repeat(128), "t", &SPEC).unwrap().len(), 128);
        let limited = TraceSpec { limit: Some(128), ..SPEC };
        assert_eq!(read_trace(&text, "t", &limited).unwrap().len(), 128);
    }

    #[test]
    fn whole_float_lengths_and_fractional_timestamps_are_read() {
        let text = "{\"timestamp\": 0.25, \"input_length\": 10.0, \"output_length\": 2.0}";
        let row = &read_trace(text, "t", &SPEC).unwrap()[0];
        assert_eq!(
            (row.timestamp, row.input_length, row.output_length),
            (Stamp::Float(0.25), 10, 2)
        );
        // A float past 2**64 is still a float (only integer literals that big are refused).
        let text = "{\"timestamp\": 2e19, \"input_length\": 1, \"output_length\": 1}";
        assert_eq!(read_trace(text, "t", &SPEC).unwrap()[0].timestamp, Stamp::Float(2e19));
    }

    #[test]
    fn independent_requests_have_their_lengths() {
        let spec = Independent {
            arrival: &[0.0, 1.0],
            mean_input: &[100.0, 40.0],
            mean_output: &[10.0, 3.0],
            tenant: &[0, 1],
            priority: &[0, 0],
            length_cv: 0.0,
        };
        let plan =
            independent_plan(spec, Pcg64::from_entropy(&[0]), PyRandom::new(0), 16, 0).unwrap();
        assert_eq!(plan.open[0].prompt_len, 100);
        assert_eq!(plan.open[0].hashes.len(), 110 / 16);
        assert_eq!(plan.open[1].hashes.len(), 43 / 16);
        plan.validate().unwrap();
    }
}
