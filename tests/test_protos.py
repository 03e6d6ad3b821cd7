"""The generated protobuf modules match protos/."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_generated_modules_are_not_stale():
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) is not installed")
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert result.returncode == 0, (
        f"stale generated modules; run `python scripts/gen_protos.py`:\n{result.stderr}"
    )
