"""MetricsScraper against fake engines: real aiohttp servers on loopback."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from _data import vector_path
from aiohttp import web

from llmsched import EndpointPool, FlowController
from llmsched.errors import ConfigError
from llmsched.integrations import EngineSpec, MetricsScraper
from llmsched.integrations.metrics import parse_engine_metrics
from llmsched.testing import FakeHTTPEngine

UNDER_LOAD = vector_path("vllm_metrics_under_load.txt").read_text()

OLD_VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 5.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:gpu_prefix_cache_queries_total{engine="1",model_name="m"} 50.0
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 30.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 2e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters="x"} 1.6e9
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 6.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 9.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
"""


@pytest.fixture
def engine() -> Iterator[FakeHTTPEngine]:
    with FakeHTTPEngine(metrics_text=UNDER_LOAD) as fake:
        yield fake


def scrape(scraper: MetricsScraper) -> dict[str, object]:
    return dict(asyncio.run(scraper.scrape_once()))


def endpoint(pool: EndpointPool, worker: str) -> dict[str, object]:
    return next(e for e in pool.endpoints() if e["id"] == worker)


def test_real_vllm_capture_feeds_pool_and_flow(engine: FakeHTTPEngine) -> None:
    spec = engine.spec(model="tiny", role="decode", labels={"zone": "a"})
    pool, flow = EndpointPool(), FlowController()
    scraper = MetricsScraper([spec], pool=pool, flow=flow)
    result = asyncio.run(scraper.scrape_once())[spec.worker_id]
    assert result.ok and result.error is None
    values = result.values
    assert (values["running"], values["waiting"]) == (3, 7)
    assert values["kv_cache_usage"] == pytest.approx(0.782608695652174)
    assert values["prefix_cache_queries"] == 589 and values["prefix_cache_hits"] == 0
    assert values["preemptions"] == 0
    assert (values["block_size"], values["num_gpu_blocks"]) == (32, 24)
    e = endpoint(pool, spec.worker_id)
    assert (e["running"], e["waiting"]) == (3, 7)
    assert e["kv_cache_usage"] == pytest.approx(0.7826, abs=1e-3)
    # The pool lacked the engine: it was added from the spec.
    assert (e["address"], e["role"], e["labels"], e["model"]) == (
        f"127.0.0.1:{engine.port}",
        "decode",
        {"zone": "a"},
        "tiny",
    )
    assert flow.saturation() > 0  # the controller now knows a loaded endpoint
    snap = scraper.snapshot()[spec.worker_id]
    assert snap["ok"] and snap["scrapes"] == 1 and snap["failures"] == 0
    assert snap["values"]["waiting"] == 7 and snap["last_ok"] is not None


def test_agrees_with_the_pools_own_parser(engine: FakeHTTPEngine) -> None:
    native = EndpointPool(["x"]).update_from_metrics_text("x", UNDER_LOAD)
    ours = parse_engine_metrics(UNDER_LOAD)
    assert (ours["waiting"], ours["running"]) == (native["waiting"], native["running"])
    assert ours["kv_cache_usage"] == pytest.approx(native["kv_cache_usage"])


def test_older_vllm_names_summed_over_engines_and_loras() -> None:
    with FakeHTTPEngine(metrics_text=OLD_VLLM) as fake:
        spec = fake.spec()
        pool = EndpointPool([spec.worker_id])  # already in the pool: kept as it is
        scraper = MetricsScraper([spec], pool=pool)
        values = asyncio.run(scraper.scrape_once())[spec.worker_id].values
    assert (values["running"], values["waiting"]) == (6, 6)
    assert values["kv_cache_usage"] == pytest.approx(0.5)  # mean over the two engines
    assert (values["prefix_cache_queries"], values["prefix_cache_hits"]) == (150, 30)
    assert values["active_loras"] == ["sql", "chat"]  # the latest sample wins
    e = endpoint(pool, spec.worker_id)
    assert (e["active_loras"], e["waiting_loras"], e["max_loras"]) == (["sql", "chat"], [], 4)
    assert e["address"] == ""


