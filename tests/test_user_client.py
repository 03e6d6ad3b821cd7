"""The user client (ps_p2p.roles.user) on the generic CoreDriver, with a stand-in overlay and
directory and trio's autojump clock: when the cores tick, and what must happen at once."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from ps_p2p.config import UserConfig
from ps_p2p.errors import RequestTimeoutError
from ps_p2p.pb.planetserve.v1 import clove_pb2
from ps_p2p.records import Role
from ps_p2p.roles import user as user_module
from ps_p2p.roles.user import UserClient

RELAYS = [bytes([i]) * 38 for i in range(1, 17)]
MODEL = b"\xee" * 38


class FakeHandle:
    """The face of :class:`~ps_p2p.protocols.overlay.PathHandle` the user client uses."""

    def __init__(self, relays: tuple[bytes, ...], number: int) -> None:
        self.relays = relays
        self.path = SimpleNamespace(first_hop=relays[0])
        self.key = (relays[0], number.to_bytes(4, "big"))
        self.ready = trio.Event()
        self.done = trio.Event()
        self.is_ready = False
        self.error: str | None = None
        self.first_hop_down = False
        self.blameless = False

    @property
    def alive(self) -> bool:
        return self.is_ready and not self.done.is_set()

    def acknowledge(self) -> None:
        self.is_ready = True
        self.ready.set()

    def die(self, reason: str = "gone") -> None:
        self.error = reason
        self.done.set()


class FakeOverlay:
    """Records what the user client opens, sends and closes; answers probes when asked to."""

    def __init__(self, *, acknowledge: bool = True, answer_probes: bool = True) -> None:
        self.peer_id = b"\xaa" * 38
        self.on_backward = None
        self.on_path_down = None
        self.on_address_changed = None
        self.acknowledge = acknowledge
        self.answer_probes = answer_probes
        self.opened: list[tuple[float, FakeHandle]] = []
        self.cloves: list[tuple[float, FakeHandle]] = []
        self.probes: list[tuple[FakeHandle, int]] = []
        self.closed: list[FakeHandle] = []

    def open_path(self, hops) -> FakeHandle:  # type: ignore[no-untyped-def]
        handle = FakeHandle(tuple(h.peer_id for h in hops), len(self.opened))
        self.opened.append((trio.current_time(), handle))
        if self.acknowledge:
            handle.acknowledge()
        return handle

    def send_on_path(self, handle: FakeHandle, payload: clove_pb2.ForwardPayload) -> bool:
        if not handle.alive:
            return False
        if payload.WhichOneof("kind") == "probe":
            self.probes.append((handle, payload.probe.nonce))
            if self.answer_probes:
                self.reply_probe(handle, payload.probe.nonce)
        else:
            self.cloves.append((trio.current_time(), handle))
        return True

    def reply_probe(self, handle: FakeHandle, nonce: int) -> None:
        reply = clove_pb2.BackwardPayload(probe_reply=clove_pb2.Probe(nonce=nonce))
        assert self.on_backward is not None
        self.on_backward(handle, reply)

    def close_path(self, handle: FakeHandle, reason: str) -> None:
        self.closed.append(handle)
        handle.die(reason)

    def kill(self, handle: FakeHandle) -> None:
        """The path dies under the client (its first hop went away)."""
        handle.die("first hop down")
        assert self.on_path_down is not None
        self.on_path_down(handle)

    def live(self) -> list[FakeHandle]:
        return [h for _, h in self.opened if h.alive]


class FakeDirectory:
    height = 1

    def __init__(self) -> None:
        self._users = [
            SimpleNamespace(peer_id=p, onion_key=bytes(32), roles=frozenset({Role.USER}))
            for p in RELAYS
        ]
        self._models = [
            SimpleNamespace(
                peer_id=MODEL, onion_key=bytes(32), roles=frozenset({Role.MODEL}), model_id="m"
            )
        ]
        self._by_id = {r.peer_id: r for r in self._users + self._models}

    def users(self):  # type: ignore[no-untyped-def]
        return self._users

    def model_nodes(self):  # type: ignore[no-untyped-def]
        return self._models

    def record(self, peer: bytes):  # type: ignore[no-untyped-def]
        return self._by_id.get(peer)

    def trusted(self, peer: bytes) -> bool:
        return True

    def serving(self, model_id=None):  # type: ignore[no-untyped-def]
        return [r for r in self._models if model_id in (None, r.model_id)]

    def reputation_or_initial(self, peer: bytes) -> float:
        return 0.5


def _client(overlay: FakeOverlay, **config: float) -> UserClient:
    directory = FakeDirectory()
    config = {"probe_interval": 2.0, "probe_timeout": 4.0, **config}
    return UserClient(overlay, lambda: directory, UserConfig(**config))  # type: ignore[arg-type]


def _count_ticks(client: UserClient, limit: int, scope: trio.CancelScope) -> list[float]:
    """Wrap the driver's tick: the times it ran; cancels ``scope`` past ``limit`` ticks (a
    spinning driver would otherwise never let the autojump clock move)."""
    ticks: list[float] = []
    tick = client.driver._tick

    def counting(now: float):  # type: ignore[no-untyped-def]
        ticks.append(now)
        if len(ticks) > limit:
            scope.cancel()
        return tick(now)

    client.driver._tick = counting
    return ticks


async def test_paths_open_at_start_and_become_ready_on_probe_replies(autojump_clock):
    overlay = FakeOverlay()
    client = _client(overlay)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        await client.wait_ready(5, timeout=5)
        assert trio.current_time() == 0.0  # setup, probe and reply all at once
        assert len(client.ready_paths()) == 5
        assert {p.path_id for p in client.ready_paths()} == {
            client._path_ids[h.key] for h in overlay.live()
        }
        nursery.cancel_scope.cancel()


async def test_a_request_waiting_for_paths_goes_out_when_they_are_confirmed(autojump_clock):
    # the request core learns of new ready paths only from a tick: the driver must tick at
    # once after a probe reply confirmed a path, not at its next timer
    overlay = FakeOverlay(answer_probes=False)
    client = _client(overlay)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        result = {}

        async def ask() -> None:
            result["answer"] = await client.ask("hello", timeout=60)

        nursery.start_soon(ask)
        await trio.sleep(3.0)  # paths set up, probes unanswered, the request waits
        assert not overlay.cloves and len(client._requests) == 1
        confirmed_at = trio.current_time()
        for handle, nonce in list(overlay.probes):
            if handle.alive:
                overlay.reply_probe(handle, nonce)
        await trio.testing.wait_all_tasks_blocked()
        assert len(overlay.cloves) == 4
        assert {t for t, _ in overlay.cloves} == {confirmed_at}
        nursery.cancel_scope.cancel()


async def test_a_path_down_is_repaired_at_once(autojump_clock):
    overlay = FakeOverlay()
    client = _client(overlay)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        await client.wait_ready(5, timeout=5)
        await trio.sleep(0.2)  # between two maintenance timers
        down_at = trio.current_time()
        overlay.kill(overlay.live()[0])
        await client.wait_changed()  # path lost
        await trio.testing.wait_all_tasks_blocked()
        assert len(overlay.opened) == 6
        assert overlay.opened[-1][0] == down_at
        await client.wait_ready(5, timeout=5)
        nursery.cancel_scope.cancel()


async def test_a_request_left_with_fewer_than_k_paths_resends_at_once(autojump_clock):
    overlay = FakeOverlay()
    client = _client(overlay, paths=8)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        await client.wait_ready(8, timeout=5)
        nursery.start_soon(client.ask, "hello")
        await trio.testing.wait_all_tasks_blocked()
        first = [h for _, h in overlay.cloves]
        assert len(first) == 4
        await trio.sleep(0.2)
        lost_at = trio.current_time()
        overlay.kill(first[0])  # 3 of 4 left, k = 3: its clove is re-sent on a spare
        overlay.kill(first[1])  # 2 of 4 left: a second attempt on the paths still ready
        await trio.testing.wait_all_tasks_blocked()
        resent, *second = overlay.cloves[4:]
        assert len(second) == 4
        assert {t for t, _ in [resent, *second]} == {lost_at}
        assert not {h for _, h in [resent, *second]} & {first[0], first[1]}
        assert client._requests.attempts(next(iter(client._waiters))) == 2
        nursery.cancel_scope.cancel()


async def test_an_idle_client_ticks_only_at_its_timers(autojump_clock):
    overlay = FakeOverlay()
    client = _client(overlay)
    with trio.CancelScope() as spin:
        async with trio.open_nursery() as nursery:
            ticks = _count_ticks(client, 10_000, spin)
            await nursery.start(client.run)
            await client.wait_ready(5, timeout=5)
            start = len(ticks)
            await trio.sleep(60)
            idle = ticks[start:]
            nursery.cancel_scope.cancel()
    assert not spin.cancelled_caught, "the driver spun"
    # maintenance every 0.5 s (min(0.5, probe_interval / 2)); probes every 2 s come in
    # between at most once per path
    assert len(idle) <= 60 / 0.5 + 60 / 2 * 5
    assert len(idle) >= 60 / 0.5 - 1
    assert all(b > a for a, b in zip(idle, idle[1:]))  # never twice at one time


async def test_a_tick_that_raises_does_not_spin_the_driver(autojump_clock, caplog):
    overlay = FakeOverlay()
    client = _client(overlay)

    def broken(now, relays):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug in the pool")

    client._pool.tick = broken  # type: ignore[method-assign]
    with trio.CancelScope() as spin:
        async with trio.open_nursery() as nursery:
            ticks = _count_ticks(client, 1_000, spin)
            await nursery.start(client.run)
            await trio.sleep(10)
            nursery.cancel_scope.cancel()
    assert not spin.cancelled_caught, "the driver spun"
    assert 10 / user_module.TICK_RETRY - 1 <= len(ticks) <= 10 / user_module.TICK_RETRY + 1
    assert client.driver.failed == len(ticks)


async def test_a_full_inbox_drops_backward_payloads_but_never_a_request(
    autojump_clock, monkeypatch
):
    monkeypatch.setattr(user_module, "MAX_INBOX", 8)
    overlay = FakeOverlay()
    client = _client(overlay)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        await client.wait_ready(5, timeout=5)
        handle = overlay.live()[0]
        unsigned = clove_pb2.BackwardPayload(clove=b"not signed")
        for _ in range(20):  # no checkpoint: the driver takes none of them meanwhile
            overlay.on_backward(handle, unsigned)
        # 8 queued (and maybe one handed straight to the waiting driver task)
        assert client.inbox_dropped in (11, 12)
        dropped = client.inbox_dropped
        # the inbox is still full: the start of the request applies at once instead
        with trio.fail_after(30):
            answer = await client.ask("anyone?", timeout=5)
        assert isinstance(answer.exception, RequestTimeoutError)
        assert answer.attempts == 1
        assert client.misrouted_cloves == 20 - dropped
        assert client.inbox_dropped == dropped
        nursery.cancel_scope.cancel()


async def test_wait_processed_follows_a_backward_payload(autojump_clock):
    overlay = FakeOverlay()
    client = _client(overlay)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        await client.wait_ready(5, timeout=5)
        overlay.on_backward(overlay.live()[0], clove_pb2.BackwardPayload(clove=b"x"))
        assert client.misrouted_cloves == 0
        with trio.fail_after(0.1):
            while client.misrouted_cloves == 0:
                await client.wait_processed()
        assert trio.current_time() == 0.0  # processed as it came, not at a timer
        nursery.cancel_scope.cancel()


async def test_a_cancelled_ask_is_forgotten_by_the_request_core(autojump_clock):
    overlay = FakeOverlay(answer_probes=False)  # no ready paths: the request waits
    client = _client(overlay)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        with trio.move_on_after(1.0):
            await client.ask("never mind", timeout=60)
        assert not client._waiters
        with trio.fail_after(0.1):  # the cancel input is in the next batch: no timer needed
            while len(client._requests):
                await client.wait_processed()
        nursery.cancel_scope.cancel()


async def test_a_failed_setup_is_answered_and_rebuilt_at_the_next_maintenance(autojump_clock):
    overlay = FakeOverlay(acknowledge=False)
    client = _client(overlay, max_setups=5)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        await trio.testing.wait_all_tasks_blocked()
        assert len(overlay.opened) == 5 and client._pool.setting_up == 5
        await trio.sleep(0.1)
        failed_at = trio.current_time()
        for _, handle in overlay.opened:
            handle.die("setup refused")
            handle.ready.set()
        await trio.testing.wait_all_tasks_blocked()
        assert client._pool.setting_up == 0
        assert len(overlay.opened) == 5  # no tight retry loop: not at once
        await trio.sleep(1.0)  # the next maintenance builds replacements
        assert len(overlay.opened) == 10
        assert {t for t, _ in overlay.opened[5:]} == {0.5}
        assert failed_at == 0.1
        nursery.cancel_scope.cancel()


async def test_setups_abandoned_on_an_address_change_leave_every_relay_above_suspicion(
    autojump_clock,
):
    # the overlay found this node's address changed: a first hop that "went down" just before
    # (its connection died with all the others) is forgiven, and the setups the overlay then
    # abandoned blame nobody; the pool rebuilds through any relay at its next maintenance
    overlay = FakeOverlay(acknowledge=False)
    client = _client(overlay, max_setups=5)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        await trio.testing.wait_all_tasks_blocked()
        first, *rest = [h for _, h in overlay.opened]
        await trio.sleep(0.1)
        first.first_hop_down = True
        first.die("first hop down: reset")
        first.ready.set()
        await trio.testing.wait_all_tasks_blocked()
        assert client._pool.penalty(first.relays[0]) == 1
        assert overlay.on_address_changed is not None
        overlay.on_address_changed(0.0)
        for handle in rest:
            handle.blameless = True
            handle.die("abandoned: own address changed")
            handle.ready.set()
        await trio.testing.wait_all_tasks_blocked()
        assert all(client._pool.penalty(r) == 0 for _, h in overlay.opened for r in h.relays)
        assert client._pool.stats.setups_abandoned == 4
        await trio.sleep(1.0)
        assert len(overlay.opened) == 10
        nursery.cancel_scope.cancel()


async def test_the_next_setup_starts_as_one_finishes(autojump_clock):
    # at most max_setups in flight; an acknowledged setup lets the next one start at once
    overlay = FakeOverlay(acknowledge=False)
    client = _client(overlay, max_setups=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        await trio.testing.wait_all_tasks_blocked()
        assert len(overlay.opened) == 2
        await trio.sleep(0.2)
        overlay.opened[0][1].acknowledge()
        await trio.testing.wait_all_tasks_blocked()
        assert len(overlay.opened) == 3
        assert overlay.opened[2][0] == 0.2
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("pool_deadline", [None, -math.inf, 5.0])
def test_next_deadline_is_at_once_while_the_ready_paths_changed(pool_deadline):
    client = _client(FakeOverlay())
    client._pool.next_deadline = lambda: pool_deadline  # type: ignore[method-assign]
    client._tick_due = True
    assert client._next_deadline() == -math.inf
    client._tick_due = False
    expected = -math.inf if pool_deadline is None else pool_deadline
    assert client._next_deadline() == expected


# ------------------------------------------------------------------ outcomes (for metrics)


def _observed_client(overlay: FakeOverlay, done: list[tuple[str, float]]) -> UserClient:
    directory = FakeDirectory()
    return UserClient(
        overlay,  # type: ignore[arg-type]
        lambda: directory,  # type: ignore[arg-type,return-value]
        UserConfig(probe_interval=2.0, probe_timeout=4.0),
        on_request_done=lambda outcome, seconds: done.append((outcome, seconds)),
    )


async def test_an_ask_without_paths_ends_no_path_counted_and_reported_with_its_duration(
    autojump_clock,
):
    overlay = FakeOverlay(answer_probes=False)  # no ready paths until the deadline
    done: list[tuple[str, float]] = []
    client = _observed_client(overlay, done)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        answer = await client.ask("hello", timeout=5.0)
        assert not answer.ok
        assert client.outcomes == {"no_path": 1}
        assert done == [("no_path", pytest.approx(5.0, abs=0.5))]
        nursery.cancel_scope.cancel()


async def test_a_cancelled_ask_is_counted_cancelled_and_reported(autojump_clock):
    overlay = FakeOverlay(answer_probes=False)
    done: list[tuple[str, float]] = []
    client = _observed_client(overlay, done)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        with trio.move_on_after(1.0):
            await client.ask("never mind", timeout=60)
        assert client.outcomes == {"cancelled": 1}
        assert done == [("cancelled", pytest.approx(1.0))]
        nursery.cancel_scope.cancel()


async def test_an_observer_that_raises_costs_the_caller_nothing(autojump_clock, caplog):
    overlay = FakeOverlay(answer_probes=False)
    directory = FakeDirectory()

    def broken(outcome: str, seconds: float) -> None:
        raise RuntimeError("observer bug")

    client = UserClient(
        overlay, lambda: directory, UserConfig(), on_request_done=broken  # type: ignore[arg-type]
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        answer = await client.ask("hello", timeout=1.0)
        assert not answer.ok and client.outcomes == {"no_path": 1}
        assert "on_request_done failed" in caplog.text
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "error, label",
    [
        (None, "ok"),
        ("RequestTimeoutError", "timeout"),
        ("NoPathError", "no_path"),
        ("NoModelNodeError", "no_model_node"),
        ("OverloadedError", "overloaded"),
        ("RequestRefusedError", "refused"),
        ("ContextLengthError", "refused"),
        ("ModelNodeError", "model_error"),
        ("RequestTooLargeError", "too_large"),
        ("RequestError", "error"),
    ],
)
def test_outcome_labels_follow_the_error_class(error, label):
    from ps_p2p import errors

    exception = None if error is None else getattr(errors, error)("x")
    answer = user_module.Answer(request_id=b"r", ok=error is None, exception=exception)
    assert user_module.outcome_label(answer) == label
