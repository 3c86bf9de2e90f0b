"""The wait of the gateway's background loops between rounds (engine health, the engines'
model check): until woken or a deadline, and always ending when the loop is cancelled."""

from __future__ import annotations

import asyncio

__all__ = ["wait_woken"]


async def wait_woken(event: asyncio.Event, timeout_s: float) -> bool:
    """Waits until ``event`` is set or ``timeout_s`` passed; whether it was set.

    A background loop's wait between rounds. ``asyncio.wait_for`` is not used: on CPython
    3.10 and 3.11 it returns normally when the task is cancelled just as the event is set
    (the cancellation is lost), and a loop waiting that way then runs on after its stop
    cancelled it, so the stop never returns. ``asyncio.wait`` lets the cancellation through.

    >>> event = asyncio.Event()
    >>> asyncio.run(wait_woken(event, 0.01))
    False
    """
    woken = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((woken,), timeout=timeout_s)
    finally:
        woken.cancel()
    return event.is_set()
