"""The ``ps-node`` command.

Subcommands::

    ps-node keygen  --key-file PATH                 create a key file, print the peer ID
    ps-node group-key [--out FILE]                  make a fresh model-group secret (hex)
    ps-node run     --role user|model|verifier ...  run one node until interrupted
    ps-node devnet  [--prompts FILE] [--model PATH] a local network of OS processes; prompts via it
    ps-node ask     --multiaddr MADDR "prompt"      join as a user, ask once, print the answer

``main(argv) -> int`` returns the exit status: 0 ok, 1 a failure at run time, 2 bad usage or
configuration.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import signal
import sys
import time
from typing import Any

import trio

from ps_p2p.errors import AddressInUseError, ConfigError, PsError, is_keyboard_interrupt
from ps_p2p.log_limits import setup_logging as _setup_logging

log = logging.getLogger("ps_p2p.cli")

#: Seconds ``ps-node ask`` allows each dial to a ``--multiaddr`` verifier before it gives up.
ASK_DIAL_TIMEOUT = 5.0


#: ``--log-level`` values (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Subcommands that start py-libp2p hosts; only they pay for importing libp2p (~0.5 s) and
#: torch, so that ``ps-node status`` and friends answer at once.
NETWORK_COMMANDS = frozenset({"run", "ask", "devnet", "valset"})


def _log_level(value: str) -> str:
    """argparse type of ``--log-level``: one of :data:`LOG_LEVELS`, any case."""
    if value.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a log level (one of {', '.join(LOG_LEVELS)})")
    return value.upper()


# ---------------------------------------------------------------------- parser


def _version() -> str:
    """The installed distribution's version (the package's own when not installed)."""
    from importlib import metadata

    try:
        return metadata.version("ps_p2p")
    except metadata.PackageNotFoundError:
        from ps_p2p import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ps-node",
        description="PlanetServe node: anonymous, verified LLM serving over py-libp2p.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--log-level", type=_log_level, default=None, metavar="LEVEL",
                        help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default INFO; WARNING "
                             "for ask, whose answer is the output)")
    sub = parser.add_subparsers(dest="command", required=True)

    keygen = sub.add_parser("keygen", help="create a key file and print its peer ID")
    keygen.add_argument("--key-file", required=True, help="where to write the keys (mode 0600)")

    org = sub.add_parser(
        "org", help="an organization's key and its members' certificates (nodes of one "
                    "organization share its reputation; docs/organizations.md)")
    org_sub = org.add_subparsers(dest="org_command", required=True)
    org_new = org_sub.add_parser("new", help="create an organization key file and print the "
                                             "organization's ID (its key's peer ID)")
    org_new.add_argument("--key-file", required=True,
                         help="where to write the organization key (mode 0600; keep it off the "
                              "nodes)")
    org_sign = org_sub.add_parser(
        "sign", help="certify that a node (its peer ID) is a member of the organization")
    org_sign.add_argument("--key-file", required=True, help="the organization key file")
    org_sign.add_argument("--name", required=True,
                          help="the organization's name, as its members' records show it")
    org_sign.add_argument("--member", required=True, metavar="PEER_ID",
                          help="the member node's peer ID (ps-node keygen prints it)")
    org_sign.add_argument("--days", type=float, default=30.0,
                          help="validity in days (default 30): a member is revoked by not "
                               "renewing its certificate")
    org_sign.add_argument("--out", required=True, metavar="FILE",
                          help="where to write the certificate; give it to the node "
                               "(ps-node run --membership FILE)")
    group_key = sub.add_parser(
        "group-key", help="make a fresh secret for [forwarding] group_key: give it to every "
                          "model node of one group, and nobody else")
    group_key.add_argument("--out", metavar="FILE",
                           help="write it as a [forwarding] table to FILE (mode 0600) instead "
                                "of printing it")

    testnet = sub.add_parser(
        "testnet", help="write a committee's genesis file and one home (keys, config) per verifier"
    )
    testnet.add_argument("--verifiers", type=int, default=4,
                         help="committee size N = 3f+1 (default 4: f = 1)")
    testnet.add_argument("--out", required=True, metavar="DIR",
                         help="folder to create (genesis.json, verifier<i>/node.key, config.toml)")
    testnet.add_argument("--chain-id", default="planetserve-testnet", help="the chain's ID")
    testnet.add_argument("--host", default="127.0.0.1", help="IP address the verifiers listen on")
    testnet.add_argument("--base-port", type=int, default=26656,
                         help="verifier i listens on base-port + i (default 26656)")
    testnet.add_argument("--challenge-model", metavar="PATH",
                         help="run challenge epochs (paper sec. 3.4) verifying this model: the "
                              "verifiers' reference copy (HF folder or .gguf); needs "
                              "--challenge-pool")
    testnet.add_argument("--challenge-pool", action="append", default=[], metavar="FILE",
                         help="prompt file of the challenge pool (repeatable; the genesis "
                              "commits to its digest), or 'generate': a private pool sampled "
                              "from --challenge-model under a secret seed, written only into "
                              "the verifiers' homes (a public file lets model nodes recognise "
                              "challenges)")
    testnet.add_argument("--challenge-pool-size", type=int, default=1000, metavar="N",
                         help="prompts of a generated pool (default 1000: ~50 s on a CPU for "
                              "stories260K; each prompt is asked once)")
    testnet.add_argument("--challenge-model-id",
                         help="the model ID model nodes announce (default: the folder's name)")
    testnet.add_argument("--epoch-seconds", type=float, default=300.0, metavar="SECONDS",
                         help="block time from one challenge epoch's start to the next "
                              "(default 300)")
    testnet.add_argument("--epoch-attempt", type=float, default=None, metavar="SECONDS",
                         help="block time a leader has before the next one is drawn (default: "
                              "the epoch + 90 s, so that a leader spreads its challenges over "
                              "the whole epoch as users' requests are; 60 when the epoch is 0)")
    testnet.add_argument("--challenges-per-node", type=int, default=12, metavar="N",
                         help="challenges per model node per epoch (default 12: what "
                              "bench_reputation needs to convict a node that forwards what it "
                              "takes for challenges; docs/verification.md)")

    valset = sub.add_parser(
        "valset", help="replace committee members: approve and assemble a VALSET_UPDATE "
                       "(docs/consensus.md \"Evidence and validator-set changes\")")
    valset_sub = valset.add_subparsers(dest="valset_command", required=True)
    vs_sign = valset_sub.add_parser(
        "sign", help="approve a new validator set with this verifier's key (offline)")
    vs_sign.add_argument("--key-file", required=True, help="the verifier's node.key")
    vs_sign.add_argument("--chain-id", required=True, help="the chain's ID")
    vs_sign.add_argument("--current", required=True, metavar="FILE",
                         help="the current set: a genesis file, `ps-node status --json` output "
                              "of a verifier, or a JSON list of {peer_id, power}")
    vs_sign.add_argument("--new", required=True, metavar="FILE", help="the new set (same forms)")
    vs_sign.add_argument("--effective-height", type=int, required=True, metavar="H",
                         help="the first height the new set decides (after the committed "
                              "height + 1)")
    vs_sign.add_argument("--out", required=True, metavar="FILE", help="where to write the approval")
    vs_make = valset_sub.add_parser(
        "make", help="assemble the approvals into the transaction (hex), for a verifier's "
                     "mempool")
    vs_make.add_argument("--new", required=True, metavar="FILE", help="the new set")
    vs_make.add_argument("--effective-height", type=int, required=True, metavar="H")
    vs_make.add_argument("--approval", action="append", required=True, metavar="FILE",
                         help="an approval of `ps-node valset sign` (repeat: more than 2/3 of "
                              "the current power)")
    vs_make.add_argument("--out", required=True, metavar="FILE",
                         help="where to write the transaction (hex)")
    vs_submit = valset_sub.add_parser(
        "submit", help="give the transaction to a committee verifier (it relays it to the "
                       "others; the next block executes it)")
    vs_submit.add_argument("--tx", required=True, metavar="FILE",
                           help="the transaction (hex) of `ps-node valset make`")
    vs_submit.add_argument("--verifier", required=True, metavar="MULTIADDR",
                           help="a verifier's multiaddr with /p2p/<peer ID>")

    status = sub.add_parser(
        "status", help="print a running node's status (peer ID, addresses, directory, consensus)"
    )
    status.add_argument("--home", help="the node's home directory (default: the one of --name)")
    status.add_argument("--name", help="the node's name (default: user)")
    status.add_argument("--json", action="store_true", help="print the status file as it is")

    run = sub.add_parser("run", help="run one node until interrupted")
    run.add_argument("--role", action="append", choices=["user", "model", "verifier"],
                     help="role of this node; repeat for several (default: user)")
    run.add_argument("--listen", help="listen multiaddr (default /ip4/127.0.0.1/tcp/0)")
    run.add_argument("--multiaddr", action="append", dest="bootstrap", metavar="MADDR",
                     help="bootstrap peer (a verifier) with /p2p/<peer ID>; repeatable")
    run.add_argument("--verifier", action="append", dest="verifiers", metavar="PEER_ID",
                     help="trusted verifier peer ID; repeatable (default: the --multiaddr peers)")
    run.add_argument("--genesis", metavar="FILE",
                     help="the committee's genesis file (ps-node testnet): trust a directory "
                          "only with 2f+1 commit signatures of its validators; a verifier must "
                          "be one of them and runs the consensus")
    run.add_argument("--key-file", help="identity + onion keys, created on first run "
                                        "(default <home>/node.key)")
    run.add_argument("--name", help="node name: its home is <user data dir>/ps_p2p/NAME "
                                    "(default: the roles, e.g. user)")
    run.add_argument("--home", metavar="DIR", help="keys and state of this node (default "
                                                   "<user data dir>/ps_p2p/<name>)")
    run.add_argument("--model", help="model role: HF folder or .gguf (transformers), "
                                     "the served model name (vllm), or any name (sim)")
    run.add_argument("--engine", choices=["transformers", "vllm", "sim"],
                     help="default transformers; sim: no model, a GPU's modelled latencies and "
                          "dummy text (parameters: the config's [sim] table)")
    run.add_argument("--vllm-url", help="vllm serve base URL (default http://127.0.0.1:8000)")
    run.add_argument("--device", help="transformers device: cpu, cuda, cuda:1 (default cpu)")
    run.add_argument("--model-id", help="model ID announced (default: the model folder name)")
    run.add_argument("--capacity", type=int, help="model role: concurrent requests (default 2)")
    run.add_argument("--membership", metavar="FILE",
                     help="this node's membership certificate of its organization (ps-node "
                          "org sign): its record names the organization and shares its "
                          "reputation")
    run.add_argument("--config", help="TOML config file; command-line flags win over it")
    run.add_argument("--api", metavar="HOST:PORT",
                     help="user role: serve the local OpenAI-compatible API here (e.g. 127.0.0.1:8088)")
    run.add_argument("--status-file", help="write a JSON status (peer ID, addresses, API URL, "
                                           "ready paths) here and keep it current")
    run.add_argument("--metrics", metavar="HOST:PORT",
                     help="serve Prometheus /metrics of this node here (e.g. 127.0.0.1:9100)")
    run.add_argument("--web", metavar="HOST:PORT",
                     help="serve this node's web page here: the network as it sees it "
                          "(e.g. 127.0.0.1:8080; a user's --api port serves it at /web too)")
    run.add_argument("--status-interval", type=float, metavar="S",
                     help="seconds between one-line status logs (default 60; 0: none)")
    run.add_argument("--drain-timeout", type=float, metavar="S",
                     help="model role: on SIGTERM, seconds to finish the requests in service "
                          "while refusing new ones (default 30)")
    run.add_argument("--tamper", action="store_true", default=None,
                     help="TESTING ONLY: corrupt relayed cells and cloves (a malicious relay)")

    devnet = sub.add_parser("devnet", help="run a local network of OS processes and send prompts through it")
    devnet.add_argument("--model", help="model for the model nodes (HF folder or .gguf; "
                                        "default ../shared/models/stories260K if present)")
    devnet.add_argument("--engine", choices=["transformers", "instant", "sim"],
                        default="transformers",
                        help="model nodes' engine: transformers (loads --model), instant "
                             "(a fake that answers at once, to measure the overlay; no --model) "
                             "or sim (no model: an 8B model's modelled latencies on one GPU, "
                             "with a prefix cache; no --model)")
    devnet.add_argument("--prompts",
                        help="prompts: a text file (one per line) or ../shared/data JSON/JSONL "
                             "(default ../shared/data/mtbench/question.jsonl if present)")
    devnet.add_argument("--users", type=int, default=8, help="user nodes (default 8)")
    devnet.add_argument("--models", type=int, default=2, help="model nodes (default 2)")
    devnet.add_argument("--verifiers", type=int, default=4, help="verifier nodes (default 4)")
    devnet.add_argument("--nodes-per-process", type=_nodes_per_process, default=None,
                        metavar="N|auto",
                        help="nodes run by one OS process (default auto: the users spread "
                             "over 4 processes per CPU core, ceil(users / (4 x cores)) each; "
                             "verifiers and model nodes one per process)")
    devnet.add_argument("--start-timeout", type=float, metavar="S",
                        help="seconds until every user has its paths (default 60 + 1 per node)")
    devnet.add_argument("--json", dest="json_out", metavar="OUT",
                        help="write one JSON object per prompt to OUT (JSON lines)")
    devnet.add_argument("--perturb", default="none",
                        choices=["none", "kill-relay", "tamper-clove", "kill-verifier",
                                 "byzantine-verifier"],
                        help="kill-relay: kill one relay on one path of each user mid-run; "
                             "tamper-clove: one relay corrupts what it forwards; "
                             "kill-verifier: kill one verifier mid-run; "
                             "byzantine-verifier: one validator equivocates "
                             "(both verifier perturbations need --verifiers >= 4)")
    devnet.add_argument("--limit", type=int, help="send only the first N prompts")
    devnet.add_argument("--shared-prefix", type=int, default=0, metavar="CHARS",
                        help="put the same CHARS-character prefix (the first prompt repeated) "
                             "before every prompt, like a long shared system prompt: model "
                             "nodes forward to the one that caches it (default 0: none)")
    devnet.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default 48)")
    devnet.add_argument("--concurrency", type=int, default=4, help="prompts in flight (default 4)")
    devnet.add_argument("--timeout", type=float, default=120.0, help="deadline per prompt, s (default 120)")
    devnet.add_argument("--workdir", help="keep keys, status files and logs here "
                                          "(default: a temp dir, removed at exit)")
    devnet.add_argument("--show", type=int, default=300,
                        help="print at most this many characters of each answer (default 300)")

    multihost = sub.add_parser(
        "multihost", help="run a testnet of separate hosts (Linux network namespaces, NATed "
                          "users; root, ip, nft, tc) and send prompts through it")
    multihost.add_argument("--verifiers", type=int, default=4, help="verifiers (default 4)")
    multihost.add_argument("--models", type=int, default=2,
                           help="model nodes, sim engine (default 2)")
    multihost.add_argument("--users", type=int, default=6,
                           help="public users: relays and proxies (default 6)")
    multihost.add_argument("--nat-users", type=int, default=2,
                           help="users behind a NAT of their own: they relay and serve as "
                                "proxies through Circuit Relay v2 (default 2)")
    multihost.add_argument("--nat-ask-only", action="store_true",
                           help="NATed users only ask (not listed, never relays or proxies)")
    multihost.add_argument("--prompts", type=int, default=20, help="prompts sent (default 20)")
    multihost.add_argument("--concurrency", type=int, default=4,
                           help="prompts in flight (default 4)")
    multihost.add_argument("--max-tokens", type=int, default=16,
                           help="tokens per answer (default 16)")
    multihost.add_argument("--perturb", default="none", metavar="LIST",
                           help="comma-separated perturbations, run one after the other while "
                                "the prompts go on (each during its share of them): "
                                "restart-model (kill model node m0, start it with its key on a "
                                "new IP address), kill-model (SIGKILL m0, start it again on its "
                                "address 5 s later), freeze-model (SIGSTOP m0 for 20 s), "
                                "partition-model (cut m0 off from the users for 10 s), "
                                "nat-remap (NATed user n0's router takes a new public IP); "
                                "the summary gives each one's time to recover")
    multihost.add_argument("--profile", default="lan",
                           choices=["lan", "continental", "intercontinental", "lossy"],
                           help="WAN profile: one-way delay per host pair drawn in lan 0, "
                                "continental 20-60 ms, intercontinental 80-200 ms, lossy "
                                "20-60 ms + 1%% packet loss (default lan)")
    multihost.add_argument("--seed", type=int, default=1,
                           help="seed of the profile's per-link delays (default 1)")
    multihost.add_argument("--bandwidth", metavar="RATE",
                           help="limit every host's link each way (tc rate, e.g. 20mbit)")
    multihost.add_argument("--start-timeout", type=float, default=120.0, metavar="S",
                           help="seconds until every user has its paths (default 120)")
    multihost.add_argument("--timeout", type=float, default=60.0,
                           help="deadline per prompt, s (default 60)")
    multihost.add_argument("--workdir", help="keep configs, keys, status files and logs here "
                                             "(default: a temp dir, removed at exit)")
    multihost.add_argument("--sweep", action="store_true",
                           help="only remove the namespaces (and processes) of earlier runs "
                                "whose controller is gone, then exit")

    ask = sub.add_parser("ask", help="join a running network as a user, ask once, print the answer")
    ask.add_argument("--multiaddr", action="append", dest="bootstrap", required=True, metavar="MADDR",
                     help="a verifier's multiaddr with /p2p/<peer ID>; repeatable")
    ask.add_argument("--model-id", help="ask a model node serving this model ID")
    ask.add_argument("--max-tokens", type=int, default=64)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds (default 120)")
    ask.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="end the answer before this text; repeatable (up to 4)")
    ask.add_argument("--stream", action="store_true",
                     help="print the text as the model node generates it (streamed through the "
                          "overlay; docs/streaming.md)")
    ask.add_argument("--json", action="store_true", help="print the answer as JSON")
    ask.add_argument("prompt")
    return parser


# ---------------------------------------------------------------------- commands


def _cmd_keygen(args: argparse.Namespace) -> int:
    from ps_p2p.keys import load_or_create_keys

    path = pathlib.Path(args.key_file).expanduser()
    if path.exists():
        raise ConfigError(f"{path} exists; refusing to overwrite a key file")
    keys = load_or_create_keys(path)
    print(keys.identity.peer_id_str)
    return 0


def _cmd_org(args: argparse.Namespace) -> int:
    import time

    from ps_p2p import records
    from ps_p2p.config import check_peer_id
    from ps_p2p.keys import load_organization_key, membership_to_json, new_organization_key

    if args.org_command == "new":
        key = new_organization_key(pathlib.Path(args.key_file).expanduser())
        print(key.peer_id_str)
        return 0
    key = load_organization_key(pathlib.Path(args.key_file).expanduser())
    member = check_peer_id(args.member, "--member")
    if not args.name or len(args.name.encode("utf-8")) > records.MAX_ORGANIZATION_BYTES:
        raise ConfigError(f"--name must be 1 to {records.MAX_ORGANIZATION_BYTES} UTF-8 bytes")
    if not 0 < args.days <= 3650:
        raise ConfigError("--days must be in (0, 3650]")
    expires = int(time.time() * 1000 + args.days * 86_400_000)
    membership = records.sign_membership(key, args.name, member, expires)
    out = pathlib.Path(args.out).expanduser()
    out.write_text(membership_to_json(args.name, member, membership), encoding="utf-8")
    print(f"{out}: {args.member} is a member of {args.name!r} ({key.peer_id_str}) until "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(expires / 1000))}")
    return 0


def _read_validator_set(path: str) -> tuple[Any, ...]:
    """A validator set from a genesis file, ``ps-node status --json`` output (its
    ``consensus.validators``) or a JSON list of ``{"peer_id", "power"}``."""
    from ps_p2p.config import check_peer_id
    from ps_p2p.consensus.types import Validator

    try:
        data = json.loads(pathlib.Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if isinstance(data, dict):
        data = (data.get("consensus") or data.get("committee") or data).get("validators")
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{path}: no validator list")
    out = []
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("peer_id"), str) \
                or not isinstance(entry.get("power", 1), int):
            raise ConfigError(f"{path}: a validator is not {{peer_id, power}}")
        out.append(Validator(check_peer_id(entry["peer_id"], path), entry.get("power", 1)))
    return tuple(sorted(out, key=lambda v: v.address))


def _cmd_valset(args: argparse.Namespace) -> int:
    from libp2p.peer.id import ID

    from ps_p2p import registry as app
    from ps_p2p.keys import NodeKeys

    if args.valset_command == "submit":
        return _valset_submit(args)
    new = _read_validator_set(args.new)
    out = pathlib.Path(args.out).expanduser()
    if args.valset_command == "sign":
        keys = NodeKeys.load(pathlib.Path(args.key_file).expanduser())
        current = _read_validator_set(args.current)
        if all(v.address != keys.identity.peer_id for v in current):
            raise ConfigError(f"{keys.identity.peer_id_str} is not in the current set")
        signer, signature = app.sign_valset_update(keys.identity, args.chain_id, current, new,
                                                   args.effective_height)
        out.write_text(json.dumps({
            "signer": ID(signer).to_base58(), "signature": signature.hex(),
            "effective_height": args.effective_height,
            "new": [{"peer_id": ID(v.address).to_base58(), "power": v.power} for v in new],
        }, indent=2) + "\n", encoding="utf-8")
        print(f"{out}: {keys.identity.peer_id_str} approves {len(new)} validator(s) from "
              f"height {args.effective_height}")
        return 0
    from ps_p2p.config import check_peer_id

    approvals = []
    for path in args.approval:
        try:
            data = json.loads(pathlib.Path(path).expanduser().read_text(encoding="utf-8"))
            approvals.append((check_peer_id(data["signer"], path),
                              bytes.fromhex(data["signature"])))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: not an approval ({exc})") from None
        if data.get("effective_height") != args.effective_height:
            raise ConfigError(f"{path}: approves another effective height")
    tx = app.encode_tx(app.make_valset_update(new, args.effective_height, approvals))
    out.write_text(tx.hex() + "\n", encoding="utf-8")
    print(f"{out}: VALSET_UPDATE of {len(new)} validator(s) from height "
          f"{args.effective_height}, {len(approvals)} approval(s), {len(tx)} bytes")
    return 0


def _valset_submit(args: argparse.Namespace) -> int:
    from ps_p2p import registry as app
    from ps_p2p.keys import Identity
    from ps_p2p.protocols.committee_directory import submit_valset_update
    from ps_p2p.protocols.host import connect, open_host

    try:
        raw = bytes.fromhex(pathlib.Path(args.tx).expanduser().read_text(encoding="utf-8"))
        tx = app.decode_tx(raw, 1 << 20)
    except (OSError, ValueError, PsError) as exc:
        raise ConfigError(f"{args.tx}: not a transaction ({exc})") from None
    if not isinstance(tx, app.ValsetUpdateTx):
        raise ConfigError(f"{args.tx}: not a VALSET_UPDATE")

    async def submit() -> None:
        async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as host:
            verifier = await connect(host, args.verifier)
            await submit_valset_update(host, verifier, tx)

    trio.run(submit)
    print(f"{args.verifier}: VALSET_UPDATE taken (effective at height {tx.effective_height})")
    return 0


def _cmd_group_key(args: argparse.Namespace) -> int:
    from ps_p2p.config import group_key_toml, new_group_key

    key = new_group_key()
    if args.out is None:
        print(key)
        return 0
    path = pathlib.Path(args.out).expanduser()
    if path.exists():
        raise ConfigError(f"{path} exists; refusing to overwrite a group secret")
    path.touch(mode=0o600)
    path.write_text(group_key_toml(key))
    print(f"group secret written to {path}")
    return 0


#: A status file older than this (seconds) belongs to a node that is not running.
STATUS_STALE_S = 5.0


def _cmd_status(args: argparse.Namespace) -> int:
    from ps_p2p import home  # not ps_p2p.config: status answers without the network's imports

    home_path = (pathlib.Path(args.home).expanduser() if args.home
                 else home.default_home(args.name or home.node_name(["user"])))
    path = home_path / home.STATUS_FILE
    try:
        status = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no status file at {path}: is a node running with this home?") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    age = time.time() - status.get("written_at_ms", 0) / 1000
    stale = f"  (STALE: written {age:.0f} s ago; the node is not running)" if age > STATUS_STALE_S else ""
    print(f"peer ID    {status.get('peer_id')}{stale}")
    print(f"roles      {', '.join(status.get('roles') or [])}")
    health = status.get("health")
    if health is not None:  # the same answer as GET /health (ps_p2p.health)
        print("health     " + ("ok" if health["ok"] else
                               "UNAVAILABLE: " + "; ".join(health["reasons"])))
    for addr in status.get("listen") or []:
        print(f"listening  {addr}")
    d = status.get("directory")
    print("directory  " + ("none yet" if not d else
                           f"height {d['height']}: {d['users']} users, {d['model_nodes']} model nodes"))
    rep = status.get("reputation")
    if rep:
        value = "not scored" if rep.get("reputation") is None else (
            f"{rep['reputation']:.6g}" if not rep.get("trusted", True)  # 0.399999: probation
            else f"{rep['reputation']:.3f}")
        print(f"reputation {value}: " + (
            "trusted" if rep.get("trusted", True) else
            "provisional (not scored yet): users send to it only when no trusted node serves "
            "its model" if rep.get("provisional") else
            f"UNTRUSTED (below {rep['untrusted_below']}): users send it only hedged copies "
            f"of their requests (probation, docs/verification.md)"))
    if "user" in (status.get("roles") or []):
        print(f"paths      {status.get('ready_paths', 0)} ready" + (
            f"; API {status['api']}" if status.get("api") else ""))
    c = status.get("committee")
    if c:
        when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["last_commit_time_ms"] / 1000))
                if c.get("last_commit_time_ms") else "none yet")
        print(f"consensus  chain {c['chain_id']}: height {c['height']} round {c['round']} "
              f"({c['step']}); committed {c['committed_height']} at {when}; "
              f"mempool {c['mempool']}")
        e = c.get("epochs")
        if e:
            svc = e.get("service")
            print(f"epochs     epoch {e['epoch']} " + (
                f"under way, led by {e['leader']}" if e.get("started") else "not started") + (
                "; this verifier runs none (no [verification] pool or model)" if svc is None
                else f"; this verifier led {svc['epochs_led']}, scored "
                     f"{svc['answers_scored']} answers, agreed with {svc['reports_agreed']} "
                     f"reports, refused {svc['reports_refused']}"))
            for peer, (answered, passed, missed) in list(e.get("credits", {}).items())[:10]:
                print(f"credits    {peer}: {answered} challenges answered, {passed} normal, "
                      f"{missed} confirmed misses")
        if c.get("evidence"):
            print(f"evidence   {c['evidence']} equivocation(s) committed against "
                  + ", ".join(c.get("equivocators") or []))
        if c.get("reputations"):
            print(f"reputation {c['reputations']} subject(s) scored, "
                  f"{c.get('untrusted_subjects', 0)} untrusted")
        up = sum(1 for v in c["validators"] if v["connected"])
        print(f"validators {up} of {len(c['validators'])} connected")
        for v in c["validators"]:
            print(f"  {v['peer_id']}  power {v['power']}  "
                  f"{'connected' if v['connected'] else 'NOT connected'}")
    return 0 if not stale else 1


def _cmd_multihost(args: argparse.Namespace) -> int:
    from ps_p2p.testing import multihost, netns

    if args.sweep:
        gone = netns.sweep()
        print(f"removed {len(gone)} namespaces of earlier runs" + (f": {' '.join(gone)}"
                                                                   if gone else ""))
        return 0
    return multihost.main(multihost.MultihostOptions(
        verifiers=args.verifiers, models=args.models, users=args.users,
        nat_users=args.nat_users, nat_ask_only=args.nat_ask_only, prompts=args.prompts,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens, perturb=args.perturb, profile=args.profile,
        bandwidth=args.bandwidth, start_timeout=args.start_timeout,
        prompt_timeout=args.timeout, workdir=args.workdir, log_level=args.log_level,
        seed=args.seed))


def _cmd_testnet(args: argparse.Namespace) -> int:
    import ipaddress

    from ps_p2p.config import group_key_toml, new_group_key
    from ps_p2p.registry import Genesis
    from ps_p2p.consensus.block import BlockLimits
    from ps_p2p.consensus.core import ConsensusConfig
    from ps_p2p.consensus.types import Validator
    from ps_p2p.genesis import genesis_hash, genesis_json
    from ps_p2p.keys import load_or_create_keys

    if not 1 <= args.verifiers <= 128:
        raise ConfigError("--verifiers must be in 1..128")
    if args.verifiers % 3 != 1:
        f = (args.verifiers - 1) // 3  # faulty verifiers a committee of N tolerates
        print(f"ps-node: note: {args.verifiers} verifiers tolerate {f} faulty one"
              f"{'' if f == 1 else 's'}, no more than {3 * f + 1} would; N = 3f+1 "
              f"(4, 7, 10, ...) uses every one", file=sys.stderr)
    try:
        version = ipaddress.ip_address(args.host).version
    except ValueError as exc:
        raise ConfigError(f"--host {args.host}: not an IP address") from exc
    if not 1 <= args.base_port <= 65535 - args.verifiers:
        raise ConfigError("--base-port leaves no room for the verifiers' ports")
    out = pathlib.Path(args.out).expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; refusing to overwrite a testnet")
    names = [f"verifier{i}" for i in range(args.verifiers)]
    keys = [load_or_create_keys(out / name / "node.key") for name in names]
    addrs = [
        f"/ip{version}/{args.host}/tcp/{args.base_port + i}/p2p/{k.identity.peer_id_str}"
        for i, k in enumerate(keys)
    ]
    verification, epochs_setup = _testnet_verification(args)
    genesis = Genesis(
        args.chain_id, int(time.time() * 1000),
        tuple(Validator(k.identity.peer_id) for k in keys),
        limits=BlockLimits(max_block_bytes=4 << 20, max_tx_bytes=1 << 20)
        if verification is not None else BlockLimits(),
        verification=verification,
    )
    text = genesis_json(genesis, ConsensusConfig(), names)
    (out / "genesis.json").write_text(text)
    for i, name in enumerate(names):
        others = [a for j, a in enumerate(addrs) if j != i]
        listen = addrs[i].rsplit("/p2p/", 1)[0]
        epochs_toml = epochs_setup(out / name) if epochs_setup is not None else ""
        (out / name / "config.toml").write_text(
            f"# {name} of chain {args.chain_id!r}; genesis: {out / 'genesis.json'}\n"
            f"roles = {json.dumps(['verifier', 'user'] if epochs_toml else ['verifier'])}\n"
            f"name = {json.dumps(name)}\n"
            f"home = {json.dumps(str(out / name))}\n"
            f"genesis = {json.dumps(str(out / 'genesis.json'))}\n"
            f"listen = {json.dumps(listen)}\n"
            f"bootstrap = {json.dumps(others)}\n"
            + epochs_toml
        )
    group = out / "model-group.toml"  # the model nodes' shared secret: theirs only
    group.touch(mode=0o600)
    group.write_text(group_key_toml(new_group_key()))
    print(f"chain {args.chain_id}: {args.verifiers} verifiers, genesis {out / 'genesis.json'} "
          f"(sha256 {genesis_hash(text)[:16]})")
    print(f"  model nodes of one group: [forwarding] of {group} in their config")
    for name, addr in zip(names, addrs):
        print(f"  {name}: {addr}  (ps-node run --config {out / name / 'config.toml'})")
    return 0


def _testnet_verification(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The genesis' verification section and ``setup(home) -> config lines``, which writes a
    verifier's secrets for it into its home (or None, None).

    Every verifier gets the same committee key (``committee.key``, mode 0600; the genesis
    commits its hash) and, for ``--challenge-pool generate``, the same generated pool
    (``challenge-pool.jsonl``); nothing of either is written outside the verifiers' homes.
    """
    if not args.challenge_model and not args.challenge_pool:
        return None, None
    if not args.challenge_model or not args.challenge_pool:
        raise ConfigError("challenge epochs need both --challenge-model and --challenge-pool")
    from ps_p2p.verification.ledger import VerificationParams, pool_digest
    from ps_p2p.verification.sealing import generate_committee_key, key_commitment
    from ps_p2p.verification.service import load_pool

    model = pathlib.Path(args.challenge_model).expanduser().resolve()
    model_id = args.challenge_model_id or model.stem
    if args.epoch_attempt is None:
        args.epoch_attempt = args.epoch_seconds + 90.0 if args.epoch_seconds else 60.0
    if not 1 <= args.epoch_attempt <= 86400 or not 0 <= args.epoch_seconds <= 7 * 86400:
        raise ConfigError("--epoch-attempt must be in 1..86400 s, --epoch-seconds in 0..604800")
    generated = args.challenge_pool == ["generate"]
    if generated:
        pool = _generate_pool(model, args.challenge_pool_size)
    else:
        if "generate" in args.challenge_pool:
            raise ConfigError("--challenge-pool generate takes no prompt file beside it")
        pool = load_pool(args.challenge_pool)
        print("ps-node: warning: a challenge pool from prompt files is only private if no "
              "model node has those files; a public data set (MT-Bench, ShareGPT) lets model "
              "nodes recognise every challenge (use --challenge-pool generate)", file=sys.stderr)
    key = generate_committee_key()
    try:
        params = VerificationParams(model_id=model_id, pool_sha256=pool_digest(pool),
                                    pool_size=len(pool),
                                    challenges_per_node=min(args.challenges_per_node, len(pool)),
                                    attempt_ms=int(args.epoch_attempt * 1000),
                                    epoch_ms=int(args.epoch_seconds * 1000),
                                    committee_key_sha256=key_commitment(key))
    except PsError as exc:
        raise ConfigError(f"challenge epochs: {exc}") from exc
    files = [str(pathlib.Path(f).expanduser().resolve()) for f in args.challenge_pool]

    def setup(home: pathlib.Path) -> str:
        pools = files
        if generated:
            pool_file = home / "challenge-pool.jsonl"
            _write_private(pool_file, "".join(json.dumps({"prompt": p}) + "\n" for p in pool))
            pools = [str(pool_file)]
        key_file = home / "committee.key"
        _write_private(key_file, key.hex() + "\n")
        return (f"model = {json.dumps(str(model))}\n"
                f"model_id = {json.dumps(model_id)}\n"
                f"\n[verification]\npool = {json.dumps(pools)}\n"
                f"committee_key = {json.dumps(str(key_file))}\n")

    return params, setup


