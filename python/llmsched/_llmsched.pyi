"""Type stubs for the native module (built from `crates/llmsched-py`).

`make lint` checks them against the module with `mypy.stubtest`.
"""

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Literal, TypeAlias, TypeVar, final, overload

import numpy as np
import numpy.typing as npt

from llmsched.sim.policies import Policy
from llmsched.types import (
    ApplyReport,
    ConfigInfo,
    EndpointId,
    EndpointInfo,
    EngineMetricValues,
    EventBatchDict,
    FlowConfig,
    FlowMetrics,
    IndexStats,
    KVCacheEvent,
    MetricsRead,
    NativeFlowStats,
    NativeGatewayCounters,
    PdNote,
    PluginInfo,
    ProfileData,
    ProfileRow,
    SyncCounters,
    SyncReport,
    TokenizerCacheStats,
    WorkerId,
)

_T = TypeVar("_T")
_Tokens: TypeAlias = npt.NDArray[np.integer] | list[int] | tuple[int, ...]
_Hashes: TypeAlias = npt.NDArray[np.integer] | Iterable[int | np.integer]

MAX_BLOCK_SIZE: int
__version__: str
VLLM_DEFAULT_NONE_HASH_SEED: str

def xxh3_block_hashes(tokens: _Tokens, block_size: int, chain_seed: int) -> npt.NDArray[np.uint64]:
    """Chained xxh3 hashes of the full blocks of `tokens` from `chain_seed` (`llmsched.block_hashes`
    checks the arguments).
    """

def namespace_seed(
    seed: int, model: str | None = None, lora: str | None = None, cache_salt: str | None = None
) -> int:
    """The chain seed that folds model, LoRA name and cache salt into `seed`
    (`llmsched.namespace_seed`).
    """

