"""Package-internal asyncio helpers: ending a background task from a stop without losing the
stopping task's own cancellation.

``task.cancel()`` then ``with contextlib.suppress(asyncio.CancelledError): await task`` is the
usual way to end a task, and it is wrong when the *stopping* task is cancelled while it waits
(the task it ended takes a few loop rounds to finish, or longer when its cleanup waits on
something): the ``CancelledError`` meant for the stopper is suppressed as if it were the
task's, the stopper runs on as if never cancelled, and an ``asyncio.timeout()`` or
``asyncio.wait_for`` around it never fires. These wait with ``asyncio.wait``, which lets the
waiter's own cancellation through.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["cancel_and_wait", "settled"]


async def settled(task: asyncio.Future[Any]) -> None:
    """Waits until ``task`` has ended, whatever it ended with (a failure is retrieved, not
    raised); a cancellation of the waiting task goes through.

    >>> async def main() -> bool:
    ...     async def fails() -> None:
    ...         raise ValueError("its own failure")
    ...     task = asyncio.ensure_future(fails())
    ...     await settled(task)
    ...     return task.done()
    >>> asyncio.run(main())
    True
    """
    await asyncio.wait((task,))
    if not task.cancelled():
        task.exception()  # retrieved: asyncio does not log it as never retrieved


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancels ``task`` and waits until it has ended; raises what it failed with, if anything
    but its cancellation (as ``suppress(CancelledError): await task`` does), while a
    cancellation of the waiting task goes through (see :func:`settled`).

    >>> async def main() -> bool:
    ...     task = asyncio.ensure_future(asyncio.sleep(3600))
    ...     await cancel_and_wait(task)
    ...     return task.cancelled()
    >>> asyncio.run(main())
    True
    """
    task.cancel()
    await asyncio.wait((task,))
    if not task.cancelled():
        failure = task.exception()
        if failure is not None:
            raise failure
