"""A multi-host testnet (issue 20): ten ``ps-node run`` processes, each on a network namespace
host of its own, one user behind a NAT; prompts through the users' APIs while a model node is
killed and started again with its key on a new IP address; every prompt is answered, every
user reaches the restarted node, and nothing of the run is left behind, also when it fails.
Needs root and ip/nft/tc (CI runs as root on Debian); skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import types

import base58
import pytest
import trio

from ps_p2p.errors import ConfigError, NetnsError
from ps_p2p.testing import multihost, netns
from ps_p2p.testing.faults import load_faults

REASON = netns.unavailable_reason()


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"no multi-host testbed here: {REASON}")
def test_every_prompt_is_answered_over_wan_links_while_a_model_node_moves_to_a_new_address(
        tmp_path):
    """Ten nodes, one user NATed, continental links (20-60 ms one way, median 40 ms)."""
    opts = multihost.MultihostOptions(verifiers=1, models=2, users=6, nat_users=1, prompts=8,
                                      perturb="restart-model", profile="continental",
                                      start_timeout=90.0)
    bed = netns.Testbed()
    prefix = bed.prefix
    try:
        bed.open()
        result = trio.run(multihost.run_multihost, opts, bed, tmp_path, print)
    finally:
        bed.close()
        assert netns.leftovers(prefix) == []  # also when the run failed
    print(result.summary())
    assert result.sent == 8 and result.answered == 8, result.errors
    assert result.recovered_s is not None  # every user got an answer from the moved node
    assert result.committee_height >= 1 and result.path_setups > 0
    # the profile's link delays were in force in every process (m0 and its restart included)
    logs = sorted((tmp_path / "logs").glob("*.log"))
    assert len(logs) == 11
    assert all("TEST ONLY faults now" in log.read_text() for log in logs)


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"no multi-host testbed here: {REASON}")
def test_natted_users_relay_and_proxy_on_paths_that_answer_prompts(tmp_path):
    """Issue 20 section 2: five users behind NATs of their own (nobody can dial them) learn
    they are private (AutoNAT), reserve Circuit Relay v2 slots, are listed with
    ``/p2p-circuit`` addresses, and relay and proxy the prompts, which are answered. With two
    public users only, every path (3 distinct relays) has a NATed hop, and each user's 5
    paths have 5 distinct proxies among 6 others, at least 3 of them NATed."""
    opts = multihost.MultihostOptions(verifiers=1, models=1, users=2, nat_users=5, prompts=8,
                                      profile="continental", start_timeout=120.0)
    bed = netns.Testbed()
    prefix = bed.prefix
    try:
        bed.open()
        result = trio.run(multihost.run_multihost, opts, bed, tmp_path, print)
    finally:
        bed.close()
        assert netns.leftovers(prefix) == []  # also when the run failed
    print(result.summary())
    assert result.sent == 8 and result.answered == 8, result.errors
    assert result.paths_nat_relay == result.paths > 0  # every path through a NATed user
    assert result.nat_cells_relayed > 0 and result.nat_cloves_proxied > 0
    assert result.relayed_connections > 0  # links to them went through relays
    statuses = [json.loads(p.read_text()) for p in (tmp_path / "status").glob("n*.json")]
    assert len(statuses) == 5
    for status in statuses:
        nat = status["nat"]
        assert nat["reachability"] == "private"
        assert nat["circuit_addrs"] and all("/p2p-circuit" in a for a in nat["circuit_addrs"])
        assert status["directory"]["users"] == 7  # every NATed user is listed


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"no multi-host testbed here: {REASON}")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_leaves_no_namespace_or_process_behind(signum, tmp_path):
    """Ctrl-C (SIGINT) or SIGTERM while the nodes start: ps-node multihost removes everything."""
    env = dict(os.environ, PYTHONPATH=str(multihost.REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ps_p2p.cli", "multihost", "--verifiers", "1", "--models", "1",
         "--users", "5", "--nat-users", "1", "--workdir", str(tmp_path / "w")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        cwd=multihost.REPO)
    prefix = None
    for line in proc.stdout:  # blocks until the hosts are built
        m = re.search(r"hosts on (psnet\d+x[0-9a-f]+)-", line)
        if m:
            prefix = m.group(1)
            break
    assert prefix is not None, proc.communicate()[0]
    assert netns.leftovers(prefix)
    proc.send_signal(signum)
    out = proc.communicate(timeout=60)[0]
    assert netns.leftovers(prefix) == [], out
    pids = subprocess.run(["pgrep", "-f", str(tmp_path / "w")], capture_output=True,
                          text=True, check=False).stdout.split()
    assert pids == [], out  # no ps-node run of this run is left


def test_link_delays_follow_the_profile_and_the_seed():
    hosts = ["v0", "m0", "u0", "u1"]
    d = netns.link_delays(hosts, "continental", seed=3)
    assert len(d) == 6 and all(20.0 <= ms <= 60.0 for ms in d.values())
    assert d == netns.link_delays(list(reversed(hosts)), "continental", seed=3)
    assert set(netns.link_delays(hosts, "lan").values()) == {0.0}
    with pytest.raises(NetnsError):
        netns.link_delays(hosts, "moon")


def test_options_that_cannot_run_are_refused_before_anything_is_built():
    with pytest.raises(ConfigError, match="users that relay"):
        multihost.MultihostOptions(users=3, nat_users=1).validate()
    with pytest.raises(ConfigError, match="users that relay"):  # NATed users only asking
        multihost.MultihostOptions(users=3, nat_users=2, nat_ask_only=True).validate()
    multihost.MultihostOptions(users=2, nat_users=3).validate()  # NATed users relay too
    with pytest.raises(ConfigError, match="models >= 2"):
        multihost.MultihostOptions(models=1, perturb="restart-model").validate()
    with pytest.raises(ConfigError, match="models >= 2"):
        multihost.MultihostOptions(models=1, perturb="nat-remap,freeze-model").validate()
    with pytest.raises(ConfigError, match="nat-users >= 1"):
        multihost.MultihostOptions(nat_users=0, perturb="nat-remap").validate()
    with pytest.raises(ConfigError, match="not 'unplug'"):
        multihost.MultihostOptions(perturb="kill-model,unplug").validate()
    with pytest.raises(ConfigError, match="--profile"):
        multihost.MultihostOptions(profile="moon").validate()
    for profile in netns.PROFILES:
        multihost.MultihostOptions(profile=profile).validate()
    opts = multihost.MultihostOptions(perturb="kill-model, freeze-model,nat-remap")
    opts.validate()
    assert opts.perturbations() == ["kill-model", "freeze-model", "nat-remap"]
    assert multihost.MultihostOptions().perturbations() == []


def test_each_end_of_a_link_holds_half_of_its_one_way_delay(tmp_path):
    opts = multihost.MultihostOptions(profile="intercontinental", seed=5)
    net = multihost.Multihost(opts, None, tmp_path)
    names = ["v0", "m0", "u0", "n0"]
    net.nodes = {n: types.SimpleNamespace(name=n) for n in names}
    net.nodes["m0-r1"] = net.nodes.pop("m0")  # a restarted node keeps its key and links
    net._write_faults()
    assert net.link_delays == netns.link_delays(names, "intercontinental", seed=5)
    ids = {n: net._peer_id(n) for n in names}
    rules = {n: load_faults(tmp_path / "faults" / f"{n}.json") for n in names}
    for (a, b), ms in net.link_delays.items():
        assert 80.0 <= ms <= 200.0
        there = rules[a].rule(base58.b58decode(ids[b])).delay_s
        back = rules[b].rule(base58.b58decode(ids[a])).delay_s
        assert there == back == pytest.approx(ms / 2000.0)
    assert all(len(r.peers) == 3 for r in rules.values())


def test_the_summary_names_the_profile_and_each_perturbations_recovery():
    result = multihost.Result(sent=4, answered=4, latencies_ms=[100, 200, 300, 400],
                              profile="lossy", perturb="kill-model,nat-remap",
                              recoveries=[("kill-model", 3.31), ("nat-remap", None)])
    line = result.summary()
    assert line.startswith("multihost (lossy): answered 4/4, latency p50 0.25 s p99 0.40 s")
    assert line.endswith("kill-model: recovered in 3.3 s, nat-remap: not recovered")
