"""Tests of the ``ps-node`` command (ps_p2p.cli): keygen, configuration errors, the flags the
README documents, and (marked ``slow``) a network of ``ps-node run`` processes that ``ps-node ask``
gets an answer from."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import trio

from ps_p2p.cli import _run_config, _run_node_at_home, build_parser, main
from ps_p2p.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parent.parent
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
BOOT = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWEyoppNCUx8Yx66oV9fJnriXwCcXwDDUA2kj6vnc6iDEp"


pytestmark = pytest.mark.usefixtures("restore_logging")


# ---------------------------------------------------------------------- keygen


def test_keygen_prints_the_peer_id_and_creates_a_0600_key_file(tmp_path, capsys):
    path = tmp_path / "keys" / "node.key"

    status = main(["keygen", "--key-file", str(path)])

    assert status == 0
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(r"12D3KooW[1-9A-HJ-NP-Za-km-z]{44}", out), out
    assert path.stat().st_mode & 0o777 == 0o600


def test_keygen_refuses_to_overwrite_an_existing_key_file(tmp_path, capsys):
    path = tmp_path / "node.key"
    assert main(["keygen", "--key-file", str(path)]) == 0
    before = path.read_bytes()
    capsys.readouterr()

    status = main(["keygen", "--key-file", str(path)])

    assert status == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "refusing to overwrite" in captured.err
    assert path.read_bytes() == before


# ---------------------------------------------------------------------- configuration errors


@pytest.mark.parametrize(
    "args, config, message",
    [
        (["--role", "model", "--multiaddr", BOOT], None, "needs --model"),
        (["--role", "user"], None, "needs --multiaddr"),
        (["--role", "user", "--multiaddr", "/ip4/127.0.0.1/tcp/4001"], None, "lacks /p2p/"),
        (["--role", "model", "--model", "m", "--multiaddr", BOOT, "--capacity", "0"], None,
         "--capacity"),
        (["--multiaddr", BOOT], 'colour = "blue"\n', "unknown config key 'colour'"),
        (["--multiaddr", BOOT], "[user]\ntotl = 4\n", "unknown key(s) in [user]: totl"),
        (["--multiaddr", BOOT], "roles = [\n", "bad TOML"),
        (["--multiaddr", BOOT], 'engine = "llamacpp"\n', "unknown engine 'llamacpp'"),
    ],
    ids=["model-without-model", "user-without-multiaddr", "multiaddr-without-p2p",
         "capacity-0", "toml-unknown-key", "toml-unknown-user-key", "toml-syntax", "toml-engine"],
)
def test_run_with_a_bad_configuration_exits_2_with_a_message(
    tmp_path, capsys, args, config, message
):
    argv = ["run", "--key-file", str(tmp_path / "node.key"), *args]
    if config is not None:
        (tmp_path / "node.toml").write_text(config)
        argv += ["--config", str(tmp_path / "node.toml")]

    status = main(argv)

    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("ps-node: ")
    assert message in err
    assert not (tmp_path / "node.key").exists()


def test_run_with_a_missing_config_file_exits_2_with_a_message(tmp_path, capsys):
    missing = tmp_path / "absent.toml"

    status = main(["run", "--multiaddr", BOOT, "--config", str(missing)])

    assert status == 2
    assert f"cannot read config file {missing}" in capsys.readouterr().err


def test_run_with_a_metrics_address_in_use_exits_1_with_one_line_naming_it(tmp_path, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"

        status = main(["run", "--role", "verifier", "--key-file", str(tmp_path / "node.key"),
                       "--metrics", address])

    assert status == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("ps-node: ")]
    assert f"cannot serve metrics on {address}" in line and "in use" in line


def test_devnet_without_prompts_or_shared_data_exits_2_naming_the_missing_file(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("PS_SHARED_DIR", str(tmp_path))

    status = main(["devnet", "--engine", "instant"])

    assert status == 2
    expected = tmp_path / "data" / "mtbench" / "question.jsonl"
    assert f"devnet needs --prompts FILE (there is no {expected})" in capsys.readouterr().err


def test_unknown_role_is_a_usage_error_with_status_2(capsys):
    with pytest.raises(SystemExit) as exc_info:
        main(["run", "--role", "wizard"])

    assert exc_info.value.code == 2
    assert "invalid choice: 'wizard'" in capsys.readouterr().err


# ---------------------------------------------------------------------- home, stdout


def _config(*argv: str):  # type: ignore[no-untyped-def]
    return _run_config(build_parser().parse_args(["run", *argv]))


@pytest.mark.parametrize(
    "argv, home, key",
    [
        (["--multiaddr", BOOT], "data/ps_p2p/user", "data/ps_p2p/user/node.key"),
        (["--role", "verifier", "--role", "model", "--model", "m"],
         "data/ps_p2p/model+verifier", "data/ps_p2p/model+verifier/node.key"),
        (["--multiaddr", BOOT, "--name", "alice"], "data/ps_p2p/alice",
         "data/ps_p2p/alice/node.key"),
        (["--multiaddr", BOOT, "--home", "h"], "h", "h/node.key"),
        (["--multiaddr", BOOT, "--key-file", "k/u.key"], "data/ps_p2p/user", "k/u.key"),
    ],
    ids=["default-user", "roles-name", "name", "home", "key-file-wins"],
)
def test_home_defaults_to_the_user_data_dir_by_name_and_key_file_overrides_the_key(
    tmp_path, monkeypatch, argv, home, key
):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)

    config = _config(*argv)

    assert config.home_path.resolve() == tmp_path / home
    assert config.key_path.resolve() == tmp_path / key


@pytest.mark.parametrize("name", ["../up", "a/b", ".hidden", ""])
def test_a_name_that_is_not_a_folder_name_exits_2(name, capsys):
    assert main(["run", "--multiaddr", BOOT, "--name", name]) == 2
    assert "bad node name" in capsys.readouterr().err


async def test_run_prints_each_listen_multiaddr_with_the_peer_id_alone_on_stdout(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    config = _config("--role", "verifier")

    async with trio.open_nursery() as nursery:
        node = await nursery.start(_run_node_at_home, config, None, None)
        out = capsys.readouterr().out
        nursery.cancel_scope.cancel()

    peer_id = node.keys.identity.peer_id_str
    assert out.splitlines() == node.listen_addrs
    address = rf"/ip4/127\.0\.0\.1/tcp/\d+/p2p/{peer_id}"
    assert all(re.fullmatch(address, a) for a in node.listen_addrs)
    assert list((tmp_path / "cwd").iterdir()) == []  # no key file in the working directory
    assert (tmp_path / "data" / "ps_p2p" / "verifier" / "node.key").is_file()


async def test_run_creates_its_home_with_the_key_file_and_refuses_a_second_node_on_it(tmp_path):
    home = tmp_path / "nodes" / "v1"
    config = _config("--role", "verifier", "--home", str(home))

    async with trio.open_nursery() as nursery:
        node = await nursery.start(_run_node_at_home, config, None, None)
        with pytest.raises(ConfigError, match="in use by another node"):
            await _run_node_at_home(config, None, None)
        nursery.cancel_scope.cancel()

    assert home.stat().st_mode & 0o777 == 0o700
    assert (home / "node.key").stat().st_mode & 0o777 == 0o600
    assert json.loads((home / "node.key").read_text())["peer_id"] == node.keys.identity.peer_id_str


# ---------------------------------------------------------------------- README reference vs parser


def _readme_flags() -> dict[str | None, set[str]]:
    """Flags in README.md's ``ps-node`` reference, by subcommand (None = global).

    Taken from each subcommand's synopsis (the backticked ``ps-node <command> ...`` line) and the
    first column of its table (the meaning column may quote other programs' flags).
    """
    text = (REPO / "README.md").read_text(encoding="utf-8")
    reference = text.split("## `ps-node` reference", 1)[1]
    flags: dict[str | None, set[str]] = {None: set()}
    section: str | None = None
    for line in reference.splitlines():
        synopsis = re.match(r"`ps-node (\w[\w-]*)([^`]*)`", line)
        if synopsis:
            section = synopsis.group(1)
            flags.setdefault(section, set()).update(FLAG.findall(synopsis.group(2)))
        elif line.startswith("Global:"):
            flags[None].update(FLAG.findall(line))
        elif line.startswith("|") and section is not None:
            flags[section].update(FLAG.findall(line.split("|")[1]))
    return flags


def _help_flags(command: str | None, capsys) -> set[str]:
    """The options ``ps-node [command] --help`` lists, and those of the command's own
    subcommands (``ps-node org new``): the README documents them under the command's synopses."""
    import argparse

    argvs = [[command, "--help"] if command else ["--help"]]
    if command:
        (top,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
        nested = [a for a in top.choices[command]._actions
                  if isinstance(a, argparse._SubParsersAction)]
        argvs += [[command, sub, "--help"] for action in nested for sub in action.choices]
    flags: set[str] = set()
    for argv in argvs:
        with pytest.raises(SystemExit) as exc_info:
            build_parser().parse_args(argv)
        assert exc_info.value.code == 0
        usage = capsys.readouterr().out.split("\n\n", 1)[0]  # the usage lines, not the help text
        flags |= set(FLAG.findall(usage))
    return flags - {"--help"}


def _subcommands() -> list[str]:
    """The parser's subcommands (so a new one must be documented too)."""
    import argparse

    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(action.choices)


def test_readme_reference_documents_every_subcommand():
    assert set(_readme_flags()) == {None, *_subcommands()}


@pytest.mark.parametrize("command", [None, *_subcommands()])
def test_help_lists_every_flag_the_readme_documents(command, capsys):
    documented = _readme_flags()[command]
    assert documented, f"README documents no flag of {command or 'ps-node'}"

    missing = documented - _help_flags(command, capsys)

    assert not missing, f"README documents {sorted(missing)} but `{command} --help` lacks them"


@pytest.mark.parametrize("command", [None, *_subcommands()])
def test_readme_documents_every_flag_of_the_parser(command, capsys):
    undocumented = _help_flags(command, capsys) - _readme_flags()[command]

    assert not undocumented, f"`{command} --help` has {sorted(undocumented)}; README lacks them"


# ---------------------------------------------------------------------- system: OS processes


class _Node:
    """One ``ps-node run`` process with its key, status and log files under ``workdir``."""

    def __init__(self, workdir: pathlib.Path, name: str, role: str, *args: str) -> None:
        self.name = name
        self.status_path = workdir / f"{name}.status.json"
        self.log_path = workdir / f"{name}.log"
        cmd = [
            sys.executable, "-m", "ps_p2p.cli", "run", "--role", role,
            "--listen", "/ip4/127.0.0.1/tcp/0", "--key-file", str(workdir / f"{name}.key"),
            "--status-file", str(self.status_path), *args,
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=_env(), cwd=REPO, start_new_session=True,
            )

    def status(self) -> dict | None:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return None

    def log_tail(self) -> str:
        try:
            return f"--- {self.name} ---\n" + self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return f"--- {self.name}: no log ---"


def _env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _wait_for(
    nodes: list[_Node], ready: Callable[[dict], bool], what: str, timeout: float = 90.0
) -> None:
    """Poll the status files (other processes rewrite them every 0.5 s) until ``ready`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        for node in nodes:
            assert node.process.poll() is None, (
                f"{node.name} exited with {node.process.returncode}\n{node.log_tail()}"
            )
        if all((s := node.status()) is not None and ready(s) for node in nodes):
            return
        if time.monotonic() > deadline:
            logs = "\n".join(node.log_tail() for node in nodes)
            raise AssertionError(f"no {what} within {timeout:.0f} s\n{logs}")
        time.sleep(0.2)  # waiting on files written by other processes


def _stop(
    nodes: list[_Node], grace: float = 10.0, signum: int = signal.SIGINT
) -> dict[str, int]:
    """Send ``signum`` to every live process, SIGKILL those still running after ``grace`` s.

    Returns the exit status of each process that stopped on the signal.
    """
    for node in nodes:
        if node.process.poll() is None:
            node.process.send_signal(signum)
    stopped: dict[str, int] = {}
    deadline = time.monotonic() + grace
    for node in nodes:
        try:
            stopped[node.name] = node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.process.kill()
            node.process.wait()
    return stopped


def _start_verifier(tmp_path, nodes: list[_Node]) -> str:
    """Start a verifier process (appended to ``nodes``); returns its listen multiaddr."""
    verifier = _Node(tmp_path, "verifier", "verifier")
    nodes.append(verifier)
    _wait_for([verifier], lambda s: bool(s.get("listen")), "verifier listen address")
    return verifier.status()["listen"][0]


@pytest.mark.slow
def test_ask_gets_a_signed_answer_from_a_network_of_processes(shared, tmp_path):
    nodes: list[_Node] = []
    try:
        boot = _start_verifier(tmp_path, nodes)
        model = _Node(tmp_path, "model", "model",
                      "--model", str(shared / "models" / "stories260K"), "--multiaddr", boot)
        nodes.append(model)
        users = [_Node(tmp_path, f"user{i}", "user", "--multiaddr", boot) for i in range(4)]
        nodes += users
        _wait_for(
            users,
            lambda s: (s.get("directory") or {}).get("users", 0) >= 4
            and s["directory"]["model_nodes"] >= 1
            and s.get("ready_paths", 0) >= 4,
            "4 ready paths on every user",
        )
        model_peer_id = model.status()["peer_id"]

        done = subprocess.run(
            [sys.executable, "-m", "ps_p2p.cli", "--log-level", "WARNING", "ask",
             "--multiaddr", boot, "--max-tokens", "16", "--timeout", "60", "--json",
             "Once upon a time"],
            capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120,
        )

        logs = done.stderr[-3000:] + "\n" + "\n".join(n.log_tail() for n in nodes)
        assert done.returncode == 0, logs
        answer = json.loads(done.stdout)
        assert answer["ok"] is True, answer
        assert answer["response"].strip(), answer
        assert answer["signature_valid"] is True
        assert answer["served_by"] == model_peer_id
        assert answer["cloves_received"] >= 3
        assert answer["error"] is None

        streamed = subprocess.run(
            [sys.executable, "-m", "ps_p2p.cli", "--log-level", "WARNING", "ask",
             "--multiaddr", boot, "--max-tokens", "16", "--timeout", "60", "--stream",
             "Once upon a time"],
            capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120,
        )
        assert streamed.returncode == 0, streamed.stderr[-3000:]
        # greedy: the streamed text is the same answer, then one newline
        assert streamed.stdout == answer["response"] + "\n"
        assert "signature valid" in streamed.stderr
    finally:
        _stop(nodes)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_nodes_stopped_by_sigint_or_sigterm_exit_with_status_0(shared, tmp_path, signum):
    nodes: list[_Node] = []
    try:
        boot = _start_verifier(tmp_path, nodes)
        nodes.append(_Node(tmp_path, "model", "model",
                           "--model", str(shared / "models" / "stories260K"), "--multiaddr", boot))
        nodes.append(_Node(tmp_path, "user", "user", "--multiaddr", boot))
        _wait_for(nodes[1:], lambda s: (s.get("directory") or {}).get("model_nodes", 0) >= 1,
                  "a directory with the model node")
    finally:
        stopped = _stop(nodes, signum=signum)

    logs = "\n".join(n.log_tail() for n in nodes)
    assert stopped == {"verifier": 0, "model": 0, "user": 0}, logs


def test_group_key_makes_a_fresh_secret_and_writes_it_for_the_owner_only(tmp_path, capsys):
    import tomllib

    from ps_p2p.cli import main
    from ps_p2p.config import ForwardingConfig

    assert main(["group-key"]) == 0 and main(["group-key"]) == 0
    first, second = capsys.readouterr().out.split()
    assert first != second and len(bytes.fromhex(first)) == 32
    out = tmp_path / "group.toml"
    assert main(["group-key", "--out", str(out)]) == 0
    assert out.stat().st_mode & 0o777 == 0o600
    assert ForwardingConfig(**tomllib.loads(out.read_text())["forwarding"]).active
    assert main(["group-key", "--out", str(out)]) == 2  # never overwrites a secret


# ---------------------------------------------------------------------- first-day defects (issue 21)


def test_version_prints_the_package_version_and_exits_0(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])

    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"ps-node {metadata.version('ps_p2p')}"


@pytest.mark.parametrize("level", ["foo", "verbose", "20"])
def test_an_unknown_log_level_is_a_usage_error_naming_the_levels(level, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--log-level", level, "status", "--home", "/nonexistent"])

    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{level!r} is not a log level" in err and "WARNING" in err


@pytest.mark.parametrize("argv, level", [
    (["ask", "--multiaddr", BOOT, "hi"], "WARNING"),
    (["--log-level", "info", "ask", "--multiaddr", BOOT, "hi"], "INFO"),
    (["run"], "INFO"),
    (["--log-level", "debug", "run"], "DEBUG"),
])
def test_ask_logs_warnings_only_unless_asked_and_other_commands_info(argv, level, monkeypatch):
    from ps_p2p import cli

    levels: list[str] = []
    monkeypatch.setattr(cli, "_setup_logging", lambda lvl, **kw: levels.append(lvl))
    monkeypatch.setattr(cli, "_cmd_ask", lambda args: 0)
    monkeypatch.setattr(cli, "_cmd_run", lambda args: 0)

    assert main(argv) == 0
    assert levels == [level]


@pytest.mark.parametrize("verifiers, f", [(2, 0), (3, 0), (5, 1), (6, 1), (8, 2)])
def test_testnet_of_a_size_not_3f_plus_1_names_the_faults_it_tolerates(
    verifiers, f, tmp_path, capsys
):
    assert main(["testnet", "--verifiers", str(verifiers), "--out", str(tmp_path / "t")]) == 0

    err = capsys.readouterr().err
    assert f"{verifiers} verifiers tolerate {f} faulty one" in err
    assert f"no more than {3 * f + 1} would" in err


@pytest.mark.slow
def test_status_imports_neither_libp2p_nor_torch(tmp_path):
    """``ps-node status`` answers without the network's imports (was 3-10 s on a loaded
    machine: every subcommand imported libp2p)."""
    (tmp_path / "status.json").write_text(json.dumps(
        {"peer_id": "12D3KooWx", "roles": ["user"], "listen": [], "directory": None,
         "ready_paths": 0, "written_at_ms": int(time.time() * 1000)}))
    code = ("import sys; from ps_p2p.cli import main; "
            f"rc = main(['status', '--home', {str(tmp_path)!r}]); "
            "print(sorted(m for m in ('libp2p', 'torch', 'transformers') if m in sys.modules), rc)")

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=60, check=False)

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[] 0"


async def test_a_node_with_metrics_says_where_once_and_its_status_file_carries_its_health(
    tmp_path, capsys, caplog
):
    import trio.testing

    from ps_p2p.cli import _status_writer
    from ps_p2p.health import node_health

    caplog.set_level(logging.INFO)
    config = _config("--role", "verifier", "--home", str(tmp_path / "v"),
                     "--metrics", "127.0.0.1:0")
    status = tmp_path / "status.json"
    async with trio.open_nursery() as nursery:
        node = await nursery.start(_run_node_at_home, config, None, None)
        nursery.start_soon(_status_writer, node, status, None)
        await trio.testing.wait_all_tasks_blocked()  # the writer wrote, and sleeps
        expected = node_health(node).as_json()
        nursery.cancel_scope.cancel()

    said = capsys.readouterr().err + caplog.text
    assert said.count(f"metrics on {node.metrics.url}") == 1
    assert json.loads(status.read_text())["health"] == expected


def test_status_prints_the_health_of_the_status_file(tmp_path, capsys):
    (tmp_path / "status.json").write_text(json.dumps(
        {"peer_id": "12D3KooWx", "roles": ["user"], "listen": [], "directory": None,
         "ready_paths": 0, "written_at_ms": int(time.time() * 1000),
         "health": {"ok": False, "reasons": ["no verified directory yet"]}}))

    assert main(["status", "--home", str(tmp_path)]) == 0

    assert "health     UNAVAILABLE: no verified directory yet" in capsys.readouterr().out
