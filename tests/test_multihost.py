"""A multi-host testnet (issue 20): ten ``ps-node run`` processes, each on a network namespace
host of its own, one user behind a NAT; prompts through the users' APIs while a model node is
killed and started again with its key on a new IP address; every prompt is answered, every
user reaches the restarted node, and nothing of the run is left behind, also when it fails.
Needs root and ip/nft/tc (CI runs as root on Debian); skipped with the reason otherwise."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import trio

from ps_p2p.errors import ConfigError, NetnsError
from ps_p2p.testing import multihost, netns

REASON = netns.unavailable_reason()


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"no multi-host testbed here: {REASON}")
def test_every_prompt_is_answered_while_a_model_node_moves_to_a_new_address(tmp_path):
    opts = multihost.MultihostOptions(verifiers=1, models=2, users=6, nat_users=1, prompts=8,
                                      perturb="restart-model", start_timeout=90.0)
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
    with pytest.raises(ConfigError, match="public users"):
        multihost.MultihostOptions(users=3).validate()
    with pytest.raises(ConfigError, match="models >= 2"):
        multihost.MultihostOptions(models=1, perturb="restart-model").validate()
    with pytest.raises(ConfigError, match="delaying transport"):
        multihost.MultihostOptions(profile="continental").validate()
    multihost.MultihostOptions().validate()
