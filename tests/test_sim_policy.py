"""Python Policy objects on the Rust engine: what they are handed, and what happens when they
fail (the equivalence with the reference engine is in tests/test_sim_rust.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from llmsched.errors import ConfigError, PolicyError
from llmsched.sim import ScenarioConfig, Simulation, fallback_counts
from llmsched.sim.fast import unsupported
from llmsched.sim.request import Request


class RoundRobin:
    """Round robin over the decode replicas; ``fail`` names a method that raises, ``answer``
    replaces pick's answer."""

    name = "py-rr"

    def __init__(
        self, replicas: int = 2, *, fail: str | None = None, answer: Any = None, after: int = 0
    ) -> None:
        self.replicas = replicas
        self.fail = fail
        self.answer = answer
        self.after = after
        self.calls: dict[str, int] = {}
        self.seen: list[Request] = []

    def _count(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.fail == method and self.calls[method] > self.after:
            raise ValueError(f"{method} failed on purpose")

    def update_metrics(
        self, replica: int, waiting: int, running: int, kv_cache_usage: float, now: float
    ) -> None:
        self._count("update_metrics")

    def pick(self, req: Request, now: float) -> Any:
        self._count("pick")
        self.seen.append(req)
        if self.answer is not None and self.calls["pick"] > self.after:
            return self.answer
        return (self.calls["pick"] - 1) % self.replicas, None

    def on_first_token(self, req: Request, now: float) -> None:
        self._count("on_first_token")

    def on_finished(self, req: Request, now: float) -> None:
        self._count("on_finished")


def scenario(replicas: int = 2, **over: Any) -> ScenarioConfig:
    data: dict[str, Any] = {
        "replicas": replicas,
        "workload": {"kind": "long_short", "num_requests": 40, "arrival": {"rate": 20.0}},
    }
    data.update(over)
    return ScenarioConfig.from_dict(data)


def test_policy_objects_run_on_the_rust_engine() -> None:
    cfg = scenario()
    policy = RoundRobin()
    assert unsupported(cfg, policy) is None
    before = fallback_counts()
    sim = Simulation(cfg, policy)
    result = sim.run()
    assert (sim.engine, sim.fallback_reason, result.engine_name) == ("rust", None, "rust")
    assert result.summary()["completed"] == 40 and result.policy == "py-rr"
    assert fallback_counts() == before
    assert policy.calls["pick"] == policy.calls["on_finished"] == 40
    assert policy.calls["on_first_token"] == 40 and policy.calls["update_metrics"] > 0


def test_the_request_handed_to_a_policy() -> None:
    """A Request, the same object from pick to on_finished, with the plan's hashes and the
    request's state at each call."""
    cfg = scenario()
    firsts: dict[int, Request] = {}

    class Checking(RoundRobin):
        def pick(self, req: Request, now: float) -> Any:
            assert isinstance(req, Request)
            assert (req.dispatched, req.first_token_time, req.generated) == (-1.0, -1.0, 0)
            assert req.replica is None and req.handle is None and req.tokens is None
            assert req.hashes.dtype == np.uint64 and len(req.hashes) > 0
            req.handle = ("mine", req.id)
            return super().pick(req, now)

        def on_first_token(self, req: Request, now: float) -> None:
            assert req.first_token_time == now and req.generated == 1
            assert req.dispatched >= req.arrival and req.replica in (0, 1)
            firsts[req.id] = req
            super().on_first_token(req, now)

        def on_finished(self, req: Request, now: float) -> None:
            assert req is firsts[req.id] and req.handle == ("mine", req.id)
            assert req.finished and req.finish_time == now
            assert req.generated == req.output_len
            super().on_finished(req, now)

    policy = Checking()
    sim = Simulation(cfg, policy)
    sim.run()
    assert len(firsts) == 40
    done = {r.id: r for r in sim.done}
    for req in policy.seen:
        assert (req.prompt_len, req.output_len, req.arrival) == (
            done[req.id].prompt_len,
            done[req.id].output_len,
            done[req.id].arrival,
        )


@pytest.mark.parametrize("method", ["pick", "update_metrics", "on_first_token", "on_finished"])
def test_a_policy_that_raises_stops_the_run_with_policy_error(method: str) -> None:
    cfg = scenario()
    policy = RoundRobin(fail=method, after=3)
    sim = Simulation(cfg, policy)
    with pytest.raises(
        PolicyError, match=rf"policy 'py-rr': {method}\(\).* raised ValueError"
    ) as info:
        sim.run()
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and str(cause) == f"{method} failed on purpose"
    # No result was kept: the simulation has not run.
    assert sim.record is None
    with pytest.raises(ConfigError, match="has not run yet"):
        sim.replicas  # noqa: B018
    # The same scenario runs again with a policy that works.
    assert Simulation(cfg, RoundRobin()).run().summary()["completed"] == 40


def test_the_failing_request_is_named() -> None:
    policy = RoundRobin(fail="pick", after=5)
    with pytest.raises(PolicyError, match=r"pick\(\) for request 5 at t="):
        Simulation(scenario(), policy).run()


class _Stop(BaseException):
    pass


def test_exceptions_that_are_not_errors_propagate_as_they_are() -> None:
    class Interrupted(RoundRobin):
        def pick(self, req: Request, now: float) -> Any:
            raise _Stop

    with pytest.raises(_Stop):
        Simulation(scenario(), Interrupted()).run()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (1, r"must return \(decode replica, prefill replica or None\), got 1"),
        ((0, None, 1), r"must return .*got \(0, None, 1\)"),
        ((2, None), r"returned \(2, None\): decode replica 2 is out of range \(2 replicas\)"),
        ((-1, None), r"the decode replica -1 is out of range"),
        (("0", None), r"the decode replica must be an int, got str"),
        ((1.0, None), r"the decode replica must be an int, got float"),
        ((True, None), r"the decode replica must be an int, got a bool"),
        ((0, "1"), r"the prefill replica must be an int, got str"),
        ((0, 1), r"prefill replica 1 is not a prefill replica"),
    ],
)
def test_bad_answers_from_pick_raise_policy_error(answer: Any, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        Simulation(scenario(), RoundRobin(answer=answer, after=2)).run()


def test_numpy_integers_and_lists_are_answers() -> None:
    policy = RoundRobin(answer=[np.int64(1), None])
    assert Simulation(scenario(), policy).run().summary()["completed"] == 40


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ((1, 3), r"prefill replica 3 is out of range \(3 replicas\)"),
        ((0, 2), r"prefill replica 2 is not a prefill replica \(replicas 0..1 are\)"),
        ((0, 1), r"prefill replica 1 is not a prefill replica"),
    ],
)
def test_prefill_decode_answers_are_checked(answer: Any, message: str) -> None:
    cfg = scenario(3, pd={"prefill_replicas": 1})
    with pytest.raises(PolicyError, match=message):
        Simulation(cfg, RoundRobin(3, answer=answer)).run()
    # A split the pools can serve runs, and so does a request sent whole to a prefill replica.
    for good in [(2, 0), (1, 0), (0, None)]:
        assert Simulation(cfg, RoundRobin(3, answer=good)).run().summary()["completed"] == 40


