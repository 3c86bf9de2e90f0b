"""The short form of ``bench_peers_index.py``: the small size cut to 4,000 sequences to keep
``make bench`` short, llmsched beside Dynamo and the twin.

Runs with ``make bench`` (timing enabled) and prints the figures; it fails only when the three
indexes disagree on some query's per-worker depths, never on timing. Skipped, saying why, when
``ai-dynamo-runtime`` cannot be installed: ``make bench-peers`` runs both sizes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from bench_peers_index import SIZES, load_dynamo, run

SHORT = replace(SIZES["small"], sequences=4_000)


def test_peers_small(benchmark) -> None:
    if benchmark.disabled:
        pytest.skip("timing disabled: the peer comparison runs under `make bench`")
    dynamo, why = load_dynamo(install=True)
    if dynamo is None:
        pytest.skip(f"Dynamo's radix tree is not available: {why}")
    fig = run(SHORT, dynamo, why)
    benchmark.group = "peers: prefix index beside Dynamo (figures printed)"
    benchmark.extra_info.update({k: round(v, 3) for k, v in fig.items()})
    benchmark.pedantic(lambda: None, rounds=1)
    assert fig["differing"] == 0