def vllm_block_hashes(
    tokens: _Tokens,
    block_size: int,
    seed: str,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> npt.NDArray[np.uint64]:
    """vLLM `sha256_cbor` block hashes in their 64-bit KV-event form
    (`llmsched.block_hashes(algo="vllm_sha256_cbor")`).
    """

def vllm_block_digests(
    tokens: _Tokens,
    block_size: int,
    seed: str,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """vLLM `sha256_cbor` block hashes as 32-byte digests (`llmsched.vllm_block_digests`)."""

def vllm_none_hash(seed: str) -> bytes:
    """vLLM's `NONE_HASH` for a seed string: `sha256(cbor(seed))`."""

def text_block_hashes(
    text: str | bytes,
    block_size: int,
    chain_seed: int,
    include_partial: bool,
    max_tokens: int | None = None,
) -> npt.NDArray[np.uint64]:
    """Block hashes of text packed 4 UTF-8 bytes per pseudo-token (`llmsched.text_block_hashes`)."""

def pack_text(text: str | bytes) -> npt.NDArray[np.uint32]:
    """Text as pseudo-tokens: 4 UTF-8 bytes each, little-endian, the last zero-padded."""

def xxh3_block_hashes_batch(
    prompts: list[npt.NDArray[np.integer]],
    block_size: int,
    chain_seed: int,
    threads: int = 1,
) -> list[npt.NDArray[np.uint64]]:
    """`xxh3_block_hashes` over many prompts with the GIL released, on up to `threads` threads."""

def vllm_block_hashes_batch(
    prompts: list[npt.NDArray[np.integer]],
    block_size: int,
    seed: str,
    lora: str | None = None,
    cache_salt: str | None = None,
    threads: int = 1,
) -> list[npt.NDArray[np.uint64]]:
    """`vllm_block_hashes` over many prompts with the GIL released, on up to `threads` threads."""

def _read_list_floor(items: list[int], prefetch: bool) -> int:
    """Benchmarks only: the wrapping sum of a list of ints in `0..2**64`, each item's type
    checked and value read as a list converter must and nothing else done (the floor of reading
    a list from memory); InvalidTypeError (a TypeError) for anything else."""

# ---- prefix_index --------------------------------------------------------------------------

def _share_between_threads(obj: object) -> None:
    """On free-threaded CPython 3.14, deferred reference counting for an object every thread
    uses for as long as it lives (freed by the cyclic collector, not at its last reference), so
    threads loading it do not update one shared count; a no-op elsewhere."""

@final
class PrefixMatch:
    """The result of matching a prompt against a `PrefixIndex`: how many leading blocks each worker
    holds.
    """

    @property
    def workers(self) -> list[WorkerId]:
        """Workers holding at least one leading block, in worker-id order."""
    @property
    def worker_ids(self) -> npt.NDArray[np.uint32]:
        """The index's ids of `workers`, in the same order."""
    @property
    def blocks(self) -> npt.NDArray[np.uint32]:
        """Leading blocks held by each worker in `workers`, in the same order."""
    @property
    def gpu_blocks(self) -> npt.NDArray[np.uint32]:
        """Of `blocks`, those held on GPU."""
    @property
    def cpu_blocks(self) -> npt.NDArray[np.uint32]:
        """Of `blocks`, those held on CPU."""
    @property
    def storage_blocks(self) -> npt.NDArray[np.uint32]:
        """Of `blocks`, those held in storage."""
    @property
    def longest(self) -> int:
        """The most leading blocks any worker holds."""
    @property
    def best(self) -> list[WorkerId]:
        """The workers holding the longest match, in worker-id order."""
    def top(self, k: int) -> list[tuple[WorkerId, int]]:
        """The `k` workers with the most leading blocks as `(worker, blocks)`, most first."""
    @property
    def query_blocks(self) -> int:
        """The number of blocks in the query."""
    @property
    def tree_blocks(self) -> int:
        """Leading blocks present in the index at all, whoever holds them."""
    @overload
    def get(self, worker: WorkerId) -> int: ...
    @overload
    def get(self, worker: WorkerId, default: _T) -> int | _T: ...
    def __getitem__(self, key: WorkerId, /) -> int:
        """Leading blocks of a matched worker (KeyError for any other)."""
    def __contains__(self, key: object, /) -> bool:
        """Whether the worker holds at least one leading block."""
    def __iter__(self) -> Iterator[WorkerId]:
        """The matched workers, in worker-id order."""
    def keys(self) -> list[WorkerId]:
        """The matched workers, in worker-id order."""
    def values(self) -> list[int]:
        """Leading blocks per matched worker, in worker-id order."""
    def items(self) -> list[tuple[WorkerId, int]]:
        """`(worker, leading blocks)` per matched worker, in worker-id order."""
    def as_dict(self) -> dict[WorkerId, int]:
        """`{worker: leading blocks held}`."""
    def tiers(self) -> dict[WorkerId, dict[str, int]]:
        """`{worker: {tier: blocks}}` for the workers that hold any."""
    def __len__(self) -> int:
        """The number of workers holding at least one leading block."""

@final
class PrefixIndex:
    """The native prefix index (a compressed radix tree over chained block hashes);
    `llmsched.PrefixIndex` wraps it and checks arguments.
    """

    def __new__(
        cls,
        block_size: int,
        seed: int,
        model: str | None,
        worker_capacity: int | None,
        max_bytes: int | None,
    ) -> PrefixIndex: ...
    @property
    def block_size(self) -> int:
        """Tokens per block."""
    @property
    def seed(self) -> int:
        """The hash chain's seed."""
    @property
    def model(self) -> str | None:
        """The model folded into the chain seed, if any."""
    @property
    def worker_capacity(self) -> int | None:
        """Blocks each worker may hold (None: unbounded)."""
    @property
    def max_bytes(self) -> int | None:
        """The index's memory cap (None: unbounded)."""
    def store(self, worker: int | str, hashes: _Hashes, parent: int | None, tier_name: str) -> int:
        """Records that `worker` holds a chain of blocks in a tier; returns the blocks added."""
    def record(self, worker: int | str, hashes: _Hashes, ttl: float, now: float) -> int:
        """Records an approximate holding (a routing decision) that expires after `ttl` unless
        confirmed.
        """
    def remove(self, worker: int | str, hashes: _Hashes, tier_name: str | None = None) -> int:
        """Removes blocks (and their descendants) from a worker; returns the blocks removed."""
    def clear(self, worker: int | str) -> int:
        """Removes every block of a worker; returns the blocks removed."""
    def remove_worker(self, worker: int | str) -> int:
        """Forgets a worker entirely; returns the blocks removed."""
    def set_capacity(self, worker: int | str, blocks: int | None) -> int:
        """Sets a worker's block capacity, evicting from the tail; returns the blocks evicted."""
    def match_hashes(self, hashes: _Hashes, now: float) -> PrefixMatch:
        """Matches precomputed block hashes."""
    def match_tokens(
        self,
        tokens: _Tokens,
        lora: str | None,
        cache_salt: str | None,
        now: float,
    ) -> PrefixMatch:
        """Hashes token ids with the index's settings and matches them."""
    def hash_tokens(
        self, tokens: _Tokens, lora: str | None, cache_salt: str | None
    ) -> npt.NDArray[np.uint64]:
        """The index's block hashes of token ids."""
    def match_many(self, queries: Sequence[_Hashes], now: float) -> list[PrefixMatch]:
        """Matches many hash queries under one lock."""
    def apply_vllm_events(self, worker: int | str, payload: bytes) -> ApplyReport:
        """Applies a vLLM KV-event payload for a worker atomically; returns what was applied and
        skipped.
        """
    @property
    def event_batches(self) -> int:
        """Engine KV-event batches applied since the index was made or loaded."""
    @property
    def max_bytes_emptied(self) -> int:
        """Times the memory cap evicted every block (a cap too small for one block), since
        the index was made or loaded."""
    def expire(self, now: float) -> int:
        """Drops approximate holdings older than their TTL; returns how many."""
    def holdings(self, worker: int | str) -> dict[int, tuple[list[str], bool]]:
        """A worker's blocks: `{hash: (tiers, approximate)}`."""
    def workers(self) -> list[WorkerId]:
        """Every worker holding anything."""
    def stats(self) -> IndexStats:
        """Counts: nodes, blocks, bytes, events applied and skipped."""
    def dumps(self, now: float) -> bytes:
        """A snapshot of the index's content as bytes (not its counters)."""
    @staticmethod
    def loads(data: bytes, now: float) -> PrefixIndex:
        """An index from a snapshot, its counters at 0; `SnapshotError` when it is corrupt."""

# --- token slices (rust/py/slices.rs) ---

@final
class SwitchCostModel:
    """The native switch-cost model of token slices; `llmsched.SwitchCostModel` wraps it."""

    def __new__(cls, params: Mapping[str, Any] | None = None) -> SwitchCostModel: ...
    @staticmethod
    def from_dims(dims: Mapping[str, Any]) -> SwitchCostModel:
        """A cost model derived from model dimensions and GPU peaks."""
    @property
    def prefill_tokens_per_s(self) -> float:
        """Prefill rate used for recompute time."""
    @property
    def decode_step_s(self) -> float:
        """Time of one decode step."""
    @property
    def kv_capacity_tokens(self) -> float:
        """KV capacity of an endpoint, in tokens."""
    @property
    def requeue_delay_s(self) -> float:
        """Delay a yielded request pays to re-enter the queue."""
    @property
    def priority_base(self) -> float:
        """Base of the priority weight `priority_base ** priority`."""
    @property
    def block_size(self) -> int:
        """The endpoint's KV block size, in tokens."""
    def weight(self, priority: int) -> float:
        """The weight of a request of this priority."""
    def recompute_s(self, context: float, prefill_tokens_per_s: float) -> float:
        """Seconds to recompute `context` tokens at a prefill rate."""
    def recompute_tokens(self, evict_probability: float, context: float) -> float:
        """Tokens a continuation recomputes: the evicted share of `context`, at least its last
        KV block.
        """
    def switch_s(
        self, evict_probability: float, context: float, prefill_tokens_per_s: float
    ) -> float:
        """Expected cost of a switch: the recompute time of `recompute_tokens`, plus the requeue
        delay.
        """
    def params(self) -> dict[str, Any]:
        """The model's parameters as a dict."""

@final
class SliceDecision:
    """A slice-boundary decision: ``action`` is continue, yield, migrate or finish."""

    def __new__(cls, *fields: object) -> SliceDecision:
        """A decision rebuilt from its fields (what ``pickle`` and ``copy`` call), in this
        order: action, level, priority, endpoint, next_slice_tokens, context_tokens,
        generated_tokens, slices, benefit_s, yield_cost_s, migrate_cost_s, evict_probability.
        """
    @property
    def action(self) -> Literal["continue", "yield", "migrate", "finish"]:
        """What the request does next."""
    @property
    def level(self) -> int:
        """Its MLFQ level after the decision."""
    @property
    def priority(self) -> int:
        """Its priority (for re-entering flow control on yield)."""
    @property
    def endpoint(self) -> str | None:
        """Where it continues (None when it finishes)."""
    @property
    def next_slice_tokens(self) -> int:
        """Tokens in its next slice (0 when it finishes)."""
    @property
    def context_tokens(self) -> int:
        """Prompt plus generated tokens so far."""
    @property
    def generated_tokens(self) -> int:
        """Tokens generated so far."""
    @property
    def slices(self) -> int:
        """Slices run so far."""
    @property
    def benefit_s(self) -> float:
        """Weighted seconds the waiting work gains if this request steps aside."""
    @property
    def yield_cost_s(self) -> float:
        """Expected cost of yielding, in seconds."""
    @property
    def migrate_cost_s(self) -> float | None:
        """Expected cost of migrating (None: no idle endpoint)."""
    @property
    def evict_probability(self) -> float:
        """Expected share of its KV evicted while it waits."""

@final
class SliceState:
    """A snapshot of one tracked request."""

    def __new__(cls, *fields: object) -> SliceState:
        """A snapshot rebuilt from its fields (what ``pickle`` and ``copy`` call), in this
        order: priority, level, prompt_tokens, max_tokens, generated_tokens, slice_generated,
        slice_tokens, slices, context_tokens, endpoint, route_to, paused_since; its ``phase``
        is "paused" when ``paused_since`` is a time, else "running".
        """
    @property
    def priority(self) -> int:
        """Its priority."""
    @property
    def level(self) -> int:
        """Its MLFQ level."""
    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens."""
    @property
    def max_tokens(self) -> int:
        """The most tokens it may generate."""
    @property
    def generated_tokens(self) -> int:
        """Tokens generated so far."""
    @property
    def slice_generated(self) -> int:
        """Tokens generated in the current slice."""
    @property
    def slice_tokens(self) -> int:
        """Length of the current slice."""
    @property
    def slices(self) -> int:
        """Slices run so far."""
    @property
    def context_tokens(self) -> int:
        """Prompt plus generated tokens."""
    @property
    def endpoint(self) -> str:
        """The endpoint holding its KV."""
    @property
    def route_to(self) -> str:
        """Where its next slice goes."""
    @property
    def phase(self) -> Literal["running", "paused"]:
        """Running or paused (between slices)."""
    @property
    def paused_since(self) -> float | None:
        """When it was paused (None while running)."""

@final
class EndpointLoad:
    """An endpoint's load as last reported."""

    def __new__(cls, *fields: object) -> EndpointLoad:
        """A load rebuilt from its fields (what ``pickle`` and ``copy`` call), in this order:
        kv_capacity_tokens, kv_cache_usage, waiting, prefill_tokens_per_s, decode_step_s;
        ``kv_free_tokens`` follows from the capacity and the usage.
        """
    @property
    def kv_capacity_tokens(self) -> float:
        """KV capacity, in tokens."""
    @property
    def kv_cache_usage(self) -> float:
        """KV-cache use, 0 to 1."""
    @property
    def kv_free_tokens(self) -> float:
        """Free KV, in tokens."""
    @property
    def waiting(self) -> int:
        """Requests waiting."""
    @property
    def prefill_tokens_per_s(self) -> float:
        """Its prefill rate."""
    @property
    def decode_step_s(self) -> float:
        """Its decode step time."""

@final
class SliceTracker:
    """The native slice tracker; `llmsched.SliceTracker` wraps it."""

    def __new__(
        cls, policy: str, params: Mapping[str, Any] | None, cost_model: SwitchCostModel
    ) -> SliceTracker: ...
    @property
    def policy_name(self) -> str:
        """The slice policy's name."""
    @property
    def levels(self) -> int:
        """The policy's number of levels."""
    def policy_params(self) -> dict[str, Any]:
        """The policy's parameters with their defaults."""
    def cost_model(self) -> SwitchCostModel:
        """The switch-cost model."""
    def quantum(self, level: int) -> int:
        """The slice length at a level."""
    def entry_level(self, prompt_tokens: int) -> int:
        """The level a request of this prompt length enters at."""
    def set_endpoint(
        self,
        name: str,
        kv_usage: float,
        waiting: int,
        kv_capacity_tokens: float | None = None,
        prefill_tokens_per_s: float | None = None,
        decode_step_s: float | None = None,
    ) -> None:
        """Reports an endpoint's load."""
    def endpoint_load(self, name: str) -> EndpointLoad | None:
        """An endpoint's last reported load."""
    def endpoint_names(self) -> list[str]:
        """The endpoints known to the tracker."""
    def remove_endpoint(self, name: str) -> bool:
        """Takes an endpoint out (no migration target until reported again)."""
    def admit(
        self, key: int, prompt_tokens: int, max_tokens: int, priority: int, endpoint: str
    ) -> tuple[int, int]:
        """Starts tracking a request; returns its level and first slice length."""
    def record_tokens(self, key: int, tokens: int) -> int:
        """Counts tokens generated in the current slice; returns the slice's total."""
    def decide(
        self,
        key: int,
        finished: bool,
        waiting: Sequence[tuple[int, int, int, int]],
        now: float,
    ) -> SliceDecision:
        """The decision at a slice boundary, given the waiting work."""
    def resume(self, key: int, endpoint: str) -> tuple[int, int]:
        """Resumes a paused request on an endpoint; returns its level and slice length."""
    def promote(self, now: float) -> list[tuple[int, int]]:
        """Promotes requests paused too long; returns `(key, level)` pairs."""
    def remove(self, key: int) -> bool:
        """Stops tracking a request."""
    def state(self, key: int) -> SliceState | None:
        """A snapshot of a tracked request."""
    def __len__(self) -> int:
        """Requests tracked."""
    def __contains__(self, key: int, /) -> bool:
        """Whether a request is tracked."""

@final
class SliceAssembler:
    """One sliced request's continuation calls and stitched response
    (`llmsched.SliceAssembler` wraps it; the native data plane runs the same code)."""

    def __new__(
        cls,
        request: Mapping[str, Any],
        api: str,
        response_id: str | None = None,
        created: int | None = None,
        default_max_tokens: int | None = None,
        forward_stop: bool = True,
    ) -> SliceAssembler:
        """ConfigError when the request cannot be sliced."""
    def next_request(self, slice_tokens: int) -> dict[str, Any]:
        """The next slice's engine request."""
    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """One engine chunk of the current slice; the user-facing chunks."""
    def end_slice(self) -> list[dict[str, Any]]:
        """Ends the current slice; the final user chunks when the response is complete."""
    def response(self) -> dict[str, Any]:
        """The complete non-streaming response."""
    @property
    def done(self) -> bool:
        """Whether the response is complete."""
    @property
    def finish_reason(self) -> str | None:
        """The finish reason once done."""
    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the response."""
    @property
    def generated_tokens(self) -> int:
        """Output tokens over every slice."""
    @property
    def produced_tokens(self) -> int:
        """Output tokens so far, the slice in progress included."""
    @property
    def generated_token_ids(self) -> list[int]:
        """Output token ids over every slice."""
    @property
    def remaining_tokens(self) -> int:
        """Output tokens the budget still allows."""
    @property
    def text(self) -> str:
        """The text released to the user so far."""
    @property
    def last_slice_tokens(self) -> int:
        """Tokens generated in the slice just ended."""
    @property
    def usage(self) -> tuple[int, int, int, int, int, int]:
        """`(prompt, completion, total, slices, resent, recomputed)` tokens."""

def evict_probability(context: float, demand_tokens: float, free_tokens: float) -> float:
    """The expected share of a paused request's `context` tokens evicted before it resumes, given
    the KV the admitted work needs and the free KV.
    """

def slice_policy_names() -> list[str]:
    """The registered slice policies."""

def slice_policy_defaults(name: str) -> dict[str, Any]:
    """A slice policy's parameters with their defaults."""

# ---- vllm_events ---------------------------------------------------------------------------

def decode_vllm_events(payload: bytes) -> EventBatchDict:
    """A vLLM KV-event payload (msgpack `EventBatch`) as plain data; `MalformedEventError` names the
    byte offset of a problem.
    """

# ---- routing -------------------------------------------------------------------------------

@final
class EndpointPool:
    """The native endpoint pool; `llmsched.EndpointPool` wraps it."""

    def __new__(cls, stale_after: float, stale_policy: str) -> EndpointPool: ...
    @staticmethod
    def default_staleness() -> tuple[float, str]:
        """The default staleness limit and policy."""
    @property
    def stale_after(self) -> float:
        """Seconds after which metrics are stale."""
    @property
    def stale_policy(self) -> str:
        """How stale metrics are read: `saturated` or `ignore`."""
    def upsert(
        self,
        id: int | str,
        address: str,
        role: str | None,
        labels: dict[str, str],
        model: str | None,
    ) -> bool:
        """Adds or updates an endpoint; returns whether it is new."""
    def upsert_many(
        self,
        rows: list[tuple[int | str, str, str | None, dict[str, str], str | None]],
    ) -> int:
        """`upsert` of each `(id, address, role, labels, model)` row in one step; every row is
        converted before anything changes. Returns how many were new."""
    def remove(self, id: int | str) -> None:
        """Removes an endpoint."""
    def update(
        self,
        id: int | str,
        waiting: int | None,
        running: int | None,
        kv_cache_usage: float | None,
        max_concurrency: int | None,
        now: float,
    ) -> None:
        """Records an endpoint's metrics at `now`."""
    def set_loras(
        self, id: int | str, active: list[str], waiting: list[str], max_loras: int
    ) -> None:
        """Records an endpoint's LoRA adapters."""
    def update_from_metrics_text(self, id: int | str, text: str, now: float) -> MetricsRead:
        """Reads a vLLM or SGLang `/metrics` text into an endpoint's metrics."""
    def endpoints(self) -> list[EndpointInfo]:
        """Every endpoint with its last metrics and counts."""
    def __len__(self) -> int:
        """The number of endpoints."""

@final
class Router:
    """The native router; `llmsched.Router` wraps it (configuration loading, prompt forms,
    warnings).
    """

    def __new__(
        cls,
        pool: EndpointPool,
        index: PrefixIndex,
        config: Mapping[str, Any],
        functions: list[Any],
        seed: int | None,
        record_ttl: float | None,
        session_ttl: float | None,
        max_sessions: int | None,
    ) -> Router: ...
    @staticmethod
    def config_info(config: Mapping[str, Any], functions: list[Any]) -> ConfigInfo:
        """What a configuration asks of its caller (block size, precise-scorer wiring, saturation
        thresholds, notes).
        """
    @staticmethod
    def preset(name: str) -> dict[str, Any] | None:
        """A preset configuration by name."""
    @staticmethod
    def preset_names() -> list[str]:
        """The preset names."""
    @staticmethod
    def plugin_catalogue() -> list[PluginInfo]:
        """Every plugin type with its kind, summary and parameters."""
    @staticmethod
    def plugin_types() -> list[str]:
        """Every plugin type name, aliases included."""
    @property
    def seed(self) -> int:
        """The seed of the decisions' random choices."""
    @property
    def record_ttl(self) -> float:
        """Seconds an approximate prefix record counts."""
    @property
    def profiles(self) -> list[str]:
        """The configuration's scheduling profiles."""
    def pick(
        self,
        tokens: _Tokens,
        model: str | None,
        lora: str | None,
        priority: int,
        session_id: str | None,
        headers: list[tuple[str, str]],
        cache_salt: str | None,
        now: float,
        session_endpoint: EndpointId | None = None,
    ) -> Decision:
        """Routes a prompt given as token ids."""

@final
class Decision:
    """The native routing decision; `llmsched.Decision` wraps it."""

    @property
    def endpoint(self) -> EndpointId:
        """The chosen endpoint."""
    @property
    def address(self) -> str:
        """Its address."""
    @property
    def fallbacks(self) -> list[EndpointId]:
        """The next-best endpoints, in order."""
    @property
    def fallback_addresses(self) -> list[str]:
        """Their addresses."""
    @property
    def prefill_endpoint(self) -> EndpointId | None:
        """The prefill endpoint when the request is split."""
    @property
    def prefill_address(self) -> str | None:
        """Its address."""
    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens."""
    @property
    def cold(self) -> bool:
        """Whether no endpoint held any of the prompt."""
    @property
    def sequence(self) -> int:
        """The decision's sequence number."""
    @property
    def cached(self) -> int:
        """Prompt tokens cached on the chosen endpoint."""
    @property
    def stage(self) -> str:
        """`picked`, `sent`, `first-token` or `finished`."""
    def cached_tokens(self) -> dict[EndpointId, int]:
        """Cached prompt tokens per endpoint."""
    def pd(self) -> PdNote | None:
        """The prefill/decode decision, when a P/D handler ran."""
    def explain_data(self, limit: int | None = None) -> list[ProfileData]:
        """Each profile's scores per endpoint and scorer: at most `limit` rows per profile (the
        table's first), the rest counted."""
    def explain_row(self, profile: int, endpoint: EndpointId) -> ProfileRow | None:
        """`endpoint`'s row in the `profile`-th profile run; None when it was not considered."""
    def again(self) -> Decision:
        """A fresh decision with this one's choice, fallbacks and scores, not started: a
        retry's (no new pick, so a round-robin cursor does not move)."""
    def started(self, endpoint: int | str | None, now: float) -> None:
        """Marks the request sent (to `endpoint`, default the chosen one); PlacementError when
        it was already started or finished."""
    def first_token(self) -> bool:
        """Marks the first token; returns False when already marked; PlacementError before
        `started`."""
    def finished(self) -> bool:
        """Marks the request finished; returns False when already finished."""

def parse_engine_metrics_text(text: str) -> EngineMetricValues:
    """An engine's `/metrics` text read as `llmsched.integrations.metrics.parse_engine_metrics`
    documents (one linear pass)."""

@final
class ReplicaSync:
    """One router replica's end of replica sync; `llmsched.cluster.ClusterSync` drives it."""

    def __new__(
        cls,
        router: Router,
        replica: str,
        incarnation: int,
        journal_limit: int,
        load_ttl: float,
        history_limit: int,
    ) -> ReplicaSync: ...
    @property
    def replica(self) -> str:
        """This replica's name."""
    def outgoing(self, now: float, heartbeat: bool, max_bytes: int) -> list[bytes]:
        """The next batches to publish, each at most `max_bytes` (an entry larger than that
        alone in its batch); empty when nothing changed and no heartbeat is due."""
    def incoming(self, data: bytes, now: float) -> SyncReport:
        """Applies another replica's batch."""
    def apply_catch_up(self, data: bytes, now: float) -> SyncReport:
        """Applies a catch-up batch (records and sessions only)."""
    def catch_up(self, now: float, max_bytes: int, request: bytes | None = None) -> list[bytes]:
        """The answer to a peer's catch-up `request` (everything when None): this replica's
        entries past the asker's cursor; empty when the request is not for this replica."""
    def catch_up_request(self) -> bytes:
        """The catch-up request to send every peer: what this replica holds of each (each
        answers its own records and the sessions it owns)."""
    def request_to(self, replica: str, incarnation: int) -> bytes:
        """A catch-up request that peer `replica` (`incarnation`) alone answers: what it has
        that is missing here (asked again when its answer came without some pieces)."""
    def repair_requests(self) -> list[tuple[str, int, bytes]]:
        """``(replica, incarnation, request)``: one catch-up request per peer with batches
        missing here, each asked once until answered or given up (:meth:`repair_unanswered`);
        after a first start's catch-up, first one request to one peer that answered for the
        sessions and records whose owner did not answer (a replica since gone)."""
    def repair_unanswered(self, replica: str, incarnation: int) -> bool:
        """Gives up the repair of that peer, unanswered: a later batch of it that shows the
        gap asks again (counted in ``repairs_unanswered``); False when none is outstanding."""
    def peer_ids(self) -> list[tuple[str, int]]:
        """``(replica, incarnation)`` of every replica heard from within the load TTL."""
    def expire(self, now: float) -> int:
        """Forgets silent replicas; returns how many."""
    def peers(self) -> list[str]:
        """Replicas heard from within the load TTL."""
    def shared_names(self) -> list[str]:
        """Names more than one live replica uses (this one's included)."""
    def counters(self) -> SyncCounters:
        """Counters since the sync started."""

# ---- sim ------------------------------------------------------------------------------------

@final
class KvCache:
    """The simulator's paged KV cache with prefix caching (the Python twin is
    `llmsched.reference.sim_kv`).
    """

    def __new__(cls, num_blocks: int, block_size: int) -> KvCache: ...
    @property
    def num_blocks(self) -> int:
        """Blocks in the cache."""
    @property
    def block_size(self) -> int:
        """Tokens per block."""
    @property
    def free_blocks(self) -> int:
        """Blocks neither used nor cached."""
    @property
    def cached_blocks(self) -> int:
        """Blocks cached and unused (evictable)."""
    def usage(self) -> float:
        """Share of blocks in use."""
    def requests(self) -> int:
        """Requests holding blocks."""
    def lookup(self, hashes: npt.NDArray[np.uint64], max_blocks: int | None = None) -> int:
        """Leading blocks of `hashes` cached."""
    def tokens_of(self, req: int) -> int:
        """Tokens a request holds."""
    def blocks_of(self, req: int) -> int:
        """Blocks a request holds."""
    def start(self, req: int, hashes: npt.NDArray[np.uint64], max_blocks: int) -> int:
        """Starts a request on its cached prefix; returns the cached blocks it reuses."""
    def allocate(self, req: int, tokens: int) -> bool:
        """Gives a request room for `tokens` more; False when blocks run out."""
    def commit(self, req: int, hashes: npt.NDArray[np.uint64], upto: int) -> None:
        """Marks a request's blocks up to `upto` as cached under their hashes."""
    def free(self, req: int) -> None:
        """Releases a request's blocks (cached ones stay, evictable)."""
    def set_decoding(self, req: int, decoding: bool) -> None:
        """Marks a request as decoding or not."""
    def decode_capacity(self, limit: int) -> int:
        """Decode steps all decoding requests can take before blocks run out."""
    def advance_decoding(self, steps: int) -> bool:
        """Advances every decoding request by `steps` tokens."""
    def take_events(self) -> list[KVCacheEvent]:
        """The KV events since the last call."""

@final
class Outcome:
    """How a flow-controlled request ended, with the HTTP status and
    dropped-reason a gateway sends.
    """

    DISPATCHED: ClassVar[Outcome]
    REJECTED_CAPACITY: ClassVar[Outcome]
    REJECTED_SHED: ClassVar[Outcome]
    REJECTED_NO_ENDPOINTS: ClassVar[Outcome]
    EVICTED_TTL: ClassVar[Outcome]
    EVICTED_PREEMPTED: ClassVar[Outcome]
    EVICTED_CANCELLED: ClassVar[Outcome]
    @property
    def http_status(self) -> int:
        """The HTTP status for a gateway to answer."""
    @property
    def reason(self) -> str:
        """The dropped-reason header value."""
    @property
    def key(self) -> str:
        """The outcome's name, e.g. `rejected_shed`."""
    def __int__(self) -> int:
        """The outcome's number."""

@final
class FlowDecision:
    """A request leaving flow control: dispatched, rejected or evicted."""

    def __new__(cls, *fields: object) -> FlowDecision:
        """A decision rebuilt from its fields (what ``pickle`` and ``copy`` call), in this
        order: id, outcome, priority, tenant, prompt_tokens, size_bytes, wait_s, payload,
        ticket.
        """
    @property
    def id(self) -> int:
        """The request's id."""
    @property
    def outcome(self) -> Outcome:
        """How it left."""
    @property
    def priority(self) -> int:
        """Its priority."""
    @property
    def tenant(self) -> str:
        """Its tenant."""
    @property
    def prompt_tokens(self) -> int:
        """Its prompt tokens."""
    @property
    def size_bytes(self) -> int:
        """Its size in bytes."""
    @property
    def wait_s(self) -> float:
        """Seconds it waited."""
    @property
    def payload(self) -> Any:
        """The payload given at enqueue."""
    @property
    def ticket(self) -> int | None:
        """The ticket given at enqueue (which ``admit()`` awaits it), or None."""
    @property
    def http_status(self) -> int:
        """The outcome's HTTP status."""
    @property
    def reason(self) -> str:
        """The outcome's dropped-reason."""

@final
class FlowCore:
    """The native flow controller; `llmsched.FlowController` wraps it (argument checks, asyncio
    admission).
    """

    def __new__(cls, config: Mapping[str, Any]) -> FlowCore: ...
    def config(self) -> FlowConfig:
        """The resolved configuration."""
    def enqueue(
        self,
        id: int,
        priority: int,
        tenant: str,
        prompt_tokens: int,
        size_bytes: int,
        deadline: float | None,
        ttft_target: float | None,
        payload: Any,
        now: float,
        ticket: int | None = None,
    ) -> Outcome | None:
        """Queues a request; returns the rejection outcome, or None when queued. ``ticket``
        comes back on its decision and stays with the request while it runs, for ``cancel``
        and ``complete`` (ids may be reused, tickets are the caller's to keep unique)."""
    def dispatch(self, now: float) -> FlowDecision | None:
        """The next request to dispatch, or None."""
    def cancel(self, id: int, now: float, ticket: int | None = None) -> FlowDecision | None:
        """Cancels a queued request (given ``ticket``, only the one enqueued with it)."""
    def expire(self, now: float) -> list[FlowDecision]:
        """Evicts requests past their TTL."""
    def drain_evicted(self) -> list[FlowDecision]:
        """Requests evicted since the last call."""
    def has_evicted(self) -> bool:
        """Whether any eviction waits to be drained."""
    def record_output(
        self, id: int, output_tokens: int, now: float, ticket: int | None = None
    ) -> bool:
        """Charges output tokens to a running request's tenant; given ``ticket``, only the
        one enqueued with it (False, charging nothing, when the id runs for another
        enqueue: a stale handle)."""
    def charge_remote(
        self, tenant: str, priority: int, prompt_tokens: int, output_tokens: int, now: float
    ) -> bool:
        """Charges another replica's service of a tenant to its flow's fairness policy."""
    def drain_service(self) -> list[tuple[str, int, int, int]]:
        """Service given since the last call: (tenant, priority, prompt, output tokens)."""
    def complete(self, id: int, output_tokens: int, now: float, ticket: int | None = None) -> bool:
        """Marks a running request finished; given ``ticket``, only the one enqueued with it
        (False, changing nothing, when the id runs for another enqueue: a stale release)."""
    def preemption_victims(self, now: float) -> list[int]:
        """Running requests to revoke for blocked higher-priority work."""
    def update_endpoint(
        self, endpoint: str, waiting: int, running: int, kv_usage: float, timestamp: float
    ) -> None:
        """Records an endpoint's metrics for saturation."""
    def remove_endpoint(self, endpoint: str) -> bool:
        """Forgets an endpoint."""
    def saturation(self, now: float) -> float:
        """The pool's saturation."""
    def jain_index(self, priority: int | None = None) -> float:
        """Jain's fairness index across tenants."""
    def metrics(self, now: float) -> FlowMetrics:
        """Queue, band and tenant metrics."""
    def is_queued(self, id: int) -> bool:
        """Whether a request is queued."""
    def is_running(self, id: int) -> bool:
        """Whether a request is running."""
    def running_count(self) -> int:
        """Requests running."""
    def __len__(self) -> int:
        """Requests queued."""

def flow_resolve_config(config: Mapping[str, Any]) -> FlowConfig:
    """A flow-control configuration merged over every default and checked
    (`llmsched.flow.resolve_config`).
    """

@final
class PlanContents:
    """Dense content ids of a workload plan's block hashes."""

    @property
    def distinct(self) -> int:
        """Distinct contents."""
    def __len__(self) -> int:
        """Hashes numbered."""

def number_contents(hashes: npt.NDArray[np.uint64]) -> PlanContents:
    """Numbers a workload plan's distinct block hashes densely (the simulator's id-addressed KV
    caches).
    """

_RngState: TypeAlias = tuple[int, int, bool, int]  # numpy PCG64 (state, inc, has_uint32, uinteger)

def plan_trace(
    path: str,
    settings: Mapping[str, object],
    rng: _RngState,
    block_size: int,
    chain_seed: int,
) -> dict[str, Any]:
    """A JSONL trace's workload plan, read and built natively (`llmsched.sim.workloads.
    native_plan`); `rng` is the state of the workload's `default_rng(seed)`.
    """

def plan_independent(
    arrival: npt.NDArray[np.float64],
    mean_input: npt.NDArray[np.float64],
    mean_output: npt.NDArray[np.float64],
    tenant: npt.NDArray[np.int64],
    priority: npt.NDArray[np.int64],
    length_cv: float,
    rng: _RngState,
    scalar_seed: int,
    block_size: int,
    chain_seed: int,
) -> dict[str, Any]:
    """The plan of independent requests (`long_short`, `priority`), drawn on from the numpy
    generator state `rng` and `random.Random(scalar_seed)`.
    """

def plan_prompted(
    prompt_hashes: npt.NDArray[np.uint64],
    prompt_offsets: npt.NDArray[np.int64],
    prompt_len: npt.NDArray[np.int64],
    arrival: npt.NDArray[np.float64],
    pick: npt.NDArray[np.int64],
    tenant: npt.NDArray[np.int64],
    output_len: int,
    rng: _RngState,
    block_size: int,
) -> dict[str, Any]:
    """The plan of requests over prompts built beforehand (`shared_prefix`); the outputs'
    fresh block ids come from the numpy generator state `rng`.
    """

def plan_agentic(
    settings: Mapping[str, object],
    systems: Sequence[npt.NDArray[np.uint32]],
    starts: npt.NDArray[np.float64],
    closed: bool,
    seed: int,
    block_size: int,
    chain_seed: int,
) -> dict[str, Any]:
    """The session scripts of an agentic workload, built natively (`AgenticWorkload.script`
    for every session).
    """

def simulate(
    config: Mapping[str, Any],
    step: Mapping[str, Any],
    router: Mapping[str, Any],
    workload: dict[str, Any],
    flow: Mapping[str, Any] | None = None,
    ttft_targets: list[tuple[int, float]] | None = None,
    slices: tuple[str, Mapping[str, Any], SwitchCostModel] | None = None,
    functions: list[Callable[..., Any]] = ...,
    policy: tuple[str, Policy] | None = None,
) -> dict[str, Any]:
    """Runs the simulator's Rust engine on a plan (`llmsched.sim.Simulation` prepares the
    arguments). `flow`: the flow controller's configuration (None: no flow control);
    `ttft_targets`: (priority, TTFT target in seconds) pairs for its requests; `slices`:
    (policy, params, switch-cost model) of the token-slice tracker (None: no slices);
    `functions`: the Python callables of the router config's `python-scorer` /
    `python-filter` plugins (`llmsched.routing.native_config`), called with the GIL taken for
    each call only; `policy`: (name, `llmsched.sim.policies.Policy` object) routing instead of
    the router, called back the same way (a failed call raises `llmsched.errors.PolicyError`).
    The plan's `hashes` array is read in place, not copied, while the engine runs with the GIL
    released: nothing may write to it meanwhile (`llmsched.sim.fast`'s plans are never written).
    A `workload` of kind `"trace"` (`path`, `settings` and `rng` as `plan_trace` takes them,
    and `chain_seed`: `llmsched.sim.workloads.trace_build`) is read and its plan built on a
    second thread while the engine runs on the lines built so far; the result then holds the
    plan too (`"plan"`, as `plan_trace` returns it). Not with a `policy`.
    """

@final
class NativeKVEventSubscriber:
    """The native KV-event feed (`llmsched_gateway::kv_events`) on its own thread;
    `llmsched.integrations.NativeKVEventSubscriber` wraps it. Every method releases the GIL."""

    def __new__(
        cls,
        index: PrefixIndex,
        engines: list[tuple[str, str, bool, str | None, str]],
        options: str,
        on_mismatch: Callable[[str, int, int, int], None] | None = None,
        on_socket: Callable[[list[str], str, str, str | None], None] | None = None,
    ) -> NativeKVEventSubscriber:
        """A feed of `(worker, endpoint, bind, replay, topic)` engines into `index` with
        `options` (JSON); `on_mismatch(worker, block_size_mismatch, extra_keys, multimodal)`
        for a batch whose stored events were skipped for any of those causes;
        `on_socket(workers, endpoint, action, error)` on each failure to open a socket, once
        when it opens after failing (error None), and for the first peer connection an
        endpoint drops (action `drop`); ConfigError naming the problem."""
    def start(self) -> None:
        """Starts the feed's thread."""
    def stop(self) -> None:
        """Stops the thread and closes every socket."""
    @property
    def running(self) -> bool:
        """Whether the thread runs."""
    def counters(self) -> dict[str, int]:
        """Totals over every engine."""
    def worker_counters(self, worker: str) -> dict[str, int]:
        """One engine's counters."""
    def last_seq(self, worker: str) -> int | None:
        """The last sequence number taken from `worker`."""
    def worker_state(self, worker: str) -> dict[str, Any]:
        """Where `worker`'s stream stands."""
    def bound_endpoint(self, worker: str) -> str | None:
        """The endpoint bound for `worker`, once bound."""
    def failing_sockets(self) -> list[tuple[str, str]]:
        """The sockets failing to open now: `(endpoint, error)` each."""
    def workers(self) -> list[str]:
        """The subscribed workers."""
    def wait_changed(self, seen: int, timeout_s: float) -> int:
        """Waits until the counters change after generation `seen`; the generation now."""

def gateway_metric_help() -> dict[str, str]:
    """The HELP text of every family of the gateway's `/metrics`, by name without the
    `llmsched_gateway_` prefix (and a counter's `_total`): the one table both data planes
    read (a new dict each call)."""

@final
class NativeGateway:
    """The native data plane (`llmsched-gateway`) serving in-process on its own runtime thread;
    `llmsched.gateway.NativeGateway` wraps it. Every method releases the GIL."""

    def __new__(
        cls,
        config: str,
        host: str,
        port: int,
        router: object | None = None,
        extra_metrics: Callable[[], str] | None = None,
        engines: Callable[[str, str], tuple[int, str]] | None = None,
        block_size: Callable[[str, int], None] | None = None,
        token_warning: Callable[[str, int], None] | None = None,
    ) -> NativeGateway:
        """Starts serving on `host:port` (0: any free port) with `config` (the JSON of the
        native gateway config), routing with `router` (an `llmsched.Router` or its native
        router; None: one built from `config`); `extra_metrics()` adds to `/metrics` (called
        with the GIL on each scrape of it); `engines(action, argument)` adds or removes an
        engine for the admin API (`"add"` with the request body, `"remove"` with the worker id)
        and returns the status and JSON body to answer; `block_size(worker, size)` is told
        the KV block size an engine's `/metrics` gives (first seen, or changed);
        `token_warning(kind, count)` is called once with `("pseudo", 1)` at the first prompt
        hashed as pseudo-tokens while engine events feed the index, and once with
        `("mismatch", unconfirmed)` when the token ids it routes on were never found among the
        blocks the engines' KV events report (see `token_check()`). Raises ConfigError naming
        the problem."""
    @property
    def host(self) -> str:
        """The address listened on."""
    @property
    def port(self) -> int:
        """The port listened on."""
    @property
    def running(self) -> bool:
        """Whether it serves."""
    def stop(self) -> None:
        """Stops listening, closes every connection and joins the runtime thread."""
    def token_check(self) -> tuple[int, int, int | None, int]:
        """The check that the token ids it routes on reach the engines' KV events: prompts
        sampled that an engine reported, those it did not while events kept arriving, the
        unconfirmed count when it warned (None before), and prompts hashed as pseudo-tokens
        while engine events fed the index (also after `stop()`)."""
    def set_engines(
        self, engines: list[tuple[str, str]], changes: int | None = None
    ) -> tuple[list[str], list[str]]:
        """Replaces the engines (`(id, base URL)` pairs); returns the ids added and removed.
        `changes`: the engine changes to count (None: each engine added, removed or moved,
        once)."""
    def metrics_text(self) -> str:
        """The `/metrics` text."""
    def health_states(self) -> list[tuple[str, str]]:
        """Each engine's health state: `up`, `down`, `open` or `draining`."""
    def routable(self) -> list[str]:
        """Engines a request could go to now."""
    def drain_usage(self) -> dict[str, Any]:
        """Usage since the last call: `keys` (digest -> (requests, tokens)) and `tenants`
        ((tenant, priority, prompt, output) tuples)."""
    def apply_usage(
        self, keys: Mapping[str, tuple[float, float]], tenants: Sequence[tuple[str, int, int, int]]
    ) -> None:
        """Charges other replicas' usage to the same keys and tenants here."""
    def sliced_requests(self) -> int | None:
        """Requests being decoded in token slices now; None when slices are off."""
    def flow_stats(self) -> NativeFlowStats | None:
        """Flow control's snapshot, or None when it is off."""
    def flow_metrics(self) -> FlowMetrics | None:
        """Flow control's gauges and counters, or None when it is off."""
    def counters(self) -> NativeGatewayCounters:
        """Connection and request counters."""
    def tokenizer_cache_stats(self) -> TokenizerCacheStats | None:
        """The tokenizer's piece cache (None without a tokenizer)."""
    def set_max_model_len(self, max_model_len: int | None) -> None:
        """Sets the engines' context length (None: unknown): what a request's
        `truncate_prompt_tokens` of -1 keeps less one, as vLLM keeps it."""

@final
class NativePromptTokenizer:
    """The native plane's prompt tokenizer on its own: the token ids `llmsched serve
    --data-plane native` routes on (the Rust `tokenizers` crate and a Jinja engine), to compare
    with `llmsched.tokenize.PromptTokenizer`. Every method releases the GIL."""

    def __new__(
        cls,
        directory: str,
        cache_bytes: int = 33554432,
        content_format: Literal["auto", "string", "openai"] = "auto",
        chat_template: str | None = None,
        default_chat_template_kwargs: str | None = None,
        exclude_tools_when_tool_choice_none: bool = False,
        trust_request_chat_template: bool = False,
        max_model_len: int | None = None,
    ) -> NativePromptTokenizer:
        """Loads a `save_pretrained` tokenizer directory; ConfigError when it cannot be loaded
        or its chat template cannot be rendered (probe conversations are rendered). Chat
        prompts go through a piece cache of `cache_bytes` (0: none) where the tokenizer's
        piecewise encoding is proved exact at load. `content_format`: `"auto"` (detected
        from the template as vLLM detects it), `"string"` or `"openai"` (as vLLM's
        `--chat-template-content-format` sets it). `chat_template`: a template's text in
        place of the directory's own (vLLM's `--chat-template`);
        `default_chat_template_kwargs`: a JSON object's text, the variables under every
        request's (vLLM's `--default-chat-template-kwargs`);
        `exclude_tools_when_tool_choice_none`: vLLM's flag of that name (a request's
        `tool_choice` of `"none"` leaves its tools out); `trust_request_chat_template`:
        vLLM's `--trust-request-chat-template` (a request's own `chat_template` is rendered;
        without it, such a request is refused); `max_model_len`: the engines' context length
        (a `truncate_prompt_tokens` of -1 keeps one less)."""
    @property
    def has_chat_template(self) -> bool:
        """Whether chat requests can be tokenized."""
    @property
    def content_format(self) -> Literal["string", "openai"]:
        """How the chat template takes a message's list content, detected as vLLM detects it."""
    @property
    def special_tokens(self) -> list[tuple[str, str]]:
        """The special tokens the chat template sees (`bos_token`, `eos_token`, ...)."""
    def render_chat(self, request: str) -> str:
        """The chat template's text for a chat request body (JSON text with `messages`, maybe
        `tools` and `chat_template_kwargs`); InvalidRequestError naming the problem."""
    def chat_tokens(self, request: str) -> list[int]:
        """The token ids of a chat request body, as the native plane routes on them."""
    def completion_tokens(self, request: str) -> list[int]:
        """The token ids of a completions request body's `prompt` (JSON text)."""
    def encode_chat(self, text: str) -> list[int]:
        """The ids of a rendered chat prompt (no special tokens added), through the piece
        cache when it is on."""
    def encode_whole(self, text: str) -> list[int]:
        """The ids of `text` (no special tokens added), encoded whole without the cache:
        the oracle of `encode_chat`."""
    def cache_stats(self) -> TokenizerCacheStats:
        """The piece cache's counters and state (why it is off, when it is)."""
