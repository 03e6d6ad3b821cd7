"""``ps-node`` fails fast and says why: bad multiaddrs, addresses in use, a bad ``--model`` path,
an unreachable verifier and an empty prompt each stop the command at once with one line naming
the flag and the value, before any key file is written."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys

import pytest

from ps_p2p.cli import main
from ps_p2p.config import NodeConfig, check_multiaddr
from ps_p2p.errors import AddressInUseError, ConfigError
from ps_p2p.keys import Identity
from ps_p2p.preflight import check_address_free, check_model_path

PEER = "12D3KooWRUZm9BaBBgi9dCdSQqKQhdPHoxGGxGVrNhTAbXd8hiHa"
BOOT = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"


pytestmark = pytest.mark.usefixtures("restore_logging")


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith(("ps-node: ", "error: "))]
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------------- 1. multiaddrs


@pytest.mark.parametrize(
    "flag, value, reason",
    [
        ("--multiaddr", f"/ip4/127.0.0.1/tcp/99999/p2p/{PEER}", "integer not in range"),
        ("--multiaddr", f"/ip4/127.0.0.300/tcp/4001/p2p/{PEER}", "'127.0.0.300' is not IPv4"),
        ("--multiaddr", "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWAbc", "Invalid CID"),
        ("--multiaddr", "/ip4/127.0.0.1/tcp/4001/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
         "not an Ed25519 peer ID"),
        ("--multiaddr", f"/ip4/127.0.0.1/udp/4001/p2p/{PEER}", "expected /ip4|ip6"),
        ("--listen", "/ip4/127.0.0.1/tcp/99999", "integer not in range"),
        ("--listen", "/ip4/127.0.0.300/tcp/0", "not IPv4"),
        ("--listen", f"/ip4/127.0.0.1/tcp/0/p2p/{PEER}", "and nothing more"),
        ("--listen", "garbage", "unknown protocol"),
        ("--verifier", "notapeer", "not an Ed25519 peer ID"),
    ],
    ids=["port-99999", "ip-300", "short-peer-id", "rsa-peer-id", "udp", "listen-port",
         "listen-ip", "listen-p2p", "listen-garbage", "verifier-id"],
)
def test_a_malformed_address_exits_2_with_one_line_naming_the_flag_and_value(
    tmp_path, capsys, flag, value, reason
):
    argv = ["run", "--home", str(tmp_path / "home"), "--multiaddr", BOOT, flag, value]

    status = main(argv)

    assert status == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{flag} {value}" in line and reason in line
    assert not (tmp_path / "home").exists()  # refused before any key file


def test_config_file_multiaddrs_are_validated_too(tmp_path, capsys):
    (tmp_path / "node.toml").write_text(f'bootstrap = ["/ip4/127.0.0.1/tcp/70000/p2p/{PEER}"]\n')

    status = main(["run", "--home", str(tmp_path / "h"), "--config", str(tmp_path / "node.toml")])

    assert status == 2
    assert "--multiaddr /ip4/127.0.0.1/tcp/70000" in _one_error_line(capsys.readouterr().err)


def test_a_well_formed_bootstrap_multiaddr_parses():
    addr = check_multiaddr(BOOT, "--multiaddr", peer_id=True)

    assert addr.value_for_protocol("p2p") == PEER
    NodeConfig(bootstrap=[BOOT], verifiers=[Identity.generate().peer_id_str]).validate()


# ---------------------------------------------------------------------- 2. addresses in use


@pytest.fixture
def taken_port():
    """A port another socket listens on (with SO_REUSEPORT, as py-libp2p's listener sets it)."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_listen_address_in_use_exits_1_with_one_line_before_the_key_file(
    tmp_path, capsys, taken_port
):
    listen = f"/ip4/127.0.0.1/tcp/{taken_port}"

    status = main(["run", "--role", "verifier", "--home", str(tmp_path / "h"), "--listen", listen])

    assert status == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line == f"ps-node: listen address {listen} is already in use"
    assert not (tmp_path / "h").exists()


def test_an_api_address_in_use_exits_1_with_one_line(tmp_path, capsys, taken_port):
    api = f"127.0.0.1:{taken_port}"

    status = main(["run", "--role", "verifier", "--role", "user", "--home", str(tmp_path / "h"),
                   "--api", api])

    assert status == 1
    assert _one_error_line(capsys.readouterr().err) == f"ps-node: --api {api} is already in use"


def test_a_malformed_api_address_exits_2(tmp_path, capsys):
    status = main(["run", "--multiaddr", BOOT, "--home", str(tmp_path / "h"), "--api", "8088"])

    assert status == 2
    assert "--api must be HOST:PORT" in _one_error_line(capsys.readouterr().err)


def test_the_probe_finds_an_address_in_use_and_passes_a_free_one(taken_port):
    with pytest.raises(AddressInUseError, match="x is already in use") as raised:
        check_address_free("127.0.0.1", taken_port, "x")
    assert isinstance(raised.value, OSError) and raised.value.errno == 98

    check_address_free("127.0.0.1", 0, "port 0 always passes")


# ---------------------------------------------------------------------- 3. --model


def test_model_path_accepts_a_model_folder_and_a_gguf_file(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")

    assert check_model_path(str(tmp_path / "m")) == tmp_path / "m"
    assert check_model_path(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: None, "no such model folder or .gguf file"),
        (lambda p: p.mkdir(), "folder without config.json"),
        (lambda p: p.write_text("weights"), "not a .gguf model"),
    ],
    ids=["missing", "empty-folder", "other-file"],
)
def test_model_path_refuses_what_is_no_model(tmp_path, make, reason):
    path = tmp_path / "model"
    make(path)

    with pytest.raises(ConfigError, match=reason):
        check_model_path(str(path))


def test_a_gguf_name_without_the_gguf_magic_is_refused(tmp_path):
    (tmp_path / "m.gguf").write_text("<html>404</html>")

    with pytest.raises(ConfigError, match="not a GGUF file"):
        check_model_path(str(tmp_path / "m.gguf"))


def test_a_bad_model_path_exits_2_before_torch_is_imported_or_a_key_is_written(tmp_path):
    home = tmp_path / "h"
    code = (
        "import sys\n"
        "from ps_p2p.cli import main\n"
        f"status = main(['run', '--role', 'model', '--model', {str(tmp_path / 'nope')!r},"
        f" '--multiaddr', {BOOT!r}, '--home', {str(home)!r}])\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print('heavy', heavy)\n"
        "sys.exit(status)\n"
    )

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)

    assert done.returncode == 2, done.stderr
    assert "heavy []" in done.stdout
    line = _one_error_line(done.stderr)
    assert f"--model {tmp_path / 'nope'}: no such model folder" in line
    assert not home.exists()


# ---------------------------------------------------------------------- 4, 5. ask


def test_ask_with_an_empty_prompt_exits_2_with_one_line(capsys):
    for prompt in ("", "  \n\t"):
        status = main(["ask", "--multiaddr", BOOT, prompt])

        assert status == 2
        assert "the prompt is empty" in _one_error_line(capsys.readouterr().err)


def test_ask_reports_an_unreachable_verifier_in_one_line_without_waiting_the_deadline(capsys):
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    verifier = f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER}"

    # with the 120 s deadline the old code printed "no directory" after 120 s
    status = main(["ask", "--timeout", "120", "--multiaddr", verifier, "hello"])

    assert status == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line == f"error: cannot reach verifier {verifier}: connection refused"
