"""``Decision.explain()`` says what the pick did: the metrics' age as the pick read them, and
every row of a large pool with the ranks the decision holds."""

from __future__ import annotations

from llmsched import EndpointPool, Router


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
    rows = decision.explain()["default"].rows
    assert len(rows) == n
    ranked = sorted((r for r in rows if r.rank is not None), key=lambda r: r.rank or 0)
    assert [r.endpoint for r in ranked] == [decision.endpoint, *decision.fallbacks]
    assert all(r.total is not None for r in rows)
