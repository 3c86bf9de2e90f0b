"""The gateway's prefix index is bounded (F4: an engine, or any peer
of a bound ``kv_events`` port, storing blocks without removing them grew the gateway without
end), by ``index.max_bytes`` (1 GiB unless set) and ``index.worker_capacity`` (the router
config's ``lruCapacityPerServer`` unless set, which ``llmsched serve`` used to ignore)."""

from __future__ import annotations

import pytest
from _gateway_harness import (  # noqa: F401 (the fixture)
    MODEL,
    plane,
    rig,
    run,
)

from llmsched.errors import ConfigError
from llmsched.gateway.config import GatewayConfig, gateway_index, load_config

ENGINE = {"host": "127.0.0.1", "port": 9}


def config_of(**keys: object) -> GatewayConfig:
    return load_config({"engines": [ENGINE], "models": [MODEL], **keys})


def test_the_index_section_is_checked_and_bounds_the_index() -> None:
    default = gateway_index(config_of())
    assert default.max_bytes == 1 << 30 and default.worker_capacity is None
    index = gateway_index(config_of(index={"max_bytes": 1 << 24, "worker_capacity": 5000}))
    assert (index.max_bytes, index.worker_capacity) == (1 << 24, 5000)
    assert gateway_index(config_of(index={"max_bytes": None})).max_bytes is None
    for bad, named in (
        ({"max_bytes": 1000}, "index.max_bytes"),
        ({"max_bytes": "1G"}, "index.max_bytes"),
        ({"worker_capacity": 0}, "index.worker_capacity"),
        ({"worker_capacity": True}, "index.worker_capacity"),
        ({"bytes": 1 << 24}, "index"),
    ):
        with pytest.raises(ConfigError, match=named):
            config_of(index=bad)


def test_the_router_configs_capacity_per_engine_bounds_the_index_unless_set() -> None:
    router = {
        "plugins": [
            {
                "type": "prefix-cache-scorer",
                "parameters": {"blockSize": 16, "lruCapacityPerServer": 777},
            },
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "prefix-cache-scorer", "weight": 1},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }
    assert gateway_index(config_of(router=router)).worker_capacity == 777
    config = config_of(router=router, index={"worker_capacity": 99})
    assert gateway_index(config).worker_capacity == 99


@pytest.mark.usefixtures("plane")
def test_a_gateway_index_past_its_max_bytes_evicts_and_counts() -> None:
    """Prompts recorded by the router's decisions (the approximate records; KV events go
    through the same bound) fill a 1 MiB index: it stays near its bound, and the evictions
    show on ``/metrics``."""

    async def main() -> None:
        async with rig(engines=2, index={"max_bytes": 1 << 20}) as r:
            assert r.gateway.index.max_bytes == 1 << 20
            for i in range(60):
                prompt = [10_000 * i + t for t in range(8000)]  # 2,000 blocks of 4, distinct
                async with r.client.post(
                    r.url("/v1/completions"),
                    json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                ) as answer:
                    assert answer.status == 200
            stats = r.gateway.index.stats()
            assert stats["evicted_blocks"] > 0, stats
            assert 0 < stats["bytes"] <= 1 << 20 and stats["blocks"] > 0
            assert (
                r.metric("llmsched_gateway_index_evicted_blocks_total") == stats["evicted_blocks"]
            )
            assert r.metric("llmsched_gateway_index_bytes") <= 1 << 20

    run(main())
