"""SIGTERM drains a model node: new requests answered OVERLOADED, requests in service finished
within the grace period (ps_p2p.serving.drain), the record withdrawn from the verifier, exit 0.
The drain core on injected time; the model service on trio's MockClock (no real waiting); the
node against a real verifier; one ``ps-node run`` process (slow)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import trio
import trio.testing

from ps_p2p.inference import ReplyProxy, ResponseStatus
from ps_p2p.keys import Identity
from ps_p2p.roles.model import ModelNodeConfig, ModelNodeService
from ps_p2p.serving.dispatch import SendAnswer, StartJob
from ps_p2p.serving.drain import Drain, DrainReport
from ps_p2p.testing.fakes import InstantEngine
from test_dispatch import OK, PROXIES, _deliver, _dispatcher, _query
from test_model_node import RecordingOverlay, _decode, _request
from test_model_node import _deliver as _deliver_cloves

# ------------------------------------------------------------------ the drain core


@pytest.mark.parametrize(
    "in_service, updates, report",
    [
        (0, [], DrainReport(finished=0, abandoned=0, seconds=0.0)),
        (2, [(1, 3.0), (0, 7.5)], DrainReport(finished=2, abandoned=0, seconds=7.5)),
        (2, [(1, 3.0), (1, 30.0)], DrainReport(finished=1, abandoned=1, seconds=30.0)),
        (1, [(1, 29.9)], None),
    ],
    ids=["idle-at-once", "finished-within-grace", "grace-ran-out", "still-waiting"],
)
def test_a_drain_ends_when_service_empties_or_the_grace_runs_out(in_service, updates, report):
    drain = Drain(30.0, now=0.0, in_service=in_service)

    for count, now in updates:
        drain.update(count, now)

    assert drain.report == report
    assert drain.next_deadline() == (None if report is not None else 30.0)


def test_a_negative_grace_is_refused():
    with pytest.raises(ValueError, match="grace"):
        Drain(-1.0, now=0.0, in_service=0)


# ------------------------------------------------------------------ the dispatch core


def test_while_draining_a_new_request_is_answered_overloaded_and_a_resent_one_joins_its_job():
    d = _dispatcher()
    q = _query()
    (start,) = _deliver(d, q)
    d.draining = True

    (refused,) = _deliver(d, _query("another prompt"), now=1.0)
    resend = dataclasses.replace(q, reply_proxies=tuple(ReplyProxy(p, b"b" * 16) for p in PROXIES))
    joined = _deliver(d, resend, now=1.0)

    assert isinstance(refused, SendAnswer) and refused.content.status == ResponseStatus.OVERLOADED
    assert "shutting down" in refused.content.error
    assert joined == [] and d.in_service == 1
    assert len(d.job_finished(start.key, OK, now=2.0)) == 2 and d.in_service == 0
    assert not isinstance(refused, StartJob)


# ------------------------------------------------------------------ the model service (MockClock)


async def _service(nursery, gate):
    service = ModelNodeService(Identity.generate(), InstantEngine(gate=gate), ModelNodeConfig(capacity=1))
    overlay = RecordingOverlay()
    overlay.identity = service.identity
    service.attach(overlay)
    await nursery.start(service.run)
    return service, overlay


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_a_drain_waits_for_the_request_in_service_and_its_answer_goes_out(autojump_clock):
    gate = trio.Event()
    async with trio.open_nursery() as nursery:
        service, overlay = await _service(nursery, gate)
        _deliver_cloves(service, _request("in service", os.urandom(16), b"A"))
        await service.engine.entered.wait()

        async def finish_later() -> None:
            await trio.sleep(12)  # the job ends 12 s into a 30 s grace (mock time)
            gate.set()

        nursery.start_soon(finish_later)
        started = trio.current_time()
        report = await service.drain(30.0)

        assert report == DrainReport(finished=1, abandoned=0, seconds=pytest.approx(12.0))
        assert trio.current_time() - started == pytest.approx(12.0)
        await overlay.wait_replies(4)
        assert _decode(overlay.replies, b"A").text == "in service"[::-1]
        # a new request while draining: OVERLOADED, no job
        _deliver_cloves(service, _request("too late", os.urandom(16), b"B"))
        await overlay.wait_replies(8)
        assert _decode(overlay.replies, b"B").status == ResponseStatus.OVERLOADED
        assert service.engine.calls == 1
        nursery.cancel_scope.cancel()


async def test_a_drain_gives_up_on_a_stuck_request_when_the_grace_runs_out(autojump_clock):
    async with trio.open_nursery() as nursery:
        service, _ = await _service(nursery, trio.Event())  # never opens
        _deliver_cloves(service, _request("stuck", os.urandom(16), b"A"))
        await service.engine.entered.wait()
        started = trio.current_time()

        report = await service.drain(30.0)

        assert report == DrainReport(finished=0, abandoned=1, seconds=pytest.approx(30.0))
        assert trio.current_time() - started == pytest.approx(30.0)
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ the node and the verifier


async def test_a_draining_model_node_withdraws_its_record_from_the_verifier():
    from ps_p2p.config import NodeConfig
    from ps_p2p.keys import NodeKeys
    from ps_p2p.node import Node

    fast = dict(directory_refresh=0.2, register_interval=1.0)
    async with trio.open_nursery() as nursery:
        verifier = await nursery.start(Node(NodeConfig(roles=["verifier"], **fast), NodeKeys.generate()).run)
        config = NodeConfig(roles=["model"], bootstrap=[verifier.listen_addrs[0]], model="fake", **fast)
        model = await nursery.start(Node(config, NodeKeys.generate(), InstantEngine()).run)
        await verifier.wait_directory(min_models=1)

        report = await model.drain(grace=5.0)

        assert report is not None and report.complete and report.finished == 0
        with trio.fail_after(30):  # withdrawn records live 1 s: the next directories drop it
            while verifier.directory.model_nodes():
                await verifier.wait_directory_update()
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ ps-node run processes


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_sigterm_or_sigint_drains_a_model_node_process_withdraws_it_and_exits_0(
    shared, tmp_path, signame
):
    import signal
    import subprocess
    import sys

    from ps_p2p.devnet import SHARED_MODEL

    model = shared / SHARED_MODEL  # the `shared` fixture skips with a reason when it is absent
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    base = [sys.executable, "-m", "ps_p2p.cli", "run"]
    verifier = subprocess.Popen(
        [*base, "--role", "verifier", "--home", str(tmp_path / "v")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        boot = verifier.stdout.readline().strip()  # its listen multiaddr, once it listens
        node = subprocess.Popen(
            [*base, "--role", "model", "--model", str(model), "--multiaddr", boot,
             "--home", str(tmp_path / "m"), "--drain-timeout", "20"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        assert node.stdout.readline().strip(), "the model node did not start"
        node.send_signal(getattr(signal, signame))
        _, err = node.communicate(timeout=60)
    finally:
        verifier.terminate()
        verifier.wait(timeout=30)

    assert node.returncode == 0, err
    assert f"{signame}: draining" in err
    assert "record withdrawn from 1 verifier(s)" in err
    assert "drained in" in err and "0 abandoned" in err


class _StuckDrainNode:
    """What ``ps_p2p.cli._stop_on_sigterm`` uses of a model node, with a drain that never ends."""

    class config:
        drain_timeout = 30.0

    model = object()

    def __init__(self) -> None:
        self.draining = trio.Event()

    async def drain(self) -> None:
        self.draining.set()
        await trio.sleep_forever()


@pytest.mark.parametrize("first, second", [("SIGINT", "SIGINT"), ("SIGTERM", "SIGINT"),
                                           ("SIGINT", "SIGTERM")])
async def test_first_signal_drains_a_model_node_and_a_second_stops_it_at_once(first, second):
    import signal

    from ps_p2p.cli import _stop_on_sigterm

    node = _StuckDrainNode()
    with trio.CancelScope() as node_scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(_stop_on_sigterm, node_scope, node)
            os.kill(os.getpid(), getattr(signal, first))
            await node.draining.wait()
            assert not node_scope.cancel_called  # draining, not stopped
            os.kill(os.getpid(), getattr(signal, second))
            await trio.sleep_forever()  # until the second signal cancels the node's scope
    assert node_scope.cancel_called
