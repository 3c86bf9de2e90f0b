"""The engine loop: continuous batching over the paged KV cache, as vLLM V1 schedules.

Each :meth:`Engine.step` spends a token budget (``max_num_batched_tokens``): first on running
requests in admission order (one token for a decode, the next chunk for a prefill), then on
waiting requests in queue order, which first take their cached prefix. A prompt longer than
what is left of the budget is prefilled in chunks over several steps (chunked prefill). When a
running request needs a block and none is free, the most recently admitted running request is
preempted by recompute: its blocks are freed (cached ones stay cached), its progress reset, and
it goes back to the front of the queue; its prompt and generated tokens are recomputed later.

Sampling is greedy at temperature 0; otherwise token ``i`` of a request is drawn with a
generator seeded by ``(seed, i)``, so a preempted, recomputed request draws the same tokens.

After every step the engine publishes what vLLM publishes: the step's KV events as one msgpack
``EventBatch`` payload (to ``publisher`` and :meth:`Engine.take_kv_event_batches`) and
:class:`EngineMetrics`.

>>> from llmsched.executor.config import EngineConfig, ModelConfig
>>> from llmsched.executor.model import MoETransformer
>>> engine = Engine(MoETransformer(ModelConfig()), EngineConfig(num_blocks=16))
>>> out = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3))
>>> len(out[0])
3
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from llmsched._extras import require

require("executor", "torch", "xxhash", feature="llmsched.executor")

import torch
import xxhash

from llmsched._tokens import TokensLike
from llmsched.errors import (
    ConfigError,
    DuplicateRequestError,
    InvalidTypeError,
    UnknownRequestError,
)
from llmsched.executor.config import EngineConfig, check_memory
from llmsched.executor.kv_cache import CachedBlock, KVCacheManager
from llmsched.executor.kv_events import encode_event_batch
from llmsched.executor.model import (
    ForwardBatch,
    MoETransformer,
    PagedKV,
    SequenceChunk,
    checked_tokens,
    device_memory_bytes,
)
from llmsched.validation import describe_int, is_finite_number

__all__ = ["Engine", "EngineMetrics", "Request", "RequestOutput", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples: greedy at ``temperature == 0``, else seeded multinomial.

    Every field is checked when built: ``max_tokens`` an int >= 1, ``temperature`` a finite
    number >= 0, ``seed`` ``None`` or an int in ``0..2**64-1``, ``stop_token_ids`` an
    iterable of ints (kept as a tuple).

    >>> SamplingParams(max_tokens=0)
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: max_tokens must be >= 1, got 0
    >>> SamplingParams(temperature=float("nan"))
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: temperature must be a finite number >= 0, got nan
    """

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens):
            raise ConfigError(f"max_tokens must be an int, got {describe_int(self.max_tokens)}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {describe_int(self.max_tokens)}")
        temperature = self.temperature
        # NaN or inf reached torch.multinomial mid-step as a bare RuntimeError; an int past a
        # float's range was a bare OverflowError from math.isfinite, and one of thousands of
        # digits has no str for the message (describe_int, below and for every int field).
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or not is_finite_number(temperature)
            or temperature < 0
        ):
            raise ConfigError(
                f"temperature must be a finite number >= 0, got {describe_int(temperature)}"
            )
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            # xxh3 takes the seed modulo 2**64: -1 would silently be 2**64 - 1.
            raise ConfigError(
                f"seed must be None or an int in 0..2**64-1, got {describe_int(self.seed)}"
            )
        stop = self.stop_token_ids
        # None was a bare TypeError; a list made the frozen params unhashable.
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Iterable):
            raise ConfigError(f"stop_token_ids must be an iterable of ints, got {stop!r}")
        stop = tuple(stop)
        for index, token in enumerate(stop):
            if not _is_int(token):
                raise ConfigError(
                    f"stop_token_ids[{index}] must be an int, got {describe_int(token)}"
                )
        object.__setattr__(self, "stop_token_ids", stop)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_request_id(request_id: object) -> None:
    """A request id is a str: anything else (an int, a list that cannot be hashed) is an
    :class:`~llmsched.errors.InvalidTypeError`."""
    if not isinstance(request_id, str):
        raise InvalidTypeError(
            f"request_id must be a str, got {type(request_id).__name__}: {request_id!r}"
        )


