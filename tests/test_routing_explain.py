"""``Decision.explain()`` says what the pick did: the metrics' age as the pick read them, and
every row of a large pool with the ranks the decision holds (``limit=None``), or the table's
first rows with the rest counted and found on demand (the default past ``EXPLAIN_ROWS``)."""

from __future__ import annotations

from typing import Any

import pytest

from llmsched import Endpoint, EndpointPool, Router
from llmsched.errors import InvalidTypeError, InvalidValueError
from llmsched.routing import EXPLAIN_ROWS, EndpointScores


def test_stale_notes_give_the_age_the_pick_saw_after_a_refresh_or_a_removal() -> None:
    pool = EndpointPool(["fresh", "old", "gone"], stale_after_s=1.0)
    pool.update("fresh", waiting=0, now=10.0)
    pool.update("old", waiting=0, now=5.0)
    pool.update("gone", waiting=0, now=2.0)
    decision = Router(pool, config="least-load").pick(tokens=[1, 2, 3], now=10.5)
    # After the pick: "old" reports again (still stale at 10.5), "gone" leaves the pool.
    pool.update("old", waiting=0, now=9.0)
    pool.remove("gone")
    profile = decision.explain()["default"]
    assert "metrics 5.5 s old at the pick" in (profile.row("old").note or "")
    assert "metrics 8.5 s old at the pick" in (profile.row("gone").note or "")
    assert profile.row("fresh").note is None
    assert "* gone: saturated: metrics 8.5 s old" in str(profile)


def test_explain_over_a_large_pool_ranks_every_endpoint_it_picked() -> None:
    n = 5000
    pool = EndpointPool([f"e{i}" for i in range(n)], stale_policy="ignore")
    for i in range(0, n, 7):
        pool.update(f"e{i}", waiting=i % 5)
    decision = Router(pool, config="least-load", seed=3).pick(tokens=[1, 2, 3], now=0.0)
    rows = decision.explain(limit=None)["default"].rows
    assert len(rows) == n
    ranked = sorted((r for r in rows if r.rank is not None), key=lambda r: r.rank or 0)
    assert [r.endpoint for r in ranked] == [decision.endpoint, *decision.fallbacks]
    assert all(r.total is not None for r in rows)


# Decode profile: a role filter and two scorers; endpoints of role prefill are removed.
CONFIG: dict[str, Any] = {
    "plugins": [
        {"type": "decode-filter"},
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": 3}},
    ],
    "schedulingProfiles": [
        {
            "name": "d",
            "plugins": [
                {"pluginRef": "decode-filter"},
                {"pluginRef": "queue-scorer", "weight": 2},
                {"pluginRef": "kv-cache-utilization-scorer"},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}


def _pool(n: int) -> EndpointPool:
    pool = EndpointPool(
        [Endpoint(f"e{i}", role="prefill" if i % 4 == 3 else None) for i in range(n)],
        stale_after_s=1.0,
    )
    for i in range(n):
        if i % 5:  # every fifth never reports: saturated, with a note
            pool.update(f"e{i}", waiting=i % 7, kv_cache_usage=(i % 10) / 10, now=0.0)
    return pool


def _table_order(rows: list[EndpointScores]) -> list[EndpointScores]:
    """The order the table prints: ranked by rank, kept by total, removed; ties by pool."""
    return sorted(
        rows,
        key=lambda r: (
            0 if r.rank is not None else 1 if r.removed_by is None else 2,
            r.rank or 0,
            -(r.total or 0.0) if r.rank is None else 0.0,
        ),
    )


@pytest.mark.parametrize("limit", [0, 1, 5, 30, 60])
def test_a_limited_explanation_keeps_the_tables_first_rows_and_counts_the_rest(
    limit: int,
) -> None:
    n = 40
    decision = Router(_pool(n), config=CONFIG, seed=2).pick(tokens=[1, 2, 3], now=0.5)
    full = decision.explain(limit=None)["d"]
    short = decision.explain(limit=limit)["d"]
    assert len(full.rows) == n and full.omitted == 0
    shown = min(limit, n)
    assert short.rows == _table_order(full.rows)[:shown] if limit < n else short.rows == full.rows
    assert short.omitted == n - shown
    rest = [r for r in full.rows if r.endpoint not in {s.endpoint for s in short.rows}]
    assert short.omitted_kept == sum(r.removed_by is None for r in rest)
    removed = sum(r.removed_by is not None for r in rest)
    assert short.omitted_removed_by == ({"decode-filter": removed} if removed else {})
    # Any endpoint's row, shown or not, is the full explanation's (scores, rank, note).
    for r in full.rows:
        assert short.row(r.endpoint) == r
    with pytest.raises(KeyError):
        short.row("nowhere")
    text = str(short)
    assert (f"... {n - shown} more endpoints not shown" in text) == (shown < n)


def test_the_default_explains_every_endpoint_up_to_explain_rows() -> None:
    """A pool of EXPLAIN_ROWS endpoints gets the unlimited explanation, in pool order; one more
    endpoint gets EXPLAIN_ROWS rows and one omitted."""
    for n, omitted in ((EXPLAIN_ROWS, 0), (EXPLAIN_ROWS + 1, 1)):
        decision = Router(_pool(n), config=CONFIG, seed=2).pick(tokens=[1, 2, 3], now=0.5)
        default = decision.explain()["d"]
        assert default.omitted == omitted
        assert len(default.rows) == n - omitted
        if not omitted:  # every row, in pool order, as before
            assert default == decision.explain(limit=None)["d"]
        else:  # the table's order: the chosen endpoint first
            assert default.rows[0].rank == 0 and default.rows[0].endpoint == decision.endpoint


@pytest.mark.parametrize(
    ("limit", "error"), [(-1, InvalidValueError), (True, InvalidTypeError), (2.0, InvalidTypeError)]
)
def test_explain_refuses_a_limit_that_is_not_a_count(limit: Any, error: type[Exception]) -> None:
    decision = Router(EndpointPool(["a"]), config="round-robin").pick(tokens=[1], now=0.0)
    with pytest.raises(error, match="limit"):
        decision.explain(limit=limit)
