"""``ps-node devnet`` (ps_p2p.devnet): networks of OS processes on 127.0.0.1.

The cheap tests run the overlay with the instant fake engine, several nodes per process; the
system tests (marked ``slow``) run the real TinyStories model, one node per process.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

from ps_p2p.devnet import (
    DevnetOptions,
    default_start_timeout,
    latency_summary,
    shared_defaults,
    shared_dir,
    work_directory,
)
from ps_p2p.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parent.parent


def _devnet(
    tmp_path: pathlib.Path, *args: str, timeout: float = 400, **env_vars: str
) -> subprocess.CompletedProcess:
    """Run ``ps-node devnet`` with its temporary directories under ``tmp_path/tmp``."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp), **env_vars)
    cmd = [sys.executable, "-m", "ps_p2p.cli", "--log-level", "WARNING", "devnet", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _prompt_file(tmp_path: pathlib.Path, count: int) -> pathlib.Path:
    path = tmp_path / "prompts.txt"
    path.write_text("".join(f"Once upon a time, story number {i}\n" for i in range(count)))
    return path


def test_default_start_timeout_grows_with_the_node_count():
    assert default_start_timeout(14) == 74.0
    assert DevnetOptions(users=100, models=2, verifiers=4).start_deadline == 166.0
    assert DevnetOptions(start_timeout=30.0).start_deadline == 30.0


SHARED = pathlib.Path("/srv/shared")
MODEL = str(SHARED / "models" / "stories260K")
MTBENCH = str(SHARED / "data" / "mtbench" / "question.jsonl")


@pytest.mark.parametrize(
    "model, prompts, engine, present, expected",
    [
        (None, None, "transformers", {MODEL, MTBENCH}, (MODEL, MTBENCH)),
        ("m", "p.txt", "transformers", {MODEL, MTBENCH}, ("m", "p.txt")),
        (None, "p.txt", "transformers", {MODEL}, (MODEL, "p.txt")),
        ("m", None, "transformers", {MTBENCH}, ("m", MTBENCH)),
        (None, None, "transformers", set(), (None, None)),
        (None, None, "instant", {MODEL, MTBENCH}, (None, MTBENCH)),
    ],
    ids=["both-from-shared", "given-win", "model-from-shared", "prompts-from-shared",
         "no-shared", "instant-loads-no-model"],
)
def test_shared_defaults_fill_only_what_is_missing_and_present(
    model, prompts, engine, present, expected
):
    found = shared_defaults(model, prompts, engine=engine, shared=SHARED,
                            exists=lambda path: str(path) in present)

    assert found == expected


@pytest.mark.parametrize(
    "environ, expected",
    [({}, "/work/shared"), ({"PS_SHARED_DIR": "/data/ps"}, "/data/ps"),
     ({"PS_SHARED_DIR": ""}, "/work/shared")],
    ids=["beside-the-repo", "env-overrides", "empty-env-ignored"],
)
def test_shared_dir_is_beside_the_repository_unless_ps_shared_dir_is_set(environ, expected):
    assert shared_dir(environ, pathlib.Path("/work/main")) == pathlib.Path(expected)


@pytest.mark.parametrize("fails", [False, True], ids=["normal-exit", "error"])
def test_a_temporary_work_directory_is_removed_when_the_devnet_exits(tmp_path, monkeypatch, fails):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        with work_directory(None) as workdir:
            assert workdir.parent == tmp_path and workdir.name.startswith("ps-devnet-")
            assert {p.name for p in workdir.iterdir()} == {"keys", "logs", "status"}
            (workdir / "keys" / "user0.key").write_text("{}")
            if fails:
                raise RuntimeError("a node failed")

    assert list(tmp_path.iterdir()) == []


def test_a_given_work_directory_is_kept_without_its_old_status_files(tmp_path):
    given = tmp_path / "net"
    (given / "status").mkdir(parents=True)
    (given / "status" / "user0.json").write_text("{}")

    with work_directory(str(given)) as workdir:
        assert workdir == given
        assert list((given / "status").iterdir()) == []
        (workdir / "logs" / "user0.log").write_text("up")

    assert (given / "logs" / "user0.log").read_text() == "up"


def test_latency_summary_uses_nearest_rank_percentiles():
    stats = latency_summary([float(i) for i in range(1, 101)])

    assert stats == {"median": 50.5, "p95": 95.0, "p99": 99.0, "max": 100.0}


@pytest.mark.slow
def test_instant_engine_with_several_nodes_per_process_answers_every_prompt(tmp_path):
    out = tmp_path / "results.jsonl"

    done = _devnet(
        tmp_path, "--engine", "instant", "--prompts", str(_prompt_file(tmp_path, 4)),
        "--users", "5", "--models", "1", "--verifiers", "1", "--nodes-per-process", "3",
        "--concurrency", "2", "--timeout", "60", "--start-timeout", "240", "--json", str(out),
    )

    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_id"] for r in rows] == ["1", "2", "3", "4"]
    assert all(r["ok"] and r["signature_valid"] and r["response"] for r in rows), rows
    assert "answered 4/4 prompts" in done.stdout
    assert "; 4 processes," in done.stdout  # 1 verifier, 1 model node, 5 users in 2 processes
    assert list((tmp_path / "tmp").iterdir()) == []  # the ps-devnet-* work dir is gone


def test_start_deadline_error_names_the_nodes_not_ready_and_removes_the_work_dir(tmp_path):
    done = _devnet(
        tmp_path, "--engine", "instant", "--prompts", str(_prompt_file(tmp_path, 1)),
        "--users", "4", "--models", "1", "--verifiers", "1", "--nodes-per-process", "6",
        "--start-timeout", "0.5",
    )

    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    assert "network not ready (--start-timeout 0.5 s)" in done.stderr, done.stderr
    assert "verifier0: not listening" in done.stderr or "user0:" in done.stderr, done.stderr
    assert list((tmp_path / "tmp").iterdir()) == []


def test_transformers_engine_without_a_model_is_a_usage_error(tmp_path):
    done = _devnet(tmp_path, "--prompts", str(_prompt_file(tmp_path, 1)), timeout=60,
                   PS_SHARED_DIR=str(tmp_path / "no-shared"))

    assert done.returncode == 2
    assert "--engine transformers needs --model" in done.stderr


def _committee_devnet(tmp_path, perturb: str):
    """A 4-verifier devnet (instant engine, 6 prompts) under ``perturb``: (result, JSON out,
    work dir)."""
    out = tmp_path / "results.jsonl"
    work = tmp_path / "work"
    done = _devnet(
        tmp_path, "--engine", "instant", "--prompts", str(_prompt_file(tmp_path, 6)),
        "--users", "6", "--models", "1", "--verifiers", "4",
        "--nodes-per-process", "4", "--concurrency", "2", "--timeout", "60",
        "--perturb", perturb, "--json", str(out), "--workdir", str(work),
    )
    return done, out, work


@pytest.mark.slow
def test_a_committee_devnet_answers_every_prompt_while_a_validator_is_killed(tmp_path):
    done, out, work = _committee_devnet(tmp_path, "kill-verifier")

    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "a committee of 4 verifier(s)" in done.stdout
    assert "answered 6/6 prompts" in done.stdout and "killed verifier3" in done.stdout
    # restarted from its home, it catches up and signs again
    assert "restarted verifier3 from its home" in done.stdout
    assert re.search(r"verifier3 restarted from its home caught up to height \d+ .* and "
                     r"signed [1-9]\d* proposals/votes again", done.stdout), done.stdout[-2000:]
    assert (work / "genesis.json").is_file()
    assert all((work / "homes" / f"verifier{i}" / "consensus.sqlite").is_file() for i in range(4))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["ok"] and r["signature_valid"] for r in rows), rows


