"""The simulator's native KV cache against its pure-Python twin, and its KV events against a
real prefix index."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmsched import PrefixIndex
from llmsched.errors import ConfigError, DuplicateRequestError, UnknownRequestError
from llmsched.reference.sim_kv import ReferenceKvCache
from llmsched.sim.kv import make_kv_cache

BLOCK = 4


def _chains() -> list[np.ndarray]:
    """Hash chains with shared prefixes (a tree of content), as prompts would produce."""
    index = PrefixIndex(block_size=BLOCK)
    rng = np.random.default_rng(7)
    base = rng.integers(0, 1000, 40)
    chains = []
    for i in range(6):
        tokens = np.concatenate([base[: 8 * (i % 3 + 1)], rng.integers(0, 1000, 24)])
        chains.append(index.hash_tokens(tokens))
    return chains


CHAINS = _chains()


def _events(events):
    out = []
    for e in events:
        if e[0] == "stored":
            out.append(("stored", e[1], [int(h) for h in e[2]]))
        else:
            out.append(("removed", sorted(int(h) for h in e[1])))
    return out


class KvMachine(RuleBasedStateMachine):
    """Random request life cycles on both caches; every observable must agree, and the events
    applied to a prefix index must always be accepted and mirror the cached chains."""

    def __init__(self) -> None:
        super().__init__()
        self.native = make_kv_cache(24, BLOCK)
        self.twin = ReferenceKvCache(24, BLOCK)
        self.index = PrefixIndex(block_size=BLOCK)
        self.live: dict[int, np.ndarray] = {}
        self.next_id = 0

    def both(self, method, *args):
        a = getattr(self.native, method)(*args)
        b = getattr(self.twin, method)(*args)
        assert a == b, (method, args, a, b)
        return a

    def feed(self) -> None:
        a, b = self.native.take_events(), self.twin.take_events()
        assert _events(a) == _events(b)
        for e in a:
            if e[0] == "stored":
                self.index.store(0, e[2], parent=e[1])
            else:
                self.index.remove(0, e[1])

    @rule(chain=st.integers(0, len(CHAINS) - 1), limit=st.integers(0, 12))
    def start(self, chain, limit) -> None:
        rid = self.next_id
        self.next_id += 1
        self.both("start", rid, CHAINS[chain], limit)
        self.live[rid] = CHAINS[chain]

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.integers(0, 60))
    def allocate(self, data, tokens) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.both("allocate", rid, tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), upto=st.integers(0, 12))
    def commit(self, data, upto) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.both("commit", rid, self.live[rid], upto)
        self.feed()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.both("free", rid)
        del self.live[rid]

    @precondition(lambda self: self.live)
    @rule(data=st.data(), on=st.booleans())
    def set_decoding(self, data, on) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.both("set_decoding", rid, on)

    @rule(steps=st.integers(0, 20))
    def decode(self, steps) -> None:
        self.both("decode_capacity", steps)
        self.both("advance_decoding", steps)

    @rule()
    def events(self) -> None:
        self.feed()

    @invariant()
    def agree(self) -> None:
        assert self.native.free_blocks == self.twin.free_blocks
        assert self.native.cached_blocks == self.twin.cached_blocks
        assert self.native.usage() == self.twin.usage()
        assert self.native.requests() == self.twin.requests()
        for rid in self.live:
            assert self.native.tokens_of(rid) == self.twin.tokens_of(rid)
            assert self.native.blocks_of(rid) == self.twin.blocks_of(rid)
        for chain in CHAINS:
            assert self.native.lookup(chain) == self.twin.lookup(chain)

    @invariant()
    def index_mirrors_cache(self) -> None:
        self.feed()
        for chain in CHAINS:
            held = self.index.match(chain, now=0.0).as_dict().get(0, 0)
            assert held == self.native.lookup(chain)


TestKvMachine = KvMachine.TestCase
TestKvMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_prefix_hit_release_and_eviction_order() -> None:
    kv = make_kv_cache(4, BLOCK)
    a, b = CHAINS[0][:2], CHAINS[3][:2]
    assert kv.start(1, a, 2) == 0 and kv.allocate(1, 8)
    kv.commit(1, a, 2)
    kv.free(1)
    assert (kv.free_blocks, kv.cached_blocks, kv.usage()) == (4, 2, 0.0)
    # A new request hits the whole cached chain...
    assert kv.start(2, a, 2) == 2 and kv.usage() == 0.5
    kv.free(2)
    # ...and needing all four blocks evicts the cached ones, tail first, one removal event.
    kv.take_events()
    assert kv.start(3, b, 0) == 0 and kv.allocate(3, 16)
    events = kv.take_events()
    assert [e[0] for e in events] == ["removed"]
    assert events[0][1].tolist() == [int(a[0])]  # the child is implied by its parent
    assert kv.allocate(3, 17) is False and kv.blocks_of(3) == 4


def test_duplicate_content_is_shared() -> None:
    kv = make_kv_cache(8, BLOCK)
    chain = CHAINS[1][:2]
    for rid in (1, 2):
        kv.start(rid, chain, 0)
        kv.allocate(rid, 8)
    kv.commit(1, chain, 2)
    kv.commit(2, chain, 2)  # same content computed twice: request 2 switches to the cached copy
    assert kv.cached_blocks == 2 and kv.free_blocks == 6
    events = kv.take_events()
    assert len(events) == 1 and events[0][0] == "stored" and events[0][1] is None


def test_errors_name_the_request() -> None:
    kv = make_kv_cache(4, BLOCK)
    with pytest.raises(UnknownRequestError, match="request 9"):
        kv.allocate(9, 4)
    with pytest.raises(UnknownRequestError):
        kv.free(9)
    kv.start(1, CHAINS[0], 0)
    with pytest.raises(DuplicateRequestError, match="request 1"):
        kv.start(1, CHAINS[0], 0)
    with pytest.raises(ConfigError):
        make_kv_cache(0, 16)
    with pytest.raises(ConfigError):
        make_kv_cache(16, 0, native=False)
    twin = ReferenceKvCache(4, BLOCK)
    with pytest.raises(UnknownRequestError):
        twin.commit(3, CHAINS[0], 1)
