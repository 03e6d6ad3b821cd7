"""The network fuzzer (ps_p2p.testing.fuzz) against a live localnet: a short seeded run."""

from __future__ import annotations

import pytest

from ps_p2p.pb.planetserve.v1 import clove_pb2, directory_pb2, onion_pb2
from ps_p2p.testing.fuzz import FuzzConfig, iter_report_lines, message_classes, root_messages, run_fuzz


def test_root_messages_come_from_the_proto_header_that_names_the_protocol():
    classes = message_classes()
    assert root_messages("/planetserve/onion/1.0.0", classes) == [onion_pb2.OnionFrame]
    assert root_messages("/planetserve/directory/2.0.0", classes) == [
        directory_pb2.CommitteeDirectoryRequest
    ]
    assert clove_pb2.CloveFrame in root_messages("/planetserve/clove/1.0.0", classes)
    assert root_messages("/planetserve/unheard-of/1.0.0", classes)  # falls back to every message


@pytest.mark.slow  # 20-30 s on 2 cores: the localnet and its attacker nodes start up and ask twice
async def test_two_thousand_fuzzed_frames_crash_nothing_and_every_user_is_still_answered():
    report = await run_fuzz(
        FuzzConfig(seed=7, inputs=2000, duration=120, check_interval=0, liveness_timeout=60)
    )
    text = "\n".join(iter_report_lines(report))
    assert not report.setup_error, text
    assert not report.crashes, text
    assert report.inputs == 2000, text
    # every protocol every node serves was fuzzed
    served = {p for protocols in report.protocols.values() for p in protocols}
    assert served and served == set(report.inputs_by_protocol), text
    final = report.checks[-1]
    assert not final.hangs and not final.failures, text
    assert final.answered == 6, text
    assert report.final_check_ok, text
