//! The prefix index at the large size of `benches/bench_peers_index.py`, without Python: ingest
//! of vLLM msgpack payloads (decode alone, then decode and apply), `match_hashes` with its result
//! dropped or recycled, and from one and from two threads, for profiling (`perf record -g target/release/examples/index_scale`)
//! and for telling the structure's scaling apart from the bindings'.
//!
//! The workload follows the Python bench: multi-turn sessions over 200 shared system prompts,
//! token ids below 128,000 (so u16 and u32 msgpack forms mix), each stored prompt's new blocks
//! one `BlockStored` event, then 10,000-token queries extending stored sequences.
//!
//! `cargo run --release -p llmsched-core --example index_scale -- [block_size workers sequences]`
//! (default 64 256 100000); `INGEST_REPEAT=n` applies the events into n fresh indexes; `ONLY=ingest`
//! stops before the matches; `DECODING=avx2` or `scalar` narrows the token-id decoder's vector
//! path, and `DECODING=alternate` alternates the default and AVX2 from ingest to ingest (an A/B
//! in one process); `RECEIVED=1` then times each apply alone, its payload read through just
//! before (as a subscriber applies one it has just received). `DECODE_AB=n` times the decode
//! alone, the default path against AVX2 in alternating rounds, over the first `n` payloads
//! cycled (`all`: every payload), each read from memory or read through first.

use std::collections::HashSet;
use std::hint::black_box;
use std::time::Instant;

use llmsched_core::prefix_index::{IndexConfig, PrefixIndex, WorkerKey};
use llmsched_core::vllm_events::{
    decode_event_batch, recycle, with_avx2_decoding, with_scalar_decoding, KvEvent,
};

/// SplitMix64: a deterministic generator, so every run builds the same workload.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(128_000) as u32).collect()
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(out, s).expect("writing to a Vec cannot fail");
}

/// One `BlockStored` batch as vLLM writes it (map-encoded event, as the Python bench's dict).
fn payload(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(tokens.len() * 5 + hashes.len() * 9 + 200);
    rmp::encode::write_array_len(&mut out, 3).unwrap();
    rmp::encode::write_f64(&mut out, 1.7e9).unwrap();
    rmp::encode::write_array_len(&mut out, 1).unwrap();
    rmp::encode::write_map_len(&mut out, 8).unwrap();
    write_str(&mut out, "type");
    write_str(&mut out, "BlockStored");
    write_str(&mut out, "block_hashes");
    rmp::encode::write_array_len(&mut out, hashes.len() as u32).unwrap();
    for &h in hashes {
        rmp::encode::write_uint(&mut out, h).unwrap();
    }
    write_str(&mut out, "parent_block_hash");
    match parent {
        Some(p) => {
            rmp::encode::write_uint(&mut out, p).unwrap();
        }
        None => rmp::encode::write_nil(&mut out).unwrap(),
    }
    write_str(&mut out, "token_ids");
    rmp::encode::write_array_len(&mut out, tokens.len() as u32).unwrap();
    for &t in tokens {
        rmp::encode::write_uint(&mut out, u64::from(t)).unwrap();
    }
    write_str(&mut out, "block_size");
    rmp::encode::write_uint(&mut out, bs as u64).unwrap();
    write_str(&mut out, "lora_id");
    rmp::encode::write_nil(&mut out).unwrap();
    write_str(&mut out, "medium");
    write_str(&mut out, "GPU");
    write_str(&mut out, "lora_name");
    rmp::encode::write_nil(&mut out).unwrap();
    rmp::encode::write_uint(&mut out, 0).unwrap();
    out
}

struct Workload {
    events: Vec<(i64, Vec<u8>)>,
    blocks: usize,
    queries: Vec<Vec<u64>>,
}

