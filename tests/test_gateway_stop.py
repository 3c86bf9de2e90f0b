"""A gateway's stop on either data plane: cancelled while a background task it ended is still
ending (the engines' model check here), the stop is cancelled. It awaited the task with
``CancelledError`` suppressed, its own included, and ran on as if never cancelled (an
``asyncio.wait_for`` around a shutdown never timed out). A second stop finishes the job."""

from __future__ import annotations

import asyncio

import pytest
from _gateway_harness import plane, rig, run  # noqa: F401 (the fixture)

from llmsched.gateway.engine_models import EngineModelCheck


@pytest.mark.usefixtures("plane")
def test_a_stop_cancelled_while_a_background_task_ends_is_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        ending, cancelled = asyncio.Event(), asyncio.Event()

        async def slow_to_end(self: EngineModelCheck) -> None:
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()
                await ending.wait()  # its cleanup takes until the test lets it end

        monkeypatch.setattr(EngineModelCheck, "run", slow_to_end)
        async with rig(engines=1) as r:
            stopping = asyncio.ensure_future(r.gateway.stop())
            await cancelled.wait()  # the stop waits for the check to end
            assert not stopping.done()
            stopping.cancel()
            ending.set()
            with pytest.raises(asyncio.CancelledError):
                await stopping
            assert r.gateway.scheduler.started  # it did not run on
        # The rig's own stop went through the rest.
        assert not r.gateway.scheduler.started

    run(main())
