"""Paged KV cache: LRU eviction, prefix caching, and vLLM-format KV events that replay exactly."""

import random

import msgpack
import pytest

torch = pytest.importorskip("torch")

from _data import load_vector  # noqa: E402

from llmsched import PrefixIndex  # noqa: E402
from llmsched.executor.config import DEFAULT_BLOCK_SIZE, EngineConfig, ModelConfig  # noqa: E402
from llmsched.executor.engine import Engine, SamplingParams  # noqa: E402
from llmsched.executor.kv_cache import BlockPool, KVCacheManager, NoFreeBlocksError  # noqa: E402
from llmsched.executor.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_event_batch,
    encode_event_batch,
)
from llmsched.executor.model import MoETransformer  # noqa: E402
from llmsched.hashing import block_hashes  # noqa: E402
from llmsched.reference import hashing as ref_hashing  # noqa: E402

torch.set_num_threads(1)


def test_event_batch_encoding_is_byte_identical_to_vllm_vector() -> None:
    vector = load_vector("vllm_kv_events.json")
    decoded = vector["decoded"]
    stored, removed, _ = decoded["events"]
    events = [
        BlockStored(
            tuple(stored["block_hashes"]),
            stored["parent_block_hash"],
            tuple(stored["token_ids"]),
            stored["block_size"],
            stored["medium"],
        ),
        BlockRemoved(tuple(removed["block_hashes"]), removed["medium"]),
        AllBlocksCleared(),
    ]
    payload = encode_event_batch(decoded["ts"], events, decoded["dp_rank"])
    assert payload.hex() == vector["payload_hex"]
    ts, wire_events, dp_rank = decode_event_batch(bytes.fromhex(vector["payload_hex"]))
    assert (ts, dp_rank) == (decoded["ts"], decoded["dp_rank"])
    assert [e["type"] for e in wire_events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]


def test_block_size_matches_hashing_default() -> None:
    import inspect

    default = inspect.signature(block_hashes).parameters["block_size"].default
    assert default == DEFAULT_BLOCK_SIZE == EngineConfig().block_size


def test_pool_evicts_unused_cached_blocks_least_recently_used_first() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    a = pool.allocate(2)
    pool.cache(a, [101, 102], None, [1, 2, 3, 4])
    b = pool.allocate(1)
    pool.cache(b, [201], None, [9, 9])
    pool.free(b)  # cached, freed first: oldest
    pool.free(a)  # frees a[1] then a[0]
    scratch = pool.allocate(1)  # the never-cached block goes first
    assert pool.block_hash[scratch[0]] is None
    pool.take_events()
    pool.allocate(2)
    assert [e.block_hashes for e in pool.take_events()] == [(201,), (102,)]
    assert set(pool.cached) == {101}
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)


def test_prefix_hit_takes_a_reference_and_protects_blocks() -> None:
    kvm = KVCacheManager(num_blocks=6, block_size=4)
    tokens = list(range(13))
    assert kvm.lookup("a", tokens) == 0
    assert kvm.allocate("a", 13)
    kvm.commit("a", tokens, 13)
    assert kvm.lookup("b", tokens) == 12
    assert kvm.block_table("b") == kvm.block_table("a")[:3]
    kvm.free("a")
    assert kvm.allocate("c", 8)  # 6 blocks: a's 4th block and 2 fresh ones
    assert set(kvm.block_table("c")).isdisjoint(kvm.block_table("b"))
    # A fully cached prompt still computes its last token.
    kvm.free("b")
    kvm.free("c")
    assert kvm.lookup("d", tokens[:12]) == 8


def test_reset_is_refused_while_blocks_are_held() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    blocks = pool.allocate(1)
    pool.cache(blocks, [5], None, [1, 2])
    assert not pool.reset()
    pool.free(blocks)
    assert pool.reset()
    assert pool.cached == {}
    assert isinstance(pool.take_events()[-1], AllBlocksCleared)


