"""``llmsched calibrate --engine URL``: fit the simulator's linear step model from a running engine.

The model is the simulator's :class:`~llmsched.sim.LinearStepModel`::

    t = b0 + b1 * prefill_tokens + b2 * decode_tokens
           + b3 * sum(prefill_chunk ** 2) + b4 * sum(decode_context_lengths)
           + b5 * prefill_requests + b6 * after_idle

Measurement, against any OpenAI-compatible engine that streams (vLLM, SGLang): every prompt is a
list of token ids drawn fresh from the engine's own vocabulary (its ``/tokenize`` answer), so
its length is exact and it never hits the prefix cache; ``ignore_eos`` fixes the output length,
and ``continuous_usage_stats`` makes every streamed chunk say how many tokens it carries.

- **Prefill on an idle engine** (one sample per prompt length ``n`` of the grid): one request
  alone, ``n`` prompt tokens and one output token, after the engine was left idle for
  :data:`IDLE_S` seconds. Its time to first token, as a client sees it, is one prefill step
  (``P = n``, ``sum(chunk^2) = n^2``, one sequence, ``after_idle``) plus the engine's
  per-request overhead (HTTP, tokenizing the answer), which the step model folds into ``b0``.
- **Paced prefill** (per total ``n``, as one prompt and as ``k`` prompts of ``n // k`` tokens
  for each ``k`` of ``prefill_batches``): the prompts in one completion request (the API's
  list of prompts), one output token each, sent while a pacer request (:data:`PACER_PROMPT`
  prompt tokens, :data:`PACER_TOKENS` output tokens) decodes: the busy engine queues the
  prompts and prefills them together in its next step, where an idle one would start on the
  first alone. The sample is that mixed step (``P = k * (n // k)``, ``sum(chunk^2) = k *
  (n // k)^2``, ``k`` sequences, and the pacer's decode token at its KV length when the
  prompts were sent). Beside each other and the idle prefill of the same length these tell
  the cost per prefilled sequence (``b5``) and that of waking an idle engine (``b6``) from
  the cost per token and per step. Where vLLM exports ``vllm:iteration_tokens_total`` the
  engine's steps of more than one token are counted: a measurement the engine split over
  several steps (or whose pacer ended within it) is taken again, up to ``repeats`` more
  times, and a point that never lands in one step is left out (``meta.split_points``).
- **Decode** (one sample per batch size ``b`` and context ``n``): ``b`` requests at once, each
  with ``n`` prompt tokens and ``m = decode_tokens`` output tokens. A request's time from its
  first token to its last over ``m - 1`` is its mean decode step (``D = b``,
  ``sum(context) = b * (n + m/2)`` at the middle token); the sample is the median over the
  ``b`` requests. (Single gaps between streamed chunks would not do: a front end that falls
  behind the engine sends several tokens in one chunk.)

Each point is measured ``repeats`` times and the median kept (the machine's noise is part of
what the simulator should predict; the median is its typical step). Points whose KV would not
fit in the engine's cache (preemption would distort them) are skipped. The samples are fitted by
:meth:`~llmsched.executor.step_time.StepTimeProfile.fit` (least squares on relative error, no
coefficient below zero), and the profile it writes is the file ``llmsched sim --step-model``
reads, with the engine's KV capacity (``kv_tokens``, from vLLM's ``vllm:cache_config_info``).

The engine's own ``/metrics`` are read before and after: the prefix-cache counters (the grid
must not hit the cache) and, where vLLM exports them, its time-to-first-token and inter-token
histograms, recorded beside the client's view in the profile's ``meta.engine_metrics``.

>>> grid = EngineGrid(prompt_lens=(16, 64), batch_sizes=(1, 2), context_lens=(16,),
...                   prefill_batches=(4,))
>>> points = grid.points(kv_tokens=4096, max_model_len=2048)
>>> [(p.batch, p.prompt_len, p.paced) for p in points if p.kind == "prefill"]
[(1, 16, False), (1, 64, False), (1, 16, True), (1, 64, True), (4, 4, True), (4, 16, True)]
>>> [p.kind for p in points][6:]
['decode', 'decode']
"""

from __future__ import annotations

import http.client
import json
import operator
import random
import statistics
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import numpy as np

from llmsched.errors import ConfigError
from llmsched.executor.step_time import StepSample, StepTimeProfile

T = TypeVar("T")