@pytest.mark.parametrize("perturb", ["kill-verifier", "byzantine-verifier"])
def test_verifier_perturbations_need_a_committee_of_four(tmp_path, perturb):
    done = _devnet(tmp_path, "--engine", "instant", "--prompts", str(_prompt_file(tmp_path, 1)),
                   "--verifiers", "3", "--perturb", perturb, timeout=60)

    assert done.returncode == 2
    assert f"--perturb {perturb} needs --verifiers >= 4" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("flag", ["--committee", "--no-committee"])
def test_the_verifiers_are_always_a_committee(tmp_path, flag):
    done = _devnet(tmp_path, "--engine", "instant", "--prompts", str(_prompt_file(tmp_path, 1)),
                   flag, timeout=60)

    assert done.returncode == 2
    assert f"unrecognized arguments: {flag}" in done.stderr


@pytest.mark.slow
def test_a_committee_devnet_with_a_byzantine_verifier_answers_and_commits_evidence(tmp_path):
    done, out, work = _committee_devnet(tmp_path, "byzantine-verifier")

    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "a committee of 4 verifier(s)" in done.stdout
    assert "verifier3" in done.stdout and "is a byzantine validator" in done.stdout
    summary = re.search(r"answered 6/6 prompts.*; (\d+) equivocation evidence committed "
                        r"\(against verifier3\)", done.stdout)
    assert summary and int(summary.group(1)) > 0, done.stdout[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["ok"] and r["signature_valid"] for r in rows), rows
    honest = json.loads((work / "status" / "verifier0.json").read_text())["committee"]
    assert honest["evidence"] > 0 and len(honest["equivocators"]) == 1
    assert "BYZANTINE" in (work / "logs" / "verifier3.log").read_text()