class IndexModel:
    """What an index following the engine's events believes: engine hash -> (parent, tokens)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, payload: bytes) -> None:
        _, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert dp_rank == 0
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                size = event["block_size"]
                parent = event["parent_block_hash"]
                tokens = event["token_ids"]
                assert len(tokens) == size * len(event["block_hashes"])
                assert parent is None or parent in self.blocks
                for i, block_hash in enumerate(event["block_hashes"]):
                    assert block_hash not in self.blocks, "stored twice without removal"
                    self.blocks[block_hash] = (parent, tuple(tokens[i * size : (i + 1) * size]))
                    parent = block_hash
            elif kind == "BlockRemoved":
                for block_hash in event["block_hashes"]:
                    del self.blocks[block_hash]
            else:
                assert kind == "AllBlocksCleared"
                self.blocks.clear()


def random_workload(engine: Engine, rng: random.Random, requests: int) -> None:
    systems = [[rng.randrange(512) for _ in range(rng.randrange(16, 48))] for _ in range(3)]
    next_id = 0
    cleared_midway = False
    for _ in range(400):
        if next_id < requests and rng.random() < 0.5:
            prompt = rng.choice(systems) + [rng.randrange(512) for _ in range(rng.randrange(1, 40))]
            params = SamplingParams(max_tokens=rng.randrange(1, 40))
            engine.add_request(f"r{next_id}", prompt, params)
            next_id += 1
        if engine.running and rng.random() < 0.05:
            engine.abort_request(rng.choice(engine.running).request_id)
        if next_id == requests // 2 and not cleared_midway:
            while engine.has_unfinished():
                engine.step()
            assert engine.reset_prefix_cache()
            cleared_midway = True
        elif not engine.has_unfinished() and rng.random() < 0.2:
            assert engine.reset_prefix_cache()
        engine.step()
        if next_id == requests and not engine.has_unfinished():
            break


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replayed_events_match_the_engine_cache(seed: int) -> None:
    index = IndexModel()
    native = PrefixIndex(block_size=DEFAULT_BLOCK_SIZE)
    reports = []

    def publish(payload: bytes) -> None:
        index.apply(payload)
        reports.append(native.apply_vllm_events("engine-0", payload))

    engine = Engine(
        MoETransformer(ModelConfig()),
        EngineConfig(num_blocks=16, max_num_batched_tokens=48, max_num_seqs=6),
        publisher=publish,
    )
    random_workload(engine, random.Random(seed), requests=30)
    metrics = engine.metrics()
    assert metrics.prefix_cache_hits > 0 and metrics.num_preemptions > 0
    actual = {h: (b.parent_hash, b.token_ids) for h, b in engine.cached_blocks().items()}
    assert index.blocks == actual
    # The native index keys blocks by its own hash of the tokens; with the same xxh3 chain and
    # seed those equal the engine's hashes, so its holdings are exactly the engine's cache.
    assert set(native.holdings("engine-0")) == set(actual)
    for key in ("unknown_parent", "unknown_removed", "conflicts", "block_size_mismatch"):
        assert sum(r[key] for r in reports) == 0, key
    assert sum(r["cleared"] for r in reports) > 0
    assert len(engine.take_kv_event_batches()) > 0
    # The engine's hashes are llmsched's xxh3 chain: recompute each from its parent and tokens.
    for block_hash, (parent, tokens) in index.blocks.items():
        chain = engine.config.hash_seed if parent is None else parent
        assert ref_hashing.block_hashes(list(tokens), len(tokens), chain) == [block_hash]


def test_a_waiting_request_that_cannot_be_admitted_does_not_refresh_its_prefix() -> None:
    """vLLM touches a request's cached prefix only once its blocks are allocated. The engine
    took (and on failure released) the prefix on every try, moving it to the back of the LRU
    queue, so a blocked request's prefix outlived older-used blocks (probe 60)."""
    engine = Engine(MoETransformer(ModelConfig()), EngineConfig(num_blocks=6))
    first, second = list(range(100, 132)), list(range(200, 216))
    engine.generate([[*first, 1]], SamplingParams(max_tokens=1))  # caches first's 2 blocks
    engine.generate([[*second, 2]], SamplingParams(max_tokens=1))  # then second's block
    oldest = next(h for h, b in engine.cached_blocks().items() if b.token_ids[0] == 116)
    engine.take_kv_event_batches()
    engine.add_request("grows", list(range(300, 340)), SamplingParams(max_tokens=20))
    # Hits first's 2 blocks but needs 3 more while only 1 is free: it waits.
    engine.add_request("blocked", first + list(range(400, 440)), SamplingParams(max_tokens=1))
    removed: list[int] = []
    while "grows" in engine.requests and not removed:
        engine.step()
        assert [r.request_id for r in engine.waiting] == ["blocked"]
        for payload in engine.take_kv_event_batches():
            for event in msgpack.unpackb(payload, raw=False)[1]:
                if event["type"] == "BlockRemoved":
                    removed += event["block_hashes"]
    # "grows" needed a 4th block: the least recently used cached block goes, first's second.
    assert removed == [oldest]


def test_peek_and_can_admit_take_no_references() -> None:
    kvm = KVCacheManager(num_blocks=4, block_size=4)
    tokens = list(range(9))
    assert kvm.lookup("a", tokens) == 0 and kvm.allocate("a", 9)
    kvm.commit("a", tokens, 9)
    kvm.free("a")
    assert kvm.peek("b", tokens) == 8
    assert kvm.pool.num_free == 4 and kvm.block_table("b") == []
    # 2 cached blocks (free, so they count) + 2 new ones: 4 <= 4 free.
    assert kvm.can_admit("b", tokens, 13)
    assert not kvm.can_admit("b", tokens, 17)
    assert kvm.lookup("b", tokens) == 8 and kvm.allocate("b", 13)
    assert kvm.pool.num_free == 0
