"""The MoE model: paged attention, prefix reuse and chunked prefill agree with dense attention."""

import random

import pytest

torch = pytest.importorskip("torch")

from llmsched.errors import ConfigError, InvalidTokenError, InvalidTypeError  # noqa: E402
from llmsched.executor.config import ModelConfig  # noqa: E402
from llmsched.executor.eplb import ExpertPlacement  # noqa: E402
from llmsched.executor.model import (  # noqa: E402
    ExpertStore,
    ForwardBatch,
    LocalExperts,
    MoETransformer,
    PagedKV,
    SequenceChunk,
)

torch.set_num_threads(1)
BLOCK = 16
ATOL = 1e-4


def prompt(length: int, seed: int = 0, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.fixture(scope="module")
def model() -> MoETransformer:
    return MoETransformer(ModelConfig())


def run_chunks(model, kv, chunks):
    return model.forward([ForwardBatch.build(chunks, BLOCK)], kv)[0]


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig(),
        ModelConfig(num_heads=4, num_kv_heads=1, num_layers=3, top_k=1),
        ModelConfig(num_heads=4, num_kv_heads=4, shared_expert_hidden_size=0, seed=7),
    ],
    ids=["gqa2", "mqa-top1", "mha-noshared"],
)
def test_paged_attention_equals_dense_attention(config: ModelConfig) -> None:
    model = MoETransformer(config)
    kv = PagedKV(config, num_blocks=16, block_size=BLOCK)
    prompts = [prompt(n, seed=n) for n in (1, 15, 16, 17, 50)]
    # Blocks deliberately scattered and out of order.
    tables = [[15], [14], [13], [12, 11], [3, 0, 7, 9]]
    chunks = [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    logits = run_chunks(model, kv, chunks)
    for row, p in enumerate(prompts):
        dense = model.forward_dense(p)[-1]
        torch.testing.assert_close(logits[row], dense, atol=ATOL, rtol=0)
        assert int(logits[row].argmax()) == int(dense.argmax())


def test_cached_prefix_plus_rest_equals_full_prefill(model: MoETransformer) -> None:
    tokens = prompt(70, seed=1)
    table = [4, 9, 2, 6, 7]
    full_kv = PagedKV(model.config, 10, BLOCK)
    full = run_chunks(model, full_kv, [SequenceChunk(tokens, 0, table)])
    # A first request computes the 48-token prefix; a second one reuses its three blocks.
    kv = PagedKV(model.config, 10, BLOCK)
    run_chunks(model, kv, [SequenceChunk(tokens[:48], 0, table[:3])])
    rest = run_chunks(model, kv, [SequenceChunk(tokens[48:], 48, table)])
    torch.testing.assert_close(rest, full, atol=ATOL, rtol=0)
    torch.testing.assert_close(kv.key[:, table], full_kv.key[:, table], atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
def test_chunked_prefill_equals_one_shot(model: MoETransformer, chunk: int) -> None:
    tokens = prompt(90, seed=2)
    table = [0, 1, 2, 3, 4, 5]
    one_shot = run_chunks(model, PagedKV(model.config, 6, BLOCK), [SequenceChunk(tokens, 0, table)])
    kv = PagedKV(model.config, 6, BLOCK)
    for start in range(0, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        last = run_chunks(model, kv, [SequenceChunk(piece, start, table)])
    torch.testing.assert_close(last, one_shot, atol=ATOL, rtol=0)
    assert int(last.argmax()) == int(one_shot.argmax())


def test_mixed_batch_of_prefill_and_decode_rows(model: MoETransformer) -> None:
    a, b = prompt(20, seed=3), prompt(33, seed=4)
    kv = PagedKV(model.config, 8, BLOCK)
    run_chunks(model, kv, [SequenceChunk(a, 0, [0, 1])])
    logits = run_chunks(model, kv, [SequenceChunk([5], 20, [0, 1]), SequenceChunk(b, 0, [2, 3, 4])])
    torch.testing.assert_close(logits[0], model.forward_dense([*a, 5])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], model.forward_dense(b)[-1], atol=ATOL, rtol=0)


def test_two_micro_batches_equal_one(model: MoETransformer) -> None:
    prompts = [prompt(n, seed=n) for n in (9, 30, 18)]
    tables = [[0], [1, 2], [3, 4]]
    chunks = [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    one = run_chunks(model, PagedKV(model.config, 5, BLOCK), chunks)
    kv = PagedKV(model.config, 5, BLOCK)
    first, second = model.forward(
        [ForwardBatch.build(chunks[:1], BLOCK), ForwardBatch.build(chunks[1:], BLOCK)], kv
    )
    torch.testing.assert_close(torch.cat([first, second]), one, atol=ATOL, rtol=0)


def test_weights_are_seeded_and_replicas_are_exact_copies() -> None:
    config = ModelConfig()
    a, b = MoETransformer(config), MoETransformer(config)
    assert torch.equal(a.embed, b.embed)
    assert not torch.equal(a.embed, MoETransformer(ModelConfig(seed=1)).embed)
    placement = ExpertPlacement.from_phy2log([[0, 1, 2, 3, 4, 5, 6, 7, 3, 3]] * 2, 8)
    replicated = MoETransformer(config, LocalExperts.build(config, placement))
    store = replicated.backend.store
    assert torch.equal(store.w_gate[0][3], store.w_gate[0][8])
    assert torch.equal(store.w_down[1][9], a.backend.store.w_down[1][3])
    tokens = prompt(40, seed=5)
    torch.testing.assert_close(
        replicated.forward_dense(tokens), a.forward_dense(tokens), atol=ATOL, rtol=0
    )
    # Round-robin replica choice spreads expert 3's tokens over its three slots.
    load = replicated.slot_load[0]
    assert load[3] > 0 and load[8] > 0 and load[9] > 0
    assert int(load[[3, 8, 9]].sum()) == int(replicated.expert_load[0, 3])


def test_router_records_load_per_expert(model: MoETransformer) -> None:
    model.reset_load()
    model.forward_dense(prompt(25, seed=6))
    load = model.load_snapshot()
    assert load.shape == (2, 8)
    assert (load.sum(axis=1) == 25 * model.config.top_k).all()


def test_bad_configs_raise_clear_errors() -> None:
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ConfigError, match="top_k"):
        ModelConfig(num_experts=2, top_k=3)
    with pytest.raises(ConfigError, match="dtype"):
        ModelConfig(dtype="int8")
    with pytest.raises(ConfigError, match="unknown model preset"):
        ModelConfig.preset("huge")
    with pytest.raises(ConfigError, match="placement is for"):
        MoETransformer(ModelConfig(), LocalExperts.build(ModelConfig(num_layers=3)))
    with pytest.raises(ConfigError, match="needs 2 blocks"):
        ForwardBatch.build([SequenceChunk(list(range(20)), 0, [0])], BLOCK)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rms_eps": float("nan")}, "rms_eps must be finite"),
        ({"rms_eps": 0.0}, "rms_eps"),
        ({"rms_eps": -1e-6}, "rms_eps"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rope_theta": float("inf")}, "rope_theta"),
        ({"rope_theta": 1.0}, "rope_theta"),
        ({"rope_theta": 10**400}, "rope_theta must be finite"),
        ({"router_skew": float("inf")}, "router_skew"),
        ({"router_skew": 1e300}, "router_skew"),
        ({"router_skew": "1"}, "router_skew"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"shared_expert_hidden_size": 1.5}, "shared_expert_hidden_size"),
    ],
)
def test_out_of_range_model_parameters_are_refused(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**overrides)