@pytest.mark.slow
def test_kill_relay_inside_a_shared_process_still_answers_every_prompt(tmp_path):
    out = tmp_path / "results.jsonl"

    done = _devnet(
        tmp_path, "--engine", "instant", "--prompts", str(_prompt_file(tmp_path, 6)),
        "--users", "6", "--models", "2", "--verifiers", "2", "--nodes-per-process", "3",
        "--concurrency", "3", "--timeout", "90", "--perturb", "kill-relay", "--json", str(out),
    )

    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "answered 6/6 prompts" in done.stdout
    assert "killed" in done.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["ok"] and r["signature_valid"] for r in rows), rows


@pytest.mark.slow
@pytest.mark.parametrize("perturb", ["none", "kill-relay", "tamper-clove"])
def test_devnet_answers_every_prompt_with_valid_signatures(shared, tmp_path, perturb):
    out = tmp_path / "results.jsonl"
    done = _devnet(
        tmp_path,
        "--model", str(shared / "models" / "stories260K"),
        "--prompts", str(shared / "data" / "mtbench" / "question.jsonl"),
        "--users", "6", "--models", "2", "--verifiers", "2",
        "--limit", "6", "--max-tokens", "24", "--concurrency", "3", "--timeout", "90",
        "--perturb", perturb, "--json", str(out), "--workdir", str(tmp_path / "net"),
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_id"] for r in rows] == ["81", "82", "83", "84", "85", "86"]
    served = set()
    for row in rows:
        assert row["ok"], row
        assert row["signature_valid"], row
        assert row["cloves_received"] >= 3
        assert row["response"], row
        assert row["error"] is None
        served.add(row["served_by"])
    assert served and all(s.startswith("12D3KooW") for s in served)
    assert "answered 6/6 prompts" in done.stdout
    if perturb == "kill-relay":
        assert "killed" in done.stdout
    # --workdir keeps keys and logs (at --log-level WARNING a healthy node's log may be empty)
    assert len(list((tmp_path / "net" / "keys").glob("*.key"))) == 10
    logs = tmp_path / "net" / "logs"
    assert {f"{role}0.log" for role in ("verifier", "model", "user")} <= {
        p.name for p in logs.iterdir()
    }


def test_a_node_failure_names_the_errors_inside_trio_exception_groups():
    from ps_p2p.devnet import describe_exception

    nested = ExceptionGroup("nursery", [ExceptionGroup("inner", [OSError("port in use")])])
    assert describe_exception(nested) == "OSError: port in use"
    many = ExceptionGroup("n", [ValueError(str(i)) for i in range(5)])
    assert describe_exception(many) == "ValueError: 0; ValueError: 1; ValueError: 2 (and 2 more)"
    assert describe_exception(KeyError("k")) == "KeyError: 'k'"


@pytest.mark.parametrize(
    "nodes, cpus, expected",
    [(14, 2, 2), (106, 2, 14), (206, 2, 26), (106, 16, 2), (5, 16, 1), (10, None, 3), (9, 0, 3)],
    ids=["8-users-2-cores", "100-users-2-cores", "200-users-2-cores", "100-users-16-cores",
         "fewer-nodes-than-processes", "cpus-unknown", "cpus-zero"],
)
def test_auto_nodes_per_process_spreads_the_nodes_over_four_processes_per_core(
    nodes, cpus, expected
):
    from ps_p2p.devnet import auto_nodes_per_process

    assert auto_nodes_per_process(nodes, cpus) == expected


def test_options_use_the_automatic_rule_unless_nodes_per_process_is_given(monkeypatch):
    monkeypatch.setattr("ps_p2p.devnet.usable_cpus", lambda: 2)

    auto = DevnetOptions(users=100, engine="instant")
    assert [auto.role_per_process(r) for r in ("user", "verifier", "model")] == [13, 1, 1]
    given = DevnetOptions(users=100, engine="instant", nodes_per_process=3)
    assert [given.role_per_process(r) for r in ("user", "verifier", "model")] == [3, 3, 3]
    # transformers model nodes each load a model and generate on their process's one thread
    assert DevnetOptions(nodes_per_process=3).role_per_process("model") == 1
    with pytest.raises(ConfigError, match="--nodes-per-process must be >= 1"):
        DevnetOptions(nodes_per_process=0).validate()


@pytest.mark.parametrize("text, expected", [("auto", None), ("6", 6)])
def test_the_nodes_per_process_flag_takes_a_number_or_auto(text, expected):
    from ps_p2p.cli import build_parser

    args = build_parser().parse_args(["devnet", "--nodes-per-process", text])
    assert args.nodes_per_process == expected
    assert build_parser().parse_args(["devnet"]).nodes_per_process is None  # auto by default


@pytest.mark.parametrize("users, sizes", [(8, [8]), (31, [31]), (32, [16, 16]),
                                          (100, [25, 25, 25, 25]), (200, [50] * 4)])
def test_users_join_in_at_most_four_interleaved_waves_of_at_least_sixteen(users, sizes):
    from ps_p2p.devnet import admission_waves

    waves = admission_waves(users)

    assert [len(w) for w in waves] == sizes
    assert sorted(i for w in waves for i in w) == list(range(users))
    # consecutive users (one worker process) are spread over the waves
    assert all(i % len(waves) == n for n, w in enumerate(waves) for i in w)


@pytest.mark.parametrize("status, users, lacks", [
    ({}, 8, "0/4 ready paths"),
    ({"ready_paths": 3, "ready_proxies": 3}, 8, "3/4 ready paths"),
    # 4 paths over 3 proxies: every request would wait out the 1 s distinct-proxy grace
    ({"ready_paths": 5, "ready_proxies": 3}, 8, "4 ready paths over 3/4 distinct proxies"),
    ({"ready_paths": 5, "ready_proxies": 4}, 8, None),
    ({"ready_paths": 4, "ready_proxies": 3}, 4, None),  # 3 other users: 3 proxies at most
])
def test_a_user_is_ready_with_n_paths_over_n_distinct_proxies(status, users, lacks):
    from ps_p2p.devnet import user_not_ready

    assert user_not_ready(status, users) == lacks


@pytest.mark.slow
async def test_a_devnet_packs_nodes_by_the_automatic_rule_and_admits_users_in_waves(
    monkeypatch, tmp_path
):
    from ps_p2p import devnet

    monkeypatch.setattr(devnet, "usable_cpus", lambda: 1)  # 8 users / 4 processes: 2 each
    monkeypatch.setattr(devnet, "ADMIT_MIN_WAVE", 4)  # 8 users: 2 waves of 4
    opts = DevnetOptions(engine="instant", users=8, models=1, verifiers=1,
                         workdir=str(tmp_path / "net"), start_timeout=240)
    async with devnet.open_devnet(opts, display=_Quiet()) as net:
        assert [[n.name for n in w.nodes] for w in net.workers] == [
            ["verifier0"], ["model0"], ["user0", "user1"], ["user2", "user3"], ["user4", "user5"],
            ["user6", "user7"]]
        assert all(devnet.user_not_ready(u.status, 8) is None for u in net.users)
        results = await net.send_prompts(
            [devnet.Prompt(str(i), f"Once upon a time {i}") for i in range(4)],
            concurrency=4, timeout=60)
    assert all(r["ok"] and r["signature_valid"] for r in results), results
    # the second wave started (by a control line to each worker) once the first had its paths
    first, second = net.waves
    assert first["users"] == ["user0", "user2", "user4", "user6"]
    assert second["users"] == ["user1", "user3", "user5", "user7"]
    assert second["admitted"] == 4 and second["admitted_with_paths"] >= 3  # 3/4 of 4


class _Quiet:
    async def run(self, progress):  # a Display that shows nothing
        import trio

        await trio.sleep_forever()