def test_a_policy_without_a_method_raises_policy_error() -> None:
    class NoFirstToken:
        name = "partial"

        def update_metrics(self, *args: Any) -> None:
            pass

        def pick(self, req: Request, now: float) -> tuple[int, None]:
            return 0, None

        def on_finished(self, req: Request, now: float) -> None:
            pass

    with pytest.raises(PolicyError, match="on_first_token") as info:
        Simulation(scenario(), NoFirstToken()).run()  # type: ignore[arg-type]
    assert isinstance(info.value.__cause__, AttributeError)


def test_policy_objects_need_one_router_replica() -> None:
    with pytest.raises(ConfigError, match="router_replicas needs a router configuration"):
        Simulation(scenario(router_replicas=2), RoundRobin())


def test_compare_runs_a_policy_object_on_the_rust_engine_outside_the_thread_pool() -> None:
    from llmsched.sim.runner import compare

    policy = RoundRobin()
    (result,) = compare(scenario(), [policy], jobs=2, progress=False)
    assert result.engine_name == "rust" and policy.calls["pick"] == 40


class _Herding(RoundRobin):
    """Sends its first 30 requests to replica 0, then spreads them: its figures depend on
    the state it starts from."""

    def pick(self, req: Request, now: float) -> Any:
        self._count("pick")
        n = self.calls["pick"]
        return (0 if n <= 30 else n % self.replicas), None


@pytest.mark.parametrize("jobs", [1, 2])
def test_each_run_of_a_policy_object_starts_from_its_state_as_given(jobs: int) -> None:
    """Probe 76: inline runs shared one Policy object, so a stateful policy began the second
    variant where the first had left off (two identical variants differed, and ``jobs=1``
    disagreed with ``jobs=2``, whose processes each get a copy)."""
    from llmsched.sim.runner import compare

    cfg = scenario(3, variants=[{"name": "a"}, {"name": "b"}])
    policy = _Herding(3)
    a, b = compare(cfg, [policy], jobs=jobs, progress=False)
    assert a.policy == "py-rr [a]" and b.policy == "py-rr [b]"
    assert a.summary()["ttft_s"] == b.summary()["ttft_s"]
    (alone,) = compare(scenario(3), [_Herding(3)], jobs=1, progress=False)
    assert a.summary()["ttft_s"] == alone.summary()["ttft_s"]


def test_a_policy_object_that_cannot_be_copied_is_named() -> None:
    import threading

    from llmsched.sim.runner import compare

    policy = RoundRobin()
    policy.lock = threading.Lock()  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="'py-rr' runs more than once"):
        compare(scenario(variants=[{"name": "a"}, {"name": "b"}]), [policy], progress=False)
