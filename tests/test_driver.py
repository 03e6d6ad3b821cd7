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


def _record(executed: list[object], name: str, now: float) -> list[object]:
    executed.append(name)
    return []


async def test_one_peer_s_backlog_does_not_delay_another_peer_s_input():
    """Issue 16: junk setups from one peer filled the one inbox; honest inputs waited behind."""
    executed: list[object] = []
    driver = _driver(executed, inbox=100)
    for i in range(60):
        driver.submit(partial(_record, executed, f"junk{i}"), peer=b"flooder")
    assert driver.submit(partial(_record, executed, "honest"), peer=b"honest")
    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert executed.index("honest") == 1  # one junk input (round robin), not sixty
    assert [e for e in executed if e != "honest"] == [f"junk{i}" for i in range(60)]  # in order


async def test_a_flooder_holds_at_most_its_share_and_is_pushed_out_for_a_newcomer():
    executed: list[object] = []
    driver = _driver(executed, inbox=10)
    accepted = sum(driver.submit(partial(_record, executed, "j"), peer=b"flooder")
                   for _ in range(50))
    assert accepted == 10 and driver.dropped == 40  # alone, its share is the whole inbox
    assert driver.submit(partial(_record, executed, "honest"), peer=b"honest")
    assert driver.queued(b"flooder") == 9 and driver.queued(b"honest") == 1
    assert not driver.submit(partial(_record, executed, "j"), peer=b"flooder")  # over 10 // 2