def test_sglang_names() -> None:
    with FakeHTTPEngine(metrics_text=SGLANG) as fake:
        pool = EndpointPool()
        values = scrape(MetricsScraper([fake.spec()], pool=pool))[fake.spec().worker_id].values  # type: ignore[attr-defined]
    assert values == {"waiting": 9, "running": 6, "kv_cache_usage": 0.5}
    assert endpoint(pool, fake.spec().worker_id)["waiting"] == 9


@pytest.mark.parametrize(
    ("status", "text", "error"),
    [
        (500, UNDER_LOAD, "HTTP 500"),
        (200, "<html>not metrics</html>", "no vLLM or SGLang load metrics"),
        (200, 'vllm:num_requests_waiting{engine="0" 3\n', "line 1: cannot parse"),
        (200, "", "no vLLM or SGLang load metrics"),
    ],
    ids=["http-500", "html", "broken-line", "empty"],
)
def test_failures_are_counted_and_leave_the_endpoint_to_go_stale(
    status: int, text: str, error: str
) -> None:
    with FakeHTTPEngine(metrics_text=UNDER_LOAD) as fake:
        spec = fake.spec()
        pool = EndpointPool(stale_after_s=0.05)
        scraper = MetricsScraper([spec], pool=pool)
        assert scrape(scraper)[spec.worker_id].ok  # type: ignore[attr-defined]
        stamp = endpoint(pool, spec.worker_id)["timestamp"]
        fake.status, fake.metrics_text = status, text
        result = asyncio.run(scraper.scrape_once())[spec.worker_id]
    assert not result.ok and result.error is not None and error in result.error
    assert endpoint(pool, spec.worker_id)["timestamp"] == stamp  # not refreshed: it goes stale
    snap = scraper.snapshot()[spec.worker_id]
    assert (snap["ok"], snap["scrapes"], snap["failures"], snap["consecutive_failures"]) == (
        False,
        2,
        1,
        1,
    )
    assert snap["values"]["waiting"] == 7  # the last good values stay visible
    assert error in snap["last_error"]
    assert snap["failing"] and not result.timed_out


def test_timeout_is_a_failure() -> None:
    with FakeHTTPEngine(metrics_text=UNDER_LOAD, delay_s=5.0) as slow:
        scraper = MetricsScraper([slow.spec()], pool=EndpointPool(), timeout_s=0.2)
        result = asyncio.run(scraper.scrape_once())[slow.spec().worker_id]
        slow.delay_s = 0.0
    assert not result.ok and "timeout" in (result.error or "") and result.timed_out
    snap = scraper.snapshot()[slow.spec().worker_id]
    # Counted, but a stalled engine is not known to fail: it keeps its place in routing.
    assert (snap["failures"], snap["timeouts"], snap["failing"]) == (1, 1, False)


def test_unreachable_engine_is_a_failure() -> None:
    with FakeHTTPEngine() as fake:
        spec = fake.spec()
    result = asyncio.run(MetricsScraper([spec]).scrape_once())[spec.worker_id]
    assert not result.ok and "Connect" in (result.error or "")


def test_slow_engines_are_scraped_concurrently() -> None:
    """Each fake answers only once all of them are inside a request at the same time (a barrier
    on their separate threads), so a scraper that serialised requests would fail them all."""
    n = 4
    barrier = threading.Barrier(n)

    async def together(request: web.Request) -> web.Response:
        try:
            await asyncio.to_thread(barrier.wait, 5.0)
        except threading.BrokenBarrierError:
            return web.Response(status=503)
        return web.Response(text=UNDER_LOAD, content_type="text/plain")

    def setup(app: web.Application) -> None:
        app.router.add_get("/together", together)

    fakes = [FakeHTTPEngine(setup=setup) for _ in range(n)]
    try:
        specs = [EngineSpec("127.0.0.1", f.port, metrics_path="/together") for f in fakes]
        results = asyncio.run(MetricsScraper(specs, timeout_s=8.0).scrape_once())
    finally:
        for f in fakes:
            f.close()
    assert all(r.ok for r in results.values()), results


