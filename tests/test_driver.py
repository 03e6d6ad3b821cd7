"""The generic core driver (ps_p2p.protocols.driver): inbox bound and essential inputs."""

from __future__ import annotations

from functools import partial

import trio
import trio.testing

from ps_p2p.protocols.driver import CoreDriver


def _driver(executed: list[object], inbox: int = 2) -> CoreDriver[object]:
    return CoreDriver(
        "test", execute=executed.append, tick=lambda now: [], next_deadline=lambda: None,
        inbox=inbox,
    )


def _input(name: str, now: float) -> list[object]:
    return [name]


async def test_a_full_inbox_drops_and_counts_plain_inputs():
    executed: list[object] = []
    driver = _driver(executed)
    assert driver.submit(partial(_input, "a")) and driver.submit(partial(_input, "b"))
    assert not driver.submit(partial(_input, "c"))
    assert driver.dropped == 1 and executed == []


async def test_an_essential_input_is_applied_at_once_when_the_inbox_is_full():
    executed: list[object] = []
    driver = _driver(executed)
    driver.submit(partial(_input, "a"))
    assert driver.submit(partial(_input, "b"), essential=True)
    assert executed == []  # queued: not full yet
    assert driver.submit(partial(_input, "c"), essential=True)
    assert executed == ["c"] and driver.dropped == 0
    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        await trio.testing.wait_all_tasks_blocked()
        assert executed == ["c", "a", "b"]
        nursery.cancel_scope.cancel()
