"""A small decoder-only MoE transformer with deterministic seeded weights.

Each layer: RMSNorm, grouped-query attention with rotary positions over a paged KV cache,
RMSNorm, then a mixture of experts (softmax router, top-k, weights renormalised over the chosen
experts, SwiGLU experts) plus an always-on shared expert.

Weights come from seeded generators, one seed per tensor name (``xxh3_64(name, seed)``), so any
process materialises exactly the tensors it holds (an expert-parallel rank builds only its own
experts) and every process agrees on their values. Nothing is downloaded.

Expert execution goes through an :class:`ExpertBackend` in three phases (dispatch, compute,
combine) so that the same forward pass serves one process (:class:`LocalExperts`), expert
parallelism over ranks (``expert_parallel.AllToAllExperts``) and dual-batch overlap, where the
phases of two micro-batches interleave so one's communication overlaps the other's compute.

>>> import torch
>>> from llmsched.executor.config import ModelConfig, check_memory
>>> model = MoETransformer(ModelConfig.preset("small"))
>>> model.forward_dense([1, 2, 3]).shape
torch.Size([3, 512])
"""

from __future__ import annotations

import abc
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from llmsched._extras import require

require("executor", "torch", "xxhash", feature="llmsched.executor")

import torch
import torch.nn.functional as F
import xxhash

from llmsched._tokens import TokensLike, as_token_array
from llmsched.errors import ConfigError, InvalidTokenError, InvalidTypeError
from llmsched.executor.config import ModelConfig, check_memory
from llmsched.executor.eplb import ExpertPlacement

__all__ = [
    "Dispatched",
    "ExpertBackend",
    "ExpertStore",
    "ForwardBatch",
    "LocalExperts",
    "MoETransformer",
    "PagedKV",
    "SequenceChunk",
    "checked_device",
    "checked_tokens",
    "device_memory_bytes",
    "seeded_tensor",
    "torch_dtype",
]

Tensor = torch.Tensor


def _dtype_bytes(config: ModelConfig) -> int:
    return torch.empty((), dtype=torch_dtype(config.dtype)).element_size()


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named by a :class:`ModelConfig` dtype string.

    >>> torch_dtype("float32")
    torch.float32
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r}")
    return dtype


_FALLBACK_MEMORY_BYTES = 2**40
"""The bound when a device's memory cannot be read (1 TiB)."""


def device_memory_bytes(device: torch.device | str) -> int:
    """The memory the executor may fill on ``device``: a GPU's total memory, else the host's
    physical memory (lowered to the address-space limit, ``ulimit -v``, when one is set).

    Model and KV sizes past it are refused with a ConfigError before anything is allocated;
    where the memory cannot be read the bound is 1 TiB.

    A device string torch does not know, or a CUDA device this machine lacks, is a
    :class:`~llmsched.errors.ConfigError` (it was a bare RuntimeError from torch).

    >>> device_memory_bytes("cpu") > 0
    True
    """
    device = checked_device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        limit = _FALLBACK_MEMORY_BYTES
    if sys.platform != "win32":
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY and soft > 0:
            limit = min(limit, soft)
    return int(limit) if limit > 0 else _FALLBACK_MEMORY_BYTES


def checked_device(device: torch.device | str) -> torch.device:
    """``device`` as a torch device, or a :class:`~llmsched.errors.ConfigError` naming it for a
    string torch does not parse or a CUDA device this machine does not have (torch's bare
    RuntimeError otherwise, from the first allocation or memory query).

    >>> checked_device("cpu")
    device(type='cpu')
    >>> checked_device("tpu")
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: device 'tpu': Expected one of cpu, cuda, ...
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {device!r}: {str(exc).splitlines()[0]}") from None
    written = device.rpartition(":")[2] if isinstance(device, str) and ":" in device else ""
    if written.isdigit() and int(written) != parsed.index:
        # torch keeps an index in 8 bits: cuda:256 was cuda:0 and cuda:255 the current device.
        raise ConfigError(
            f"device {device!r}: index {int(written)} is past torch's device indices (it read "
            f"it as {parsed})"
        )
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {str(device)!r}: no CUDA device on this machine")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ConfigError(f"device {str(device)!r}: this machine has {count} CUDA device(s)")
    return parsed


def _check_fits(what: str, parts: Mapping[str, int], device: torch.device | str) -> None:
    device = checked_device(device)
    check_memory(what, parts, device_memory_bytes(device), str(device))


def checked_tokens(config: ModelConfig, tokens: TokensLike, what: str = "tokens") -> list[int]:
    """``tokens`` as a list of ids in ``config``'s vocabulary, or the error naming the first
    bad one (what :func:`llmsched.hashing.block_hashes` refuses, plus ids past the vocabulary:
    a negative id indexed the embedding from its end).

    >>> checked_tokens(ModelConfig(), [1, 512], "prompt")
    Traceback (most recent call last):
    ...
    llmsched.errors.InvalidTokenError: prompt: token id 512 at position 1 is outside the \
