//! Model-based tests: random operation sequences on the index and on a naive model (one map per
//! worker, the same semantics as the Python twin) must agree after every step.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::{tree, IndexConfig, IndexStats, PrefixIndex, Tier, WorkerKey};
use crate::hashing::chain_hashes;

#[derive(Clone, Debug)]
struct Holding {
    tiers: u8,
    confirmed: bool,
    expires: f64,
    stamp: u64,
}

#[derive(Default)]
struct Model {
    parent_of: HashMap<u64, Option<u64>>,
    held: HashMap<i64, HashMap<u64, Holding>>,
    capacity: HashMap<i64, Option<u64>>,
    stamp: u64,
    default_capacity: Option<u64>,
}

impl Model {
    fn store(
        &mut self,
        w: i64,
        hashes: &[u64],
        parent: Option<u64>,
        attrs: (u8, bool, f64),
    ) -> bool {
        let empty = HashMap::new();
        let mine = self.held.get(&w).unwrap_or(&empty);
        if let Some(p) = parent {
            if !self.parent_of.contains_key(&p) || !mine.contains_key(&p) {
                return false;
            }
        }
        let mut pending: HashMap<u64, Option<u64>> = HashMap::new();
        let mut prev = parent;
        for &h in hashes {
            match self.parent_of.get(&h).or_else(|| pending.get(&h)) {
                None => {
                    pending.insert(h, prev);
                }
                Some(&known) if known != prev => return false,
                Some(_) => {}
            }
            prev = Some(h);
        }
        self.held.entry(w).or_default();
        self.capacity.entry(w).or_insert(self.default_capacity);
        if hashes.is_empty() {
            return true;
        }
        self.stamp += 1;
        let (tiers, confirmed, expires) = attrs;
        let mut prev = parent;
        for &h in hashes {
            self.parent_of.entry(h).or_insert(prev);
            let mine = self.held.get_mut(&w).expect("registered");
            match mine.get_mut(&h) {
                None => {
                    let expires = if confirmed { f64::INFINITY } else { expires };
                    mine.insert(h, Holding { tiers, confirmed, expires, stamp: 0 });
                }
                Some(x) => {
                    x.tiers |= tiers;
                    x.confirmed |= confirmed;
                    x.expires = if x.confirmed { f64::INFINITY } else { x.expires.max(expires) };
                }
            }
            prev = Some(h);
        }
        let mut cur = hashes.last().copied();
        while let Some(h) = cur {
            let x = self.held.get_mut(&w).expect("registered").get_mut(&h).expect("closed");
            x.stamp = self.stamp;
            if confirmed {
                x.confirmed = true;
                x.expires = f64::INFINITY;
            }
            cur = self.parent_of[&h];
        }
        self.enforce(w);
        true
    }

    fn descendants(&self, w: i64, top: u64) -> Vec<u64> {
        let mine = &self.held[&w];
        mine.keys()
            .copied()
            .filter(|&h| {
                let mut cur = Some(h);
                while let Some(c) = cur {
                    if c == top {
                        return true;
                    }
                    cur = self.parent_of[&c];
                }
                false
            })
            .collect()
    }

    fn drop_from(&mut self, w: i64, top: u64) {
        for h in self.descendants(w, top) {
            self.held.get_mut(&w).expect("registered").remove(&h);
            self.forget_if_unheld(h);
        }
    }

    fn forget_if_unheld(&mut self, h: u64) {
        if !self.held.values().any(|m| m.contains_key(&h)) {
            self.parent_of.remove(&h);
        }
    }

    fn remove(&mut self, w: i64, hashes: &[u64], tiers: u8) -> bool {
        let Some(mine) = self.held.get(&w) else { return false };
        if hashes.iter().any(|h| !mine.contains_key(h)) {
            return false;
        }
        for &h in hashes {
            let Some(x) = self.held.get_mut(&w).expect("registered").get_mut(&h) else { continue };
            x.tiers &= !tiers;
            if x.tiers == 0 {
                self.drop_from(w, h);
            }
        }
        true
    }

    fn enforce(&mut self, w: i64) {
        let Some(cap) = self.capacity[&w] else { return };
        while self.held[&w].len() as u64 > cap {
            let mine = &self.held[&w];
            let parents: HashSet<u64> = mine.keys().filter_map(|h| self.parent_of[h]).collect();
            let victim = mine
                .iter()
                .filter(|(h, _)| !parents.contains(h))
                .min_by_key(|(_, x)| x.stamp)
                .map(|(h, _)| *h)
                .expect("a leaf");
            self.held.get_mut(&w).expect("registered").remove(&victim);
            self.forget_if_unheld(victim);
        }
    }

