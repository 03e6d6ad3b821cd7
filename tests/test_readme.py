"""The README's hand-run recipe runs as written (issue 21: its readiness loop once waited for
``"ready": true`` where the API sends ``"ready":true``, and never ended).

The test takes the shell block of README "A long-running network, by hand" and the Python block
of the ``openai`` client after it, straight from README.md, and runs them in one bash script
(``set -e``) from a folder beside ``shared/`` (a link to the shared model and data), with the
venv's ``ps-node`` and ``python3`` first on ``PATH``. Only the two fixed ports are replaced by
free ones (4001 and 8088 may be taken on a shared machine). Everything it starts is in its own
process group, killed at the end whatever happened.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def readme_block(after: str, language: str) -> str:
    """The first fenced ``language`` block of README.md after the line containing ``after``."""
    text = (REPO / "README.md").read_text()
    start = text.index(after)
    match = re.compile(rf"```{language}\n(.*?)```", re.DOTALL).search(text, start)
    assert match is not None, f"no {language} block after {after!r} in README.md"
    return match.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hand_run_script(verifier_port: int, api_port: int) -> str:
    """The README's shell block, its last line (stopping the nodes) after the Python block."""
    shell = readme_block("A long-running network, by hand", "bash")
    python = readme_block("The user node's API speaks OpenAI's protocol", "python")
    lines = shell.rstrip("\n").split("\n")
    stop = [i for i, line in enumerate(lines) if line.startswith("kill $(jobs -p)")]
    assert stop, "the README's block no longer ends by stopping its nodes"
    body, tail = "\n".join(lines[: stop[0]]), "\n".join(lines[stop[0]:])
    script = (f"set -e\n{body}\npython3 - <<'README_PYTHON'\n{python}README_PYTHON\n"
              f"echo; echo README-PYTHON-DONE\n{tail}\n")
    return script.replace("tcp/4001", f"tcp/{verifier_port}").replace("8088", str(api_port))


def test_the_hand_run_script_keeps_the_readme_order():
    script = hand_run_script(4101, 8188)

    assert script.index("ps-node run --role verifier") < script.index("/health")
    assert script.index("/health") < script.index("client.chat.completions.create")
    assert script.index("README-PYTHON-DONE") < script.index("kill $(jobs -p)")
    assert "8088" not in script and "tcp/4001" not in script


@pytest.mark.slow
def test_the_readme_hand_run_network_answers_as_written(shared, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "shared").symlink_to(shared)  # ../shared, as beside a fresh clone
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(REPO),
               PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    script = hand_run_script(_free_port(), _free_port())
    proc = subprocess.Popen(["bash", "-c", script], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the README's block did not finish in 300 s:\n{out[-2000:]}\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the block left running
        except ProcessLookupError:
            pass

    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"
    assert '"object":"text_completion"' in out.replace(" ", "")  # the curl completion
    assert "-- served by" in err and "signature valid" in err  # ps-node ask
    story = out.split("README-PYTHON-DONE")[0].rsplit("}", 1)[-1]
    assert story.strip(), "the openai client streamed no text"


async def test_the_readme_readiness_check_passes_on_a_ready_api_and_fails_on_one_not_ready():
    """The condition of the README's wait loop (``until <condition>; do sleep 1; done``), run
    by bash against the API of a ready node and of one whose model node is lost."""
    import shutil

    import trio

    from ps_p2p.api.openai_compat import serve_api
    from ps_p2p.testing.fakes import FakeUserNode

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    shell = readme_block("A long-running network, by hand", "bash")
    (condition,) = re.findall(r"^until (curl .*?); do sleep 1; done", shell, re.MULTILINE)
    node = FakeUserNode()

    async def check() -> int:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_api, node, "127.0.0.1:0")
            port = url.rsplit(":", 1)[1]
            done = await trio.run_process(["bash", "-c", condition.replace("8088", port)],
                                          check=False, capture_stdout=True)
            nursery.cancel_scope.cancel()
        return done.returncode

    ready = await check()
    node.user.lose(node.model_record.peer_id)
    not_ready = await check()

    assert (ready, not_ready != 0) == (0, True)