@pytest.mark.parametrize(
    ("overrides", "part"),
    [
        ({"vocab_size": 2**40}, "vocab_size x hidden_size"),
        ({"max_position": 2**40}, "max_position x head_dim"),
        ({"num_layers": 10**9}, "num_layers x num_experts x hidden_size"),
        ({"num_experts": 10**9}, "num_layers x num_experts x hidden_size"),
        ({"hidden_size": 2**30}, "num_layers x num_experts x hidden_size"),
    ],
)
def test_a_model_past_memory_is_refused_before_allocating(overrides, part) -> None:
    config = ModelConfig(**overrides)
    with pytest.raises(
        ConfigError, match=rf"MoETransformer would allocate .*largest part is {part}"
    ):
        MoETransformer(config)
    with pytest.raises(ConfigError, match="LocalExperts would allocate"):
        LocalExperts.build(config)


def test_kv_and_expert_stores_past_memory_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"PagedKV would allocate .*num_blocks"):
        PagedKV(ModelConfig(), num_blocks=2**40, block_size=BLOCK)
    config = ModelConfig(expert_hidden_size=2**30)
    placement = ExpertPlacement.contiguous(config.num_layers, config.num_experts)
    with pytest.raises(ConfigError, match=r"ExpertStore would allocate .*expert_hidden_size"):
        ExpertStore(config, placement, range(8))


@pytest.mark.parametrize(
    ("tokens", "error", "message"),
    [
        ([3, -1], InvalidTokenError, "-1 at position 1"),  # ran silently as token 511
        ([512], InvalidTokenError, "512 at position 0"),  # a bare IndexError
        ([], ConfigError, "empty"),  # a reshape RuntimeError
        ([1] * 8193, ConfigError, "max_position"),  # a bare IndexError
        ([1.5], InvalidTypeError, "float"),
    ],
)
def test_the_dense_reference_refuses_what_it_cannot_run(model, tokens, error, message) -> None:
    with pytest.raises(error, match=message):
        model.forward_dense(tokens)
    load = model.load_snapshot()
    model.forward_dense([1, 2])
    assert (model.load_snapshot() - load).sum() == 2 * 2 * model.config.top_k
