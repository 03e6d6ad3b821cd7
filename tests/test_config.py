"""Node configuration: TOML file, overrides, validation."""

import pytest

from ps_p2p.config import load_config
from ps_p2p.errors import ConfigError

BOOT = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


def test_toml_file_and_flags_combine_with_flags_winning(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(
        'roles = ["user"]\n'
        f'bootstrap = ["{BOOT}"]\n'
        'listen = "/ip4/127.0.0.1/tcp/5000"\n'
        "[user]\ntotal = 5\nthreshold = 3\npaths = 6\n"
    )
    config = load_config(path, {"listen": "/ip4/127.0.0.1/tcp/6000", "membership": None})
    assert config.listen == "/ip4/127.0.0.1/tcp/6000"
    assert config.user.total == 5 and config.user.paths == 6
    assert config.membership is None


def test_a_free_text_organization_is_refused_pointing_to_membership_certificates(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(f'roles = ["user"]\nbootstrap = ["{BOOT}"]\norganization = "acme"\n')
    with pytest.raises(ConfigError, match="organization.*membership"):
        load_config(path)


def test_unknown_key_is_an_error_not_a_silent_default(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(f'roles = ["user"]\nbootstrap = ["{BOOT}"]\nlistn = "x"\n')
    with pytest.raises(ConfigError, match="listn"):
        load_config(path)


def test_unknown_key_in_a_table_is_an_error(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(f'bootstrap = ["{BOOT}"]\n[user]\nthreshhold = 2\n')
    with pytest.raises(ConfigError, match="threshhold"):
        load_config(path)


def test_a_removed_table_key_names_what_replaced_it(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text("[forwarding]\noverload_threshold = 10.0\n")
    with pytest.raises(ConfigError, match=r"\[forwarding\] 'overload_threshold' was removed.*"
                       r"prefill_tokens_per_s"):
        load_config(path)


def test_bad_toml_is_reported_with_the_file_name(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("roles = [\n")
    with pytest.raises(ConfigError, match="broken.toml"):
        load_config(path)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"roles": ["wizard"], "bootstrap": [BOOT]}, "unknown role"),
        ({"roles": ["model"], "bootstrap": [BOOT]}, "--model"),
        ({"roles": ["user"]}, "verifier"),
        ({"roles": ["user"], "bootstrap": ["/ip4/127.0.0.1/tcp/1"]}, "/p2p/"),
        ({"roles": ["user"], "bootstrap": [BOOT], "engine": "onnx"}, "engine"),
        ({"roles": ["verifier"], "metrics": "9100"}, "--metrics must be HOST:PORT"),
        ({"roles": ["verifier"], "metrics": "127.0.0.1:http"}, "--metrics must be HOST:PORT"),
        ({"roles": ["verifier"], "metrics": "127.0.0.1:70000"}, "--metrics must be HOST:PORT"),
        ({"roles": ["verifier"], "status_interval": -1}, "status_interval"),
    ],
)
def test_impossible_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_threshold_above_total_is_refused(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(f'bootstrap = ["{BOOT}"]\n[user]\ntotal = 2\nthreshold = 3\npaths = 2\n')
    with pytest.raises(ConfigError):
        load_config(path)


def test_a_threshold_of_one_is_refused_since_every_proxy_could_read_the_prompt(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(f'roles = ["user"]\nbootstrap = ["{BOOT}"]\n[user]\ntotal = 4\nthreshold = 1\n')
    with pytest.raises(ConfigError, match="threshold"):
        load_config(path)


@pytest.mark.parametrize("line", ["probation_share = 1.5", "probation_share = -0.1",
                                  "probation_in_flight = -1"])
def test_probation_hedging_settings_out_of_range_are_refused(tmp_path, line):
    path = tmp_path / "node.toml"
    path.write_text(f'roles = ["user"]\nbootstrap = ["{BOOT}"]\n[user]\n{line}\n')
    with pytest.raises(ConfigError, match="probation"):
        load_config(path)


def test_users_hedge_five_percent_to_nodes_on_probation_by_default(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(f'roles = ["user"]\nbootstrap = ["{BOOT}"]\n[user]\nprobation_share = 0\n')
    assert load_config(path).user.probation_share == 0
    assert load_config(None, {"bootstrap": [BOOT]}).user.probation_share == 0.05


@pytest.mark.parametrize(
    "text, expected",
    [("127.0.0.1:9100", ("127.0.0.1", 9100)), ("[::1]:0", ("::1", 0)),
     ("localhost:9100", ("localhost", 9100))],
)
def test_metrics_addresses_parse_into_host_and_port(text, expected):
    from ps_p2p.config import parse_host_port

    assert parse_host_port(text) == expected
    assert load_config(None, {"roles": ["verifier"], "metrics": text}).metrics == text


def test_snapshot_and_pruning_options_are_checked(tmp_path):
    path = tmp_path / "node.toml"
    roles = 'roles = ["verifier"]\n'
    path.write_text(roles + "snapshot_every = 500\nkeep_blocks = 10000\nblock_interval = 30\n")
    config = load_config(path)
    assert (config.snapshot_every, config.keep_blocks, config.block_interval) == (500, 10000, 30)
    for bad in ("snapshot_every = -1", "keep_blocks = 0", "snapshot_every = 1.5"):
        path.write_text(roles + bad + "\n")
        with pytest.raises(ConfigError, match=bad.split(" ")[0]):
            load_config(path)


# ------------------------------------------------------------------ types (issue 21)


def test_every_wrong_type_is_reported_with_its_key_before_anything_starts(tmp_path):
    """Was: ``directory_refresh = "fast"`` a 79-line traceback after start-up, ``roles =
    "user"`` "unknown role 'u'"."""
    path = tmp_path / "node.toml"
    path.write_text('directory_refresh = "fast"\nroles = "user"\n'
                    '[user]\npaths = "many"\n[sim]\nmax_batch = 0\n')

    with pytest.raises(ConfigError) as info:
        load_config(path)

    lines = str(info.value).splitlines()
    assert lines[0] == "bad configuration:"
    assert sorted(line.strip() for line in lines[1:]) == sorted([
        "roles = 'user': Input should be a valid list",
        ("directory_refresh = 'fast': Input should be a valid number, unable to parse string "
         "as a number"),
        ("user.paths = 'many': Input should be a valid integer, unable to parse string as an "
         "integer"),
        "[sim]: max_batch must be an int >= 1, not 0",
    ])


def test_lossless_conversions_of_toml_values_still_pass(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('roles = ["verifier"]\ndirectory_refresh = 2\n'
                    '[connections]\nexempt = ["127.0.0.0/8"]\n')

    config = load_config(path)

    assert config.directory_refresh == 2
    assert tuple(config.connections.exempt) == ("127.0.0.0/8",)


def test_a_wrong_type_from_a_flag_is_reported_with_its_key():
    with pytest.raises(ConfigError, match=r"status_interval = 'often': Input should be a valid"):
        load_config(None, {"status_interval": "often"})


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("load_heartbeat = 0.5\n", "load_heartbeat must be in"),  # below load_interval
        ("load_heartbeat = 3.0\n", "load_heartbeat must be in"),  # not below load_max_age
        ("load_deadband = 1.5\n", "load_deadband must be in"),
    ],
)
def test_a_load_heartbeat_or_deadband_out_of_range_is_refused(tmp_path, table, message):
    path = tmp_path / "node.toml"
    path.write_text(f'roles = ["model"]\nengine = "sim"\nmodel = "m"\nbootstrap = ["{BOOT}"]\n[forwarding]\n{table}')
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_load_heartbeat_and_deadband_are_read_from_the_forwarding_table(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(f'bootstrap = ["{BOOT}"]\n[forwarding]\nload_heartbeat = 2.5\n'
                    "load_deadband = 0.25\n")
    config = load_config(path)
    assert (config.forwarding.load_heartbeat, config.forwarding.load_deadband) == (2.5, 0.25)