@dataclass
class Request:
    """A request's tokens and progress inside the engine."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    sample_seed: int
    num_computed_tokens: int = 0
    finish_reason: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated so far."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)


@dataclass(frozen=True)
class RequestOutput:
    """What a step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True)
class EngineMetrics:
    """The engine's gauges and counters, named after vLLM's Prometheus metrics
    (``vllm:num_requests_running``, ...).

    Prefix-cache queries and hits count tokens, as vLLM's counters do.

    >>> print(EngineMetrics(1, 2, 0.5, 10, 4, 0, 7, 3).prometheus("m").splitlines()[0])
    vllm:num_requests_running{model_name="m"} 1
    """

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_generated_tokens: int
    num_steps: int

    def prometheus(self, model_name: str) -> str:
        """The metrics in Prometheus text format with vLLM's names."""
        label = f'{{model_name="{model_name}"}}'
        lines = [
            f"vllm:num_requests_running{label} {self.num_requests_running}",
            f"vllm:num_requests_waiting{label} {self.num_requests_waiting}",
            f"vllm:kv_cache_usage_perc{label} {self.kv_cache_usage}",
            f"vllm:prefix_cache_queries_total{label} {self.prefix_cache_queries}",
            f"vllm:prefix_cache_hits_total{label} {self.prefix_cache_hits}",
            f"vllm:num_preemptions_total{label} {self.num_preemptions}",
            f"vllm:generation_tokens_total{label} {self.num_generated_tokens}",
        ]
        return "\n".join(lines) + "\n"


@dataclass
class _Counters:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0


@dataclass
class _Schedule:
    chunks: list[tuple[Request, int]] = field(default_factory=list)
    preempted: bool = False