    fn expire(&mut self, now: f64) {
        let workers: Vec<i64> = self.held.keys().copied().collect();
        for w in workers {
            let expired: Vec<u64> =
                self.held[&w].iter().filter(|(_, x)| x.expires <= now).map(|(h, _)| *h).collect();
            for h in expired {
                if self.held[&w].contains_key(&h) {
                    self.drop_from(w, h);
                }
            }
        }
    }

    /// Sorted (worker, blocks, per-tier) for a query.
    fn matches(&self, hashes: &[u64], now: f64) -> Vec<(i64, u32, [u32; 3])> {
        let mut out = Vec::new();
        for (&w, mine) in &self.held {
            let mut blocks = 0u32;
            let mut tiers = [0u32; 3];
            let mut alive = [true; 3];
            let mut prev = None;
            for &h in hashes {
                let Some(x) = mine.get(&h) else { break };
                if x.expires <= now || self.parent_of[&h] != prev {
                    break;
                }
                blocks += 1;
                for t in 0..3 {
                    alive[t] &= x.tiers & (1 << t) != 0;
                    tiers[t] += u32::from(alive[t]);
                }
                prev = Some(h);
            }
            if blocks > 0 {
                out.push((w, blocks, tiers));
            }
        }
        out.sort_unstable_by_key(|e| e.0);
        out
    }
}

#[derive(Clone, Debug)]
enum Op {
    Store { w: i64, chain: usize, a: usize, b: usize, tier: u8 },
    Record { w: i64, chain: usize, end: usize, ttl: f64 },
    Remove { w: i64, chain: usize, pos: Vec<usize>, tiers: u8 },
    Clear { w: i64 },
    Capacity { w: i64, cap: Option<u64> },
    Tick { dt: f64 },
    Expire,
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0i64..3;
    prop_oneof![
        4 => (w.clone(), 0usize..5, 0usize..9, 0usize..9, 0u8..3)
            .prop_map(|(w, chain, a, b, tier)| Op::Store { w, chain, a: a.min(b), b: a.max(b), tier }),
        2 => (w.clone(), 0usize..5, 1usize..9, prop::sample::select(vec![1.0, 5.0, 50.0]))
            .prop_map(|(w, chain, end, ttl)| Op::Record { w, chain, end, ttl }),
        2 => (w.clone(), 0usize..5, prop::collection::vec(0usize..8, 1..3), prop::sample::select(vec![1u8, 2, 4, 7]))
            .prop_map(|(w, chain, pos, tiers)| Op::Remove { w, chain, pos, tiers }),
        1 => w.clone().prop_map(|w| Op::Clear { w }),
        1 => (w, prop::option::of(1u64..10)).prop_map(|(w, cap)| Op::Capacity { w, cap }),
        1 => prop::sample::select(vec![0.5, 2.0, 10.0]).prop_map(|dt| Op::Tick { dt }),
        1 => Just(Op::Expire),
    ]
}

fn chains() -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    for root in 0..2u32 {
        let shared: Vec<u32> = (0..6).map(|i| 100 + root * 10 + i).collect();
        for branch in 0..2u32 {
            let mut tokens = shared.clone();
            tokens.extend((0..(branch + 2) * 2).map(|i| 500 + root * 50 + branch * 10 + i));
            out.push(chain_hashes(&tokens, 2, 0).expect("valid tokens"));
        }
    }
    out.push(chain_hashes(&(900..916u32).collect::<Vec<_>>(), 2, 0).expect("valid tokens"));
    out
}

fn check(index: &PrefixIndex, model: &Model, chains: &[Vec<u64>], now: f64) {
    for chain in chains {
        let result = index.match_hashes(chain, now);
        let got: Vec<(i64, u32, [u32; 3])> = result
            .entries
            .iter()
            .map(|e| match index.worker_key(e.worker) {
                Some(WorkerKey::Int(w)) => (w, e.blocks, e.tiers),
                other => panic!("unexpected worker {other:?}"),
            })
            .collect();
        // The next match fills this result's buffer again: what a recycled buffer held before
        // must not show.
        result.recycle();
        let mut got = got;
        got.sort_unstable_by_key(|e| e.0);
        assert_eq!(got, model.matches(chain, now));
    }
    for (&w, mine) in &model.held {
        let got = index.holdings(&WorkerKey::Int(w)).expect("known worker");
        let mut want: Vec<(u64, u8, bool)> =
            mine.iter().map(|(h, x)| (*h, x.tiers, x.confirmed)).collect();
        want.sort_unstable();
        assert_eq!(got, want);
    }
    assert_eq!(index.stats().blocks, model.parent_of.len());
    let st = index.state.read();
    for w in 0..st.tree.workers.len() {
        st.tree.check_leaves(w as tree::WorkerId);
    }
}

