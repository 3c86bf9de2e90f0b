"""Seeded workloads: agentic sessions, shared-prefix tenants, long/short mix, priorities, traces.

Every workload yields :class:`~llmsched.sim.request.Request` objects whose ``hashes`` are real
chained block hashes (:mod:`llmsched.hashing`) of their token content, so prefix caching
and prefix-aware routing see exactly the sharing the workload has. A multi-turn session's next
prompt is its previous prompt plus the previous output plus a new message; the next turn is
created when the previous one finishes (closed loop) after a think time.

Arrival processes (``arrival``): ``poisson`` (exponential gaps), ``gamma`` (gaps with coefficient
of variation ``cv``: burstier above 1), ``constant``; agentic sessions may instead be
``closed``: ``concurrency`` sessions at a time, a new one starting when one ends.

>>> w = make_workload({"kind": "shared_prefix", "num_requests": 5, "num_groups": 2,
...                    "system_prompt_len": 64, "question_len": 16, "output_len": 8})
>>> [r.prompt_len for r in w.arrivals()]
[80, 80, 80, 80, 80]
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from llmsched import _llmsched
from llmsched.errors import ConfigError
from llmsched.sim.request import Request
from llmsched.validation import describe_int

__all__ = [
    "MAX_PLAN_TOKENS",
    "MAX_REQUESTS",
    "MAX_SHARED_TOKENS",
    "AgenticConfig",
    "ArrivalConfig",
    "Conversation",
    "LongShortConfig",
    "PriorityConfig",
    "SharedPrefixConfig",
    "TraceConfig",
    "Workload",
    "check_fields",
    "make_workload",
    "native_plan",
    "trace_build",
]

VOCAB = 128_000
U64_TOP = np.iinfo(np.int64).max
MAX_TOKENS = 1 << 24  # the longest prompt or output a workload may draw or a trace ask for
MAX_REQUESTS = 10_000_000
"""Requests a workload may make (a session's turns each count): simulating ten million takes
hours (and see :data:`MAX_PLAN_TOKENS` for the plan's memory)."""
MAX_PLAN_TOKENS = 1 << 32
"""Prompt and output tokens a synthetic workload's plan may write out, in expectation (the
mean lengths times the requests; an agentic session's conversation once), and a trace's lines
in all (refused at the line that passes it, before the plan is built): the plan holds a
block hash and a content id per block, about 22 bytes a 16-token block, and building it
about 60 at its peak. A million default ``long_short`` requests (2.4e9 tokens) peaked at
7.5 GB; unchecked, 200,000 prompts of a million tokens each went on allocating past 100 GB."""
MAX_SHARED_TOKENS = 1 << 28
"""Tokens of the shared texts a workload writes out before its first request (system prompts,
questions): 1 GiB of token ids."""


class Workload(Protocol):
    """What the simulator asks of a workload."""

    expected_requests: int

    def arrivals(self) -> Iterator[Request]:
        """Open-loop requests (and the first turns of sessions) in arrival order."""
        ...

    def on_finish(self, request: Request, now: float) -> Request | None:
        """The follow-up a finished request causes (next turn), if any."""
        ...


class Conversation:
    """A growing token sequence's chained block hashes, extended incrementally.

    ``tokens`` holds the whole sequence (routers hash prompts themselves); with
    ``keep_tokens=False`` only the trailing partial block is kept (all a continuation needs).

    >>> c = Conversation(block_size=4, chain_seed=0)
    >>> c.append(np.arange(10, dtype=np.uint32)); len(c.hashes), c.length
    (2, 10)
    >>> c.append(np.arange(6, dtype=np.uint32)); len(c.hashes), c.length
    (4, 16)
    """

    __slots__ = ("_buf", "_owned", "block_size", "chain_seed", "hashes", "length", "tail")

    def __init__(self, block_size: int, chain_seed: int, keep_tokens: bool = True) -> None:
        self.block_size = block_size
        self.chain_seed = chain_seed
        self.length = 0
        self.tail: npt.NDArray[np.uint32] = np.zeros(0, dtype=np.uint32)
        self.hashes: npt.NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)
        # Tokens live in a buffer that grows by doubling; views handed out (``tokens``) cover
        # only what was written before, and appends write past them, so views never change.
        # A copy shares the buffer until its first append (``_owned`` False).
        self._buf: npt.NDArray[np.uint32] | None = (
            np.zeros(0, dtype=np.uint32) if keep_tokens else None
        )
        self._owned = True

    @property
    def tokens(self) -> npt.NDArray[np.uint32] | None:
        """The whole sequence (a read-only view), or None without ``keep_tokens``."""
        if self._buf is None:
            return None
        view = self._buf[: self.length]
        view.flags.writeable = False
        return view

    def append(self, new_tokens: npt.NDArray[np.uint32]) -> None:
        """Add tokens; hashes only the blocks that become full."""
        n = len(new_tokens)
        if self._buf is not None:
            end = self.length + n
            if not self._owned or end > len(self._buf):
                # Twice what is used, not twice the buffer: a copy of a copy of ... must not
                # double a shared buffer at every level.
                grown = np.empty(max(end, 2 * self.length, 1024), dtype=np.uint32)
                grown[: self.length] = self._buf[: self.length]
                self._buf, self._owned = grown, True
            self._buf[self.length : end] = new_tokens
        self.length += n
        tail = np.concatenate([self.tail, new_tokens]) if len(self.tail) else new_tokens
        full = len(tail) - len(tail) % self.block_size
        if full:
            seed = int(self.hashes[-1]) if len(self.hashes) else self.chain_seed
            more = _llmsched.xxh3_block_hashes(tail[:full], self.block_size, seed)
            self.hashes = np.concatenate([self.hashes, more]) if len(self.hashes) else more
        self.tail = tail[full:]

    def copy(self) -> Conversation:
        """An independent copy (it shares storage until either side appends)."""
        other = Conversation(self.block_size, self.chain_seed, self._buf is not None)
        other.length, other.tail, other.hashes = self.length, self.tail, self.hashes
        other._buf, other._owned = self._buf, False
        self._owned = False
        return other


@dataclass
class ArrivalConfig:
    """How requests (or sessions) arrive: ``poisson``, ``gamma``, ``constant`` or ``closed``."""

    process: str = "poisson"
    rate: float = 10.0  # per second, open loop
    cv: float = 1.0  # gamma only
    concurrency: int = 64  # closed loop only

    def validate(self, closed_allowed: bool) -> None:
        """ConfigError for an unknown process or impossible numbers."""
        known = ("poisson", "gamma", "constant", *(("closed",) if closed_allowed else ()))
        if self.process not in known:
            raise ConfigError(f"unknown arrival process {self.process!r}; known: {list(known)}")
        if self.process != "closed" and not self.rate > 0:
            raise ConfigError(f"arrival rate must be > 0, got {self.rate}")
        if self.process == "gamma" and not self.cv > 0:
            raise ConfigError(f"gamma cv must be > 0, got {self.cv}")
        if self.process == "closed" and self.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {self.concurrency}")

    def gaps(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.float64]:
        """``n`` inter-arrival gaps in seconds."""
        if self.process == "constant":
            return np.full(n, 1.0 / self.rate)
        if self.process == "gamma":
            shape = 1.0 / (self.cv * self.cv)
            return rng.gamma(shape, 1.0 / (self.rate * shape), n)
        return rng.exponential(1.0 / self.rate, n)


def _lengths(rng: np.random.Generator, mean: float, cv: float, n: int) -> npt.NDArray[np.int64]:
    """Gamma-distributed positive integer lengths (``cv == 0``: all equal to ``mean``)."""
    if cv <= 0:
        return np.full(n, max(1, round(mean)), dtype=np.int64)
    shape = 1.0 / (cv * cv)
    return np.maximum(1, np.rint(rng.gamma(shape, mean / shape, n))).astype(np.int64)


def _length(rng: random.Random, mean: float, cv: float) -> int:
    """One gamma-distributed positive integer length (``cv == 0``: ``mean``)."""
    if cv <= 0:
        if not math.isfinite(mean):
            raise ConfigError(f"mean length must be a number, got {mean}")
        value = max(1, round(mean))
    else:
        if not (mean > 0 and math.isfinite(mean) and math.isfinite(cv)):
            raise ConfigError(f"a mean length must be > 0 with length_cv > 0, got {mean}")
        shape = 1.0 / (cv * cv)
        value = max(1, round(rng.gammavariate(shape, mean / shape)))
    if value > MAX_TOKENS:
        raise ConfigError(f"a drawn length {float(value)} is above {MAX_TOKENS} tokens")
    return value


def _tokens(rng: np.random.Generator, n: int) -> npt.NDArray[np.uint32]:
    return rng.integers(0, VOCAB, n, dtype=np.uint32)


def _state(rng: np.random.Generator) -> tuple[int, int, bool, int]:
    """The PCG64 state the native plan builders continue from (numpy's own report of it)."""
    st = rng.bit_generator.state
    return (
        int(st["state"]["state"]),
        int(st["state"]["inc"]),
        bool(st["has_uint32"]),
        int(st["uinteger"]),
    )


def _offsets(lengths: list[int]) -> npt.NDArray[np.int64]:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


class _Base:
    """Shared plumbing: the rng, request ids, hashing namespace."""

    def __init__(self, seed: int, block_size: int, chain_seed: int) -> None:
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.scalar_rng = random.Random(seed)  # numpy's per-call cost dominates scalar draws
        self.block_size = block_size
        self.chain_seed = chain_seed
        self._next_id = 0
        self.expected_requests = 0

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _single(
        self,
        arrival: float,
        conv: Conversation,
        output_len: int,
        **kw: Any,
    ) -> Request:
        """A request whose output nobody reuses: the output's blocks get fresh random ids."""
        prompt_len = conv.length
        full = (prompt_len + output_len) // self.block_size
        extra = full - len(conv.hashes)
        hashes = conv.hashes
        if extra > 0:
            fresh = self.rng.integers(1, U64_TOP, extra, dtype=np.int64).astype(np.uint64)
            hashes = np.concatenate([hashes, fresh])
        return Request(
            self._id(), arrival, prompt_len, output_len, hashes, tokens=conv.tokens, **kw
        )

    def on_finish(self, request: Request, now: float) -> Request | None:
        """Single-turn workloads cause no follow-ups."""
        return None

    def _independent_plan(
        self,
        times: npt.NDArray[np.float64],
        mean_input: npt.NDArray[np.float64],
        mean_output: npt.NDArray[np.float64],
        tenant: npt.NDArray[np.int64],
        priority: npt.NDArray[np.int64],
        length_cv: float,
    ) -> dict[str, Any]:
        """The native plan of independent requests drawn as :meth:`arrivals` draws them."""
        return _llmsched.plan_independent(
            times,
            mean_input,
            mean_output,
            tenant,
            priority,
            float(length_cv),
            _state(self.rng),
            self.seed,
            self.block_size,
            self.chain_seed,
        )


# -- agentic multi-turn ----------------------------------------------------------------------


@dataclass
class AgenticConfig:
    """Agentic sessions (as vLLM and llm-d describe agentic traffic: ~10k-token first turn with
    ~2k reasoning output, then ~5 turns of ~500-token inputs). The first input includes one of
    ``system_prompts`` shared system prompts."""

    sessions: int = 600
    arrival: ArrivalConfig = field(
        default_factory=lambda: ArrivalConfig(process="closed", concurrency=160)
    )
    first_input: int = 10_000
    first_output: int = 2_000
    followup_turns: int = 5
    followup_input: int = 500
    followup_output: int = 300
    length_cv: float = 0.3
    think_time_s: float = 2.0
    system_prompts: int = 4
    system_prompt_len: int = 2_000


class _Script:
    """One session, written out in full: its tenant, every turn's (prompt length, output
    length, blocks of the chain it covers), the think time after each turn, and the whole
    conversation. Drawn from the session's own random streams (seeded by the workload seed
    and the session's number), so its content never depends on when other requests finish
    and every policy and both engines see the same sessions."""

    __slots__ = ("conv", "tenant", "thinks", "turns")

    def __init__(self, tenant: int, conv: Conversation) -> None:
        self.tenant = tenant
        self.conv = conv
        self.turns: list[tuple[int, int, int]] = []
        self.thinks: list[float] = []


class AgenticWorkload(_Base):
    """Multi-turn agent sessions; tenants are the system prompts."""

    def __init__(self, cfg: AgenticConfig, seed: int, block_size: int, chain_seed: int) -> None:
        super().__init__(seed, block_size, chain_seed)
        cfg.arrival.validate(closed_allowed=True)
        if cfg.sessions < 1 or cfg.system_prompts < 1:
            raise ConfigError("agentic: sessions and system_prompts must be >= 1")
        if cfg.system_prompt_len >= cfg.first_input:
            raise ConfigError("agentic: system_prompt_len must be below first_input")
        self.cfg = cfg
        self.expected_requests = cfg.sessions * (1 + cfg.followup_turns)
        self._systems = []
        for _ in range(cfg.system_prompts):
            conv = Conversation(block_size, chain_seed)
            conv.append(_tokens(self.rng, cfg.system_prompt_len))
            self._systems.append(conv)
        self._started = 0
        self._sessions: dict[int, tuple[_Script, int]] = {}

    def script(self, sid: int) -> _Script:
        """Session ``sid`` in full. The draw order is the order the turns happen in: tenant,
        first message and output, then per follow-up the think time before it, its message
        and output, and finally the think time after the last turn."""
        cfg = self.cfg
        rng = np.random.default_rng([self.seed, sid])
        scalar = random.Random(self.seed * 1_000_003 + sid)
        tenant = scalar.randrange(cfg.system_prompts)
        conv = self._systems[tenant].copy()
        script = _Script(tenant, conv)
        user = _length(scalar, cfg.first_input - cfg.system_prompt_len, cfg.length_cv)
        conv.append(_tokens(rng, user))
        output = _length(scalar, cfg.first_output, cfg.length_cv)
        for turn in range(cfg.followup_turns + 1):
            if turn:
                conv.append(_tokens(rng, _length(scalar, cfg.followup_input, cfg.length_cv)))
                output = _length(scalar, cfg.followup_output, cfg.length_cv)
            prompt_len = conv.length
            conv.append(_tokens(rng, output))  # what the model will answer
            script.turns.append((prompt_len, output, len(conv.hashes)))
            think = scalar.expovariate(1.0 / cfg.think_time_s) if cfg.think_time_s > 0 else 0.0
            script.thinks.append(think)
        return script

    def _first_turn(self, arrival: float) -> Request:
        sid = self._started
        self._started += 1
        script = self.script(sid)
        self._sessions[sid] = (script, 0)
        return self._turn(sid, script, 0, arrival)

    def _turn(self, sid: int, script: _Script, turn: int, arrival: float) -> Request:
        prompt_len, output, blocks = script.turns[turn]
        tokens = script.conv.tokens
        return Request(
            self._id(),
            arrival,
            prompt_len,
            output,
            script.conv.hashes[:blocks],
            tokens=None if tokens is None else tokens[:prompt_len],
            tenant=script.tenant,
            session=sid,
            turn=turn,
        )

    def starts(self) -> npt.NDArray[np.float64]:
        """Start times of the sessions the arrival stream starts: ``concurrency`` sessions
        staggered over the first 10 seconds (closed loop), or every session at the arrival
        process's rate. Draws from the workload's generator: call once, before anything else."""
        cfg = self.cfg
        if cfg.arrival.process == "closed":
            n = min(cfg.arrival.concurrency, cfg.sessions)
            return np.sort(self.rng.uniform(0.0, 10.0, n))
        return np.cumsum(cfg.arrival.gaps(self.rng, cfg.sessions))

    def native_plan(self) -> dict[str, Any]:
        """Every session's script as a plan, built natively (the plan
        ``fast.build_plan(..., native=False)`` builds from :meth:`script`, bit for bit).
        Draws :meth:`starts`: call on a fresh workload, instead of :meth:`arrivals`."""
        cfg = self.cfg
        starts = np.ascontiguousarray(self.starts(), dtype=np.float64)
        systems = [conv.tokens for conv in self._systems]
        settings = {
            name: float(getattr(cfg, name))
            for name in (
                "first_input",
                "first_output",
                "followup_input",
                "followup_output",
                "length_cv",
                "think_time_s",
                "system_prompt_len",
            )
        }
        settings |= {"sessions": int(cfg.sessions), "followup_turns": int(cfg.followup_turns)}
        return _llmsched.plan_agentic(
            settings,
            [t for t in systems if t is not None],
            starts,
            cfg.arrival.process == "closed",
            self.seed,
            self.block_size,
            self.chain_seed,
        )

    def arrivals(self) -> Iterator[Request]:
        """First turns at :meth:`starts` (fewer if finished sessions of a closed loop already
        started all ``sessions``)."""
        for t in self.starts():
            if self._started >= self.cfg.sessions:
                return
            yield self._first_turn(float(t))

    def on_finish(self, request: Request, now: float) -> Request | None:
        """Next turn after a think time; a finished session makes room for a new one."""
        cfg = self.cfg
        state = self._sessions.get(request.session) if request.session is not None else None
        if state is None:
            return None
        script, turn = state
        think = script.thinks[turn]
        sid = int(request.session)  # type: ignore[arg-type]
        if turn + 1 < len(script.turns):
            self._sessions[sid] = (script, turn + 1)
            return self._turn(sid, script, turn + 1, now + think)
        del self._sessions[sid]
        if cfg.arrival.process == "closed" and self._started < cfg.sessions:
            return self._first_turn(now + think)
        return None


# -- shared prefix (inference-perf) -----------------------------------------------------------


@dataclass
class SharedPrefixConfig:
    """inference-perf ``shared_prefix``: ``num_groups`` system prompts (tenants), each with
    ``num_prompts_per_group`` questions; every request picks one of those prompts at random."""

    num_requests: int = 4000
    num_groups: int = 150
    num_prompts_per_group: int = 5
    system_prompt_len: int = 6_000
    question_len: int = 1_200
    output_len: int = 1_000
    arrival: ArrivalConfig = field(default_factory=lambda: ArrivalConfig(rate=20.0))


class SharedPrefixWorkload(_Base):
    """Tenants sharing long system prompts."""

    def __init__(
        self, cfg: SharedPrefixConfig, seed: int, block_size: int, chain_seed: int
    ) -> None:
        super().__init__(seed, block_size, chain_seed)
        cfg.arrival.validate(closed_allowed=False)
        for name in ("num_requests", "num_groups", "num_prompts_per_group", "output_len"):
            if getattr(cfg, name) < 1:
                raise ConfigError(f"shared_prefix: {name} must be >= 1")
        self.cfg = cfg
        self.expected_requests = cfg.num_requests
        self._prompts: list[list[Conversation]] = []
        for _ in range(cfg.num_groups):
            system = Conversation(block_size, chain_seed)
            system.append(_tokens(self.rng, cfg.system_prompt_len))
            group = []
            for _ in range(cfg.num_prompts_per_group):
                conv = system.copy()
                conv.append(_tokens(self.rng, cfg.question_len))
                group.append(conv)
            self._prompts.append(group)

    def _draws(
        self,
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        cfg = self.cfg
        times = np.cumsum(cfg.arrival.gaps(self.rng, cfg.num_requests))
        groups = self.rng.integers(0, cfg.num_groups, cfg.num_requests)
        picks = self.rng.integers(0, cfg.num_prompts_per_group, cfg.num_requests)
        return times, groups, picks

    def arrivals(self) -> Iterator[Request]:
        """Requests at the arrival process's rate; prompt chosen uniformly."""
        times, groups, picks = self._draws()
        for t, g, p in zip(times.tolist(), groups.tolist(), picks.tolist(), strict=True):
            yield self._single(t, self._prompts[g][p], self.cfg.output_len, tenant=g)

    def native_plan(self) -> dict[str, Any]:
        """:meth:`arrivals` as a plan, built natively (call on a fresh workload)."""
        times, groups, picks = self._draws()
        prompts = [conv for group in self._prompts for conv in group]
        hashes = [conv.hashes for conv in prompts]
        return _llmsched.plan_prompted(
            np.ascontiguousarray(np.concatenate(hashes), dtype=np.uint64),
            _offsets([len(h) for h in hashes]),
            np.array([conv.length for conv in prompts], dtype=np.int64),
            np.ascontiguousarray(times, dtype=np.float64),
            (groups * self.cfg.num_prompts_per_group + picks).astype(np.int64),
            groups.astype(np.int64),
            int(self.cfg.output_len),
            _state(self.rng),
            self.block_size,
        )


# -- long/short mix --------------------------------------------------------------------------


@dataclass
class LongShortConfig:
    """Mostly short interactive requests with a fraction of long ones (head-of-line blocking).
    Tenant 0 is short, tenant 1 long."""

    num_requests: int = 4000
    long_fraction: float = 0.1
    short_input: int = 512
    short_output: int = 128
    long_input: int = 16_000
    long_output: int = 2_000
    length_cv: float = 0.3
    arrival: ArrivalConfig = field(default_factory=lambda: ArrivalConfig(rate=20.0))


class LongShortWorkload(_Base):
    """Short and long requests interleaved."""

    def __init__(self, cfg: LongShortConfig, seed: int, block_size: int, chain_seed: int) -> None:
        super().__init__(seed, block_size, chain_seed)
        cfg.arrival.validate(closed_allowed=False)
        if not 0 <= cfg.long_fraction <= 1:
            raise ConfigError(f"long_fraction must be in [0, 1], got {cfg.long_fraction}")
        self.cfg = cfg
        self.expected_requests = cfg.num_requests

    def native_plan(self) -> dict[str, Any]:
        """:meth:`arrivals` as a plan, built natively (call on a fresh workload)."""
        cfg = self.cfg
        times = np.cumsum(cfg.arrival.gaps(self.rng, cfg.num_requests))
        is_long = self.rng.random(cfg.num_requests) < cfg.long_fraction
        return self._independent_plan(
            np.ascontiguousarray(times, dtype=np.float64),
            np.where(is_long, float(cfg.long_input), float(cfg.short_input)),
            np.where(is_long, float(cfg.long_output), float(cfg.short_output)),
            is_long.astype(np.int64),
            np.zeros(len(is_long), dtype=np.int64),
            cfg.length_cv,
        )

    def arrivals(self) -> Iterator[Request]:
        """Poisson (or as configured) arrivals, each long with probability ``long_fraction``."""
        cfg = self.cfg
        times = np.cumsum(cfg.arrival.gaps(self.rng, cfg.num_requests))
        is_long = self.rng.random(cfg.num_requests) < cfg.long_fraction
        for t, long in zip(times.tolist(), is_long.tolist(), strict=True):
            inp, out = (
                (cfg.long_input, cfg.long_output) if long else (cfg.short_input, cfg.short_output)
            )
            conv = Conversation(self.block_size, self.chain_seed)
            conv.append(_tokens(self.rng, _length(self.scalar_rng, inp, cfg.length_cv)))
            output = _length(self.scalar_rng, out, cfg.length_cv)
            yield self._single(t, conv, output, tenant=int(long))


# -- interactive + batch priorities ----------------------------------------------------------


@dataclass
class PriorityConfig:
    """Interactive requests (priority 1, tenant 0) mixed with batch requests (priority -1,
    tenant 1: sheddable in flow control's terms)."""

    num_requests: int = 4000
    batch_fraction: float = 0.5
    interactive_input: int = 1_000
    interactive_output: int = 200
    batch_input: int = 4_000
    batch_output: int = 1_000
    length_cv: float = 0.3
    arrival: ArrivalConfig = field(default_factory=lambda: ArrivalConfig(rate=20.0))


class PriorityWorkload(_Base):
    """Two priority classes."""

    def __init__(self, cfg: PriorityConfig, seed: int, block_size: int, chain_seed: int) -> None:
        super().__init__(seed, block_size, chain_seed)
        cfg.arrival.validate(closed_allowed=False)
        if not 0 <= cfg.batch_fraction <= 1:
            raise ConfigError(f"batch_fraction must be in [0, 1], got {cfg.batch_fraction}")
        self.cfg = cfg
        self.expected_requests = cfg.num_requests

    def native_plan(self) -> dict[str, Any]:
        """:meth:`arrivals` as a plan, built natively (call on a fresh workload)."""
        cfg = self.cfg
        times = np.cumsum(cfg.arrival.gaps(self.rng, cfg.num_requests))
        is_batch = self.rng.random(cfg.num_requests) < cfg.batch_fraction
        return self._independent_plan(
            np.ascontiguousarray(times, dtype=np.float64),
            np.where(is_batch, float(cfg.batch_input), float(cfg.interactive_input)),
            np.where(is_batch, float(cfg.batch_output), float(cfg.interactive_output)),
            is_batch.astype(np.int64),
            np.where(is_batch, -1, 1).astype(np.int64),
            cfg.length_cv,
        )

    def arrivals(self) -> Iterator[Request]:
        """Arrivals in order; each is batch with probability ``batch_fraction``."""
        cfg = self.cfg
        times = np.cumsum(cfg.arrival.gaps(self.rng, cfg.num_requests))
        is_batch = self.rng.random(cfg.num_requests) < cfg.batch_fraction
        for t, batch in zip(times.tolist(), is_batch.tolist(), strict=True):
            if batch:
                inp, out, prio = cfg.batch_input, cfg.batch_output, -1
            else:
                inp, out, prio = cfg.interactive_input, cfg.interactive_output, 1
            conv = Conversation(self.block_size, self.chain_seed)
            conv.append(_tokens(self.rng, _length(self.scalar_rng, inp, cfg.length_cv)))
            output = _length(self.scalar_rng, out, cfg.length_cv)
            yield self._single(t, conv, output, tenant=int(batch), priority=prio)


# -- trace replay ----------------------------------------------------------------------------


@dataclass
class TraceConfig:
    """Replay a JSONL trace: one object per line with ``timestamp``, ``input_length``,
    ``output_length`` and optionally ``hash_ids`` (Mooncake: one id per ``hash_block``-token
    block; equal ids mean equal content), ``tenant``, ``priority``, ``session``. A line with
    ``output_length`` 0 runs as one output token (the token its prefill step produces: every
    simulated request produces at least one, as an engine's ``max_tokens`` is at least 1).
    ``timestamp_unit`` is ``ms`` (Mooncake) or ``s``; ``time_scale`` divides the gaps
    (2 replays twice as fast); ``limit`` keeps the first lines."""

    path: str = ""
    timestamp_unit: str = "ms"
    time_scale: float = 1.0
    hash_block: int = 512
    limit: int | None = None


class TraceWorkload(_Base):
    """A recorded trace. Blocks named by ``hash_ids`` get content derived from the id (and
    their position in the chain), so requests sharing leading ids share a cached prefix."""

    def __init__(self, cfg: TraceConfig, seed: int, block_size: int, chain_seed: int) -> None:
        super().__init__(seed, block_size, chain_seed)
        _check_trace_config(cfg, block_size)
        self.cfg = cfg
        self._rows = _read_trace(cfg)
        self.expected_requests = len(self._rows)
        self._chains: dict[tuple[int, ...], Conversation] = {}

    def _chain(self, ids: tuple[int, ...]) -> Conversation:
        """The content of blocks ``ids``: each id's tokens derive from the id (memoised by
        prefix, so requests sharing leading ids share tokens and hashes)."""
        known = self._chains.get(ids)
        if known is not None:
            return known
        if ids:
            conv = self._chain(ids[:-1]).copy()
            rng = np.random.default_rng(ids[-1] & U64_TOP)
            conv.append(rng.integers(0, VOCAB, self.cfg.hash_block, dtype=np.uint32))
        else:
            conv = Conversation(self.block_size, self.chain_seed)
        self._chains[ids] = conv
        return conv

    def arrivals(self) -> Iterator[Request]:
        """The trace's requests, timestamps rebased to start at 0."""
        if not self._rows:
            return
        scale = (1e-3 if self.cfg.timestamp_unit == "ms" else 1.0) / self.cfg.time_scale
        t0 = self._rows[0]["timestamp"]
        for row in self._rows:
            prompt_len = row["input_length"]
            shared = self._chain(tuple(row.get("hash_ids", ())))
            conv = Conversation(self.block_size, self.chain_seed)
            if shared.length >= prompt_len:
                assert shared.tokens is not None
                conv.append(shared.tokens[:prompt_len])
            else:
                conv = shared.copy()
                conv.append(_tokens(self.rng, prompt_len - shared.length))
            yield self._single(
                (row["timestamp"] - t0) * scale,
                conv,
                row["output_length"],
                tenant=int(row.get("tenant") or 0),
                priority=int(row.get("priority") or 0),
                session=row.get("session"),
            )


def _check_trace_config(cfg: TraceConfig, block_size: int) -> None:
    if cfg.timestamp_unit not in ("ms", "s"):
        raise ConfigError(f"timestamp_unit must be 'ms' or 's', got {cfg.timestamp_unit!r}")
    if not cfg.time_scale > 0:
        raise ConfigError(f"time_scale must be > 0, got {cfg.time_scale}")
    if isinstance(cfg.hash_block, bool) or not isinstance(cfg.hash_block, int):
        raise ConfigError(f"hash_block must be an integer, got {cfg.hash_block!r}")
    if cfg.hash_block < 1 or cfg.hash_block % block_size:
        raise ConfigError(
            f"hash_block {cfg.hash_block} must be a positive multiple of block size {block_size}"
        )
    if cfg.limit is not None and (
        isinstance(cfg.limit, bool) or not isinstance(cfg.limit, int) or cfg.limit < 1
    ):
        raise ConfigError(f"limit must be an integer >= 1 or null, got {cfg.limit!r}")
    if not isinstance(cfg.path, str):
        raise ConfigError(f"trace path must be a string, got {cfg.path!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_trace(cfg: TraceConfig) -> list[dict[str, Any]]:
    """The trace's rows, checked, sorted by timestamp: read a line at a time, and refused at
    the line where its prompts and outputs pass :data:`MAX_PLAN_TOKENS` (before the plan that
    writes them out is built)."""
    path = Path(cfg.path)
    try:
        with path.open() as lines:
            return _trace_rows(cfg, path, lines)
    except OSError as exc:
        raise ConfigError(f"trace {path}: cannot read: {exc}") from None


def _trace_rows(cfg: TraceConfig, path: Path, lines: Iterable[str]) -> list[dict[str, Any]]:
    rows = []
    tokens = 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
            raise ConfigError(f"trace {path}:{n}: not JSON: {reason}") from None
        if not isinstance(row, dict):
            raise ConfigError(f"trace {path}:{n}: each line must be an object")
        for key in ("timestamp", "input_length", "output_length"):
            value = row.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > U64_TOP:
                raise ConfigError(
                    f"trace {path}:{n}: {key} is out of range: an integer must be below 2**63, "
                    f"got {value!r}"
                )
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not value >= 0
                or not math.isfinite(value)
            ):
                raise ConfigError(f"trace {path}:{n}: {key} must be a number >= 0, got {value!r}")
            if key != "timestamp" and isinstance(value, float) and not value.is_integer():
                raise ConfigError(
                    f"trace {path}:{n}: {key} must be a whole number of tokens, got {value!r}"
                )
        row["input_length"] = int(row["input_length"])
        row["output_length"] = int(row["output_length"])
        if row["input_length"] < 1:
            raise ConfigError(f"trace {path}:{n}: input_length must be >= 1")
        if row["input_length"] > MAX_TOKENS or row["output_length"] > MAX_TOKENS:
            raise ConfigError(
                f"trace {path}:{n}: input_length and output_length must be <= {MAX_TOKENS}"
            )
        tokens += row["input_length"] + row["output_length"]
        if tokens > MAX_PLAN_TOKENS:
            raise ConfigError(
                f"trace {path}:{n}: the lines up to here ask for {tokens} tokens of prompts "
                f"and outputs, more than the simulator writes out (MAX_PLAN_TOKENS, "
                f"{MAX_PLAN_TOKENS}); replay fewer lines (limit)"
            )
        ids = row.get("hash_ids")
        if ids is None:
            ids = row["hash_ids"] = []
        if not isinstance(ids, list) or any(not _is_int(i) or not 0 <= i < 2**64 for i in ids):
            raise ConfigError(f"trace {path}:{n}: hash_ids must be a list of ints in [0, 2**64)")
        # Without hash_ids a line's content is its own (fresh tokens): nothing to cover.
        if ids and len(ids) * cfg.hash_block < row["input_length"] - cfg.hash_block:
            raise ConfigError(
                f"trace {path}:{n}: {len(ids)} hash_ids cannot cover "
                f"{row['input_length']} input tokens in blocks of {cfg.hash_block}"
            )
        for key in ("tenant", "priority"):
            value = row.get(key)
            if value is not None and not (_is_int(value) and -(2**63) <= value < 2**63):
                raise ConfigError(f"trace {path}:{n}: {key} must be an integer, got {value!r}")
        session = row.get("session")
        if session == "":  # as Router.pick refuses model=""
            raise ConfigError(f"trace {path}:{n}: session must not be an empty string")
        if (
            session is not None
            and not isinstance(session, str)
            and not (_is_int(session) and -(2**63) <= session < 2**64)
        ):
            raise ConfigError(
                f"trace {path}:{n}: session must be a string or an integer, got {session!r}"
            )
        rows.append(row)
        if cfg.limit is not None and len(rows) >= cfg.limit:
            break
    rows.sort(key=lambda r: r["timestamp"])
    return rows


# -- construction from config data -----------------------------------------------------------

KINDS: dict[str, tuple[type[Any], type[Any]]] = {
    "agentic": (AgenticConfig, AgenticWorkload),
    "shared_prefix": (SharedPrefixConfig, SharedPrefixWorkload),
    "long_short": (LongShortConfig, LongShortWorkload),
    "priority": (PriorityConfig, PriorityWorkload),
    "trace": (TraceConfig, TraceWorkload),
}


def from_dict(cls: type[Any], data: dict[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from ``data`` over its defaults; ConfigError names unknown keys."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key == "arrival":
            # Over the workload's own default process (agentic sessions default to closed).
            if not isinstance(value, dict):
                raise ConfigError(f"{where}.arrival: expected a mapping")
            base = asdict(cls().arrival)
            values[key] = from_dict(ArrivalConfig, {**base, **value}, f"{where}.arrival")
        else:
            values[key] = value
    return cls(**values)


_EXPECTED = {
    "int": "an int",
    "float": "a finite number",
    "str": "a string",
    "bool": "true or false",
}
_CONTAINERS = {"dict": (dict, "a mapping"), "list": (list, "a list")}


def _fits(kind: str, value: object) -> bool:
    if kind == "bool" or kind == "str":
        return isinstance(value, bool if kind == "bool" else str)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind == "int":
        return isinstance(value, int)
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond a float's range
        return False


def check_fields(config: Any, where: str, *, nonnegative: bool = False) -> None:
    """ConfigError naming ``where.<field>`` for the first field of dataclass ``config`` whose
    value is not of its annotated type: an ``int`` (not a ``bool``), a finite number for a
    ``float``, a ``str``, a ``bool``, a mapping or a list (``None`` where the annotation allows
    it); with ``nonnegative``, also for a number below 0. Nested dataclass fields are left to
    their own check.

    >>> check_fields(ArrivalConfig(rate=float("nan")), "arrival")
    Traceback (most recent call last):
        ...
    llmsched.errors.ConfigError: arrival.rate must be a finite number, got nan
    >>> check_fields(ArrivalConfig(concurrency=-1), "arrival", nonnegative=True)
    Traceback (most recent call last):
        ...
    llmsched.errors.ConfigError: arrival.concurrency must be >= 0, got -1
    """
    for f in fields(config):
        kinds = [k.strip() for k in str(f.type).split("|")]
        optional = "None" in kinds
        kinds = [k for k in kinds if k != "None"]
        if len(kinds) != 1:
            continue
        kind = kinds[0]
        value = getattr(config, f.name)
        if optional and value is None:
            continue
        name = f"{where}.{f.name}" if where else f.name
        shown = describe_int(value) if isinstance(value, int) else repr(value)
        null = " or null" if optional else ""
        container = _CONTAINERS.get(kind.split("[", 1)[0])
        if container is not None:
            if not isinstance(value, container[0]):
                raise ConfigError(f"{name} must be {container[1]}{null}, got {shown}")
            continue
        if kind not in _EXPECTED:
            continue
        if not _fits(kind, value):
            raise ConfigError(f"{name} must be {_EXPECTED[kind]}{null}, got {shown}")
        if nonnegative and kind in ("int", "float") and value < 0:
            raise ConfigError(f"{name} must be >= 0, got {shown}")


def _parse(spec: dict[str, Any]) -> tuple[str, Any]:
    if not isinstance(spec, dict) or "kind" not in spec:
        raise ConfigError("workload: needs a 'kind'")
    params = dict(spec)
    kind = params.pop("kind")
    if kind not in KINDS:
        raise ConfigError(f"unknown workload kind {kind!r}; known: {sorted(KINDS)}")
    where = f"workload ({kind})"
    cfg = from_dict(KINDS[kind][0], params, where)
    # Every number of a workload is a count, a length, a time or a fraction: none below 0.
    check_fields(cfg, where, nonnegative=True)
    arrival = getattr(cfg, "arrival", None)
    if arrival is not None:
        check_fields(arrival, f"{where}.arrival", nonnegative=True)
    _check_sizes(kind, cfg)
    _check_draws(kind, cfg)
    return kind, cfg


# The mean lengths each kind draws (agentic: its first user message is first_input less the
# system prompt, checked by the workload).
_MEAN_LENGTHS = {
    "agentic": ("first_output", "followup_input", "followup_output"),
    "long_short": ("short_input", "short_output", "long_input", "long_output"),
    "priority": ("interactive_input", "interactive_output", "batch_input", "batch_output"),
}


def _gamma_fits(cv: float, mean: float) -> bool:
    """Whether a gamma of mean ``mean`` and coefficient of variation ``cv`` can be drawn: its
    shape ``1/cv**2`` and scale ``mean * cv**2`` positive finite numbers (1e200 or 1e-200
    made one of them 0 and the draw a ZeroDivisionError).

    >>> _gamma_fits(0.3, 512.0), _gamma_fits(1e200, 512.0), _gamma_fits(1e-200, 1.0)
    (True, False, False)
    """
    square = cv * cv
    if not (square > 0 and math.isfinite(square)):
        return False
    shape, scale = 1.0 / square, mean * square
    return math.isfinite(shape) and shape > 0 and math.isfinite(scale) and scale > 0


def _check_draws(kind: str, cfg: Any) -> None:
    """ConfigError naming the key for lengths and gaps a workload cannot draw: a mean length
    below one token (0 with ``length_cv: 0`` became 1 without a word), a shared-prefix prompt
    of no tokens (a bare OverflowError on the reference engine), a ``length_cv`` or gamma
    ``cv`` too large or too small for a gamma distribution (a ZeroDivisionError)."""
    where = f"workload ({kind})"
    names = _MEAN_LENGTHS.get(kind, ())
    if kind == "long_short" and cfg.long_fraction in (0, 1):
        names = names[:2] if cfg.long_fraction == 0 else names[2:]  # the other pair is unused
    if kind == "priority" and cfg.batch_fraction in (0, 1):
        names = names[:2] if cfg.batch_fraction == 0 else names[2:]
    for name in names:
        if getattr(cfg, name) < 1:
            raise ConfigError(
                f"{where}.{name}: a mean length must be >= 1 token, got {getattr(cfg, name)!r}"
            )
    if kind == "shared_prefix" and cfg.system_prompt_len + cfg.question_len < 1:
        raise ConfigError(
            f"{where}: system_prompt_len + question_len must be >= 1 (a prompt of no tokens)"
        )
    cv = getattr(cfg, "length_cv", 0)
    if cv > 0:
        longest = max([float(getattr(cfg, name)) for name in names] + [1.0])
        if kind == "agentic":
            longest = max(longest, float(cfg.first_input))
        if not (_gamma_fits(cv, 1.0) and _gamma_fits(cv, longest)):
            raise ConfigError(
                f"{where}.length_cv: {cv!r} is outside what a gamma distribution of lengths "
                "can take (1/length_cv**2 and mean * length_cv**2 must be finite and > 0)"
            )
    arrival = getattr(cfg, "arrival", None)
    if (
        arrival is not None
        and arrival.process == "gamma"
        and arrival.rate > 0
        and not _gamma_fits(arrival.cv, 1.0 / arrival.rate)
    ):
        raise ConfigError(
            f"{where}.arrival.cv: {arrival.cv!r} is outside what a gamma distribution of "
            f"gaps at rate {arrival.rate!r} can take (1/cv**2 and cv**2/rate must be finite "
            "and > 0)"
        )


def _check_sizes(kind: str, cfg: Any) -> None:
    """ConfigError for a workload too large to plan: more than :data:`MAX_REQUESTS` requests,
    :data:`MAX_SHARED_TOKENS` tokens of shared texts or :data:`MAX_PLAN_TOKENS` tokens in all
    (a plan is written out in full before the run: unchecked, a count of 1e11 was an
    allocation of terabytes, which aborts)."""
    for name in ("num_requests", "sessions", "followup_turns", "num_groups", "system_prompts"):
        value = getattr(cfg, name, 0)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"workload ({kind}).{name}: must be an int, got {value!r}")
    if isinstance(cfg, AgenticConfig):
        requests = cfg.sessions * (1 + max(cfg.followup_turns, 0))
        shared = cfg.system_prompts * max(cfg.system_prompt_len, 0)
    elif isinstance(cfg, SharedPrefixConfig):
        if cfg.output_len > MAX_TOKENS:
            raise ConfigError(
                f"workload ({kind}).output_len must be <= {MAX_TOKENS}, "
                f"got {describe_int(cfg.output_len)}"
            )
        requests = cfg.num_requests
        texts = cfg.num_groups * max(cfg.num_prompts_per_group, 0)
        shared = cfg.num_groups * max(cfg.system_prompt_len, 0) + texts * max(cfg.question_len, 0)
    else:
        requests, shared = getattr(cfg, "num_requests", 0), 0
    if requests > MAX_REQUESTS:
        raise ConfigError(
            f"workload ({kind}): {requests} requests, more than the simulator plans "
            f"({MAX_REQUESTS})"
        )
    if shared > MAX_SHARED_TOKENS:
        raise ConfigError(
            f"workload ({kind}): {shared} tokens of shared prompts, more than the simulator "
            f"writes out ({MAX_SHARED_TOKENS})"
        )
    tokens, keys = _plan_tokens(cfg)
    if tokens > MAX_PLAN_TOKENS:
        raise ConfigError(
            f"workload ({kind}): about {tokens:.3g} tokens of prompts and outputs to plan "
            f"({keys}), more than the simulator writes out ({MAX_PLAN_TOKENS}); "
            f"make them fewer or shorter"
        )


def _plan_tokens(cfg: Any) -> tuple[float, str]:
    """The prompt and output tokens a synthetic workload's plan writes out in expectation,
    and the keys that set them (0 for a trace, whose lines give their own lengths).

    >>> _plan_tokens(LongShortConfig(num_requests=10, long_fraction=0.5))[0]
    93200.0
    """

    def mix(share: float, a: int, b: int) -> float:
        return (1.0 - share) * max(a, 0) + share * max(b, 0)

    per: float
    if isinstance(cfg, AgenticConfig):
        turns = max(cfg.followup_turns, 0) * (cfg.followup_input + cfg.followup_output)
        per = cfg.first_input + cfg.first_output + turns
        return float(cfg.sessions) * per, "sessions, first_input, followup_turns, ..."
    if isinstance(cfg, SharedPrefixConfig):
        per = cfg.system_prompt_len + cfg.question_len + cfg.output_len
        return float(cfg.num_requests) * per, "num_requests, system_prompt_len, ..."
    if isinstance(cfg, LongShortConfig):
        short = cfg.short_input + cfg.short_output
        per = mix(cfg.long_fraction, short, cfg.long_input + cfg.long_output)
        return float(cfg.num_requests) * per, "num_requests, long_input, long_fraction, ..."
    if isinstance(cfg, PriorityConfig):
        interactive = cfg.interactive_input + cfg.interactive_output
        per = mix(cfg.batch_fraction, interactive, cfg.batch_input + cfg.batch_output)
        return float(cfg.num_requests) * per, "num_requests, batch_input, batch_fraction, ..."
    return 0.0, ""


def make_workload(
    spec: dict[str, Any], seed: int = 0, block_size: int = 16, chain_seed: int = 0
) -> Workload:
    """The workload ``spec`` describes: ``{"kind": ..., <that kind's parameters>}``."""
    kind, cfg = _parse(spec)
    workload: Workload = KINDS[kind][1](cfg, seed, block_size, chain_seed)
    return workload


def trace_build(
    spec: dict[str, Any], seed: int = 0, block_size: int = 16, chain_seed: int = 0
) -> dict[str, Any] | None:
    """What the native engine needs to read the trace ``spec`` describes and build its plan
    (the plan :func:`native_plan` builds) while it simulates it; None for other workloads.

    >>> trace_build({"kind": "long_short"}) is None
    True
    """
    kind, cfg = _parse(spec)
    if kind != "trace":
        return None
    _check_trace_config(cfg, block_size)
    settings = {
        "timestamp_unit": cfg.timestamp_unit,
        "time_scale": float(cfg.time_scale),
        "hash_block": cfg.hash_block,
        "limit": cfg.limit,
    }
    rng = np.random.default_rng(seed)  # the trace's generator, as TraceWorkload's
    return {
        "kind": "trace",
        "path": cfg.path,
        "settings": settings,
        "rng": _state(rng),
        "chain_seed": chain_seed,
    }


def native_plan(
    spec: dict[str, Any], seed: int = 0, block_size: int = 16, chain_seed: int = 0
) -> dict[str, Any]:
    """The plan of the workload ``spec`` describes, built natively: the same plan, bit for bit,
    as ``llmsched.sim.fast.build_plan(..., native=False)`` builds from the workload classes
    (which stay the oracle and the Python engine's source). A trace is read natively too.

    >>> plan = native_plan({"kind": "long_short", "num_requests": 3})
    >>> plan["kind"], plan["prompt"].tolist()
    ('open', [23098, 517, 502])
    """
    build = trace_build(spec, seed, block_size, chain_seed)
    if build is not None:
        return _llmsched.plan_trace(
            build["path"], build["settings"], build["rng"], block_size, chain_seed
        )
    kind, cfg = _parse(spec)
    workload = KINDS[kind][1](cfg, seed, block_size, chain_seed)
    plan: dict[str, Any] = workload.native_plan()
    return plan