class Engine:
    """Continuous batching with chunked prefill, prefix caching and preemption by recompute.

    ``dual_batch_overlap`` splits each step's sequences into two micro-batches of about equal
    tokens (see :meth:`MoETransformer.forward`). ``step_hooks`` run after every step (the
    expert rebalancer moves a layer there).
    """

    def __init__(
        self,
        model: MoETransformer,
        config: EngineConfig | None = None,
        *,
        dual_batch_overlap: bool = False,
        publisher: Callable[[bytes], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # A dict config or a None model was a bare AttributeError from check_memory.
        if not isinstance(model, MoETransformer):
            raise InvalidTypeError(f"model must be a MoETransformer, got {type(model).__name__}")
        if config is not None and not isinstance(config, EngineConfig):
            raise InvalidTypeError(
                f"config must be an EngineConfig or None, got {type(config).__name__}"
            )
        self.model = model
        self.config = config or EngineConfig()
        self.dual_batch_overlap = dual_batch_overlap
        self.publisher = publisher
        self.clock = clock
        cfg = self.config
        # Before the KV tensors and the block lists: num_blocks=2**40 is a ConfigError.
        check_memory(
            "Engine",
            cfg.estimate_bytes(model.config),
            device_memory_bytes(model.device),
            str(model.device),
        )
        self.kv = PagedKV(model.config, cfg.num_blocks, cfg.block_size, model.device)
        self.kv_manager = KVCacheManager(
            cfg.num_blocks,
            cfg.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            hash_seed=cfg.hash_seed,
            medium=cfg.medium,
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_hooks: list[Callable[[Engine], None]] = []
        self._counters = _Counters()
        self._event_batches: list[bytes] = []
        self._generate_calls = 0

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: TokensLike,
        params: SamplingParams | None = None,
    ) -> None:
        """Queue a request; raises (and queues nothing) if it can never run.

        ``prompt_token_ids`` is any token input :func:`llmsched.hashing.block_hashes` takes
        (a list of ints, a numpy integer array, ...); floats, bools and strings are an
        :class:`~llmsched.errors.InvalidTypeError`, ids outside the vocabulary an
        :class:`~llmsched.errors.InvalidTokenError`. An id already in the engine (waiting or
        running; a finished request's id may be used again) is a
        :class:`~llmsched.errors.DuplicateRequestError`. A request that may grow past the KV cache
        or ``max_position``, or, with chunked prefill off, whose prompt plus output (what a
        preempted request recomputes) may exceed ``max_num_batched_tokens``, is a
        :class:`~llmsched.errors.ConfigError`: it could never be scheduled.
        """
        _check_request_id(request_id)
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidTypeError(
                f"request {request_id!r}: params must be a SamplingParams or None, "
                f"got {type(params).__name__}"
            )
        if request_id in self.requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in the engine")
        # 1.7 was truncated to 1 and "123" read as [1, 2, 3] by int(); refuse what is not ids.
        tokens = checked_tokens(self.model.config, prompt_token_ids, f"request {request_id!r}")
        if not tokens:
            raise ConfigError(f"request {request_id!r} has an empty prompt")
        longest = len(tokens) + params.max_tokens
        capacity = self.config.num_blocks * self.config.block_size
        if longest > min(capacity, self.model.config.max_position):
            raise ConfigError(
                f"request {request_id!r} may reach {describe_int(longest)} tokens; the engine "
                "holds at most "
                f"{min(capacity, self.model.config.max_position)}"
            )
        # Without chunked prefill a prompt is scheduled whole, and a preempted request
        # recomputes its prompt and output (up to longest - 1 tokens) in one step: past the
        # budget it would wait forever.
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and longest - 1 > budget:
            raise ConfigError(
                f"request {request_id!r} may need {longest - 1} tokens computed in one step "
                f"(prompt {len(tokens)} + max_tokens {params.max_tokens} - 1); with "
                f"enable_chunked_prefill off a step holds at most max_num_batched_tokens = "
                f"{budget}"
            )
        seed = params.seed
        if seed is None:
            seed = xxhash.xxh3_64_intdigest(request_id.encode(), seed=self.config.hash_seed)
        request = Request(request_id, tokens, len(tokens), params, seed)
        self.requests[request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is, freeing its blocks. An id not in the engine (never
        added, finished or aborted) is an :class:`~llmsched.errors.UnknownRequestError`, one
        that is not a str an :class:`~llmsched.errors.InvalidTypeError`."""
        _check_request_id(request_id)
        request = self.requests.pop(request_id, None)
        if request is None:
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_manager.free(request_id)
        self._publish_events()

    def preempt(self, request_id: str) -> None:
        """Preempt a running request by recompute (free its KV, requeue it at the front). A
        request that is not running (waiting, finished, never added) is an
        :class:`~llmsched.errors.UnknownRequestError`, an id that is not a str an
        :class:`~llmsched.errors.InvalidTypeError`."""
        _check_request_id(request_id)
        request = self.requests.get(request_id)
        if request is None or request not in self.running:
            raise UnknownRequestError(f"request {request_id!r} is not running")
        self._preempt(request)
        self._publish_events()

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_manager.free(request.request_id)
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self._counters.num_preemptions += 1

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, publish events; outputs of sampled requests."""
        schedule = self._schedule()
        outputs: list[RequestOutput] = []
        if schedule.chunks or self.model.backend.requires_lockstep:
            outputs = self._execute(schedule.chunks)
        self._counters.num_steps += 1
        self._publish_events()
        for hook in self.step_hooks:
            hook(self)
        return outputs

    def _schedule(self) -> _Schedule:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        schedule = _Schedule()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            end = request.num_computed_tokens + count
            while not self.kv_manager.allocate(request.request_id, end):
                victim = self.running[-1]
                self._preempt(victim)
                schedule.preempted = True
                if victim is request:
                    break
            if schedule.preempted and request not in self.running:
                break
            schedule.chunks.append((request, count))
            budget -= count
            index += 1
        while (
            self.waiting
            and budget > 0
            and not schedule.preempted
            and len(self.running) < cfg.max_num_seqs
        ):
            request = self.waiting[0]
            rid, tokens = request.request_id, request.token_ids
            # Check before taking the prefix: as in vLLM, a request that cannot be admitted
            # must not refresh its cached blocks' place in the LRU queue.
            hit = self.kv_manager.peek(rid, tokens)
            remaining = request.num_tokens - hit
            count = min(remaining, budget)
            chunk_refused = count < remaining and not cfg.enable_chunked_prefill
            if chunk_refused or not self.kv_manager.can_admit(rid, tokens, hit + count):
                break
            taken = self.kv_manager.lookup(rid, tokens)
            admitted = self.kv_manager.allocate(rid, hit + count)
            assert taken == hit and admitted, "can_admit promised the blocks"
            self.waiting.popleft()
            request.num_computed_tokens = hit
            self._counters.prefix_cache_queries += request.num_tokens
            self._counters.prefix_cache_hits += hit
            self.running.append(request)
            schedule.chunks.append((request, count))
            budget -= count
        return schedule

    def _execute(self, scheduled: list[tuple[Request, int]]) -> list[RequestOutput]:
        chunks = []
        for request, count in scheduled:
            start = request.num_computed_tokens
            chunks.append(
                SequenceChunk(
                    token_ids=request.token_ids[start : start + count],
                    start=start,
                    block_table=self.kv_manager.block_table(request.request_id),
                    sample=start + count == request.num_tokens,
                )
            )
        groups = self._micro_batches(chunks)
        batches = [
            ForwardBatch.build([chunks[i] for i in g], self.config.block_size, self.model.device)
            for g in groups
        ]
        logits = self.model.forward(batches, self.kv)
        sampled: dict[int, int] = {}
        for group, batch, group_logits in zip(groups, batches, logits, strict=True):
            for row, local in enumerate(batch.sample_sequences):
                request = scheduled[group[local]][0]
                sampled[group[local]] = self._sample(request, group_logits[row])
        outputs = []
        for index, (request, count) in enumerate(scheduled):
            request.num_computed_tokens += count
            self.kv_manager.commit(
                request.request_id, request.token_ids, request.num_computed_tokens
            )
            if index in sampled:
                outputs.append(self._append_token(request, sampled[index]))
        return outputs

    def _micro_batches(self, chunks: list[SequenceChunk]) -> list[list[int]]:
        if not self.dual_batch_overlap:
            return [list(range(len(chunks)))]
        total = sum(len(c.token_ids) for c in chunks)
        first: list[int] = []
        tokens = 0
        for index, chunk in enumerate(chunks):
            if tokens * 2 >= total:
                break
            first.append(index)
            tokens += len(chunk.token_ids)
        return [first, list(range(len(first), len(chunks)))]

    def _sample(self, request: Request, logits: torch.Tensor) -> int:
        params = request.params
        if params.temperature == 0:
            return int(torch.argmax(logits).item())
        position = len(request.output_token_ids)
        token_seed = xxhash.xxh3_64_intdigest(position.to_bytes(8, "little"), request.sample_seed)
        generator = torch.Generator().manual_seed(token_seed & (2**63 - 1))
        # In float64 (a float32 temperature of 1e-300 is 0), shifted so the largest logit is 0:
        # a tiny temperature then gives -inf for the others rather than inf - inf = NaN.
        logits = logits.double().cpu()
        probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator).item())

    def _append_token(self, request: Request, token: int) -> RequestOutput:
        request.token_ids.append(token)
        self._counters.num_generated_tokens += 1
        if token in request.params.stop_token_ids:
            request.finish_reason = "stop"
        elif len(request.output_token_ids) >= request.params.max_tokens:
            request.finish_reason = "length"
        if request.finish_reason is not None:
            self.running.remove(request)
            self.kv_manager.free(request.request_id)
            del self.requests[request.request_id]
        return RequestOutput(
            request.request_id,
            [token],
            list(request.output_token_ids),
            request.finish_reason is not None,
            request.finish_reason,
        )

    # -- caching, events, metrics ----------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (``AllBlocksCleared``); refused while requests hold KV."""
        cleared = self.kv_manager.pool.reset()
        self._publish_events()
        return cleared

    def cached_blocks(self) -> dict[int, CachedBlock]:
        """The prefix cache right now: block hash -> block id, parent hash and tokens."""
        return dict(self.kv_manager.pool.cached)

    def _publish_events(self) -> None:
        events = self.kv_manager.pool.take_events()
        if not events:
            return
        payload = encode_event_batch(self.clock(), events, self.config.dp_rank)
        self._event_batches.append(payload)
        if self.publisher is not None:
            self.publisher(payload)

    def take_kv_event_batches(self) -> list[bytes]:
        """The ``EventBatch`` payloads published since the last call."""
        batches, self._event_batches = self._event_batches, []
        return batches

    def metrics(self) -> EngineMetrics:
        """Current gauges and counters."""
        c = self._counters
        return EngineMetrics(
            num_requests_running=len(self.running),
            num_requests_waiting=len(self.waiting),
            kv_cache_usage=self.kv_manager.pool.usage,
            prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits,
            num_preemptions=c.num_preemptions,
            num_generated_tokens=c.num_generated_tokens,
            num_steps=c.num_steps,
        )

    # -- convenience -----------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[TokensLike],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[list[int]]:
        """Run ``prompts`` to completion; the generated tokens of each, in order.

        If it raises (a bad prompt, an interrupt), the requests it added are aborted, so the
        engine is left as it was for the next call; requests added with :meth:`add_request`
        are left alone (and run alongside). ``prompts`` must be a collection of prompts
        (a list, a tuple, a 2-D array; not a generator) and ``params`` one
        :class:`SamplingParams`, a collection of one per prompt, or None; anything else is an
        :class:`~llmsched.errors.InvalidTypeError`.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Collection):
            raise InvalidTypeError(
                f"prompts must be a collection of prompts, got {type(prompts).__name__}"
            )
        if params is not None and not isinstance(params, (SamplingParams, Collection)):
            raise InvalidTypeError(
                "params must be a SamplingParams, a collection of them or None, "
                f"got {type(params).__name__}"
            )
        if params is None or isinstance(params, SamplingParams):
            per_request = [params or SamplingParams()] * len(prompts)
        else:
            per_request = list(params)
            if len(per_request) != len(prompts):
                raise ConfigError(
                    f"{len(per_request)} sampling params for {len(prompts)} prompts; "
                    "give one, or one per prompt"
                )
        # Ids no request in the engine holds: a caller's own request named like one made
        # generate raise, and its clean-up abort the caller's request.
        while True:
            self._generate_calls += 1
            ids = [f"generate-{self._generate_calls}-{i}" for i in range(len(prompts))]
            if not any(i in self.requests for i in ids):
                break
        added: list[str] = []
        results: dict[str, list[int]] = {}
        try:
            for request_id, prompt, p in zip(ids, prompts, per_request, strict=True):
                self.add_request(request_id, prompt, p)
                added.append(request_id)
            while any(i not in results for i in ids):
                for output in self.step():
                    if output.finished:
                        results[output.request_id] = output.output_token_ids
        except BaseException:
            # Left in the engine, a request that cannot run would fail every later step.
            for request_id in added:
                if request_id in self.requests:
                    self.abort_request(request_id)
            raise
        return [results[i] for i in ids]
