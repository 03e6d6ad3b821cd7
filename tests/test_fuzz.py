"""The network fuzzer (ps_p2p.testing.fuzz) against a live localnet: a short seeded run."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF

from ps_p2p.keys import Identity
from ps_p2p.pb.planetserve.v1 import clove_pb2, directory_pb2, onion_pb2
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.testing.fuzz import (
    FuzzConfig,
    FuzzReport,
    FuzzStreams,
    LivenessCheck,
    _Target,
    iter_report_lines,
    message_classes,
    root_messages,
    run_fuzz,
    watch_handlers,
)

_spec = importlib.util.spec_from_file_location(
    "fuzz_protocols", pathlib.Path(__file__).parents[1] / "benchmarks" / "fuzz_protocols.py")
benchmark = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(benchmark)


def test_root_messages_come_from_the_proto_header_that_names_the_protocol():
    classes = message_classes()
    assert root_messages("/planetserve/onion/1.0.0", classes) == [onion_pb2.OnionFrame]
    assert root_messages("/planetserve/directory/2.0.0", classes) == [
        directory_pb2.CommitteeDirectoryRequest
    ]
    assert clove_pb2.CloveFrame in root_messages("/planetserve/clove/1.0.0", classes)
    assert root_messages("/planetserve/unheard-of/1.0.0", classes)  # falls back to every message


def test_a_run_stopped_by_its_duration_says_so_and_does_not_count_as_done():
    report = FuzzReport(config=FuzzConfig(inputs=100_000, duration=600.0))
    report.inputs_by_protocol["/planetserve/onion/1.0.0"] = 34_382
    report.stopped_on_time = True
    report.checks.append(LivenessCheck(0.0, 6, [], [], 0.1, 0, 0))
    assert "STOPPED ON TIME after 34382 of 100000 inputs" in report.summary()
    record = report.summary_record()
    assert record["stopped_on_time"] and not record["ok"]
    assert (record["inputs"], record["inputs_requested"]) == (34_382, 100_000)


def test_a_run_without_duration_has_no_time_limit():
    assert FuzzConfig().duration is None
    assert benchmark._parser().parse_args([]).duration is None


def test_the_summary_line_names_inputs_per_protocol_crashes_hangs_and_the_slowest_input():
    report = FuzzReport(config=FuzzConfig(inputs=3))
    report.inputs_by_protocol.update({"/planetserve/onion/1.0.0": 2, "/planetserve/clove/1.0.0": 1})
    report.inputs_by_role_protocol.update({"user /planetserve/onion/1.0.0": 2,
                                           "user /planetserve/clove/1.0.0": 1})
    report.input_hangs_by_protocol["/planetserve/clove/1.0.0"] += 1
    report.input_hangs.append("user x clove raw: 1 frame(s): the node neither ended nor reset ...")
    report.slowest_input_seconds, report.slowest_input = 1.5, "user x onion proto, then close"
    report.checks.append(LivenessCheck(0.0, 6, [], [], 0.1, 0, 0))
    record = json.loads(json.dumps(report.summary_record()))
    assert record["inputs_by_protocol"] == {"/planetserve/clove/1.0.0": 1, "/planetserve/onion/1.0.0": 2}
    assert (record["crashes"], record["hangs"], record["ok"]) == (0, 1, False)
    assert record["slowest_input"] == "user x onion proto, then close"
    assert record["slowest_input_seconds"] == 1.5
    assert "onion=2" in report.progress_line(10.0, 0.3)


def _target(host, protocol: str) -> _Target:
    return _Target(host.get_id().to_bytes(), "user", protocol, [])


@pytest.mark.parametrize("ends_it", [True, False])
async def test_an_input_the_node_never_finishes_with_is_a_hang(ends_it):
    async def served(stream):
        try:
            while await stream.read(1024):  # reads to our close ...
                pass
        except StreamEOF:
            pass
        if ends_it:  # ... then ends its side, or holds the stream half-open forever
            await stream.close()
        else:
            await trio.sleep_forever()

    # a hang is certain whatever the machine's speed; a node that ends at once gets 60 s
    config = FuzzConfig(hang_timeout=60.0 if ends_it else 0.5)
    report = FuzzReport(config=config)
    async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as node, \
            open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as attacker, \
            trio.open_nursery() as nursery:
        node.set_stream_handler(TProtocol("/fuzz/test/1"), served)
        await connect(attacker, listen_multiaddrs(node)[0])
        async with trio.open_nursery() as watchers:
            streams = FuzzStreams(config, report, watchers)
            await streams.session(attacker, _target(node, "/fuzz/test/1"), [b"\x01x"], "close",
                                  "user node /fuzz/test/1 raw: 1 frame(s)")
        nursery.cancel_scope.cancel()
    assert report.streams_opened == 1
    if ends_it:
        assert report.hang_count == 0 and report.input_seconds["/fuzz/test/1"][0] == 1
    else:
        assert report.hang_count == 1 and report.input_hangs_by_protocol == {"/fuzz/test/1": 1}
        assert "neither ended nor reset" in report.input_hangs[0]
        assert report.summary_record()["hangs"] == 1


async def test_an_exception_escaping_a_handler_is_reported_as_a_crash_and_still_raised():
    from types import SimpleNamespace

    async def broken(stream):
        raise ValueError("handler bug")

    async def fine(stream):
        return None

    handlers = {TProtocol("/a/1"): broken, TProtocol("/b/1"): fine}
    host = SimpleNamespace(get_mux=lambda: SimpleNamespace(handlers=handlers))
    raised: list[tuple[str, str]] = []
    watch_handlers(host, ["/a/1", "/b/1"], lambda protocol, tb: raised.append((protocol, tb)))
    await handlers[TProtocol("/b/1")](object())
    with pytest.raises(ValueError):  # py-libp2p still sees it, as before
        await handlers[TProtocol("/a/1")](object())
    assert [p for p, _ in raised] == ["/a/1"] and "handler bug" in raised[0][1]


@pytest.mark.slow  # 5-10 s on 2 cores: the localnet and its attacker nodes start up and ask twice
async def test_two_thousand_fuzzed_frames_crash_nothing_and_every_user_is_still_answered():
    report = await run_fuzz(FuzzConfig(seed=7, inputs=2000, check_interval=0, liveness_timeout=60))
    text = "\n".join(iter_report_lines(report))
    assert not report.setup_error, text
    assert not report.crashes, text
    assert report.inputs == 2000 and not report.stopped_on_time, text
    assert report.hang_count == 0, text
    # every protocol every role serves was fuzzed (13 (role, protocol) pairs in 2026-11)
    served = {f"{role} {p}" for role, protocols in report.protocols.items() for p in protocols}
    assert served and served == set(report.inputs_by_role_protocol), text
    final = report.checks[-1]
    assert not final.hangs and not final.failures, text
    assert final.answered == 6, text
    assert report.final_check_ok, text
    assert report.summary_record()["ok"], text