def test_run_on_a_thread_and_stop(engine: FakeHTTPEngine) -> None:
    pool, spec = EndpointPool(), engine.spec()
    # Threads of earlier tests may end meanwhile: only the ones started here must be gone.
    threads_before = set(threading.enumerate())
    with MetricsScraper([spec], pool=pool, interval_s=0.01) as scraper:
        deadline = time.monotonic() + 10.0
        while scraper.rounds < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="already running"):
            scraper.start()
    assert scraper.rounds >= 3 and engine.metrics_requests >= 3
    assert not set(threading.enumerate()) - threads_before
    assert endpoint(pool, spec.worker_id)["waiting"] == 7


def test_asyncio_run_and_cancel(engine: FakeHTTPEngine) -> None:
    scraper = MetricsScraper([engine.spec()], interval_s=0.01)

    async def main() -> None:
        task = asyncio.create_task(scraper.run())
        while scraper.rounds < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert scraper.snapshot()[engine.spec().worker_id]["ok"]


def test_endpoint_removed_from_pool_meanwhile(engine: FakeHTTPEngine) -> None:
    pool, spec = EndpointPool(), engine.spec()
    scraper = MetricsScraper([spec], pool=pool)
    pool.remove(spec.worker_id)
    assert asyncio.run(scraper.scrape_once())[spec.worker_id].ok
    assert pool.endpoints() == []


def test_configuration_errors() -> None:
    spec = EngineSpec("h", 1)
    with pytest.raises(ConfigError, match="listed twice"):
        MetricsScraper([spec, spec])
    with pytest.raises(ConfigError, match="timeout_s"):
        MetricsScraper([spec], timeout_s=0)
    with pytest.raises(ConfigError, match="interval_s"):
        MetricsScraper([spec], interval_s=float("nan"))
    with pytest.raises(TypeError, match="EngineSpec"):
        MetricsScraper(["h:1"])  # type: ignore[list-item]


@pytest.mark.parametrize("text", [UNDER_LOAD, OLD_VLLM, SGLANG], ids=["new", "old", "sglang"])
def test_prefilter_reads_the_same_values_as_a_full_parse(text: str) -> None:
    assert parse_engine_metrics(text) == parse_engine_metrics(text, prefilter=False)


def _one_long_line(labels: int) -> str:
    return (
        "vllm:num_requests_waiting{"
        + ",".join(f'a{i}="b\\""' for i in range(labels))
        + "} 3\nvllm:kv_cache_usage_perc 0.5\n"
    )


def test_a_multi_megabyte_line_is_read_by_the_native_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Probe 49 F15: prometheus_client's parser, super-linear on a long line, ran on the event
    loop (a 1.3 MB line took 10 s; the body cap is 8 MiB). The scraper no longer calls it."""
    import llmsched.integrations.metrics as metrics

    def refused(text: str) -> object:
        raise AssertionError("prometheus_client's parser ran on an engine's text")

    monkeypatch.setattr(metrics, "text_string_to_metric_families", refused)
    text = _one_long_line(550_000)
    assert 6 << 20 < len(text) < metrics.MAX_BODY_BYTES
    with FakeHTTPEngine(metrics_text=text) as fake:
        spec = fake.spec()
        pool = EndpointPool()
        result = asyncio.run(MetricsScraper([spec], pool=pool).scrape_once())[spec.worker_id]
        assert result.ok, result.error
        assert result.values == {"waiting": 3, "kv_cache_usage": 0.5}
        assert endpoint(pool, spec.worker_id)["waiting"] == 3
        fake.metrics_text = text.replace("} 3", " 3", 1)  # the brace never closes
        result = asyncio.run(MetricsScraper([spec]).scrape_once())[spec.worker_id]
        assert not result.ok and result.error is not None
        assert "line 1: cannot parse" in result.error and len(result.error) < 200


def test_the_native_parse_agrees_with_prometheus_client_on_odd_texts() -> None:
    for text in (
        "vllm:num_requests_waiting 2.5\nvllm:num_requests_waiting 1\n",  # 3.5 rounds to 4
        "vllm:num_requests_running 0.5\nsglang:token_usage 7\n",  # 0.5 rounds to 0
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="+7"} 1\nsglang:num_queue_reqs 1\n',
        _one_long_line(2_000),
    ):
        assert parse_engine_metrics(text) == parse_engine_metrics(text, prefilter=False), text