vocabulary (0 to 511)
    """
    ids: list[int] = as_token_array(tokens, what).tolist()
    vocab = config.vocab_size
    for position, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise InvalidTokenError(
                f"{what}: token id {token} at position {position} is outside the vocabulary "
                f"(0 to {vocab - 1})"
            )
    return ids


def seeded_tensor(
    name: str,
    shape: Sequence[int],
    std: float,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Tensor:
    """A normal(0, std) tensor whose values depend only on ``(seed, name, shape, device type)``.

    >>> a = seeded_tensor("w", (2, 2), 1.0, 0, torch.device("cpu"), torch.float32)
    >>> torch.equal(a, seeded_tensor("w", (2, 2), 1.0, 0, torch.device("cpu"), torch.float32))
    True
    """
    tensor_seed = xxhash.xxh3_64_intdigest(name.encode(), seed=seed) & (2**63 - 1)
    generator = torch.Generator(device=device).manual_seed(tensor_seed)
    values = torch.randn(tuple(shape), generator=generator, device=device, dtype=torch.float32)
    return (values * std).to(dtype)


@dataclass(frozen=True)
class SequenceChunk:
    """The tokens one sequence computes in a step, after ``start`` tokens already in its cache.

    ``block_table`` lists the KV blocks holding positions ``0 .. start + len(token_ids) - 1``;
    ``sample`` asks for the logits of the chunk's last token.
    """

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    sample: bool = True


@dataclass
class ForwardBatch:
    """Sequence chunks flattened into one batch, with the indices paged attention needs.

    Rows are the chunks' tokens concatenated in order. Attention runs padded: ``query_index``
    ``[B, max_q]`` gathers each sequence's rows, ``kv_blocks`` ``[B, max_blocks]`` its cache
    blocks, and ``attn_mask`` ``[B, 1, max_q, max_ctx]`` keeps keys at or before each query's
    position. ``sample_rows`` are the rows whose logits the pass returns.

    >>> b = ForwardBatch.build([SequenceChunk([5, 6, 7], 0, [0])], block_size=4)
    >>> b.slot_mapping.tolist(), b.sample_rows.tolist()
    ([0, 1, 2], [2])
    """

    token_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    query_index: Tensor
    query_valid: Tensor
    kv_blocks: Tensor
    attn_mask: Tensor
    sample_rows: Tensor
    num_sequences: int
    sample_sequences: list[int] = field(default_factory=list)
    block_size: int = 0
    """The block size the slots were computed for (0: unknown, not checked by ``forward``)."""

    @property
    def num_tokens(self) -> int:
        """Number of rows (tokens) in the batch."""
        return int(self.token_ids.shape[0])

    @classmethod
    def build(
        cls,
        chunks: Sequence[SequenceChunk],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Flatten ``chunks`` (each needs enough blocks for its positions).

        >>> ForwardBatch.build([], block_size=4).num_tokens
        0
        """
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_sequences: list[int] = []
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        for index, chunk in enumerate(chunks):
            start = chunk.start
            # A negative start read the block table and the rotary tables from their end.
            if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
                raise ConfigError(
                    f"sequence chunk {index}: start must be an int >= 0, got {start!r}"
                )
            end = chunk.start + len(chunk.token_ids)
            if len(chunk.token_ids) == 0:
                raise ConfigError(f"sequence chunk {index} has no tokens")
            for block in chunk.block_table:
                if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 0:
                    raise ConfigError(
                        f"sequence chunk {index}: block ids must be ints >= 0, got {block!r}"
                    )
            if len(chunk.block_table) * block_size < end:
                raise ConfigError(
                    f"sequence chunk {index} needs {-(-end // block_size)} blocks for {end} "
                    f"positions, has {len(chunk.block_table)}"
                )
            tokens.extend(chunk.token_ids)
            for position in range(chunk.start, end):
                positions.append(position)
                block = chunk.block_table[position // block_size]
                slots.append(block * block_size + position % block_size)
            if chunk.sample:
                sample_rows.append(len(tokens) - 1)
                sample_sequences.append(index)
        query_lens = [len(c.token_ids) for c in chunks]
        context_lens = [c.start + len(c.token_ids) for c in chunks]
        num_seqs = len(chunks)
        max_q = max(query_lens, default=0)
        max_blocks = max((-(-n // block_size) for n in context_lens), default=0)

        query_index = torch.zeros((num_seqs, max_q), dtype=torch.long)
        query_valid = torch.zeros((num_seqs, max_q), dtype=torch.bool)
        kv_blocks = torch.zeros((num_seqs, max_blocks), dtype=torch.long)
        query_pos = torch.zeros((num_seqs, max_q), dtype=torch.long)
        row = 0
        for index, chunk in enumerate(chunks):
            q = query_lens[index]
            query_index[index, :q] = torch.arange(row, row + q)
            query_valid[index, :q] = True
            query_pos[index, :q] = torch.arange(chunk.start, chunk.start + q)
            needed = -(-context_lens[index] // block_size)
            kv_blocks[index, :needed] = torch.tensor(list(chunk.block_table[:needed]))
            row += q
        key_pos = torch.arange(max_blocks * block_size)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]
        # Padding queries see key 0 only, so softmax stays finite; their rows are dropped.
        mask = torch.where(query_valid[:, :, None], mask, key_pos[None, None, :] == 0)

        def put(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            token_ids=put(tokens),
            positions=put(positions),
            slot_mapping=put(slots),
            query_index=query_index.to(device),
            query_valid=query_valid.to(device),
            kv_blocks=kv_blocks.to(device),
            attn_mask=mask[:, None].to(device),
            sample_rows=put(sample_rows),
            num_sequences=num_seqs,
            sample_sequences=sample_sequences,
            block_size=block_size,
        )


class PagedKV:
    """The KV tensors: ``key[L, num_blocks, block_size, kv_heads, head_dim]`` and ``value``.

    >>> kv = PagedKV(ModelConfig(), num_blocks=4, block_size=16)
    >>> tuple(kv.key.shape)
    (2, 4, 16, 2, 16)
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        # -1 and 2.5 failed in torch.zeros; a block size of 0 made a cache that holds nothing.
        # No blocks is a cache: an expert-parallel rank with no sequence still runs each pass.
        for name, size, low in (("num_blocks", num_blocks, 0), ("block_size", block_size, 1)):
            if isinstance(size, bool) or not isinstance(size, int) or size < low:
                kind = "a positive int" if low else "an int >= 0"
                raise ConfigError(f"{name} must be {kind}, got {size!r}")
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        kv_part = "num_blocks x block_size x num_layers x num_kv_heads x head_dim (KV cache)"
        _check_fits("PagedKV", {kv_part: 2 * math.prod(shape) * _dtype_bytes(config)}, device)
        dtype = torch_dtype(config.dtype)
        self.block_size = block_size
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_blocks(self) -> int:
        """Blocks in the cache.

        >>> PagedKV(ModelConfig(), 4, 16).num_blocks
        4
        """
        return int(self.key.shape[1])

    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers (``2 * layers * kv_heads * head_dim * b``).

        >>> PagedKV(ModelConfig(), 1, 16).bytes_per_token()
        512
        """
        layers, _, _, heads, dim = self.key.shape
        return 2 * layers * heads * dim * self.key.element_size()


@dataclass
class Dispatched:
    """Token rows on their way to (or arrived at) the expert slots that serve them.

    ``rows`` and ``slots`` are the rows this process computes and their local slot ids once
    ``works`` (async collectives) complete; ``order`` maps the sent rows back to the
    (token, choice) pairs, and the counts size the return trip.
    """

    rows: Tensor
    slots: Tensor
    num_pairs: int
    order: Tensor | None = None
    send_counts: list[int] = field(default_factory=list)
    recv_counts: list[int] = field(default_factory=list)
    works: list[object] = field(default_factory=list)
    output: Tensor | None = None


class ExpertStore:
    """SwiGLU weights of the physical expert slots one process holds, per layer.

    Slot ``s`` of layer ``l`` holds logical expert ``placement.phy2log[l, s]``; its weights are
    the seeded weights of that logical expert, so replicas are exact copies.

    >>> cfg = ModelConfig()
    >>> store = ExpertStore(cfg, ExpertPlacement.contiguous(2, 8), range(0, 4))
    >>> tuple(store.w_gate[0].shape)
    (4, 64, 64)
    """

    def __init__(
        self,
        config: ModelConfig,
        placement: ExpertPlacement,
        slots: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.device = checked_device(device)
        self.slots = list(slots)
        part = "num_layers x num_experts x hidden_size x expert_hidden_size (routed experts)"
        _check_fits("ExpertStore", {part: config.expert_bytes(len(self.slots))}, self.device)
        self.w_gate: list[Tensor] = []
        self.w_up: list[Tensor] = []
        self.w_down: list[Tensor] = []
        for layer in range(config.num_layers):
            experts = [int(placement.phy2log[layer, s]) for s in self.slots]
            gate, up, down = self.logical_weights(layer, experts)
            self.w_gate.append(gate)
            self.w_up.append(up)
            self.w_down.append(down)

    def logical_weights(self, layer: int, experts: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """Freshly materialised weights of logical ``experts`` of ``layer`` (stacked)."""
        cfg = self.config
        dtype = torch_dtype(cfg.dtype)
        hidden, inner = cfg.hidden_size, cfg.expert_hidden_size
        empty = torch.empty((0, hidden, inner), dtype=dtype, device=self.device)
        gates, ups, downs = [empty], [empty], [empty.transpose(1, 2)]
        for expert in experts:
            prefix = f"layers.{layer}.experts.{expert}"
            args = (cfg.seed, self.device, dtype)
            gates.append(seeded_tensor(f"{prefix}.gate", (1, hidden, inner), hidden**-0.5, *args))
            ups.append(seeded_tensor(f"{prefix}.up", (1, hidden, inner), hidden**-0.5, *args))
            downs.append(seeded_tensor(f"{prefix}.down", (1, inner, hidden), inner**-0.5, *args))
        return torch.cat(gates), torch.cat(ups), torch.cat(downs)

    def run(self, layer: int, rows: Tensor, local_slots: Tensor) -> Tensor:
        """Each row through the expert in its local slot; output rows in input order."""
        out = torch.zeros_like(rows)
        if rows.shape[0] == 0:
            return out
        order = torch.argsort(local_slots, stable=True)
        counts = torch.bincount(local_slots, minlength=len(self.slots)).tolist()
        start = 0
        for slot, count in enumerate(counts):
            if count == 0:
                continue
            picked = order[start : start + count]
            x = rows[picked]
            hidden = F.silu(x @ self.w_gate[layer][slot]) * (x @ self.w_up[layer][slot])
            out[picked] = hidden @ self.w_down[layer][slot]
            start += count
        return out

    def replace_layer(self, layer: int, gate: Tensor, up: Tensor, down: Tensor) -> None:
        """Install new slot weights for ``layer`` (an expert move)."""
        self.w_gate[layer], self.w_up[layer], self.w_down[layer] = gate, up, down

    def slot_weights(self, layer: int, local_slots: Sequence[int]) -> Tensor:
        """The weights of ``local_slots`` flattened into rows (for sending to another rank)."""
        index = torch.tensor(list(local_slots), dtype=torch.long, device=self.device)
        parts = (self.w_gate[layer], self.w_up[layer], self.w_down[layer])
        return torch.cat([p[index].flatten(1) for p in parts], dim=1)

    def unflatten(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Inverse of :meth:`slot_weights`."""
        hidden, inner = self.config.hidden_size, self.config.expert_hidden_size
        size = hidden * inner
        gate = flat[:, :size].reshape(-1, hidden, inner)
        up = flat[:, size : 2 * size].reshape(-1, hidden, inner)
        down = flat[:, 2 * size :].reshape(-1, inner, hidden)
        return gate.contiguous(), up.contiguous(), down.contiguous()


class ExpertBackend(abc.ABC):
    """Runs the routed experts of an MoE layer in three phases.

    ``dispatch`` sends each (token, choice) row towards its physical slot and may return before
    the rows arrive; ``compute`` waits for them, runs the local experts and starts the return
    trip; ``combine`` waits for the results, returned in (token, choice) order. A backend also
    owns the expert placement and moves experts when it changes.
    """

    placement: ExpertPlacement
    store: ExpertStore

    def __init__(self, store: ExpertStore, placement: ExpertPlacement) -> None:
        self.store = store
        self.placement = placement
        self._log2phy: list[Tensor] = []
        self._logcnt: list[Tensor] = []
        self._next_replica: list[Tensor] = []
        for layer in range(placement.num_layers):
            self._cache_layer_maps(layer)

    def _cache_layer_maps(self, layer: int) -> None:
        device = self.store.device
        log2phy = torch.as_tensor(self.placement.log2phy[layer], device=device)
        logcnt = torch.as_tensor(self.placement.logcnt[layer], device=device)
        turn = torch.zeros_like(logcnt)
        if layer < len(self._log2phy):
            self._log2phy[layer], self._logcnt[layer] = log2phy, logcnt
            self._next_replica[layer] = turn
        else:
            self._log2phy.append(log2phy)
            self._logcnt.append(logcnt)
            self._next_replica.append(turn)

    def physical_ids(self, layer: int, expert_ids: Tensor) -> Tensor:
        """Slot for each (token, choice): each expert's replicas taken in turn (round-robin
        continuing across forward passes, so small batches still spread evenly)."""
        flat = expert_ids.flatten()
        counts = torch.bincount(flat, minlength=self.placement.num_experts)
        order = torch.argsort(flat, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        occurrence = torch.empty_like(flat)
        occurrence[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        turn = self._next_replica[layer]
        replica = (turn[flat] + occurrence) % self._logcnt[layer][flat]
        self._next_replica[layer] = (turn + counts) % self._logcnt[layer]
        return self._log2phy[layer][flat, replica].view_as(expert_ids)

    @property
    def requires_lockstep(self) -> bool:
        """True when every rank must run every forward pass (collectives inside)."""
        return False

    @abc.abstractmethod
    def dispatch(self, layer: int, rows: Tensor, physical_ids: Tensor) -> Dispatched:
        """Start sending ``rows`` (one per (token, choice)) to their slots."""

    @abc.abstractmethod
    def compute(self, layer: int, dispatched: Dispatched) -> Dispatched:
        """Wait for arrivals, run the local experts, start the return trip."""

    @abc.abstractmethod
    def combine(self, computed: Dispatched) -> Tensor:
        """Wait for the results; rows in (token, choice) order."""

    @abc.abstractmethod
    def move_layer(self, layer: int, new_layer_placement: ExpertPlacement) -> None:
        """Move ``layer``'s experts to a new one-layer placement."""


class LocalExperts(ExpertBackend):
    """Every physical slot in this process; dispatch and combine are no-ops.

    >>> backend = LocalExperts.build(ModelConfig())
    >>> backend.placement.num_slots
    8
    """

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        placement: ExpertPlacement | None = None,
        device: torch.device | str = "cpu",
    ) -> LocalExperts:
        """All slots of ``placement`` (default: one slot per expert) in this process."""
        if placement is None:
            # Before the placement's [layers, experts] tables are built.
            _check_fits("LocalExperts", config.estimate_bytes(), device)
        placement = placement or ExpertPlacement.contiguous(config.num_layers, config.num_experts)
        _check_placement(config, placement)
        store = ExpertStore(config, placement, range(placement.num_slots), device)
        return cls(store, placement)

    def dispatch(self, layer: int, rows: Tensor, physical_ids: Tensor) -> Dispatched:
        return Dispatched(rows=rows, slots=physical_ids.flatten(), num_pairs=rows.shape[0])

    def compute(self, layer: int, dispatched: Dispatched) -> Dispatched:
        dispatched.output = self.store.run(layer, dispatched.rows, dispatched.slots)
        return dispatched

    def combine(self, computed: Dispatched) -> Tensor:
        assert computed.output is not None
        return computed.output

    def move_layer(self, layer: int, new_layer_placement: ExpertPlacement) -> None:
        """Rebuild the layer's slots by copying each logical expert from a current replica."""
        new_phy2log = new_layer_placement.phy2log[0]
        source_slots = [int(self.placement.log2phy[layer, e, 0]) for e in new_phy2log]
        flat = self.store.slot_weights(layer, source_slots)
        self.store.replace_layer(layer, *self.store.unflatten(flat))
        self.placement = self.placement.with_layer(layer, new_layer_placement)
        self._cache_layer_maps(layer)


_EXPERT_FIELDS = ("num_layers", "num_experts", "hidden_size", "expert_hidden_size", "dtype", "seed")
"""The model settings an expert backend's weights depend on."""


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one (``cuda`` and ``cuda:0`` are, when the index is left out)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _check_backend(config: ModelConfig, backend: object, device: torch.device) -> None:
    """ConfigError for an expert backend built for another model or device: its weights were
    used as they were (another ``seed`` or ``expert_hidden_size`` gave other logits without a
    word) or failed mid-forward as a bare RuntimeError (another dtype or width)."""
    if not isinstance(backend, ExpertBackend):
        raise InvalidTypeError(
            f"backend must be an ExpertBackend or None, got {type(backend).__name__}"
        )
    _check_placement(config, backend.placement)
    theirs = backend.store.config
    differ = [
        f"{name} {getattr(theirs, name)!r} (the model's: {getattr(config, name)!r})"
        for name in _EXPERT_FIELDS
        if getattr(theirs, name) != getattr(config, name)
    ]
    if differ:
        raise ConfigError("the expert backend was built for another model: " + ", ".join(differ))
    if not _same_device(backend.store.device, device):
        raise ConfigError(
            f"the expert backend's weights are on {backend.store.device}, the model is on {device}"
        )


_BATCH_TENSORS = (
    "token_ids",
    "positions",
    "slot_mapping",
    "query_index",
    "query_valid",
    "kv_blocks",
    "attn_mask",
    "sample_rows",
)
"""The tensors of a :class:`ForwardBatch`, each on the model's device."""


def _check_distinct_slots(batches: Sequence[ForwardBatch], block_size: int) -> None:
    """ConfigError when two tokens of one forward pass write one KV slot (two sequences given
    one block, or a block listed twice in a table): one overwrote the other's keys and values,
    and the logits of both were wrong without a word."""
    slots = [batch.slot_mapping for batch in batches if batch.num_tokens]
    if not slots:
        return
    flat = torch.cat(slots)
    unique, counts = torch.unique(flat, return_counts=True)
    if unique.numel() == flat.numel():
        return
    slot = int(unique[counts > 1][0])
    raise ConfigError(
        f"KV slot {slot} (block {slot // block_size}, offset {slot % block_size}) is written by "
        "two tokens of one forward pass; each sequence needs blocks of its own for the "
        "positions it computes"
    )


def _check_placement(config: ModelConfig, placement: ExpertPlacement) -> None:
    if placement.num_layers != config.num_layers or placement.num_experts != config.num_experts:
        raise ConfigError(
            f"placement is for {placement.num_layers} layers x {placement.num_experts} experts, "
            f"model has {config.num_layers} x {config.num_experts}"
        )


@dataclass
class _LayerWeights:
    attn_norm: Tensor
    wq: Tensor
    wk: Tensor
    wv: Tensor
    wo: Tensor
    moe_norm: Tensor
    router: Tensor
    router_bias: Tensor
    shared_gate: Tensor
    shared_up: Tensor
    shared_down: Tensor


@dataclass
class _MicroBatch:
    batch: ForwardBatch
    hidden: Tensor
    normed: Tensor = field(default_factory=lambda: torch.empty(0))
    topk_weights: Tensor = field(default_factory=lambda: torch.empty(0))
    pending: Dispatched | None = None


class MoETransformer:
    """The model: dense attention weights here, routed experts behind an :class:`ExpertBackend`.

    ``forward`` runs one or more micro-batches over a :class:`PagedKV` and returns the logits
    of each micro-batch's sample rows. The router's choices are counted into ``expert_load``
    ``[L, E]`` (logical) and ``slot_load`` ``[L, S]`` (physical) for the load balancer.

    >>> model = MoETransformer(ModelConfig())
    >>> kv = PagedKV(model.config, num_blocks=2, block_size=16)
    >>> batch = ForwardBatch.build([SequenceChunk([1, 2, 3], 0, [0])], 16)
    >>> model.forward([batch], kv)[0].shape
    torch.Size([1, 512])
    """

    def __init__(
        self,
        config: ModelConfig,
        backend: ExpertBackend | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.device = checked_device(device)
        # A given backend has built its experts already.
        _check_fits("MoETransformer", config.estimate_bytes(0 if backend else None), self.device)
        self.dtype = torch_dtype(config.dtype)
        if backend is not None:
            _check_backend(config, backend, self.device)
        self.backend = backend or LocalExperts.build(config, device=self.device)
        _check_placement(config, self.backend.placement)
        self.embed = self._tensor("embed", (config.vocab_size, config.hidden_size), 1.0)
        self.final_norm = torch.ones(config.hidden_size, dtype=self.dtype, device=self.device)
        self.lm_head = self._tensor(
            "lm_head", (config.hidden_size, config.vocab_size), config.hidden_size**-0.5
        )
        self.layers = [self._layer_weights(layer) for layer in range(config.num_layers)]
        half = config.head_dim // 2
        inv_freq = config.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(config.max_position, dtype=torch.float64)[:, None] * inv_freq
        self._cos = angles.cos().to(self.dtype).to(self.device)
        self._sin = angles.sin().to(self.dtype).to(self.device)
        self.reset_load()

    def _tensor(self, name: str, shape: Sequence[int], std: float) -> Tensor:
        return seeded_tensor(name, shape, std, self.config.seed, self.device, self.dtype)

    def _layer_weights(self, layer: int) -> _LayerWeights:
        cfg = self.config
        h, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads
        kv_dim *= cfg.head_dim
        fs = cfg.shared_expert_hidden_size
        p = f"layers.{layer}"
        ones = torch.ones(h, dtype=self.dtype, device=self.device)
        return _LayerWeights(
            attn_norm=ones,
            wq=self._tensor(f"{p}.wq", (h, q_dim), h**-0.5),
            wk=self._tensor(f"{p}.wk", (h, kv_dim), h**-0.5),
            wv=self._tensor(f"{p}.wv", (h, kv_dim), h**-0.5),
            wo=self._tensor(f"{p}.wo", (q_dim, h), q_dim**-0.5),
            moe_norm=ones.clone(),
            router=self._tensor(f"{p}.router", (h, cfg.num_experts), h**-0.5),
            router_bias=self._tensor(f"{p}.router_bias", (cfg.num_experts,), cfg.router_skew),
            shared_gate=self._tensor(f"{p}.shared.gate", (h, fs), h**-0.5),
            shared_up=self._tensor(f"{p}.shared.up", (h, fs), h**-0.5),
            shared_down=self._tensor(f"{p}.shared.down", (fs, h), max(fs, 1) ** -0.5),
        )

    # -- load statistics -------------------------------------------------------------------

    def reset_load(self) -> None:
        """Zero the recorded per-expert and per-slot routing counts."""
        cfg = self.config
        self.expert_load = torch.zeros(
            (cfg.num_layers, cfg.num_experts), dtype=torch.long, device=self.device
        )
        self.slot_load = torch.zeros(
            (cfg.num_layers, self.backend.placement.num_slots), dtype=torch.long, device=self.device
        )

    def load_snapshot(self) -> np.ndarray:
        """The recorded logical load ``[L, E]`` as a numpy array (tokens routed per expert)."""
        snapshot: np.ndarray = self.expert_load.cpu().numpy().copy()
        return snapshot

    # -- building blocks -------------------------------------------------------------------

    def _rms_norm(self, x: Tensor, weight: Tensor) -> Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.config.rms_eps)).to(x.dtype) * weight

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:
        half = self.config.head_dim // 2
        cos = self._cos[positions][:, None, :]
        sin = self._sin[positions][:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def _qkv(self, w: _LayerWeights, x: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        cfg = self.config
        tokens = x.shape[0]
        q = (x @ w.wq).view(tokens, cfg.num_heads, cfg.head_dim)
        k = (x @ w.wk).view(tokens, cfg.num_kv_heads, cfg.head_dim)
        v = (x @ w.wv).view(tokens, cfg.num_kv_heads, cfg.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _paged_attention(self, layer: int, x: Tensor, batch: ForwardBatch, kv: PagedKV) -> Tensor:
        cfg = self.config
        w = self.layers[layer]
        q, k, v = self._qkv(w, x, batch.positions)
        kv.key[layer].view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(0, batch.slot_mapping, k)
        kv.value[layer].view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(
            0, batch.slot_mapping, v
        )
        num_seqs = batch.kv_blocks.shape[0]
        group = cfg.num_heads // cfg.num_kv_heads

        def context(cache: Tensor) -> Tensor:
            gathered = cache[layer][batch.kv_blocks]  # [B, blocks, block_size, kvh, hd]
            gathered = gathered.reshape(num_seqs, -1, cfg.num_kv_heads, cfg.head_dim)
            return gathered.transpose(1, 2).repeat_interleave(group, dim=1)

        queries = q[batch.query_index].transpose(1, 2)  # [B, heads, max_q, hd]
        out = F.scaled_dot_product_attention(
            queries, context(kv.key), context(kv.value), attn_mask=batch.attn_mask
        )
        out = out.transpose(1, 2)[batch.query_valid]  # [T, heads, hd] in row order
        return out.reshape(x.shape[0], -1) @ w.wo

    def _dense_attention(self, layer: int, x: Tensor, positions: Tensor) -> Tensor:
        cfg = self.config
        w = self.layers[layer]
        q, k, v = self._qkv(w, x, positions)
        group = cfg.num_heads // cfg.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
        )
        return out[0].transpose(0, 1).reshape(x.shape[0], -1) @ w.wo

    def _route(self, layer: int, normed: Tensor) -> tuple[Tensor, Tensor]:
        w = self.layers[layer]
        logits = (normed @ w.router).float() + w.router_bias.float()
        probs = torch.softmax(logits, dim=-1)
        weights, expert_ids = torch.topk(probs, self.config.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(normed.dtype), expert_ids

    def _shared_expert(self, layer: int, normed: Tensor) -> Tensor:
        w = self.layers[layer]
        if self.config.shared_expert_hidden_size == 0:
            return torch.zeros_like(normed)
        return (F.silu(normed @ w.shared_gate) * (normed @ w.shared_up)) @ w.shared_down

    def _start_moe(self, layer: int, mb: _MicroBatch) -> None:
        w = self.layers[layer]
        mb.normed = self._rms_norm(mb.hidden, w.moe_norm)
        mb.topk_weights, expert_ids = self._route(layer, mb.normed)
        physical = self.backend.physical_ids(layer, expert_ids)
        ones = torch.ones(expert_ids.numel(), dtype=torch.long, device=self.device)
        self.expert_load[layer].index_add_(0, expert_ids.flatten(), ones)
        self.slot_load[layer].index_add_(0, physical.flatten(), ones)
        rows = mb.normed.repeat_interleave(self.config.top_k, dim=0)
        mb.pending = self.backend.dispatch(layer, rows, physical)

    def _finish_moe(self, layer: int, mb: _MicroBatch) -> None:
        assert mb.pending is not None
        shared = self._shared_expert(layer, mb.normed)
        routed = self.backend.combine(mb.pending).view(-1, self.config.top_k, mb.hidden.shape[1])
        mb.hidden = mb.hidden + (routed * mb.topk_weights[..., None]).sum(dim=1) + shared
        mb.pending = None

    # -- forward passes --------------------------------------------------------------------

    def forward(self, batches: Sequence[ForwardBatch], kv: PagedKV) -> list[Tensor]:
        """Logits (float32) of each micro-batch's sample rows, writing K/V into ``kv``.

        With two micro-batches the phases interleave layer by layer: A's dispatch is in flight
        while B's attention runs, A's return trip while B's experts run. One micro-batch is
        the plain pass. Every micro-batch must use distinct cache blocks.

        Checked before anything is written (:meth:`check_inputs`): token ids in the
        vocabulary (an :class:`~llmsched.errors.InvalidTokenError`), positions below
        ``max_position``, and a ``kv`` of this model's shape, dtype and device whose blocks
        and block size the batches were built for (a :class:`~llmsched.errors.ConfigError`).
        """
        self.check_inputs(batches, kv)
        mbs = [_MicroBatch(b, self.embed[b.token_ids]) for b in batches]
        for layer in range(self.config.num_layers):
            w = self.layers[layer]
            for mb in mbs:
                normed = self._rms_norm(mb.hidden, w.attn_norm)
                if mb.batch.num_tokens:
                    mb.hidden = mb.hidden + self._paged_attention(layer, normed, mb.batch, kv)
                self._start_moe(layer, mb)
            for mb in mbs:
                assert mb.pending is not None
                mb.pending = self.backend.compute(layer, mb.pending)
            for mb in mbs:
                self._finish_moe(layer, mb)
        return [self._logits(mb.hidden[mb.batch.sample_rows]) for mb in mbs]

    def check_inputs(self, batches: Sequence[ForwardBatch], kv: PagedKV) -> None:
        """The checks :meth:`forward` makes before it runs. Unchecked, a token id of -1 read
        the last row of the embedding, a batch built for another block size wrote its keys
        and values into other sequences' slots before failing, and a block past the cache or
        a ``kv`` of another model failed in torch as a bare IndexError or RuntimeError.

        >>> model = MoETransformer(ModelConfig())
        >>> batch = ForwardBatch.build([SequenceChunk([1, 2], 0, [0])], 8)
        >>> model.check_inputs([batch], PagedKV(model.config, 2, 16))
        Traceback (most recent call last):
        ...
        llmsched.errors.ConfigError: batch 0 was built for blocks of 8 tokens, the KV cache \
has blocks of 16
        """
        cfg = self.config
        if not isinstance(kv, PagedKV):
            raise InvalidTypeError(f"kv must be a PagedKV, got {type(kv).__name__}")
        layers, num_blocks, block_size, heads, dim = kv.key.shape
        shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        if (layers, heads, dim) != shape or kv.key.dtype != self.dtype:
            raise ConfigError(
                f"the KV cache holds {layers} layers x {heads} KV heads x {dim} in "
                f"{kv.key.dtype}; the model needs {shape[0]} x {shape[1]} x {shape[2]} in "
                f"{self.dtype}"
            )
        if not _same_device(kv.key.device, self.device):
            raise ConfigError(f"the KV cache is on {kv.key.device}, the model is on {self.device}")
        if isinstance(batches, ForwardBatch) or not isinstance(batches, Sequence):
            raise InvalidTypeError(
                f"batches must be a sequence of ForwardBatch, got {type(batches).__name__}"
            )
        for index, batch in enumerate(batches):
            if not isinstance(batch, ForwardBatch):
                raise InvalidTypeError(
                    f"batch {index} must be a ForwardBatch, got {type(batch).__name__}"
                )
            if batch.block_size and batch.block_size != block_size:
                raise ConfigError(
                    f"batch {index} was built for blocks of {batch.block_size} tokens, the KV "
                    f"cache has blocks of {block_size}"
                )
            for name in _BATCH_TENSORS:
                device = getattr(batch, name).device
                if not _same_device(device, self.device):
                    raise ConfigError(
                        f"batch {index} is on {device}, the model is on {self.device} "
                        f"(its {name}; build it with device={str(self.device)!r})"
                    )
            if not batch.num_tokens:
                continue
            low, high = int(batch.token_ids.min()), int(batch.token_ids.max())
            if low < 0 or high >= cfg.vocab_size:
                bad = low if low < 0 else high
                raise InvalidTokenError(
                    f"batch {index}: token id {bad} is outside the vocabulary "
                    f"(0 to {cfg.vocab_size - 1})"
                )
            last = int(batch.positions.max())
            if last >= cfg.max_position:
                raise ConfigError(
                    f"batch {index} reaches position {last}; the rotary tables hold "
                    f"max_position = {cfg.max_position}"
                )
            top = max(int(batch.kv_blocks.max()), int(batch.slot_mapping.max()) // block_size)
            if top >= num_blocks:
                raise ConfigError(
                    f"batch {index} uses block {top}; the KV cache has {num_blocks} blocks"
                )
        _check_distinct_slots(batches, block_size)

    def forward_dense(self, token_ids: TokensLike) -> Tensor:
        """Logits of every position of one sequence, attention without any cache (reference).

        Token ids outside the vocabulary are an :class:`~llmsched.errors.InvalidTokenError`;
        an empty sequence or one past ``max_position`` a :class:`~llmsched.errors.ConfigError`.

        >>> MoETransformer(ModelConfig()).forward_dense([7]).dtype
        torch.float32
        """
        ids = checked_tokens(self.config, token_ids)
        if not ids:
            raise ConfigError("forward_dense needs at least one token, got an empty sequence")
        if len(ids) > self.config.max_position:
            raise ConfigError(
                f"forward_dense got {len(ids)} tokens; the rotary tables hold max_position = "
                f"{self.config.max_position}"
            )
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.arange(tokens.shape[0], device=self.device)
        mb = _MicroBatch(ForwardBatch.build([], 1, self.device), self.embed[tokens])
        for layer in range(self.config.num_layers):
            normed = self._rms_norm(mb.hidden, self.layers[layer].attn_norm)
            mb.hidden = mb.hidden + self._dense_attention(layer, normed, positions)
            self._start_moe(layer, mb)
            assert mb.pending is not None
            mb.pending = self.backend.compute(layer, mb.pending)
            self._finish_moe(layer, mb)
        return self._logits(mb.hidden)

    def _logits(self, hidden: Tensor) -> Tensor:
        return (self._rms_norm(hidden, self.final_norm) @ self.lm_head).float()
