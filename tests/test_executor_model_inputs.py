"""The MoE model under inputs it cannot use: an expert backend built for another model, and
forward passes over a KV cache or tokens that do not fit it. Each is refused before anything is
written (no KV slot, no load count changes), where it gave other logits without a word or failed
mid-pass in torch."""

import re

import pytest

torch = pytest.importorskip("torch")

from llmsched.errors import ConfigError, InvalidTokenError  # noqa: E402
from llmsched.executor.config import ModelConfig  # noqa: E402
from llmsched.executor.model import (  # noqa: E402
    ForwardBatch,
    LocalExperts,
    MoETransformer,
    PagedKV,
    SequenceChunk,
)

torch.set_num_threads(1)
CONFIG = ModelConfig(num_layers=1)


@pytest.fixture(scope="module")
def model() -> MoETransformer:
    return MoETransformer(CONFIG)


@pytest.mark.parametrize(
    ("other", "named"),
    [
        ({"seed": 5}, "seed 5 (the model's: 0)"),  # other expert weights, silently
        ({"expert_hidden_size": 32}, "expert_hidden_size 32"),  # silently too
        ({"dtype": "float64"}, "dtype 'float64'"),  # a RuntimeError in the first forward
        ({"hidden_size": 32}, "hidden_size 32"),  # likewise
    ],
)
def test_a_backend_built_for_another_model_is_refused(other: dict[str, object], named: str) -> None:
    backend = LocalExperts.build(ModelConfig(num_layers=1, **other))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="the expert backend was built for another model"):
        MoETransformer(CONFIG, backend)
    with pytest.raises(ConfigError, match=re.escape(named)):
        MoETransformer(CONFIG, backend)


def test_a_backend_built_for_the_same_model_is_taken(model: MoETransformer) -> None:
    same = MoETransformer(CONFIG, LocalExperts.build(CONFIG))
    assert torch.equal(same.forward_dense([1, 2, 3]), model.forward_dense([1, 2, 3]))


def _unchanged(model: MoETransformer, kv: PagedKV, batch: ForwardBatch) -> None:
    before = (kv.key.clone(), kv.value.clone(), model.expert_load.clone())
    with pytest.raises((ConfigError, InvalidTokenError)) as raised:
        model.forward([batch], kv)
    assert torch.equal(kv.key, before[0]) and torch.equal(kv.value, before[1])
    assert torch.equal(model.expert_load, before[2])
    raise raised.value


def test_a_token_outside_the_vocabulary_is_refused(model: MoETransformer) -> None:
    kv = PagedKV(CONFIG, 2, 16)
    batch = ForwardBatch.build([SequenceChunk([5, -1, 7], 0, [0])], 16)
    # -1 read the last row of the embedding.
    with pytest.raises(InvalidTokenError, match="token id -1 is outside the vocabulary"):
        _unchanged(model, kv, batch)


def test_a_batch_built_for_another_block_size_writes_nothing(model: MoETransformer) -> None:
    kv = PagedKV(CONFIG, 4, 16)
    batch = ForwardBatch.build([SequenceChunk(list(range(10)), 0, [2, 3])], 8)
    # Its keys went to slots 16-25 (block * 8 + offset), block 1 of the cache, which it does not
    # hold; then attention failed as a bare RuntimeError.
    with pytest.raises(
        ConfigError, match=r"built for blocks of 8 tokens, the KV cache has blocks of 16"
    ):
        _unchanged(model, kv, batch)


def test_a_block_past_the_cache_is_refused(model: MoETransformer) -> None:
    kv = PagedKV(CONFIG, 2, 16)
    batch = ForwardBatch.build([SequenceChunk([1, 2, 3], 0, [5])], 16)
    with pytest.raises(ConfigError, match="uses block 5; the KV cache has 2 blocks"):
        _unchanged(model, kv, batch)


def test_a_cache_of_another_model_is_refused(model: MoETransformer) -> None:
    kv = PagedKV(ModelConfig(num_layers=1, num_kv_heads=4), 2, 16)
    batch = ForwardBatch.build([SequenceChunk([1, 2, 3], 0, [0])], 16)
    with pytest.raises(ConfigError, match="the KV cache holds 1 layers x 4 KV heads"):
        _unchanged(model, kv, batch)


def test_a_position_past_the_rotary_tables_is_refused() -> None:
    short = MoETransformer(ModelConfig(num_layers=1, max_position=8))
    kv = PagedKV(short.config, 1, 16)
    batch = ForwardBatch.build([SequenceChunk([1, 2, 3], 6, [0])], 16)
    with pytest.raises(ConfigError, match="reaches position 8; the rotary tables hold"):
        _unchanged(short, kv, batch)


