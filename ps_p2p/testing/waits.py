"""Waiting on state another task changes without an event to await (pytest-trio tests).

py-libp2p changes its connection and stream tables, and its pubsub peer sets, inside its own
tasks and signals nothing a test could await; where a project object has an event (a driver's
``wait_changed``, a service's hook), await that instead.
"""

from __future__ import annotations

from collections.abc import Callable

import trio


async def wait_until(condition: Callable[[], bool], timeout: float = 15.0,
                     interval: float = 0.01) -> None:
    """Return once ``condition()`` holds, checking every ``interval`` seconds.

    Raises:
        trio.TooSlowError: it did not hold within ``timeout`` seconds (trio's clock, so an
            autojump clock makes the wait instant).
    """
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(interval)