__all__ = [
    "EngineGrid",
    "GridPoint",
    "Measurement",
    "StreamTiming",
    "calibrate_engine",
    "engine_info",
    "read_metrics",
    "timed_batch",
    "timed_completion",
]


# A paced prefill runs beside one decoding request (the pacer) so the engine is busy when the
# prompts arrive and takes them all in its next step: an idle engine starts on the first prompt
# alone, and pays for waking up. The step is then a mixed one: the prompts plus the pacer's
# decode token.
PACER_PROMPT = 16
PACER_TOKENS = 128
# Seconds the engine is left idle before a prompt is timed alone.
IDLE_S = 0.2


@dataclass(frozen=True)
class GridPoint:
    """One measurement: ``kind`` ``prefill`` (``batch`` prompts of ``prompt_len`` tokens
    prefilled in one step; ``paced``: beside a decoding request, else on an idle engine) or
    ``decode``."""

    kind: str
    batch: int
    prompt_len: int
    output_len: int
    paced: bool = False


def _grid_int(name: str, value: object) -> int:
    """``value`` as an int (numpy's too), not a bool; ConfigError naming ``name`` otherwise."""
    if not isinstance(value, (bool, np.bool_)):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise ConfigError(f"calibration grid: {name} must hold ints, got {value!r}")


