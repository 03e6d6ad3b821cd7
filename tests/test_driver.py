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


# ------------------------------------------------------------------ handler-to-core shortcut


async def test_a_handler_input_is_applied_on_its_own_task_when_the_inbox_is_empty():
    executed: list[object] = []
    driver = _driver(executed, inbox=100)
    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        assert driver.submit(partial(_input, "cell"), peer=b"a", direct=True)
        assert executed == ["cell"] and driver.direct == 1  # before any other task ran
        nursery.cancel_scope.cancel()


async def test_a_burst_in_one_step_applies_the_first_and_queues_the_rest_in_arrival_order():
    executed: list[object] = []
    driver = _driver(executed, inbox=100)
    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        for i in range(5):  # one read that brought five frames: no await in between
            driver.submit(partial(_input, f"a{i}"), peer=b"a", direct=True)
        assert executed == ["a0"] and driver.queued(b"a") == 4
        driver.submit(partial(_input, "b0"), peer=b"b", direct=True)  # another handler
        assert driver.queued(b"b") == 1  # the inbox is not empty: queued behind a1..a4
        await driver.wait_processed()
        driver.submit(partial(_input, "a5"), peer=b"a", direct=True)  # next read, empty inbox
        nursery.cancel_scope.cancel()
    # the round robin took b0 after a1 (one input per peer in turn), arrival order per peer
    assert executed == ["a0", "a1", "b0", "a2", "a3", "a4", "a5"] and driver.direct == 2


async def test_the_processed_event_taken_before_a_check_is_set_by_an_input_applied_after_it():
    executed: list[object] = []
    driver = _driver(executed, inbox=100)
    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        event = driver.processed  # taken, then the condition checked: not yet
        assert executed == []
        driver.submit(partial(_input, "cell"), peer=b"a", direct=True)  # before any wait
        with trio.fail_after(1):
            await event.wait()  # not missed: the only input came before the wait
        assert executed == ["cell"] and driver.processed is not event
        nursery.cancel_scope.cancel()


async def test_an_input_waiting_in_the_inbox_is_never_overtaken_by_a_direct_one():
    executed: list[object] = []
    driver = _driver(executed, inbox=100)
    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        driver.submit(partial(_input, "b queued"), peer=b"b")  # the driver has not run yet
        driver.submit(partial(_input, "a direct"), peer=b"a", direct=True)
        await driver.wait_processed()
        nursery.cancel_scope.cancel()
    assert executed == ["b queued", "a direct"] and driver.direct == 0


async def test_an_input_submitted_from_inside_an_input_is_queued_not_nested():
    executed: list[object] = []
    driver = _driver(executed, inbox=100)

    def outer(now: float) -> list[object]:
        executed.append("outer starts")
        driver.submit(partial(_input, "inner"), peer=b"a", direct=True)
        return ["outer ends"]

    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        driver.submit(outer, peer=b"a", direct=True)
        assert executed == ["outer starts", "outer ends"]
        await driver.wait_processed()
        nursery.cancel_scope.cancel()
    assert executed == ["outer starts", "outer ends", "inner"]


async def test_a_direct_input_that_brings_the_deadline_forward_wakes_the_driver(autojump_clock):
    ticks: list[float] = []
    deadline: list[float | None] = [None]

    def arm(now: float) -> list[object]:
        deadline[0] = now + 1.0
        return []

    def tick(now: float) -> list[object]:
        ticks.append(now)
        deadline[0] = None
        return []

    driver: CoreDriver[object] = CoreDriver(
        "test", execute=lambda c: None, tick=tick, next_deadline=lambda: deadline[0]
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        await trio.testing.wait_all_tasks_blocked()  # asleep with no deadline
        start = trio.current_time()
        driver.submit(arm, peer=b"a", direct=True)
        assert driver.direct == 1
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert ticks == [start + 1.0]
