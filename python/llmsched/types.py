"""The shapes of llmsched's structured results and configuration, as ``TypedDict`` classes.

Results stay plain dicts at run time (cheap to build in Rust, easy to print, log or serialise
as JSON); these classes give them a checked type. Every dict a public method returns is one of
these, and the native module's stubs (``_llmsched.pyi``) name them too.

>>> from llmsched import PrefixIndex
>>> stats: IndexStats = PrefixIndex(block_size=16).stats()
>>> sorted(stats) == sorted(IndexStats.__annotations__)
True
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

__all__ = [
    "AllBlocksClearedDict",
    "ApplyReport",
    "BandConfig",
    "BandMetrics",
    "BlockRemovedDict",
    "BlockStoredDict",
    "CandidateInfo",
    "ConfigInfo",
    "ConfigNote",
    "DataLayerInfo",
    "DataLayerSource",
    "EndpointId",
    "EndpointInfo",
    "EndpointLoad",
    "EngineMetricValues",
    "EventBatchDict",
    "FlowConfig",
    "FlowMetrics",
    "FlowStats",
    "GlobalLimits",
    "IndexStats",
    "KVCacheEvent",
    "KVEventDict",
    "KeyLimits",
    "MetricsRead",
    "MetricsSourceInfo",
    "NativeAdminConfig",
    "NativeApiKey",
    "NativeEngineEntry",
    "NativeFlowStats",
    "NativeGatewayConfig",
    "NativeGatewayCounters",
    "NativeHealthConfig",
    "NativeSlicesConfig",
    "PdNote",
    "PdReason",
    "PluginInfo",
    "PluginParamInfo",
    "PolicySpec",
    "PreciseWiring",
    "PreemptionConfig",
    "PrefillHeader",
    "ProfileData",
    "ProfileRow",
    "ReportKey",
    "RequestInfo",
    "ResolvedBand",
    "SaturationThresholds",
    "SchedulerConfig",
    "SchedulerStats",
    "ScrapeSettings",
    "SyncCounters",
    "SyncReport",
    "TokenizerWiring",
    "WaitHistogram",
    "WorkerId",
]

WorkerId = int | str
"""A worker (engine) name in the prefix index: an int that fits 64 bits signed, or a str."""

EndpointId = int | str
"""An endpoint id in the routing pool: an int or a str."""

PolicySpec = dict[str, Any]
"""A pluggable policy and its parameters: ``{"type": <registered name>, <parameter>: ...}``.
The parameters belong to the policy (each plugin documents its own), so they stay open here."""


# ---- prefix index -------------------------------------------------------------------------


class IndexStats(TypedDict):
    """:meth:`llmsched.PrefixIndex.stats`: sizes of the index, and counters of what this
    index object saw since it was made. A snapshot (:meth:`llmsched.PrefixIndex.dumps`,
    pickling) keeps the index's content, not its counters: an index rebuilt from one
    (:meth:`~llmsched.PrefixIndex.loads`, unpickling) counts from 0, and warns again of what
    is warned of once, so a copy in another process counts its own (summing copies never
    counts one event twice)."""

    workers: int
    """Workers known to the index."""
    nodes: int
    """Radix-tree nodes."""
    blocks: int
    """Distinct blocks held by at least one worker."""
    holdings: int
    """(block, worker) pairs."""
    engine_blocks: int
    """Engine block hashes mapped to blocks (from KV events)."""
    bytes: int
    """Approximate heap bytes used."""
    evicted_blocks: int
    """Blocks evicted for ``worker_capacity`` or ``max_bytes`` since the index was made (or
    loaded: every counter below starts from 0 in a loaded index)."""
    max_bytes_emptied: int
    """Times ``max_bytes`` evicted every block the index held, those just stored with them: the
    cap is too small for what was stored (below one block, for a cap of a few bytes), and the
    index holds nothing (a warning is logged the first time), since the index was made or
    loaded."""
    replaced_engine_blocks: int
    """Engine blocks a worker stored again under the same engine hash with other content
    (:class:`ApplyReport`'s ``replaced``; a warning is logged the first time), since the index
    was made or loaded."""
    worker_blocks: dict[WorkerId, int]
    """Blocks held, per worker."""
    event_batches: int
    """Engine KV-event batches applied (:meth:`llmsched.PrefixIndex.apply_vllm_events`), since
    the index was made or loaded."""
    block_size_mismatch: dict[WorkerId, int]
    """Per worker, stored events skipped because the engine's block size is not a multiple of
    the index's (a warning is logged the first time for each worker), since the index was made
    or loaded."""
    extra_keys: dict[WorkerId, int]
    """Per worker, stored events skipped for extra keys no request's hashes can name
    (:class:`ApplyReport`'s ``extra_keys``; a warning is logged the first time for each
    worker), since the index was made or loaded."""
    multimodal: dict[WorkerId, int]
    """Per worker, stored events skipped because their extra keys stand for content beside
    their tokens (multimodal inputs, prompt embeddings; counted, not warned of), since the
    index was made or loaded."""


class ApplyReport(TypedDict):
    """:meth:`llmsched.PrefixIndex.apply_vllm_events`: what one batch of KV events did."""

    events: int
    blocks_stored: int
    blocks_removed: int
    cleared: int
    unknown_parent: int
    """``BlockStored`` events skipped: their parent block was never seen (a gap)."""
    unknown_removed: int
    """``BlockRemoved`` hashes the index did not know."""
    block_size_mismatch: int
    conflicts: int
    unknown_events: int
    other_groups: int
    """Events of a KV-cache group other than the first (ignored)."""
    extra_keys: int
    """Stored events skipped for extra keys no request's hashes can name, though the blocks'
    content is their tokens: strings other than the LoRA name and a root block's cache salt
    (a LoRA name the event does not give, an older engine's keys), or a LoRA adapter named
    only by its ``lora_id`` (vLLM before 0.20). A routing miss the index warns of."""
    multimodal: int
    """Stored events skipped because their blocks' extra keys stand for content beside their
    tokens (multimodal inputs, prompt embeddings): no prompt's hashes can match them."""
    replaced: int
    """Engine blocks stored under a hash the worker had stored with other content and still
    held (a hash collision, or two engines reporting as one worker): the hash now names the new
    content, and the worker's holding of the old blocks (and of what lies below them) is
    released, as a removal of the hash would have released it."""


ReportKey = Literal[
    "events",
    "blocks_stored",
    "blocks_removed",
    "cleared",
    "unknown_parent",
    "unknown_removed",
    "block_size_mismatch",
    "conflicts",
    "unknown_events",
    "other_groups",
    "extra_keys",
    "multimodal",
    "replaced",
]
"""A key of :class:`ApplyReport`."""


KVCacheEvent = (
    tuple[Literal["stored"], int | None, list[int]] | tuple[Literal["removed"], list[int]]
)
"""A simulated KV cache's event: ``("stored", parent, hashes)`` or ``("removed", hashes)``,
ready for :meth:`llmsched.PrefixIndex.store` / ``remove`` (see :mod:`llmsched.sim.kv`)."""


# ---- vLLM KV events -----------------------------------------------------------------------


class BlockStoredDict(TypedDict):
    """A decoded ``BlockStored`` event (see :func:`llmsched.decode_vllm_events`)."""

    type: Literal["BlockStored"]
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None
    has_extra_keys: list[bool]
    cache_salt: str | None
    opaque_extra_keys: bool
    content_extra_keys: bool
    group_idx: int | None
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None


class BlockRemovedDict(TypedDict):
    """A decoded ``BlockRemoved`` event."""

    type: Literal["BlockRemoved"]
    block_hashes: list[int]
    medium: str
    group_idx: int | None


class AllBlocksClearedDict(TypedDict):
    """A decoded ``AllBlocksCleared`` event."""

    type: Literal["AllBlocksCleared"]


KVEventDict = BlockStoredDict | BlockRemovedDict | AllBlocksClearedDict
"""One decoded KV event, tagged by ``type``."""


class EventBatchDict(TypedDict):
    """:func:`llmsched.decode_vllm_events`: one decoded ``EventBatch``."""

    ts: float
    events: list[KVEventDict]
    dp_rank: int | None
    unknown_events: int
    """Events of a type this decoder does not know (skipped)."""


# ---- routing ------------------------------------------------------------------------------


class _MetricsReadRequired(TypedDict):
    waiting: int | None
    running: int | None
    kv_cache_usage: float | None


class MetricsRead(_MetricsReadRequired, total=False):
    """:meth:`llmsched.EndpointPool.update_from_metrics_text`: the values a scrape held (None:
    absent from the scrape). The LoRA keys are present only when the scrape reports adapters."""

    active_loras: list[str]
    waiting_loras: list[str]
    max_loras: int


class EngineMetricValues(TypedDict, total=False):
    """:func:`llmsched.integrations.metrics.parse_engine_metrics`: what one engine's
    ``/metrics`` text held (a key is present only when the scrape reported it)."""

    waiting: int
    running: int
    kv_cache_usage: float
    prefix_cache_queries: int
    """Tokens looked up in the prefix cache (counter)."""
    prefix_cache_hits: int
    """Tokens found in the prefix cache (counter)."""
    preemptions: int
    block_size: int
    num_gpu_blocks: int
    active_loras: list[str]
    waiting_loras: list[str]
    max_loras: int


class EndpointLoad(TypedDict):
    """What every view of an endpoint holds: who it is and its load."""

    id: EndpointId
    address: str
    role: Literal["prefill", "decode", "both"] | None
    labels: dict[str, str]
    waiting: int
    running: int
    kv_cache_usage: float
    in_flight_requests: int
    in_flight_prefill_tokens: int


class EndpointInfo(EndpointLoad):
    """:meth:`llmsched.EndpointPool.endpoints`: one endpoint, its last metrics and counts."""

    model: str | None
    max_concurrency: int
    timestamp: float | None
    """When the metrics were taken (None: never)."""
    active_loras: list[str]
    waiting_loras: list[str]
    max_loras: int
    in_flight_tokens: int
    remote_in_flight_requests: int
    """Of ``in_flight_requests``, those other router replicas report (replica sync, see
    :mod:`llmsched.cluster`); 0 without sync."""


class RequestInfo(TypedDict):
    """The request a ``python-scorer`` / ``python-filter`` function is asked about."""

    prompt_tokens: int
    prompt_blocks: int
    block_size: int
    model: str | None
    lora: str | None
    priority: int
    session_id: str | None
    session_endpoint: EndpointId | None
    """The endpoint the request names as its session's (``Router.pick``'s
    ``session_endpoint``, the gateway's decoded ``x-session-token``), member or not."""
    headers: dict[str, str]
    now: float


class CandidateInfo(EndpointLoad):
    """One candidate endpoint a ``python-scorer`` / ``python-filter`` function is given."""

    saturated: bool
    cached_blocks: int
    cached_tokens: int


PdReason = Literal[
    "split", "below-threshold", "no-prefill-endpoint", "prefill-queue-longer", "same-endpoint"
]
"""Why a prefill/decode decision split the request or did not (:class:`PdNote`)."""


class PdNote(TypedDict):
    """:attr:`llmsched.routing.Decision.pd`: the prefill/decode split decision."""

    uncached_tokens: int
    wanted: bool
    """The handler's threshold asked for a split."""
    disaggregated: bool
    """A prefill endpoint other than the decode endpoint was picked and kept."""
    reason: PdReason
    """Why: ``"split"``; ``"below-threshold"`` (fewer uncached tokens than the decider's
    threshold); ``"no-prefill-endpoint"`` (the prefill profile found none);
    ``"prefill-queue-longer"`` (``load-aware-pd-decider`` kept the decode endpoint);
    ``"same-endpoint"`` (the prefill profile picked the decode endpoint itself, one of role
    ``both``: it prefills locally, with no hand-off to itself)."""


class ProfileRow(TypedDict):
    """One endpoint's line in a profile run's explanation."""

    endpoint: EndpointId
    address: str
    cached_tokens: int
    saturated: bool
    metrics_timestamp: float | None
    """When the metrics the pick read were taken (None: never reported)."""
    removed_by: str | None
    """The filter that removed it (None: kept)."""
    scores: list[float] | None
    """One score per scorer, in the profile's order (None: removed before scoring)."""
    total: float | None
    rank: int | None


class ProfileData(TypedDict):
    """One profile run of a decision (raw material of ``Decision.explain()``)."""

    profile: str
    picker: str
    filters: list[str]
    skipped_filters: list[str]
    scorers: list[tuple[str, float]]
    """``(name, weight)`` per scorer."""
    rows: list[ProfileRow]
    omitted: int
    """Endpoints without a row (``explain_data(limit)``): 0 when every row is there."""
    omitted_kept: int
    """Of those, the ones that reached the scorers."""
    omitted_removed_by: dict[str, int]
    """Of those, the ones each filter removed."""


# ---- flow control -------------------------------------------------------------------------


class BandConfig(TypedDict):
    """The resolved settings of a priority band (see :mod:`llmsched.flow`). None: no limit
    (``max_requests``, ``max_bytes``), no expiry (``ttl_s``), the ``ceilings`` policy's
    ceiling (``ceiling``, else a saturation number this band stops dispatching at)."""

    max_requests: int | None
    max_bytes: int | None
    ttl_s: float | None
    ceiling: float | None
    fairness: PolicySpec
    ordering: PolicySpec


class ResolvedBand(BandConfig):
    """A band override, resolved over the default band."""

    priority: int


class GlobalLimits(TypedDict):
    """Limits over all bands (None: no limit)."""

    max_requests: int | None
    max_bytes: int | None


class PreemptionConfig(TypedDict):
    """When and how many running requests a saturated controller asks to preempt."""

    evict_queued: bool
    max_victims: int
    pacing_s: float


FlowConfig = TypedDict(
    "FlowConfig",
    {
        "default_band": BandConfig,
        "bands": list[ResolvedBand],
        "global": GlobalLimits,
        "saturation": PolicySpec,
        "ceilings": PolicySpec,
        "shedding": PolicySpec,
        "preemption": PreemptionConfig,
        "wait_buckets_s": list[float],
        "flow_idle_s": float | None,
    },
)
"""The resolved flow-control configuration (:func:`llmsched.flow.resolve_config`,
:attr:`llmsched.flow.FlowController.config`). ``global`` is a keyword, hence this spelling."""


class WaitHistogram(TypedDict):
    """Queue waits of a band, in seconds: Prometheus-style cumulative buckets."""

    bounds: list[float]
    counts: list[int]
    """One count per bound plus the overflow bucket."""
    sum: float
    count: int


class BandMetrics(TypedDict):
    """One priority band in :meth:`llmsched.flow.FlowController.metrics`."""

    priority: int
    ceiling: float
    queued: int
    queued_bytes: int
    flows: int
    dispatched: int
    wait_s: WaitHistogram


class FlowStats(TypedDict):
    """One flow (tenant within a band) in :meth:`llmsched.flow.FlowController.metrics`."""

    tenant: str
    priority: int
    queued: int
    queued_bytes: int
    dispatched: int
    service_tokens: int
    fairness_counter: float | None


class FlowMetrics(TypedDict):
    """:meth:`llmsched.flow.FlowController.metrics`."""

    saturation: float
    no_endpoints: bool
    queued: int
    queued_bytes: int
    running: int
    running_tokens: int
    outcomes: dict[str, int]
    """Count per terminal outcome key (``dispatched``, ``rejected_capacity``, ...)."""
    bands: list[BandMetrics]
    flows: list[FlowStats]
    jain_index: float
    """Jain's fairness index over the flows' service."""
    tenants: int
    """Tenants with at least one flow now (idle flows are reclaimed after ``flow_idle_s``)."""
    flows_reclaimed: int
    """Flows reclaimed after ``flow_idle_s`` seconds without a queued or running request."""
    priorities_folded: int
    """Requests queued in another priority's band: their priority had none, and the 256 bands
    made besides the configured ones existed (a gateway's client-chosen priorities stay
    bounded so)."""


class ConfigNote(TypedDict):
    """Something a configuration does that its author should know: an older plugin name read
    under its current one, or a setting accepted without effect (and what to use instead)."""

    key: str
    message: str


class PreciseWiring(TypedDict):
    """What llm-d's precise prefix scorer needs around the router: the engines publish KV events
    hashed with vLLM's ``sha256_cbor`` over ``block_size``-token blocks with ``vllm_seed`` as
    ``PYTHONHASHSEED`` (:func:`llmsched.hashing.block_hashes` with ``algo="vllm_sha256_cbor"``
    reproduces them), and a subscriber applies them to the router's index (``zmq_endpoint``,
    topics starting with ``topic_filter``)."""

    key: str
    block_size: int
    hash_seed: str
    vllm_seed: str
    zmq_endpoint: str
    topic_filter: str
    discover_pods: bool


class SaturationThresholds(TypedDict):
    """The Inference Extension's ``saturationDetector`` for flow control's ``utilization``
    detector (None: flow control's default)."""

    queue_depth_threshold: int | None
    kv_cache_util_threshold: float | None
    metrics_staleness_s: float | None


class TokenizerWiring(TypedDict):
    """llm-d's ``token-producer`` (earlier ``tokenizer``) plugin: prompts are tokenized with
    ``model``'s tokenizer before scoring (the caller tokenizes; the gateway with its
    ``tokenizer``, looked up from ``model`` in the local Hugging Face cache when not set)."""

    key: str
    model: str


class DataLayerSource(TypedDict):
    """One ``dataLayer`` source (a plugin name) and the plugins extracting from it."""

    source: str
    extractors: list[str]


class DataLayerInfo(TypedDict):
    """The ``dataLayer`` (or ``data``) section: its sources and ``injectDefaults``."""

    sources: list[DataLayerSource]
    inject_defaults: bool


class PrefillHeader(TypedDict):
    """The prefill header llm-d sets (``disagg-headers-handler``, or
    ``disagg-profile-handler`` with a prefill decider); the gateway sets it (``pd``)."""

    key: str
    header: str


class MetricsSourceInfo(TypedDict):
    """The Inference Extension's ``metrics-data-source``: each endpoint's Prometheus metrics
    are polled at ``path`` (the gateway's scraper, with the engines' ``metrics_path``)."""

    key: str
    path: str


class ConfigInfo(TypedDict):
    """What a configuration asks of whoever runs the router (see :func:`config_info`)."""

    block_size: int | None
    worker_capacity: int | None
    notes: list[ConfigNote]
    precise: PreciseWiring | None
    saturation: SaturationThresholds | None
    flow_control: bool
    tokenizer: TokenizerWiring | None
    data_layer: DataLayerInfo | None
    prefill_header: PrefillHeader | None
    default_profile: bool
    """True when the config gives no ``schedulingProfiles`` and the Inference Extension's
    default profile was built (every filter, scorer and picker declared)."""
    metrics_source: MetricsSourceInfo | None
    session_affinity: bool
    """True when a profile's filter or scorer reads the request's session
    (``session-affinity-scorer`` / ``-filter``): llm-d then answers with the serving pod's
    ``x-session-token``, and so does ``llmsched serve``."""


class PluginParamInfo(TypedDict):
    """One parameter of a routing plugin (see :meth:`llmsched.Router.plugin_catalogue`).

    ``name`` may be a dotted path into a nested mapping; ``type`` is ``integer``, ``number``,
    ``string``, ``boolean``, ``mapping``, ``list`` or ``callable``; ``default`` is None where
    absence means what ``doc`` says; ``min`` / ``max`` are inclusive bounds the plugin checks;
    ``choices`` lists the accepted strings of a closed set (empty otherwise)."""

    name: str
    type: str
    default: Any
    min: float | None
    max: float | None
    choices: list[str]
    required: bool
    doc: str


class PluginInfo(TypedDict):
    """One routing plugin type: its ``kind`` (``filter``, ``scorer``, ``picker``, ``profile
    handler``, ``decider``, ``pre-request plugin``, ``data source``, ``data producer``), the
    current name when it is an older alias (``alias_of``), a
    one-line ``summary`` and its parameters."""

    type: str
    kind: str
    alias_of: str | None
    summary: str
    params: list[PluginParamInfo]


class SyncReport(TypedDict):
    """What applying one replica-sync batch did (:class:`llmsched.cluster.ClusterSync`)."""

    own: bool
    """The batch was this replica's own (the bus delivers to every subscriber)."""
    duplicate: bool
    """Already applied: its sequence is not newer than the last one from that replica."""
    missed: int
    """Batches from that replica that never arrived before this one."""
    records: int
    """Approximate prefix records added to the index."""
    sessions: int
    """Session bindings made."""
    unknown_endpoints: int
    """Entries and counts for endpoints this replica's pool does not have (skipped)."""
    records_mismatched: int
    """Records skipped because the sender hashes prompts otherwise (another block size, seed
    or model): they could never match here."""
    records_refused: int
    """Records the index refused (a chain conflicting with what it holds)."""
    identity_conflict: bool
    """Another live replica (this one, or another peer) uses the sender's name too."""
    stale: bool
    """From an older incarnation of a name whose newer one was heard (a restarted replica's
    previous life, late): dropped, unless it keeps speaking for longer than the load TTL."""
    behind: bool
    """Batches of the sender are missing here and no repair was asked yet
    (``ReplicaSync.repair_requests``)."""


class SyncCounters(TypedDict):
    """Counters of one replica's sync since it started
    (:meth:`llmsched.cluster.ClusterSync.stats`)."""

    batches_out: int
    bytes_out: int
    entries_out: int
    skipped_out: int
    """Entries left out of a batch because a name was over 65,535 bytes."""
    journal_dropped: int
    """Entries dropped because the journal filled between two flushes."""
    batches_in: int
    bytes_in: int
    own_in: int
    duplicates_in: int
    missed_in: int
    malformed_in: int
    records_applied: int
    sessions_applied: int
    unknown_endpoints: int
    mismatched_in: int
    """Batches from a replica that hashes prompts otherwise (their records skipped)."""
    records_mismatched: int
    records_refused: int
    replicas_expired: int
    """Replicas forgotten because nothing came from them within ``load_ttl_s``."""
    identity_conflicts: int
    """Batches from a replica whose name another live replica uses too (this one's, or a
    peer's): names must be unique; both replicas' counts still add up."""
    stale_in: int
    """Batches dropped as a late one of an older incarnation (a restarted replica's previous
    life) after a newer one of its name was heard."""
    catch_up_batches_out: int
    """Catch-up answers built for peers: batches, bytes and entries (each peer answers only
    what the asker misses of its own journal)."""
    catch_up_bytes_out: int
    catch_up_entries_out: int
    repairs_asked: int
    """Catch-up requests aimed at one peer for a gap in its batches."""
    repairs_unanswered: int
    """Repairs (and first-start session requests) that got no answer at all, asked again and
    given up: that peer's gap is asked for again when a later batch of it shows the gap."""
    tables_asked: int
    """After a first start's catch-up (each peer answers with its own sessions): requests to
    one peer for the sessions that no answering peer owns (of replicas since gone)."""


class SchedulerStats(TypedDict):
    """:meth:`llmsched.Scheduler.stats`: what the request pipeline did, counted since it was
    built, and what it holds now."""

    admitted: int
    """Requests flow control dispatched (every request, without flow control)."""
    rejected: int
    """Requests flow control refused or evicted (:class:`~llmsched.errors.FlowRejected`)."""
    no_endpoint: int
    """Admitted requests no endpoint could serve (:class:`~llmsched.errors.NoEndpointError`)."""
    completed: int
    failed: int
    cancelled: int
    retries: int
    """Attempts moved to a fallback (:meth:`llmsched.Placement.retry`)."""
    records_removed: int
    """Approximate prefix blocks dropped from the index because their request failed there."""
    in_flight: int
    """Placements open now (picked, not yet completed, failed or cancelled)."""
    queued: int
    """Requests waiting in flow control now."""
    engines: int
    draining: int
    """Engines out of routing (:meth:`llmsched.Scheduler.drain`); they keep their state."""
    config_warnings: int
    """Notes about a configuration that will route badly (see ``Scheduler.warnings``)."""
    dropped: int
    """Admissions and placements garbage-collected without being ended (their slots were
    given back then; the first one is warned of through logging). A placement's own
    admission counts with it."""


class ScrapeSettings(TypedDict, total=False):
    """``scrape`` of a :class:`SchedulerConfig`: the metrics scraper's settings."""

    enabled: bool
    interval_s: float
    timeout_s: float


class SchedulerConfig(TypedDict, total=False):
    """What :meth:`llmsched.Scheduler.from_config` reads (a dict, or YAML / JSON text or file):
    ``engines`` (mappings in :meth:`EngineSpec.from_dict <llmsched.integrations.EngineSpec>`
    form, or endpoint ids), ``router`` (a preset name, a path or an llm-d
    ``EndpointPickerConfig`` mapping), ``flow`` (a flow-control config, or null for none), and
    the :class:`llmsched.Scheduler` keywords of the same names."""

    engines: list[dict[str, object] | str | int]
    router: str | dict[str, object]
    flow: dict[str, object] | None
    block_size: int
    seed: int
    record_ttl_s: float
    allow_pseudo_tokens: bool
    kv_events: bool
    scrape: ScrapeSettings
    retry_after_s: float


class KeyLimits(TypedDict):
    """An API key's rate and concurrency limits (None: unlimited)."""

    requests_per_s: float | None
    burst_requests: float | None
    tokens_per_s: float | None
    burst_tokens: float | None
    max_concurrent: int | None


class NativeEngineEntry(TypedDict):
    """One engine of the native data plane's configuration."""

    id: str
    url: str


class NativeApiKey(KeyLimits):
    """One API key of the native data plane's configuration, with its limits."""

    key: str
    tenant: str
    priority: int


class NativeHealthConfig(TypedDict):
    """Health probes and the circuit breaker of the native data plane."""

    path: str
    interval_s: float | None
    timeout_s: float
    unhealthy_threshold: int
    healthy_threshold: int
    failures_to_probe: int
    breaker_window_s: float
    breaker_min_requests: int
    breaker_failure_rate: float | None
    breaker_open_s: float
    eject_s: float


class NativeAdminConfig(TypedDict):
    """The native data plane's admin API (``llmsched_gateway::admin::AdminConfig``)."""

    token: str


class NativeSlicesConfig(TypedDict):
    """Token slices on the native data plane (``llmsched_gateway::slicing::SlicesConfig``):
    the ``slices`` section of a gateway config, when enabled."""

    policy: str
    params: dict[str, Any]
    default_max_tokens: int


class NativeGatewayConfig(TypedDict):
    """The native data plane's configuration (``llmsched_gateway::GatewayConfig``, sent as
    JSON), built from a checked gateway config by ``llmsched.gateway.native.native_config``."""

    engines: list[NativeEngineEntry]
    models: list[str]
    lora_adapters: dict[str, str]
    max_body: int
    max_body_in_flight: int
    retries: int
    retry_on_5xx: bool
    scrape_interval_s: float | None
    scrape_timeout_s: float
    flow: FlowConfig | None
    api_keys: list[NativeApiKey]
    retry_after_s: float
    body_timeout_s: float
    idle_timeout_s: float
    connect_timeout_s: float | None
    read_timeout_s: float | None
    total_timeout_s: float | None
    max_connections: int
    max_headers: int
    max_field_size: int
    max_line_size: int
    max_tenants: int
    tenant_idle_s: float
    left_grace_s: float | None
    health: NativeHealthConfig
    pd_header: str | None
    threads: int
    tokenizer: str | None
    tokenizer_cache_bytes: int
    chat_template_content_format: str
    chat_template: str | None
    default_chat_template_kwargs: dict[str, Any] | None
    exclude_tools_when_tool_choice_none: bool
    trust_request_chat_template: bool
    max_model_len: int | None
    slices: NativeSlicesConfig | None
    admin: NativeAdminConfig | None
    record_unread_prefixes: bool
    session_token_namespace: str | None


class NativeFlowStats(TypedDict):
    """Flow control of the native data plane (``NativeGateway.flow_stats()``)."""

    queued: int
    running: int
    saturation: float
    tenants: int
    outcomes: dict[str, int]


class TokenizerCacheStats(TypedDict):
    """The native plane's tokenizer piece cache (``NativeGateway.tokenizer_cache_stats()``,
    ``NativePromptTokenizer.cache_stats()``): chat prompts' text between the tokenizer's added
    tokens, with its ids.

    ``enabled``: whether chat prompts are encoded through it; ``disabled_reason``: why not
    (None when enabled: a tokenizer whose piecewise encoding could not be proved exact at
    load, or ``tokenizer_cache_bytes: 0``); ``capacity_bytes``, ``bytes``, ``entries``: its
    size; ``hits``, ``misses``, ``evictions``: pieces found, encoded and inserted, evicted;
    ``fallbacks``: prompts encoded whole because a piece could not be encoded alone;
    ``chunks``: whether long pieces are cut at word boundaries into chunks of about 64 bytes,
    each cached on its own, so that prompts sharing a long prefix share its chunks (proved
    exact at load on long probe texts; ``chunks_disabled_reason`` says why not, e.g. for a
    tokenizer with a ``Prepend`` normalizer); ``completions``: whether ``/v1/completions``
    prompts (special tokens added) go through the cache, the ids the post-processor adds
    around a text proved fixed at load."""

    enabled: bool
    disabled_reason: str | None
    capacity_bytes: int
    bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    fallbacks: int
    chunks: bool
    chunks_disabled_reason: str | None
    completions: bool


class NativeGatewayCounters(TypedDict):
    """Request and connection counters of the native data plane."""

    received: int
    completed: int
    disconnects: int
    connections: int
    retries: int
    records_removed: int