@dataclass(frozen=True)
class EngineGrid:
    """The prompt lengths (prefill), batch sizes and contexts (decode) to time.

    ``prefill_batches``: each prompt length ``n`` is also timed beside a decoding request, as
    one prompt and as ``k`` prompts of ``n // k`` tokens prefilled together for each ``k`` here
    (``()``: none of these; then neither the cost per prefilled sequence nor that of a step
    on an idle engine can be told from the cost per step with prefill). ``batch_sizes`` and
    ``prefill_batches`` should not pass the engine's ``--max-num-seqs``, nor a prompt length its
    ``--max-num-batched-tokens`` (a request beyond them waits, and the step is not one batch).
    """

    prompt_lens: tuple[int, ...] = (32, 128, 512, 1024)
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    context_lens: tuple[int, ...] = (32, 256, 512)
    decode_tokens: int = 32
    repeats: int = 3
    prefill_batches: tuple[int, ...] = (2, 4)

    def __post_init__(self) -> None:
        # 16.5 tokens, True or "16" failed only once timing had started (range(16.5), an
        # engine refusing max_tokens 4.5), a bare TypeError at best.
        for name in ("prompt_lens", "batch_sizes", "context_lens", "prefill_batches"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
                raise ConfigError(
                    f"calibration grid: {name} must be a tuple of ints, got {value!r}"
                )
            object.__setattr__(self, name, tuple(_grid_int(name, v) for v in value))
        for name in ("repeats", "decode_tokens"):
            object.__setattr__(self, name, _grid_int(name, getattr(self, name)))
        if not self.prompt_lens or not self.batch_sizes or not self.context_lens:
            raise ConfigError("calibration grid: prompt lengths, batch sizes and contexts needed")
        values = (*self.prompt_lens, *self.batch_sizes, *self.context_lens, self.repeats)
        if min(values) < 1:
            raise ConfigError("calibration grid: every length, batch size and repeat must be >= 1")
        if any(k < 2 for k in self.prefill_batches):
            raise ConfigError(
                f"calibration grid: prefill batches must be >= 2, got {list(self.prefill_batches)}"
            )
        if self.decode_tokens < 4:
            raise ConfigError(
                f"calibration grid: decode_tokens must be >= 4, got {self.decode_tokens}"
            )

    def points(self, kv_tokens: int | None, max_model_len: int | None) -> list[GridPoint]:
        """The grid's measurements whose KV fits the cache and whose prompt the engine takes."""
        out = []
        limit = kv_tokens if kv_tokens is not None else float("inf")
        longest = max_model_len if max_model_len is not None else float("inf")
        for n in self.prompt_lens:
            if n + 1 <= longest and n + 1 <= limit:
                out.append(GridPoint("prefill", 1, n, 1))
        for k in (1, *self.prefill_batches) if self.prefill_batches else ():
            for n in self.prompt_lens:
                part = n // k
                room = k * (part + 1) + PACER_PROMPT + PACER_TOKENS
                if part >= 1 and part + 1 <= longest and room <= limit:
                    out.append(GridPoint("prefill", k, part, 1, paced=True))
        m = self.decode_tokens
        for b in self.batch_sizes:
            for n in self.context_lens:
                if n + m <= longest and b * (n + m) <= limit:
                    out.append(GridPoint("decode", b, n, m))
        return out


@dataclass(frozen=True)
class StreamTiming:
    """What a client saw of one streamed completion (seconds since it was sent).

    ``token_times[i]`` is when output token ``i`` arrived (tokens that came in one chunk share
    its time).
    """

    sent: float
    token_times: tuple[float, ...]
    prompt_tokens: int

    @property
    def ttft(self) -> float:
        """Time to the first token."""
        return self.token_times[0] - self.sent

    @property
    def finish(self) -> float:
        """When the last token arrived."""
        return self.token_times[-1]

    def tpot(self) -> float:
        """Mean seconds per output token after the first (0 for one token)."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0


def _split(url: str) -> tuple[str, int, str]:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise ConfigError(f"--engine {url!r}: expected http://host:port")
    return parsed.hostname, parsed.port or 80, parsed.path.rstrip("/")


def _request(
    url: str, method: str, path: str, body: object | None = None, timeout_s: float = 60.0
) -> tuple[int, bytes]:
    """``method path`` on the engine: its status and body, all within ``timeout_s`` (an engine
    that trickles its answer out is cut off at the deadline, not only one that goes quiet)."""
    host, port, base = _split(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    deadline = time.perf_counter() + timeout_s
    try:
        payload = None if body is None else json.dumps(body)
        headers = {"content-type": "application/json"} if body is not None else {}
        conn.request(method, base + path, payload, headers)
        reply = conn.getresponse()
        parts = []
        while part := reply.read1(65536):
            parts.append(part)
            if time.perf_counter() > deadline:
                raise ConfigError(
                    f"engine {url}: {method} {path} still answering after {timeout_s:g} s"
                )
        return reply.status, b"".join(parts)
    except OSError as exc:
        raise ConfigError(f"engine {url} did not answer {method} {path}: {exc}") from None
    finally:
        conn.close()


def _object(url: str, what: str, raw: bytes) -> dict[str, object]:
    """``raw`` as a JSON object, or a ConfigError naming the engine and ``what`` answered it."""
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(f"engine {url}: {what} answered {raw[:200]!r}, not a JSON object")
    return value


def _count(url: str, what: str, value: object, default: int = 0) -> int:
    """``value`` as a count >= 0 (``default`` when absent), or a ConfigError naming it."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"engine {url}: {what} must be a count, got {value!r}")
    return value


def timed_completion(
    url: str,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    timeout_s: float = 300.0,
    extra: Mapping[str, object] | None = None,
    progress: list[int] | None = None,
    started: threading.Event | None = None,
) -> StreamTiming:
    """Send one streamed ``/v1/completions`` request of token ids and time its tokens.

    ``ignore_eos`` makes it produce exactly ``max_tokens`` tokens; ConfigError when the engine
    refuses it or the stream ends short. ``progress`` (a one-element list) follows the tokens
    received so far and ``started`` is set at the first (both for a caller on another thread).
    """
    host, port, base = _split(url)
    body: dict[str, object] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    body.update(extra or {})
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    times: list[float] = []
    seen, prompt_tokens = 0, len(prompt)
    try:
        sent = time.perf_counter()
        conn.request(
            "POST", base + "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        reply = conn.getresponse()
        if reply.status != 200:
            raise ConfigError(
                f"engine {url} refused a completion ({reply.status}): {reply.read()[:300]!r}"
            )
        for raw in reply:
            now = time.perf_counter()
            # A stream that never ends (keep-alive comments, a count that never grows) stops
            # here; the socket's timeout only ends one that goes quiet.
            if now - sent > timeout_s:
                raise ConfigError(
                    f"engine {url}: a completion of {max_tokens} tokens still streaming after "
                    f"{timeout_s:g} s ({seen} tokens counted)"
                )
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            usage = _object(url, "a streamed completion chunk", line[5:]).get("usage") or {}
            if not isinstance(usage, dict):
                raise ConfigError(f"engine {url}: a streamed chunk's usage is {usage!r}")
            done = _count(url, "usage.completion_tokens", usage.get("completion_tokens"))
            prompt_tokens = _count(
                url, "usage.prompt_tokens", usage.get("prompt_tokens"), prompt_tokens
            )
            times.extend([now] * (done - seen))
            seen = max(seen, done)
            if progress is not None:
                progress[0] = seen
            if started is not None and seen > 0:
                started.set()
    except OSError as exc:
        raise ConfigError(f"engine {url}: completion failed: {exc}") from None
    finally:
        conn.close()
    if len(times) < max_tokens:
        raise ConfigError(
            f"engine {url}: stream ended after {len(times)} of {max_tokens} tokens "
            "(does it report continuous_usage_stats?)"
        )
    return StreamTiming(sent, tuple(times[:max_tokens]), prompt_tokens)


def timed_batch(
    url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    timeout_s: float = 300.0,
) -> float:
    """Send one unstreamed ``/v1/completions`` request holding every prompt of ``prompts``
    (token ids) and return its seconds; ConfigError when the engine refuses it or answers fewer
    choices."""
    body = {
        "model": model,
        "prompt": [list(p) for p in prompts],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    sent = time.perf_counter()
    status, reply = _request(url, "POST", "/v1/completions", body, timeout_s)
    seconds = time.perf_counter() - sent
    if status != 200:
        raise ConfigError(f"engine {url} refused a batched completion ({status}): {reply[:300]!r}")
    choices = _object(url, "a batched completion", reply).get("choices") or []
    if not isinstance(choices, list):
        raise ConfigError(f"engine {url}: a batched completion's choices are {choices!r:.200}")
    if len(choices) != len(prompts):
        raise ConfigError(
            f"engine {url}: {len(choices)} choices for a request of {len(prompts)} prompts"
        )
    return seconds


def read_metrics(url: str) -> dict[str, float]:
    """The engine's Prometheus samples, ``name{labels}`` -> value (labels as written)."""
    status, text = _request(url, "GET", "/metrics", timeout_s=30.0)
    if status != 200:
        raise ConfigError(f"engine {url}: /metrics answered {status}")
    out: dict[str, float] = {}
    for line in text.decode(errors="replace").splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def _metric_sum(metrics: Mapping[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def _label(key: str, label: str) -> str | None:
    marker = f'{label}="'
    start = key.find(marker)
    if start < 0:
        return None
    start += len(marker)
    return key[start : key.find('"', start)]


@dataclass(frozen=True)
class EngineInfo:
    """What the engine says about itself: served model, longest prompt, KV cache."""

    model: str
    max_model_len: int | None
    block_size: int | None
    kv_tokens: int | None
    vocabulary: tuple[int, ...]


def engine_info(url: str, model: str | None = None) -> EngineInfo:
    """The served model (``/v1/models``), its KV cache (``vllm:cache_config_info``) and token
    ids to draw prompts from (``/tokenize`` of a few hundred words)."""
    status, body = _request(url, "GET", "/v1/models")
    if status != 200:
        raise ConfigError(f"engine {url}: /v1/models answered {status}")
    listed = _object(url, "/v1/models", body).get("data") or []
    if not isinstance(listed, list) or not all(isinstance(m, dict) for m in listed):
        raise ConfigError(f"engine {url}: /v1/models data is {listed!r}, not a list of models")
    names = [str(m.get("id")) for m in listed]
    if model is None:
        if not names:
            raise ConfigError(f"engine {url} serves no model")
        model = names[0]
    elif model not in names:
        raise ConfigError(f"engine {url} does not serve {model!r}; it serves {names}")
    entry = next(m for m in listed if str(m.get("id")) == model)
    max_len = entry.get("max_model_len")
    if max_len is not None and (
        isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1
    ):
        raise ConfigError(f"engine {url}: {model!r} has max_model_len {max_len!r}")
    block_size = kv_tokens = None
    for key in read_metrics(url):
        if key.startswith("vllm:cache_config_info{"):
            # vLLM sets num_gpu_blocks to the override when one is given, and exports the
            # override label as "None" when not (read first, it left every such engine's
            # capacity unknown).
            blocks = _label(key, "num_gpu_blocks")
            if not (blocks and blocks.isdigit()):
                blocks = _label(key, "num_gpu_blocks_override")
            size = _label(key, "block_size")
            if size and size.isdigit():
                block_size = int(size)
                if blocks and blocks.isdigit():
                    kv_tokens = int(blocks) * block_size
    rng = random.Random(0)
    words = ("cache", "token", "route", "engine", "batch", "memory", "block", "queue", "time")
    text = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(400))
    status, body = _request(url, "POST", "/tokenize", {"model": model, "prompt": text})
    if status != 200:
        raise ConfigError(f"engine {url}: /tokenize answered {status}; calibrate needs it")
    tokens = _object(url, "/tokenize", body).get("tokens") or []
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise ConfigError(f"engine {url}: /tokenize tokens are not token ids: {tokens!r:.200}")
    vocabulary = tuple(sorted(set(tokens)))
    if len(vocabulary) < 16:
        raise ConfigError(f"engine {url}: /tokenize gave {len(vocabulary)} distinct tokens")
    return EngineInfo(model, max_len, block_size, kv_tokens, vocabulary)


def _concurrently(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``jobs`` at once on threads (released together); re-raise the first failure."""
    results: list[T | None] = [None] * len(jobs)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def work(i: int) -> None:
        barrier.wait()
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # re-raised on the calling thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


@dataclass(frozen=True)
class Measurement:
    """One grid point measured once: the step time as the engine's own metrics give it
    (``None`` where the engine does not export them), as the client saw it, and the engine
    steps with prefill it took (``None`` where the engine does not count them) and, for a
    paced prefill, the KV length of the decoding request beside it (``pacer_ctx``)."""

    point: GridPoint
    engine_s: float | None
    client_s: float
    engine_steps: float | None = None
    pacer_ctx: int = 0

    @property
    def split(self) -> bool:
        """A prefill the engine spread over more than one step (not the shape it stands for)."""
        return (
            self.point.kind == "prefill" and self.engine_steps is not None and self.engine_steps > 1
        )

    def sample(self, seconds: float) -> StepSample:
        """The point's step shape with ``seconds``."""
        n, b, m = self.point.prompt_len, self.point.batch, self.point.output_len
        if self.point.kind == "prefill":
            d = 1 if self.point.paced else 0
            return StepSample(
                b * n,
                d,
                b * n * n,
                self.pacer_ctx,
                seconds,
                prefill_requests=b,
                after_idle=not self.point.paced,
            )
        return StepSample(0, b, 0, b * (n + m // 2), seconds)


def _delta(after: Mapping[str, float], before: Mapping[str, float], name: str) -> float:
    return _metric_sum(after, name) - _metric_sum(before, name)


def _steps_with_prefill(after: Mapping[str, float], before: Mapping[str, float]) -> float | None:
    """Engine steps of more than one token between the two scrapes (vLLM's
    ``vllm:iteration_tokens_total`` histogram: its count less its ``le="1.0"`` bucket); None
    where the engine does not export it."""
    name = "vllm:iteration_tokens_total"
    if not any(k.startswith(name + "_count") for k in after):
        return None

    def single(metrics: Mapping[str, float]) -> float:
        return sum(
            v
            for k, v in metrics.items()
            if k.startswith(name + "_bucket{") and _label(k, "le") in ("1", "1.0")
        )

    return _delta(after, before, name + "_count") - (single(after) - single(before))


def measure(
    url: str,
    info: EngineInfo,
    point: GridPoint,
    rng: random.Random,
) -> Measurement:
    """Time one grid point once (see the module docs)."""

    def prompt(n: int = point.prompt_len) -> list[int]:
        return [rng.choice(info.vocabulary) for _ in range(n)]

    prompts = [prompt() for _ in range(point.batch)]
    batched = point.paced
    pacer_ctx, paced = 0, True
    if batched:
        progress, started, failed = [0], threading.Event(), []
        pacer_prompt = prompt(PACER_PROMPT)

        def pace() -> None:
            try:
                timed_completion(
                    url, info.model, pacer_prompt, PACER_TOKENS, progress=progress, started=started
                )
            except BaseException as exc:  # re-raised on the calling thread below
                failed.append(exc)
                started.set()

        pacer = threading.Thread(target=pace, daemon=True)
        pacer.start()
        started.wait(300.0)
        if failed:
            raise failed[0]
        before = read_metrics(url)
        pacer_ctx = PACER_PROMPT + progress[0]
        batch_s = timed_batch(url, info.model, prompts, point.output_len)
        # The pacer must still have been decoding when the prompts' step ended (else they may
        # have found the engine idle): not done as the client saw it on the reply, read before
        # the scrape below (whose time the pacer may finish in: the step was paced all the
        # same, and taking it again on a slow scrape cost a point or, twice, lost it).
        paced = progress[0] < PACER_TOKENS
        after = read_metrics(url)
        pacer.join(300.0)
        if failed:
            raise failed[0]
    else:
        if point.kind == "prefill":
            time.sleep(IDLE_S)  # an idle engine, as a request after a quiet spell finds it
        before = read_metrics(url)
        jobs = [
            (lambda p=p: timed_completion(url, info.model, p, point.output_len)) for p in prompts
        ]
        timings = _concurrently(jobs)
        after = read_metrics(url)
    requests = _delta(after, before, "vllm:request_prefill_time_seconds_count")
    steps = _steps_with_prefill(after, before) if point.kind == "prefill" else None
    if batched and (not paced or (steps is not None and requests != point.batch)):
        steps = float("inf")  # the pacer ended before or within the measurement: not the step
    engine: float | None = None
    if point.kind == "prefill":
        # Alone: the time to the first token; batched: the whole reply (one token each).
        client = batch_s if batched else timings[0].ttft
        if requests > 0:
            engine = _delta(after, before, "vllm:request_prefill_time_seconds_sum") / requests
    else:
        # A request's mean step from its first token to its last: an engine that streams
        # several tokens in one chunk when its front end falls behind blurs single gaps.
        client = statistics.median(t.tpot() for t in timings)
        gaps = _delta(after, before, "vllm:request_generation_tokens_sum") - _delta(
            after, before, "vllm:request_generation_tokens_count"
        )
        if gaps > 0:
            engine = _delta(after, before, "vllm:request_decode_time_seconds_sum") / gaps
    if engine is not None and engine <= 0:
        engine = None
    return Measurement(point, engine, client, steps, pacer_ctx)


@dataclass
class _Progress:
    done: int = 0
    of: int = 0
    report: Callable[[str], None] | None = None
    lines: list[str] = field(default_factory=list)

    def step(self, text: str) -> None:
        self.done += 1
        if self.report is not None:
            self.report(f"[{self.done}/{self.of}] {text}")


_ENGINE_HISTOGRAMS = (
    ("ttft", "vllm:time_to_first_token_seconds"),
    ("inter_token", "vllm:inter_token_latency_seconds"),
    ("prefill", "vllm:request_prefill_time_seconds"),
    ("queue", "vllm:request_queue_time_seconds"),
)


def calibrate_engine(
    url: str | Sequence[str],
    grid: EngineGrid | None = None,
    model: str | None = None,
    seed: int = 0,
    report: Callable[[str], None] | None = None,
) -> StepTimeProfile:
    """Time ``grid`` against the engine at ``url`` and fit the linear step model.

    Several URLs (identical engines, e.g. a fleet on one machine) are measured at the same
    time, each point on every engine at once, and their samples pooled: the fit then sees the
    engines slow each other down as they do when they all serve.

    The profile's ``meta`` holds the engines, the model, the KV capacity, the grid and the
    engines' own view of the same requests (``engine_metrics``). ConfigError when an engine
    is unreachable, refuses a request, serves another model, or no grid point fits its cache.
    """
    grid = grid or EngineGrid()
    urls = [url] if isinstance(url, str) else list(url)
    if not urls:
        raise ConfigError("calibrate: no engine given")
    named: dict[tuple[str, int, str], str] = {}
    for u in urls:
        # One engine given twice was timed against itself: its steps under twice the load.
        where = _split(u)
        if where in named:
            raise ConfigError(f"calibrate: {u} and {named[where]} are the same engine")
        named[where] = u
    infos = [engine_info(u, model) for u in urls]
    info = infos[0]
    for u, other in zip(urls[1:], infos[1:], strict=True):
        if other.model != info.model:
            raise ConfigError(f"engine {u} serves {other.model!r}, {urls[0]} {info.model!r}")
    known = [i.kv_tokens for i in infos if i.kv_tokens is not None]
    kv_tokens = min(known) if known else None
    points = grid.points(kv_tokens, info.max_model_len)
    if len({p.kind for p in points}) < 2:
        raise ConfigError(
            f"engine {urls[0]}: too few grid points fit its cache ({kv_tokens} KV tokens, "
            f"max_model_len {info.max_model_len}); give shorter lengths or smaller batches"
        )
    rngs = [random.Random(seed * 1000 + i) for i in range(len(urls))]
    # One warm-up request each: the first one after startup pays for lazy initialisation.
    for u, i, r in zip(urls, infos, rngs, strict=True):
        timed_completion(u, i.model, [r.choice(i.vocabulary) for _ in range(8)], 4)
    before = [read_metrics(u) for u in urls]
    progress = _Progress(of=len(points) * grid.repeats, report=report)
    measured: list[list[Measurement]] = []
    split_points: list[dict[str, int]] = []
    retries = 0
    for point in points:
        runs: list[Measurement] = []
        kept, tries = 0, 0
        # A batched prefill that the engine split over steps is taken again (bounded).
        while kept < grid.repeats and tries < 2 * grid.repeats:
            tries += 1
            jobs = [
                (lambda u=u, i=i, r=r, p=point: measure(u, i, p, r))
                for u, i, r in zip(urls, infos, rngs, strict=True)
            ]
            now = _concurrently(jobs)
            whole = [m for m in now if not m.split]
            runs.extend(whole)
            retries += len(now) - len(whole)
            if len(whole) < len(now) and tries < 2 * grid.repeats:
                progress.of += 1
            kept += 1 if whole else 0
            seen = [m.engine_s if m.engine_s is not None else m.client_s for m in now]
            progress.step(
                f"{point.kind} batch {point.batch} x {point.prompt_len} tokens: "
                + ", ".join(f"{x * 1e3:.2f} ms" for x in seen)
                + f" (client {now[0].client_s * 1e3:.2f} ms)"
                + ("" if len(whole) == len(now) else " (split over steps: taken again)")
            )
        if runs:
            measured.append(runs)
        else:
            split_points.append({"batch": point.batch, "prompt_len": point.prompt_len})
    # The engine's own clock where it has one for every point: a front end that falls behind
    # (a loaded machine) delays what the client sees, not the engine's steps.
    use_engine = all(r.engine_s is not None for runs in measured for r in runs)
    samples: list[StepSample] = []
    client_samples: list[StepSample] = []
    for runs in measured:
        client_samples.append(runs[0].sample(statistics.median(r.client_s for r in runs)))
        if use_engine:
            samples.append(runs[0].sample(statistics.median(r.engine_s or 0.0 for r in runs)))
    if not use_engine:
        samples = client_samples
    overhead = [
        r.client_s - r.engine_s
        for runs in measured
        for r in runs
        if r.point.kind == "prefill" and r.engine_s is not None
    ]
    after = [read_metrics(u) for u in urls]
    engine: dict[str, float] = {}
    for short, name in _ENGINE_HISTOGRAMS:
        count = sum(_delta(a, b, name + "_count") for a, b in zip(after, before, strict=True))
        total = sum(_delta(a, b, name + "_sum") for a, b in zip(after, before, strict=True))
        if count > 0:
            engine[f"{short}_mean_s"] = total / count
            engine[f"{short}_count"] = count
    hits = sum(
        _delta(a, b, "vllm:prefix_cache_hits_total") for a, b in zip(after, before, strict=True)
    )
    queries = sum(
        _delta(a, b, "vllm:prefix_cache_queries_total") for a, b in zip(after, before, strict=True)
    )
    engine["prefix_cache_hit_tokens"] = hits
    engine["prefix_cache_query_tokens"] = queries
    if overhead:
        # What a client waits beyond the engine's prefill: HTTP, tokenizing, the front end.
        engine["first_token_overhead_median_s"] = statistics.median(overhead)
    meta: dict[str, object] = {
        "source": "engine",
        "engine": urls[0] if len(urls) == 1 else urls,
        "model": info.model,
        "max_model_len": info.max_model_len,
        "block_size": info.block_size,
        "grid": asdict(grid),
        "seed": seed,
        "timing": "engine metrics" if use_engine else "client",
        "engine_metrics": engine,
        "split_retries": retries,
        "split_points": split_points,
    }
    try:
        if use_engine:
            client_fit = StepTimeProfile.fit(client_samples)
            meta["client_coefficients"] = client_fit.coefficients
            meta["client_fit_error"] = asdict(client_fit.error)
        profile = StepTimeProfile.fit(samples, meta)
    except ConfigError as exc:
        if not split_points:
            raise
        # Say why the grid came out short: the points the engine never took in one step.
        raise ConfigError(
            f"{exc}; {len(split_points)} batched prefill points were left out (the engine "
            "never prefilled them in one step, or the decoding request beside them ended "
            "first): give more prompt lengths or smaller --prefill-batches"
        ) from None
    profile.kv_tokens = kv_tokens
    return profile