fn build(bs: usize, workers: usize, sequences: usize) -> Workload {
    let hasher = PrefixIndex::new(IndexConfig { block_size: bs, ..Default::default() }).unwrap();
    let mut rng = Rng(1);
    let systems: Vec<Vec<u32>> = (0..200)
        .map(|_| {
            let n = 500 + rng.below(1_500) as usize;
            rng.tokens(n)
        })
        .collect();
    let mut seqs: Vec<(usize, Vec<u32>)> = Vec::new();
    while seqs.len() < sequences {
        let mut prompt = systems[rng.below(200) as usize].clone();
        let mut worker = rng.below(workers as u64) as usize;
        for turn in 0..1 + rng.below(7) {
            let n = 300 + rng.below(1_700) as usize;
            prompt.extend(rng.tokens(n));
            if prompt.len() > 10_000 {
                break;
            }
            if turn > 0 && rng.below(5) == 0 {
                worker = rng.below(workers as u64) as usize;
            }
            seqs.push((worker, prompt.clone()));
        }
    }
    seqs.truncate(sequences);
    let mut held: Vec<HashSet<u64>> = vec![HashSet::new(); workers];
    let mut wl = Workload { events: Vec::new(), blocks: 0, queries: Vec::new() };
    for (worker, tokens) in &seqs {
        let hashes = hasher.hash_tokens(tokens, None, None).unwrap();
        let mine = &mut held[*worker];
        let k = hashes.iter().take_while(|h| mine.contains(h)).count();
        if k == hashes.len() {
            continue;
        }
        let new = &hashes[k..];
        mine.extend(new.iter().copied());
        wl.blocks += new.len();
        let parent = k.checked_sub(1).map(|i| hashes[i]);
        let bytes = payload(new, parent, &tokens[k * bs..hashes.len() * bs], bs);
        wl.events.push((*worker as i64, bytes));
    }
    let long: Vec<&Vec<u32>> = seqs.iter().map(|(_, t)| t).filter(|t| t.len() >= 4_000).collect();
    for _ in 0..1_000 {
        let mut q: Vec<u32> = long[rng.below(long.len() as u64) as usize].clone();
        q.truncate(10_000);
        let more = 10_000 - q.len();
        q.extend(rng.tokens(more));
        wl.queries.push(hasher.hash_tokens(&q, None, None).unwrap());
    }
    wl
}

/// Nanoseconds of CPU time this thread has used: on a loaded machine a rate per CPU second says
/// more about the code than one per wall second.
fn cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec for the call to write.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `what`'s rate in M blocks per wall second and per CPU second since (`wall`, `cpu`).
fn rate(what: &str, blocks: usize, wall: Instant, cpu: u64) {
    let per_wall = blocks as f64 / wall.elapsed().as_secs_f64() / 1e6;
    let per_cpu = blocks as f64 / ((cpu_ns() - cpu) as f64 * 1e-9) / 1e6;
    println!("{what}: {per_wall:.2} M blocks/s, {per_cpu:.2} M blocks per CPU second");
}

#[inline(never)]
fn ingest(bs: usize, wl: &Workload) -> PrefixIndex {
    let index = PrefixIndex::new(IndexConfig { block_size: bs, ..Default::default() }).unwrap();
    for (worker, bytes) in &wl.events {
        index.apply_vllm_events(&WorkerKey::Int(*worker), bytes).unwrap();
    }
    index
}

/// [`ingest`] as a subscriber sees its payloads, just received (in the cache): each payload is
/// read through once before its apply, which alone is timed; returns the index and the
/// seconds spent applying.
#[inline(never)]
fn ingest_received(bs: usize, wl: &Workload) -> (PrefixIndex, f64) {
    let index = PrefixIndex::new(IndexConfig { block_size: bs, ..Default::default() }).unwrap();
    let mut applying = std::time::Duration::ZERO;
    for (worker, bytes) in &wl.events {
        read_through(bytes);
        let t = Instant::now();
        index.apply_vllm_events(&WorkerKey::Int(*worker), bytes).unwrap();
        applying += t.elapsed();
    }
    (index, applying.as_secs_f64())
}

/// Reads one byte of each cache line of `bytes`, so the payload is in the cache (and its pages
/// in the TLB), as one just received from a socket is.
fn read_through(bytes: &[u8]) {
    black_box(bytes.chunks(64).map(|line| line[0]).fold(0u8, |a, b| a ^ b));
}

