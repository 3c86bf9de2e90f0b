"""An empty ``model``, ``lora`` or ``cache_salt`` in a request is refused, as an endpoint's
empty ``model`` is: ``""`` is no name, and taken as one it routed without a word
(``model=""`` went to the endpoints serving any model; ``lora=""`` and ``cache_salt=""`` hashed
the prompt into a namespace no engine's cache is in)."""

from __future__ import annotations

from typing import Any

import pytest

from llmsched import Endpoint, EndpointPool, PrefixIndex, Router
from llmsched.errors import InvalidRequestError, InvalidValueError
from llmsched.scheduler import ScheduleRequest

UNSET = {"model": "any model", "lora": "the base model", "cache_salt": "no salt"}


def _router() -> Router:
    pool = EndpointPool([Endpoint("any"), Endpoint("served", model="m")])
    index = PrefixIndex(block_size=2)
    index.store("served", index.hash_tokens([1, 2, 3, 4]))
    return Router(pool, index, config="prefix-only", seed=1)


def _state(router: Router) -> Any:
    return router.pool.endpoints(), router.index.stats(), router.index.dumps(), router.stats()


@pytest.mark.parametrize("name", sorted(UNSET))
def test_router_pick_refuses_an_empty_name_and_changes_nothing(name: str) -> None:
    router = _router()
    before = _state(router)
    with pytest.raises(InvalidValueError) as info:
        router.pick(tokens=[1, 2, 3, 4], now=1.0, **{name: ""})
    assert str(info.value) == (
        f"{name} must be a non-empty str or None (None: {UNSET[name]}), got ''"
    )
    assert _state(router) == before
    # None still means what it says.
    assert router.pick(tokens=[1, 2, 3, 4], now=1.0, **{name: None}).endpoint in ("any", "served")


def test_model_none_serves_any_endpoint_and_a_named_model_its_own() -> None:
    router = _router()
    assert router.pick(tokens=[1, 2, 3, 4], model="m", now=1.0).endpoint == "served"
    assert router.pick(tokens=[1, 2, 3, 4], model="other", now=1.0).endpoint == "any"


@pytest.mark.parametrize("name", sorted(UNSET))
def test_schedule_request_refuses_an_empty_name(name: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"^{name} must be a non-empty str or None"):
        ScheduleRequest(tokens=[1, 2], **{name: ""})
    assert ScheduleRequest(tokens=[1, 2], **{name: "x"}).pick_arguments()[name] == "x"