@pytest.mark.parametrize(
    ("chunk", "match"),
    [
        (SequenceChunk([1, 2], -1, [0, 1]), "start must be an int >= 0, got -1"),
        (SequenceChunk([1, 2], 0, [-1]), "block ids must be ints >= 0, got -1"),
    ],
)
def test_negative_starts_and_blocks_are_refused_when_built(
    chunk: SequenceChunk, match: str
) -> None:
    # Both indexed their tables from the end.
    with pytest.raises(ConfigError, match=match):
        ForwardBatch.build([chunk], 16)


@pytest.mark.parametrize(
    ("chunks", "match"),
    [
        # Two sequences given the same block: their keys went to the same slots, and the first
        # attended to the second's keys (its logits off by about 2 against forward_dense).
        (
            [SequenceChunk([1, 2, 3], 0, [0, 1]), SequenceChunk([4, 5], 0, [0])],
            r"KV slot 0 \(block 0, offset 0\) is written by two tokens",
        ),
        # One sequence whose table lists a block twice writes positions 0 and 2 to one slot.
        ([SequenceChunk([1, 2, 3, 4], 0, [1, 1])], r"KV slot 2 \(block 1, offset 0\)"),
    ],
)
def test_two_tokens_writing_one_kv_slot_are_refused(
    model: MoETransformer, chunks: list[SequenceChunk], match: str
) -> None:
    kv = PagedKV(CONFIG, 2, 2)
    batch = ForwardBatch.build(chunks, 2)
    with pytest.raises(ConfigError, match=match):
        _unchanged(model, kv, batch)


def test_two_micro_batches_writing_one_kv_slot_are_refused(model: MoETransformer) -> None:
    kv = PagedKV(CONFIG, 4, 16)
    first = ForwardBatch.build([SequenceChunk([1, 2, 3], 0, [1])], 16)
    second = ForwardBatch.build([SequenceChunk([4, 5], 0, [1])], 16)
    before = kv.key.clone()
    with pytest.raises(ConfigError, match=r"KV slot 16 \(block 1, offset 0\) is written by two"):
        model.forward([first, second], kv)
    assert torch.equal(kv.key, before)
    # Reading a block another sequence computed earlier (a shared prefix) is fine.
    model.forward([first], kv)
    shared = ForwardBatch.build([SequenceChunk([9], 16, [1, 2])], 16)
    model.forward([shared], kv)


def test_a_batch_on_another_device_is_refused(model: MoETransformer) -> None:
    kv = PagedKV(CONFIG, 2, 16)
    # The meta device stands in for a GPU on a CPU-only machine: it was a bare RuntimeError
    # (Tensor.item() cannot be called on meta tensors), on a GPU one from the embedding.
    batch = ForwardBatch.build([SequenceChunk([1, 2, 3], 0, [0])], 16, device="meta")
    with pytest.raises(ConfigError, match="batch 0 is on meta, the model is on cpu"):
        _unchanged(model, kv, batch)


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "match"),
    [
        (-1, 16, "num_blocks must be an int >= 0, got -1"),  # a bare RuntimeError
        (2.5, 16, "num_blocks must be an int >= 0, got 2.5"),  # a bare TypeError
        (2, 0, "block_size must be a positive int, got 0"),  # a cache that holds nothing
        (2, True, "block_size must be a positive int, got True"),
    ],
)
def test_kv_cache_sizes_are_checked(num_blocks: object, block_size: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PagedKV(CONFIG, num_blocks, block_size)  # type: ignore[arg-type]
    # No blocks is a cache: an expert-parallel rank with no sequence still runs every pass.
    assert PagedKV(CONFIG, 0, 16).num_blocks == 0


@pytest.mark.parametrize("build", [MoETransformer, LocalExperts.build])
def test_a_device_this_machine_lacks_is_a_config_error(build: object) -> None:
    # A bare RuntimeError from torch ("Found no NVIDIA driver", "Expected one of cpu, cuda,
    # ... device type", an invalid device ordinal) from the memory check on.
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU, on any machine
    with pytest.raises(ConfigError, match=f"device '{missing}'"):
        build(CONFIG, device=missing)  # type: ignore[operator]
    with pytest.raises(ConfigError, match="device 'tpu': Expected one of cpu, cuda"):
        build(CONFIG, device="tpu")  # type: ignore[operator]


def test_a_kv_cache_on_a_device_this_machine_lacks_is_a_config_error() -> None:
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ConfigError, match=f"device '{missing}'"):
        PagedKV(CONFIG, 2, 16, missing)


@pytest.mark.parametrize(("device", "read_as"), [("cuda:256", "cuda:0"), ("cuda:255", "cuda")])
def test_a_device_index_torch_wraps_is_refused(device: str, read_as: str) -> None:
    # torch keeps a device index in 8 bits: on a GPU machine cuda:256 ran on GPU 0, and
    # cuda:255 (index -1) on the current device, without a word.
    with pytest.raises(ConfigError, match=f"index {device[5:]} is past .* read it as {read_as}\\)"):
        MoETransformer(CONFIG, device=device)