/// `f`'s result, on the AVX2 decoding path when `avx2`, with a label saying which.
fn alternated<R>(avx2: bool, f: impl FnOnce() -> R) -> (R, &'static str) {
    if avx2 {
        (with_avx2_decoding(f), " (AVX2 decoding)")
    } else {
        (f(), "")
    }
}

/// `DECODE_AB`: the decode alone (its batches recycled, as the index does) over the first
/// `limit` payloads cycled to the workload's count, the default path and AVX2 in alternating
/// rounds, each payload read from memory or read through first; ns per block of `bs` ids.
fn decode_ab(wl: &Workload, bs: usize, limit: usize) {
    for round in 0..6 {
        for touch in [false, true] {
            let decode_all = || {
                let (mut spent, mut ids) = (std::time::Duration::ZERO, 0usize);
                let payloads = wl.events[..limit.min(wl.events.len())].iter().cycle();
                for (_, b) in payloads.take(wl.events.len()) {
                    if touch {
                        read_through(b);
                    }
                    let t = Instant::now();
                    let batch = decode_event_batch(b).unwrap();
                    spent += t.elapsed();
                    for e in &batch.events {
                        if let KvEvent::Stored(s) = e {
                            ids += s.token_ids.len();
                        }
                    }
                    recycle(batch);
                }
                spent.as_secs_f64() * 1e9 / (ids as f64 / bs as f64)
            };
            let (ns_per_block, label) = alternated(round % 2 == 1, decode_all);
            let payloads = if touch { "read through" } else { "from memory" };
            println!("decode{label}, payloads {payloads}: {ns_per_block:.1} ns/block");
        }
    }
}

/// match_hashes calls per second of `threads` threads, each over every query, best of 3, and
/// the CPU time per call, mean over the threads: on a loaded machine two threads may not get two
/// cores, but what sharing the index costs them (contended cache lines, the lock) still shows
/// as CPU time per call above one thread's.
fn match_rate(index: &PrefixIndex, queries: &[Vec<u64>], threads: usize) -> (f64, f64) {
    let mut best = 0.0f64;
    let mut cpu_per_call = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        let cpu: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        let c = cpu_ns();
                        for _ in 0..3 {
                            for q in queries {
                                black_box(index.match_hashes(q, 0.0));
                            }
                        }
                        cpu_ns() - c
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        let calls = (threads * queries.len() * 3) as f64;
        best = best.max(calls / t.elapsed().as_secs_f64());
        cpu_per_call = cpu_per_call.min(cpu as f64 / calls);
    }
    (best, cpu_per_call)
}

/// CPU ns per call of `match_hashes` with each result dropped and with each handed back
/// (`recycle`, as the Python bindings do), interleaved, best of 5: what allocating and freeing
/// the result costs a match.
fn recycle_cpu(index: &PrefixIndex, queries: &[Vec<u64>]) -> (f64, f64) {
    let (mut dropped, mut recycled) = (f64::INFINITY, f64::INFINITY);
    let calls = (3 * queries.len()) as f64;
    for _ in 0..5 {
        let c = cpu_ns();
        for _ in 0..3 {
            for q in queries {
                black_box(index.match_hashes(q, 0.0));
            }
        }
        dropped = dropped.min((cpu_ns() - c) as f64 / calls);
        let c = cpu_ns();
        for _ in 0..3 {
            for q in queries {
                black_box(index.match_hashes(q, 0.0)).recycle();
            }
        }
        recycled = recycled.min((cpu_ns() - c) as f64 / calls);
    }
    (dropped, recycled)
}

fn main() {
    match std::env::var("DECODING").as_deref() {
        Ok("avx2") => with_avx2_decoding(run),
        Ok("scalar") => with_scalar_decoding(run),
        _ => run(),
    }
}