/// Applies `ops` to the index and the model, checking after each. `fillers` workers holding
/// nothing are registered first, so that the model's workers get the ids after theirs.
fn run(ops: Vec<Op>, capacity: Option<u64>, fillers: i64) {
    let config = IndexConfig { block_size: 2, worker_capacity: capacity, ..Default::default() };
    let index = PrefixIndex::new(config).expect("valid config");
    for f in 0..fillers {
        index.set_capacity(&WorkerKey::Int(-1 - f), None).expect("valid capacity");
    }
    let mut model = Model { default_capacity: capacity, ..Default::default() };
    let chains = chains();
    let mut now = 0.0;
    for op in ops {
        match op {
            Op::Store { w, chain, a, b, tier } => {
                let c = &chains[chain];
                let (a, b) = (a.min(c.len()), b.min(c.len()));
                let parent = (a > 0).then(|| c[a - 1]);
                let tier = Tier::ALL[tier as usize];
                let got = index.store(&WorkerKey::Int(w), &c[a..b], parent, tier).is_ok();
                let want = model.store(w, &c[a..b], parent, (tier.bit(), true, f64::INFINITY));
                assert_eq!(got, want);
            }
            Op::Record { w, chain, end, ttl } => {
                let c = &chains[chain];
                let end = end.min(c.len());
                assert!(index.record(&WorkerKey::Int(w), &c[..end], ttl, now).is_ok());
                assert!(model.store(w, &c[..end], None, (Tier::Gpu.bit(), false, now + ttl)));
            }
            Op::Remove { w, chain, pos, tiers } => {
                let c = &chains[chain];
                let hashes: Vec<u64> = pos.iter().map(|&p| c[p % c.len()]).collect();
                let tier = Tier::ALL.into_iter().find(|t| t.bit() == tiers);
                let got = index.remove(&WorkerKey::Int(w), &hashes, tier).is_ok();
                let want = model.remove(w, &hashes, tier.map_or(0b111, Tier::bit));
                assert_eq!(got, want);
            }
            Op::Clear { w } => {
                let got = index.clear(&WorkerKey::Int(w)).is_ok();
                assert_eq!(got, model.held.contains_key(&w));
                if let Some(mine) = model.held.get_mut(&w) {
                    let gone: Vec<u64> = mine.drain().map(|(h, _)| h).collect();
                    gone.into_iter().for_each(|h| model.forget_if_unheld(h));
                }
            }
            Op::Capacity { w, cap } => {
                index.set_capacity(&WorkerKey::Int(w), cap).expect("valid capacity");
                model.held.entry(w).or_default();
                model.capacity.insert(w, cap);
                model.enforce(w);
            }
            Op::Tick { dt } => now += dt,
            Op::Expire => {
                index.expire(now);
                model.expire(now);
            }
        }
        check(&index, &model, &chains, now);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn index_agrees_with_model(ops in prop::collection::vec(op(), 1..40)) {
        run(ops, None, 0);
    }

    /// The model's three workers get ids 63 to 65, across two 64-bit words of a match's masks.
    #[test]
    fn index_agrees_with_model_across_words(ops in prop::collection::vec(op(), 1..40)) {
        run(ops, None, 63);
    }

    #[test]
    fn capped_index_agrees_with_model(ops in prop::collection::vec(op(), 1..40)) {
        run(ops, Some(4), 0);
    }

    #[test]
    fn snapshot_round_trips(ops in prop::collection::vec(op(), 1..30)) {
        let config = IndexConfig { block_size: 2, ..Default::default() };
        let index = PrefixIndex::new(config).expect("valid config");
        let chains = chains();
        for op in ops {
            if let Op::Store { w, chain, a, b, tier } = op {
                let c = &chains[chain];
                let (a, b) = (a.min(c.len()), b.min(c.len()));
                let parent = (a > 0).then(|| c[a - 1]);
                let _ = index.store(&WorkerKey::Int(w), &c[a..b], parent, Tier::ALL[tier as usize]);
            }
        }
        let copy = PrefixIndex::loads(&index.dumps(0.0), 0.0).expect("own snapshot loads");
        for c in &chains {
            prop_assert_eq!(index.match_hashes(c, 0.0), copy.match_hashes(c, 0.0));
        }
        // The tables are counted as allocated: the copy's are sized for what it holds, the
        // original's for the most it ever held.
        let (stats, copied) = (index.stats(), copy.stats());
        prop_assert!(copied.bytes <= stats.bytes, "{} > {}", copied.bytes, stats.bytes);
        prop_assert_eq!(
            IndexStats { bytes: 0, evicted_blocks: 0, ..stats },
            IndexStats { bytes: 0, evicted_blocks: 0, ..copied }
        );
    }

    #[test]
    fn corrupt_snapshots_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = PrefixIndex::loads(&bytes, 0.0);
    }
}