def _generate_pool(model: pathlib.Path, size: int) -> list[str]:
    """A private pool of ``size`` prompts sampled from ``model`` under a fresh secret seed
    (:func:`ps_p2p.prompts.generate_prompts`; the seed is not kept)."""
    from ps_p2p.engines import load_engine
    from ps_p2p.prompts import MAX_PROMPTS, generate_prompts

    if not 1 <= size <= MAX_PROMPTS:
        raise ConfigError(f"--challenge-pool-size must be in 1..{MAX_PROMPTS}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    engine = load_engine("transformers", model=str(model))
    seed = os.urandom(32)
    print(f"ps-node: generating a private challenge pool of {size} prompts with {model.name}",
          file=sys.stderr)
    prompts = trio.run(generate_prompts, engine, size, seed)
    return [p.text for p in prompts]


def _write_private(path: pathlib.Path, text: str) -> None:
    """Write a new file readable by its owner only (mode 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def _run_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ps_p2p.config import load_config

    overrides: dict[str, Any] = {
        "roles": args.role,
        "listen": args.listen,
        "bootstrap": args.bootstrap,
        "verifiers": args.verifiers,
        "genesis": args.genesis,
        "key_file": args.key_file,
        "name": args.name,
        "home": args.home,
        "model": args.model,
        "engine": args.engine,
        "vllm_url": args.vllm_url,
        "device": args.device,
        "model_id": args.model_id,
        "membership": args.membership,
        "tamper": args.tamper,
        "metrics": args.metrics,
        "web": args.web,
        "status_interval": args.status_interval,
        "drain_timeout": args.drain_timeout,
    }
    config = load_config(args.config, overrides)
    if args.capacity is not None:
        if args.capacity < 1:
            raise ConfigError("--capacity must be >= 1")
        config.model_node.capacity = args.capacity
    return config


def make_engine(config):  # type: ignore[no-untyped-def]
    """The engine of a model node's config, or a verifier's reference copy of the committee's
    model when it runs challenge epochs (None otherwise)."""
    epochs = "verifier" in config.roles and bool(config.verification.pool)
    if "model" not in config.roles and not epochs:
        return None
    from ps_p2p.engines import load_engine

    if config.engine == "transformers":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return load_engine(
        config.engine,
        model=config.model,
        device=config.device,
        base_url=config.vllm_url,
        model_id=config.model_id,
        sim=config.sim,
        kv_events_endpoint=config.kv_events_endpoint,
        kv_events_replay_endpoint=config.kv_events_replay_endpoint,
    )


async def _run_node_at_home(  # type: ignore[no-untyped-def]
    config, api: str | None, status_file: str | None,
    *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    """:func:`_run_node` with the key and status files not given in the node's home
    (:mod:`ps_p2p.home`), which stays locked while the node runs.

    Raises:
        ConfigError: the home is in use by another node or cannot be created.
    """
    import contextlib

    from ps_p2p.home import STATUS_FILE, locked_home

    uses_home = config.home is not None or config.key_file is None or status_file is None
    with locked_home(config.home_path) if uses_home else contextlib.nullcontext():
        status_file = status_file or str(config.home_path / STATUS_FILE)
        await _run_node(config, api, status_file, task_status=task_status)


async def _run_node(  # type: ignore[no-untyped-def]
    config, api: str | None, status_file: str | None,
    *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one node until cancelled; once it listens, print its listen multiaddrs (with
    ``/p2p/<peer ID>``) on stdout, one a line, and call ``task_status.started(node)``."""
    from ps_p2p.keys import load_or_create_keys
    from ps_p2p.node import Node

    keys = load_or_create_keys(config.key_path)
    engine = make_engine(config)
    if engine is not None:
        log.info("model %s loaded (%s engine)", engine.model_id, config.engine)
    node = Node(config, keys, engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        api_url = None
        if api:
            from ps_p2p.api.openai_compat import serve_api

            api_url = await nursery.start(serve_api, node, api)
        if config.web:
            from ps_p2p.api.web import serve_web

            await nursery.start(serve_web, node, config.web)
        # before the addresses are printed: a script that reads them may send SIGTERM at once
        await nursery.start(_stop_on_sigterm, nursery.cancel_scope, node)
        log.info("peer ID %s, keys %s, status %s", keys.identity.peer_id_str, config.key_path,
                 status_file)
        for addr in node.listen_addrs:  # stdout is for scripts: the addresses only
            print(addr, flush=True)
        if status_file:
            nursery.start_soon(_status_writer, node, pathlib.Path(status_file), api_url)
        task_status.started(node)


async def _stop_on_sigterm(  # type: ignore[no-untyped-def]
    scope: trio.CancelScope, node=None, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """SIGINT (Ctrl-C) and SIGTERM (systemd, docker, the devnet) stop the node cleanly; a model
    node first drains (:meth:`ps_p2p.node.Node.drain`: new requests refused, its record
    withdrawn, the requests in service finished within ``--drain-timeout``). A second SIGINT
    or SIGTERM stops it at once. ``task_status.started()`` once the signals are caught (before
    that, during start-up, SIGINT stops the process as KeyboardInterrupt)."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if node is None or node.model is None:
                log.info("%s: stopping the node", name)
                scope.cancel()
                return
            log.info("%s: draining (up to %.0f s; SIGINT or SIGTERM again stops at once)",
                     name, node.config.drain_timeout)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_drain_then_stop, node, scope)
                async for again in signals:
                    log.info("second signal (%s): stopping at once", signal.Signals(again).name)
                    break
                scope.cancel()
            return


async def _drain_then_stop(node, scope: trio.CancelScope) -> None:  # type: ignore[no-untyped-def]
    report = await node.drain()
    if report is not None:
        log.info("drained in %.1f s: %d request(s) finished, %d abandoned; stopping",
                 report.seconds, report.finished, report.abandoned)
    scope.cancel()


async def _status_writer(node, path: pathlib.Path, api_url: str | None) -> None:  # type: ignore[no-untyped-def]
    from ps_p2p.health import node_health

    while True:
        d = node.directory
        status = {
            "pid": os.getpid(),
            "peer_id": node.keys.identity.peer_id_str,
            "roles": list(node.config.roles),
            "listen": node.listen_addrs,
            "api": api_url,
            "directory": None if d is None else {
                "height": d.height, "users": len(d.users()), "model_nodes": len(d.model_nodes()),
            },
            "ready_paths": len(node.user.ready_paths()) if node.user else 0,
            "nat": node.nat.status() if node.nat is not None else None,
            "committee": node.committee_status(),
            "reputation": node.reputation_status(),
            "health": node_health(node).as_json(),
            "written_at_ms": int(time.time() * 1000),
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(status))
        tmp.replace(path)
        await trio.sleep(0.5)  # periodic refresh of a file other processes poll


def _preflight(config, api: str | None) -> None:  # type: ignore[no-untyped-def]
    """What can be checked before a key file is written or torch is imported
    (:mod:`ps_p2p.preflight`): the model path, and that the listen, API and metrics addresses
    are free.

    Raises:
        ConfigError: a bad ``--model`` path or ``--api`` address.
        AddressInUseError: an address another socket holds.
    """
    from ps_p2p import preflight
    from ps_p2p.config import parse_host_port

    if "model" in config.roles and config.engine == "transformers":
        preflight.check_model_path(config.model)
    preflight.check_listen_free(config.listen)
    if api is not None:
        host, port = parse_host_port(api, "--api")
        preflight.check_address_free(host, port, f"--api {api}")
    if config.web is not None:
        host, port = parse_host_port(config.web, "--web")
        preflight.check_address_free(host, port, f"--web {config.web}")
    if config.metrics is not None:
        host, port = parse_host_port(config.metrics, "--metrics")
        try:
            preflight.check_address_free(host, port, f"--metrics {config.metrics}")
        except AddressInUseError:  # worded as NodeMetrics.serve words it
            raise AddressInUseError(
                f"cannot serve metrics on {config.metrics}: address already in use"
            ) from None


def _cmd_run(args: argparse.Namespace) -> int:
    config = _run_config(args)
    if args.api is not None and "user" not in config.roles:
        raise ConfigError("--api needs the user role")
    _preflight(config, args.api)
    # A process started in the background of a non-interactive shell inherits SIGINT ignored;
    # an operator's Ctrl-C (or kill -INT) must still stop the node.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        trio.run(_run_node_at_home, config, args.api, args.status_file)
    except BaseException as exc:
        if is_keyboard_interrupt(exc):
            log.info("interrupted; node stopped")
            return 0
        # an address in use, a bad address...: reach main() as themselves, not as a group
        leaf = _only_exception(exc)
        if isinstance(leaf, (OSError, PsError)):
            raise leaf from None
        raise
    return 0


def _only_exception(exc: BaseException) -> BaseException:
    """The one exception inside nested exception groups of one member each (trio wraps what
    escapes a nursery), else ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _cmd_ask(args: argparse.Namespace) -> int:
    from ps_p2p.config import NodeConfig
    from ps_p2p.keys import NodeKeys
    from ps_p2p.node import Node

    if not args.prompt.strip():
        raise ConfigError("the prompt is empty; ask needs a non-empty prompt")
    if len(args.stop) > 4 or any(not s for s in args.stop):
        raise ConfigError("--stop takes up to 4 non-empty strings")
    if args.stream and args.json:
        raise ConfigError("--stream prints text as it comes; --json prints one object at the end")
    config = NodeConfig(roles=["user"], bootstrap=args.bootstrap, relay=False, register=False)
    config.validate()
    keys = NodeKeys.generate()

    async def main() -> int:
        async with trio.open_nursery() as nursery:
            node = await nursery.start(Node(config, keys).run)
            print("joining the network...", file=sys.stderr)
            failures = await node.unreachable_verifiers(timeout=min(ASK_DIAL_TIMEOUT, args.timeout))
            if len(failures) == len(config.bootstrap):
                for addr, reason in failures.items():
                    print(f"error: cannot reach verifier {addr}: {reason}", file=sys.stderr)
                nursery.cancel_scope.cancel()
                return 1
            try:
                await node.wait_directory(min_models=1, timeout=args.timeout)
            except trio.TooSlowError:
                print("error: no directory with a model node from the verifier", file=sys.stderr)
                nursery.cancel_scope.cancel()
                return 1
            assert node.user is not None
            streamed: list[str] = []

            def show(text: str) -> None:
                streamed.append(text)
                sys.stdout.write(text)
                sys.stdout.flush()

            answer = await node.user.ask(
                args.prompt,
                model_id=args.model_id,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                stop=args.stop,
                timeout=args.timeout,
                on_text=show if args.stream else None,
            )
            if streamed:
                print()
            nursery.cancel_scope.cancel()
        from libp2p.peer.id import ID

        served_by = ID(answer.served_by).to_base58() if answer.served_by else ""
        forwarded_by = ID(answer.forwarded_by).to_base58() if answer.forwarded_by else None
        if args.json:
            print(json.dumps({
                "ok": answer.ok, "response": answer.text, "served_by": served_by,
                "forwarded_by": forwarded_by,
                "signature_valid": answer.signature_valid, "cloves_received": answer.cloves_received,
                "latency_ms": round(answer.latency_ms, 1), "error": answer.error or None,
                # the typed outcome: a class of ps_p2p.errors (e.g. RequestTimeoutError)
                "error_type": answer.error_type.__name__ if answer.error_type else None,
            }))
        elif answer.ok:
            if not args.stream:
                print(answer.text)
            print(
                f"-- served by {served_by}"
                f"{f' (forwarded by {forwarded_by})' if forwarded_by else ''}, signature valid, {answer.cloves_received} cloves, "
                f"{answer.latency_ms:.0f} ms",
                file=sys.stderr,
            )
        else:
            if streamed:
                print("error: the text above was streamed but not confirmed by the signed answer",
                      file=sys.stderr)
            print(f"error: {answer.error}", file=sys.stderr)
        return 0 if answer.ok else 1

    return trio.run(main)


def _cmd_devnet(args: argparse.Namespace) -> int:
    from ps_p2p.devnet import (
        SHARED_PROMPTS,
        DevnetOptions,
        run_devnet,
        shared_defaults,
        shared_dir,
    )

    shared = shared_dir()
    model, prompts = shared_defaults(args.model, args.prompts, engine=args.engine, shared=shared)
    if prompts is None:
        raise ConfigError(f"devnet needs --prompts FILE (there is no {shared / SHARED_PROMPTS})")
    options = DevnetOptions(
        model=model,
        prompts=prompts,
        users=args.users,
        models=args.models,
        verifiers=args.verifiers,
        json_out=args.json_out,
        perturb=args.perturb,
        limit=args.limit,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        timeout=args.timeout,
        workdir=args.workdir,
        show=args.show,
        log_level=args.log_level,
        engine=args.engine,
        nodes_per_process=args.nodes_per_process,
        shared_prefix=args.shared_prefix,
        start_timeout=args.start_timeout,
    )
    return run_devnet(options)


def _nodes_per_process(text: str) -> int | None:
    """``--nodes-per-process``: a number, or ``auto`` (None: ps_p2p.devnet's automatic rule)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', not {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ps-node``; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_level is None:
        args.log_level = "WARNING" if args.command == "ask" else "INFO"
    _setup_logging(args.log_level, network=args.command in NETWORK_COMMANDS)
    try:
        if args.command == "keygen":
            return _cmd_keygen(args)
        if args.command == "org":
            return _cmd_org(args)
        if args.command == "group-key":
            return _cmd_group_key(args)
        if args.command == "testnet":
            return _cmd_testnet(args)
        if args.command == "status":
            return _cmd_status(args)
        if args.command == "valset":
            return _cmd_valset(args)
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "ask":
            return _cmd_ask(args)
        if args.command == "devnet":
            return _cmd_devnet(args)
        if args.command == "multihost":
            return _cmd_multihost(args)
    except ConfigError as exc:
        print(f"ps-node: {exc}", file=sys.stderr)
        return 2
    except AddressInUseError as exc:  # the message names the flag or the listen multiaddr
        print(f"ps-node: {exc}", file=sys.stderr)
        return 1
    except PsError as exc:
        print(f"ps-node: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. a listen or metrics address in use: the message names it
        print(f"ps-node: {exc}", file=sys.stderr)
        return 1
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