fn run() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().unwrap()).collect();
    let (bs, workers, sequences) = match args[..] {
        [bs, w, s] => (bs, w, s),
        _ => (64, 256, 100_000),
    };
    if let Ok(vocab) = std::env::var("TOKENS_ONLY") {
        // Decode alone: 200 events of 1,920 ids below `vocab`, each decoded 100 times.
        let vocab: u64 = vocab.parse().unwrap();
        let mut rng = Rng(7);
        let events: Vec<Vec<u8>> = (0..200)
            .map(|_| {
                let tokens: Vec<u32> = (0..1_920).map(|_| rng.below(vocab) as u32).collect();
                let hashes: Vec<u64> = (0..30).map(|_| rng.next()).collect();
                payload(&hashes, None, &tokens, 64)
            })
            .collect();
        for _ in 0..3 {
            let (t, c) = (Instant::now(), cpu_ns());
            for _ in 0..100 {
                for e in &events {
                    black_box(decode_event_batch(e).unwrap());
                }
            }
            let ids = 200.0 * 100.0 * 1_920.0;
            println!(
                "decode, ids below {vocab}: {:.2} ns/id wall, {:.2} ns/id CPU",
                t.elapsed().as_secs_f64() * 1e9 / ids,
                (cpu_ns() - c) as f64 / ids
            );
        }
        return;
    }
    let repeat: usize = std::env::var("INGEST_REPEAT").ok().map_or(1, |v| v.parse().unwrap());
    let only = std::env::var("ONLY").unwrap_or_default();
    let t = Instant::now();
    let wl = build(bs, workers, sequences);
    let bytes: usize = wl.events.iter().map(|(_, b)| b.len()).sum();
    println!(
        "bs{bs}, {workers} workers, {sequences} seqs: {} pairs in {} events, {:.0} bytes/block \
         (built in {:.1} s)",
        wl.blocks,
        wl.events.len(),
        bytes as f64 / wl.blocks as f64,
        t.elapsed().as_secs_f64()
    );
    if let Ok(limit) = std::env::var("DECODE_AB") {
        decode_ab(&wl, bs, limit.parse().unwrap_or(wl.events.len()));
        return;
    }
    if only.is_empty() || only == "ingest" {
        let (t, c) = (Instant::now(), cpu_ns());
        for (_, b) in &wl.events {
            black_box(decode_event_batch(b).unwrap());
        }
        rate("decode", wl.blocks, t, c);
    }
    let alternate = std::env::var("DECODING").as_deref() == Ok("alternate");
    let mut index = None;
    for r in 0..repeat {
        drop(index.take());
        let (t, c) = (Instant::now(), cpu_ns());
        let (built, label) = alternated(alternate && r % 2 == 1, || ingest(bs, &wl));
        index = Some(built);
        rate(&format!("decode+apply{label}"), wl.blocks, t, c);
    }
    if std::env::var("RECEIVED").is_ok() {
        for r in 0..repeat {
            drop(index.take());
            let ((built, seconds), label) =
                alternated(alternate && r % 2 == 1, || ingest_received(bs, &wl));
            index = Some(built);
            println!(
                "decode+apply of payloads in cache{label}: {:.2} M blocks/s",
                wl.blocks as f64 / seconds / 1e6
            );
        }
    }
    if !only.is_empty() && only != "match" {
        return;
    }
    let index = index.unwrap();
    let matched: usize =
        wl.queries.iter().map(|q| index.match_hashes(q, 0.0).entries.len()).sum::<usize>();
    println!("workers matched per query: {:.0}", matched as f64 / wl.queries.len() as f64);
    for _ in 0..3 {
        let (dropped, recycled) = recycle_cpu(&index, &wl.queries);
        println!(
            "match_hashes CPU per call: {:.3} us, result dropped; {:.3} us, recycled ({:.2}x)",
            dropped / 1e3,
            recycled / 1e3,
            recycled / dropped
        );
    }
    for _ in 0..3 {
        let (one, one_cpu) = match_rate(&index, &wl.queries, 1);
        let (two, two_cpu) = match_rate(&index, &wl.queries, 2);
        println!(
            "match_hashes: 1 thread {one:.0}/s ({:.2} us each, {:.2} us CPU), 2 threads {two:.0}/s \
             ({:.2} us CPU each): {:.2}x the calls/s, {:.2}x the CPU per call",
            1e6 / one,
            one_cpu / 1e3,
            two_cpu / 1e3,
            two / one,
            two_cpu / one_cpu
        );
    }
}
