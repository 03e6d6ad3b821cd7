"""A network fuzzer: random and mutated frames against every protocol of a live localnet.

:func:`run_fuzz` starts :func:`~ps_p2p.testing.localnet.open_localnet` (a verifier, model nodes
with :class:`~ps_p2p.testing.fakes.InstantEngine`, users), then attacks it from ``sybils`` hosts of
its own (real py-libp2p hosts, fresh identities, in no directory). For every node it reads the
protocols the node's host serves from the host's multistream-select handler table
(``host.get_mux().handlers``, where ``BasicHost.set_stream_handler`` stores them), so a protocol
added later is fuzzed without editing this file; libp2p's own ``/ipfs/...`` protocols (ping,
identify) are left out unless asked for.

What it sends, one *input* = one frame (or one malformed length prefix):

* ``proto``: a message of the protocol's root type with random field values (built from the
  protobuf descriptors of ``ps_p2p.pb``; the root type of ``/planetserve/<name>/...`` is found from
  the ``.proto`` file whose header comment names that protocol ID, else by name, else any message),
  with hints that reach deeper code: real peer IDs, 16-byte path IDs, fixed setup and cell sizes,
  nested messages serialized into ``bytes`` fields named after them (``clove`` -> ``Clove``);
* ``mutated``: such a message bit-flipped, truncated, extended, spliced or with bytes overwritten;
* ``raw``: random bytes; ``empty``: zero-length frames; ``big``: frames near the size limits;
* ``framing``: oversized length prefixes, varints of 10+ bytes, non-minimal varints;
* endings: close, reset, half a frame then close, half a frame then reset;
* ``burst``: many streams at once to one node;
* ``sida``: S-IDA cloves of a random (partly valid) inference request, each clove delivered by a
  different sybil host (model nodes count one clove per proxy), so requests reassemble and the
  model node's request handling and answering are fuzzed too;
* ``directory``: well-formed but hostile ``/planetserve/directory/2.0.0`` requests, several on
  one stream, that pass the frame and protobuf checks and reach the committee's admission: a
  record in the sender's name signed by another key (forged), another node's validly signed
  record, another node's signed deregistration, genesis requests, and directory requests from
  heights 0 to 2**64 - 1.

It sends every one of ``inputs`` (a time limit only when ``duration`` is given; the report then
says it stopped on time). ``concurrency`` workers generate inputs; each stream is written and
ended by its worker, which then goes on while a watcher task reads what the node sends back
and waits for the node to end the stream (at most ``max_open_streams`` streams at once), so a
slow reply never idles a worker.

A *crash*: an exception leaving the localnet (a node task died: the localnet nursery raises), or
an exception escaping a fuzzed protocol's stream handler on a node, past the protocol's own
wrapper (:func:`watch_handlers`; py-libp2p would end the connection or the host). A *hang*: an
input whose handling does not finish within ``hang_timeout`` seconds (our writes blocked that
long because the node stopped reading, or a stream we closed that the node neither ended nor
reset that long after our close), or a liveness request that did not come back in time.

While it runs, and after, it checks liveness: every user must complete an anonymous request
(``node.user.ask`` returns ok) and the verifier must serve its committed directory
(``/planetserve/directory/2.0.0``, verified against the localnet's genesis), each within
``liveness_timeout`` seconds. It also samples the RSS of the process (``VmRSS`` of
``/proc/self/status``) and the sizes of the containers the nodes' services hold, counts what the
nodes and py-libp2p logged at WARNING and above (exceptions logged with a traceback are reported
as findings), and times every input from its stream's open to the node's end of it (the slowest
is reported).

Randomness: every worker draws from ``random.Random(f"{seed}/{worker}")``; what each worker sends
is fixed by the seed, how the workers interleave is up to the scheduler.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import os
import pathlib
import pkgutil
import platform
import random
import re
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import trio
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from ps_p2p.config import NodeConfig
from ps_p2p.crypto import onion, sida
from ps_p2p.keys import Identity, NodeKeys
from ps_p2p.node import Node
from ps_p2p.pb.planetserve.v1 import directory_pb2
from ps_p2p.protocols.committee_directory import (
    COMMITTEE_DIRECTORY_PROTOCOL_ID,
    fetch_committed_directory,
)
from ps_p2p.protocols.framing import encode_frame, encode_varint
from ps_p2p.protocols.host import connect, open_host
from ps_p2p.protocols.record_codec import record_to_pb
from ps_p2p.records import NodeRecord, Role, sign_record
from ps_p2p.registry import encode_tx, sign_deregister
from ps_p2p.registry.replica import CommitteeReplica
from ps_p2p.roles.user import UserConfig
from ps_p2p.testing.localnet import LocalNet, open_localnet

log = logging.getLogger(__name__)

#: Protocol ID prefixes of libp2p's own services (ping, identify), skipped unless asked for.
LIBP2P_PREFIXES = ("/ipfs/", "/libp2p/", "/multistream/")
#: Protocols a node serves to any honest peer, in the order the liveness check's fresh stream
#: tries them (onion: every relay; directory/2: the verifier).
HONEST_PROTOCOLS: tuple[str, ...] = ("/planetserve/onion/1.0.0", "/planetserve/directory/2.0.0")
#: Where the .proto files live in a checkout (their header comments name the protocol IDs).
PROTOS_DIR = pathlib.Path(__file__).resolve().parents[2] / "protos"
#: The package holding the generated protobuf modules.
PB_PACKAGE = "ps_p2p.pb.planetserve.v1"

#: Byte lengths that matter to the wire formats: IDs, keys, signatures, setup packets, cells.
INTERESTING_SIZES: tuple[int, ...] = (
    0, 1, 2, 15, 16, 17, 31, 32, 33, 42, 63, 64, 65, 127, 128, 255, 256,
    onion.SETUP_PACKET_BYTES - 1, onion.SETUP_PACKET_BYTES, onion.SETUP_PACKET_BYTES + 1,
    *(onion.CELL_IV_BYTES + b + 16 for b in onion.CELL_BUCKETS[:2]),
)
#: Length prefixes above every protocol's limit (and some just below large ones).
OVERSIZED_LENGTHS: tuple[int, ...] = (
    4 * 1024 + 1, 64 * 1024 + 1, onion.CELL_BUCKETS[-1] + 1025, 16 * 1024 * 1024 + 1,
    1 << 31, (1 << 32) + 7, (1 << 62), (1 << 63) - 1,
)
_U32 = (0, 1, 2, 3, 4, 5, 15, 16, 17, 255, 256, 65535, 2**31 - 1, 2**31, 2**32 - 1)
_U64 = (*_U32, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1)
_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-45, 3.4e38, -3.4e38, math.inf, -math.inf, math.nan)
#: Field names whose value is a 16-byte identifier in every honest message.
_ID16_FIELDS = ("path_id", "message_id", "request_id", "reply_tag")
#: Field names whose value is a peer ID.
_PEER_FIELDS = ("peer_id", "destination", "verifier_id", "model_node", "preferred_model_node")


def rss_kib() -> int:
    """Resident set size of this process in KiB (``VmRSS`` of /proc/self/status; 0 if absent)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def discover_protocols(host: IHost, *, include_libp2p: bool = False) -> list[str]:
    """The protocol IDs ``host`` serves, from its multistream-select handler table (sorted)."""
    handlers = host.get_mux().handlers
    out = [str(p) for p in handlers if p is not None]
    if not include_libp2p:
        out = [p for p in out if not p.startswith(LIBP2P_PREFIXES)]
    return sorted(out)


# ---------------------------------------------------------------------------------- messages


def message_classes() -> dict[str, type[Message]]:
    """Every top-level message class of the generated modules, by full name."""
    package = importlib.import_module(PB_PACKAGE)
    out: dict[str, type[Message]] = {}
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"{PB_PACKAGE}.{info.name}")
        for name, desc in module.DESCRIPTOR.message_types_by_name.items():
            out[desc.full_name] = getattr(module, name)
    return out


def _proto_protocol_map(protos_dir: pathlib.Path) -> dict[str, tuple[str, str]]:
    """protocol ID -> (proto file stem, its comment line), from header comments such as
    ``// /planetserve/x/1.0.0: ... (XFrame: a, b)``."""
    out: dict[str, tuple[str, str]] = {}
    if not protos_dir.is_dir():
        return out
    for path in protos_dir.rglob("*.proto"):
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.startswith("//"):
                break
            for match in re.finditer(r"(/planetserve/[\w.-]+/[\w.-]+)", line):
                out.setdefault(match.group(1), (path.stem, line))
    return out


def root_messages(protocol_id: str, classes: dict[str, type[Message]]) -> list[type[Message]]:
    """The message types a frame of ``protocol_id`` plausibly holds (best guess first).

    Order of guesses: the messages of the .proto file whose header comment names the protocol
    that the same comment line names; else that file's ``*Frame``/``*Request`` messages; else
    messages named after the protocol's ``<name>``; else every message.
    """
    found = _proto_protocol_map(PROTOS_DIR).get(protocol_id)
    if found is not None:
        stem, line = found
        in_file = [c for c in classes.values() if c.DESCRIPTOR.file.name.endswith(f"/{stem}.proto")]
        words = set(re.findall(r"\w+", line))
        named = [c for c in in_file if c.DESCRIPTOR.name in words]
        roots = [c for c in in_file if c.DESCRIPTOR.name.endswith(("Frame", "Request"))]
        if named or roots or in_file:
            return named or roots or in_file
    parts = [p for p in protocol_id.split("/") if p]
    name = re.sub(r"[^a-z0-9]", "", parts[1].lower()) if len(parts) > 1 else ""
    if name:
        named = [c for c in classes.values() if c.DESCRIPTOR.name.lower().startswith(name)]
        if named:
            named.sort(key=lambda c: not c.DESCRIPTOR.name.endswith(("Frame", "Request")))
            return named
    return list(classes.values())


class MessageFactory:
    """Random protobuf messages from descriptors, with hints that make them look valid.

    Args:
        rng: the randomness (all draws come from it).
        classes: message classes by full name (:func:`message_classes`).
        peer_ids: real peer IDs to put into peer-ID fields now and then.
    """

    def __init__(
        self, rng: random.Random, classes: dict[str, type[Message]], peer_ids: list[bytes]
    ) -> None:
        self.rng = rng
        self.classes = classes
        self.peer_ids = peer_ids
        self._by_short = {c.DESCRIPTOR.name.lower(): c for c in classes.values()}

    def random_bytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def random_size(self) -> int:
        r = self.rng.random()
        if r < 0.75:
            return self.rng.choice(INTERESTING_SIZES)
        if r < 0.97:
            return self.rng.randrange(0, 2048)
        return self.rng.randrange(2048, 70_000)

    def random_text(self) -> str:
        rng = self.rng
        n = rng.choice((0, 1, 3, 8, 16, 64, 200, 256, 257, 1000))
        if rng.random() < 0.02:
            n = rng.randrange(1000, 40_000)
        alphabet = rng.choice(("ascii", "unicode", "fake"))
        if alphabet == "fake":
            return rng.choice(("fake-model", "fake", "", "/ip4/127.0.0.1/tcp/1", "x" * n))
        if alphabet == "ascii":
            return "".join(chr(rng.randrange(32, 127)) for _ in range(min(n, 4000))) * max(1, n // 4000)
        points = []
        for _ in range(min(n, 2000)):
            c = rng.randrange(0, 0x110000)
            points.append(chr(c) if not 0xD800 <= c <= 0xDFFF else "\u00e9")
        return "".join(points)

    def build(self, cls: type[Message], depth: int = 0) -> Message:
        """A message of ``cls`` with random fields (at most one field of each oneof)."""
        msg = cls()
        self._fill(msg, cls.DESCRIPTOR, depth)
        return msg

    def _fill(self, msg: Message, desc: Descriptor, depth: int) -> None:
        rng = self.rng
        chosen_oneof: dict[str, FieldDescriptor | None] = {}
        for oneof in desc.oneofs:
            fields = list(oneof.fields)
            chosen_oneof[oneof.name] = rng.choice(fields) if rng.random() < 0.95 else None
        for f in desc.fields:
            oneof = f.containing_oneof
            if oneof is not None:
                if chosen_oneof.get(oneof.name) is not f:
                    continue
            elif rng.random() < 0.25:
                continue
            if f.is_repeated:
                count = rng.choice((0, 1, 1, 2, 3, 4, 5, 17)) if depth < 3 else rng.choice((0, 1))
                if rng.random() < 0.01:
                    count = rng.randrange(17, 300)
                target = getattr(msg, f.name)
                for _ in range(count):
                    if f.type == FieldDescriptor.TYPE_MESSAGE:
                        self._fill(target.add(), f.message_type, depth + 1)
                    else:
                        target.append(self._scalar(f, depth))
            elif f.type == FieldDescriptor.TYPE_MESSAGE:
                sub = getattr(msg, f.name)
                if depth < 5:
                    self._fill(sub, f.message_type, depth + 1)
                else:
                    sub.SetInParent()
            else:
                setattr(msg, f.name, self._scalar(f, depth))

    def _scalar(self, f: FieldDescriptor, depth: int) -> Any:
        rng = self.rng
        t = f.type
        name = f.name
        if t == FieldDescriptor.TYPE_BYTES:
            return self._bytes_for(name, depth)
        if t == FieldDescriptor.TYPE_STRING:
            return self.random_text()
        if t == FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if t == FieldDescriptor.TYPE_ENUM:
            values = [v.number for v in f.enum_type.values]
            if rng.random() < 0.9:
                return rng.choice(values)
            return rng.choice((-1, 99, 2**31 - 1, -(2**31)))
        if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
            return rng.choice(_FLOATS) if rng.random() < 0.7 else rng.uniform(-1e6, 1e6)
        if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
            return rng.choice(_U32) if rng.random() < 0.8 else rng.randrange(2**32)
        if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
            if name.endswith("_ms") and rng.random() < 0.5:
                return int(time.time() * 1000) + rng.randrange(-10**7, 10**7)
            return rng.choice(_U64) if rng.random() < 0.8 else rng.randrange(2**64)
        if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
            return rng.choice((0, 1, -1, 2**31 - 1, -(2**31))) if rng.random() < 0.8 else rng.randrange(-(2**31), 2**31)
        if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
            return rng.choice((0, 1, -1, 2**63 - 1, -(2**63))) if rng.random() < 0.8 else rng.randrange(-(2**63), 2**63)
        raise ValueError(f"unhandled field type {t} of {f.full_name}")

    def _bytes_for(self, name: str, depth: int) -> bytes:
        rng = self.rng
        r = rng.random()
        if name in _ID16_FIELDS and r < 0.8:
            return self.random_bytes(16)
        if (name in _PEER_FIELDS or name.endswith("_id")) and self.peer_ids and r < 0.6:
            return rng.choice(self.peer_ids)
        if name == "packet" and r < 0.7:
            return self.random_bytes(onion.SETUP_PACKET_BYTES)
        if name in ("payload", "ack") and r < 0.5:
            bucket = rng.choice(onion.CELL_BUCKETS[:2])
            return self.random_bytes(onion.CELL_IV_BYTES + bucket + 16 if name == "payload" else bucket)
        if name in ("onion_key", "key_share") and r < 0.6:
            return self.random_bytes(32)
        if name == "signature" and r < 0.6:
            return self.random_bytes(64)
        nested = self._by_short.get(name.replace("_", ""))
        if depth < 4 and (nested is not None and r < 0.7 or r < 0.1):
            cls = nested if nested is not None else rng.choice(list(self.classes.values()))
            data = self.build(cls, depth + 1).SerializeToString()
            return mutate(rng, data) if rng.random() < 0.2 else data
        return self.random_bytes(self.random_size())


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to three random mutations of ``data`` (bit flips, truncation, splices, ...)."""
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.randrange(9)
        n = len(buf)
        if op == 0 and n:  # flip bits
            for _ in range(rng.choice((1, 1, 2, 8))):
                i = rng.randrange(n)
                buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:  # truncate
            del buf[rng.randrange(n):]
        elif op == 2:  # append random bytes
            buf += rng.randbytes(rng.choice((1, 2, 16, 100)))
        elif op == 3 and n:  # overwrite with an interesting byte
            buf[rng.randrange(n)] = rng.choice((0x00, 0x01, 0x7F, 0x80, 0xFF))
        elif op == 4 and n:  # delete a range
            i = rng.randrange(n)
            del buf[i : i + rng.randrange(1, 32)]
        elif op == 5 and n:  # duplicate a range
            i = rng.randrange(n)
            buf[i:i] = buf[i : i + rng.randrange(1, 64)]
        elif op == 6:  # insert a huge varint (a field length or tag that runs off the end)
            i = rng.randrange(n + 1)
            buf[i:i] = b"\xff" * rng.randrange(1, 12) + b"\x01"
        elif op == 7 and n:  # set a length-delimited-looking byte to a big length
            i = rng.randrange(n)
            buf[i : i + 1] = encode_varint(rng.choice((127, 128, 2**20, 2**31, 2**63 - 1)))
        elif op == 8:  # insert an unknown field (tag 1000..2^29) with a random wire type
            tag = (rng.randrange(16, 2**29) << 3) | rng.choice((0, 1, 2, 5, 3, 4, 6, 7))
            i = rng.randrange(n + 1)
            buf[i:i] = encode_varint(tag) + rng.randbytes(rng.randrange(0, 10))
    return bytes(buf)


# ---------------------------------------------------------------------------------- report


@dataclass
class FuzzConfig:
    """Settings of one fuzz run; times in seconds.

    Attributes:
        seed: seeds the workers' randomness and the localnet.
        inputs: frames to send in total; the run sends all of them unless ``duration`` is set.
        duration: None (the default): no time limit. Else stop sending after this many seconds
            even if ``inputs`` are not all sent; the report then says it stopped on time
            (:attr:`FuzzReport.stopped_on_time`).
        users, models: size of the localnet.
        concurrency: attack tasks at once (each works one stream at a time, or a burst).
        sybils: insider attackers: user nodes of their own (fresh identities, registered in the
            directory, relaying honestly) whose hosts also send fuzz; S-IDA cloves of one request
            come from distinct ones (model nodes accept deliveries only from directory users).
            One outsider host (in no directory) attacks too.
        check_interval: seconds between liveness checks while fuzzing (0: only at the end).
        liveness_timeout: deadline of one liveness check (each request and directory fetch).
        include_libp2p: also fuzz libp2p's own protocols (ping, identify).
        ready_timeout: for the localnet to come up.
        hang_timeout: the bound on one input's handling: writes that block this long (the node
            stopped reading) or a stream we closed that the node neither ends nor resets within
            this long after our close is a hang. 30 s: handling one frame takes milliseconds; the
            bound leaves room for a loaded 2-core machine.
        max_open_streams: fuzz streams open at once (the workers' plus those whose end is awaited).
        progress_interval: seconds between progress lines (0: none).
    """

    seed: int = 1
    inputs: int = 2000
    duration: float | None = None
    users: int = 6
    models: int = 1
    concurrency: int = 8
    sybils: int = 3
    check_interval: float = 20.0
    liveness_timeout: float = 60.0
    include_libp2p: bool = False
    ready_timeout: float = 60.0
    hang_timeout: float = 30.0
    max_open_streams: int = 64
    progress_interval: float = 10.0


@dataclass
class LivenessCheck:
    """One round of liveness checks: every user asks once, the verifier serves its directory."""

    at: float
    answered: int
    failures: list[str]
    hangs: list[str]
    seconds: float
    rss_kib: int
    table_entries: int


@dataclass
class FuzzReport:
    """What a fuzz run did and found (see :meth:`summary`)."""

    config: FuzzConfig
    protocols: dict[str, list[str]] = field(default_factory=dict)
    inputs_by_protocol: Counter[str] = field(default_factory=Counter)
    #: inputs by ``"<role> <protocol ID>"`` (13 pairs for today's localnet)
    inputs_by_role_protocol: Counter[str] = field(default_factory=Counter)
    inputs_by_kind: Counter[str] = field(default_factory=Counter)
    streams_opened: int = 0
    stream_open_failures: Counter[str] = field(default_factory=Counter)
    streams_left_open: int = 0
    streams_left_open_by_protocol: Counter[str] = field(default_factory=Counter)
    #: inputs whose handling did not finish within ``config.hang_timeout`` (first 50), and counts
    input_hangs: list[str] = field(default_factory=list)
    input_hangs_by_protocol: Counter[str] = field(default_factory=Counter)
    #: protocol ID -> [streams, total seconds, max seconds] from stream open to the node's end of it
    input_seconds: dict[str, list[float]] = field(default_factory=dict)
    slowest_input_seconds: float = 0.0
    slowest_input: str = ""
    #: the run stopped at ``config.duration`` before it sent ``config.inputs``
    stopped_on_time: bool = False
    #: seconds the slowest fresh stream of a liveness check took to open (a starved process is slow)
    slowest_fresh_stream: float = 0.0
    fuzz_seconds: float = 0.0
    checks: list[LivenessCheck] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    #: the localnet (or the attackers) could not start: nothing was fuzzed
    setup_error: str = ""
    rss_before_kib: int = 0
    rss_after_kib: int = 0
    rss_peak_kib: int = 0
    tables_before: dict[str, int] = field(default_factory=dict)
    tables_after: dict[str, int] = field(default_factory=dict)
    node_log: Counter[str] = field(default_factory=Counter)
    #: the first full message logged under each ``node_log`` template
    node_log_samples: dict[str, str] = field(default_factory=dict)
    logged_tracebacks: list[str] = field(default_factory=list)
    last_inputs: list[str] = field(default_factory=list)

    @property
    def inputs(self) -> int:
        return sum(self.inputs_by_protocol.values())

    @property
    def inputs_per_second(self) -> float:
        return self.inputs / self.fuzz_seconds if self.fuzz_seconds > 0 else 0.0

    @property
    def checks_passed(self) -> int:
        return sum(1 for c in self.checks if not c.failures and not c.hangs)

    @property
    def hangs(self) -> list[str]:
        """Liveness requests that did not come back in time, then inputs whose handling did not
        finish within ``config.hang_timeout`` (the first 50; :meth:`hang_count` counts all)."""
        return [h for c in self.checks for h in c.hangs] + self.input_hangs

    @property
    def hang_count(self) -> int:
        return sum(len(c.hangs) for c in self.checks) + sum(self.input_hangs_by_protocol.values())

    @property
    def liveness_failures(self) -> list[str]:
        return [f for c in self.checks for f in c.failures]

    @property
    def final_check_ok(self) -> bool:
        return bool(self.checks) and not self.checks[-1].failures and not self.checks[-1].hangs

    def summary(self) -> str:
        """A human-readable report."""
        c = self.config
        lines = [
            f"machine: {platform.platform()}, python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs",
            f"localnet: 1 verifier, {c.models} model node(s), {c.users} users; "
            f"attackers: 1 outsider + {c.sybils} insider user nodes, {c.concurrency} attack tasks, seed {c.seed}",
            "protocols fuzzed:",
        ]
        for role, protocols in self.protocols.items():
            lines.append(f"  {role}: {', '.join(protocols)}")
        if self.stopped_on_time:
            lines.append(
                f"STOPPED ON TIME after {self.inputs} of {c.inputs} inputs "
                f"(--duration {c.duration:g} s): the run is incomplete"
            )
        lines.append(
            f"inputs: {self.inputs} of {c.inputs} in {self.fuzz_seconds:.1f} s = "
            f"{self.inputs_per_second:.0f}/s over {self.streams_opened} streams"
        )
        for protocol, n in sorted(self.inputs_by_role_protocol.items()):
            lines.append(f"  {protocol}: {n}")
        lines.append("per protocol: inputs, streams, mean / max seconds from open to the node's end")
        for protocol, n in sorted(self.inputs_by_protocol.items()):
            streams, total, worst = self.input_seconds.get(protocol, (0, 0.0, 0.0))
            mean = total / streams if streams else 0.0
            lines.append(f"  {protocol}: {n} inputs, {int(streams)} streams, {mean:.3f} / {worst:.2f} s")
        lines.append(f"slowest input: {self.slowest_input_seconds:.2f} s: {self.slowest_input or '-'}")
        lines.append("  by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(self.inputs_by_kind.items())))
        if self.stream_open_failures:
            lines.append(
                "stream opens that failed: "
                + ", ".join(f"{k} x{n}" for k, n in self.stream_open_failures.most_common())
            )
        lines.append(
            f"streams the node left open {c.hang_timeout:g} s after our close: {self.streams_left_open}"
            + (" (" + ", ".join(f"{p} {n}" for p, n in self.streams_left_open_by_protocol.most_common()) + ")"
               if self.streams_left_open else "")
        )
        lines.append(f"slowest fresh stream of a liveness check: {self.slowest_fresh_stream:.1f} s")
        lines.append(
            f"liveness checks: {self.checks_passed} of {len(self.checks)} rounds passed "
            f"({sum(ch.answered for ch in self.checks)} requests answered); "
            f"final round {'ok' if self.final_check_ok else 'FAILED'}"
        )
        for ch in self.checks:
            lines.append(
                f"  t={ch.at:6.1f}s answered {ch.answered} in {ch.seconds:.1f} s, "
                f"RSS {ch.rss_kib / 1024:.1f} MiB, table entries {ch.table_entries}"
                + (f", failures {ch.failures}" if ch.failures else "")
                + (f", hangs {ch.hangs}" if ch.hangs else "")
            )
        if self.setup_error:
            lines.append("SETUP FAILED (nothing fuzzed):\n  " + self.setup_error.replace("\n", "\n  "))
        lines.append(f"crashes: {len(self.crashes)}")
        for crash in self.crashes:
            lines.append("  " + crash.replace("\n", "\n  "))
        lines.append(f"hangs: {self.hang_count}")
        for hang in self.hangs[:20]:
            lines.append("  " + hang)
        lines.append(
            f"RSS: before {self.rss_before_kib / 1024:.1f} MiB, after {self.rss_after_kib / 1024:.1f} MiB, "
            f"peak {self.rss_peak_kib / 1024:.1f} MiB"
        )
        grown = {
            k: (self.tables_before.get(k, 0), v)
            for k, v in self.tables_after.items()
            if v != self.tables_before.get(k, 0)
        }
        lines.append(
            f"node tables (sum over nodes, entries): {sum(self.tables_before.values())} before, "
            f"{sum(self.tables_after.values())} after; changed:"
        )
        for k, (before, after) in sorted(grown.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))[:15]:
            lines.append(f"  {k}: {before} -> {after}")
        lines.append("log records of the nodes and py-libp2p (WARNING+), top:")
        for msg, n in self.node_log.most_common(20):
            lines.append(f"  {n:7d}  {msg}")
            lines.append(f"           e.g. {self.node_log_samples.get(msg, '')[:200]!r}")
        lines.append(f"exceptions logged with a traceback: {len(self.logged_tracebacks)}")
        for tb in self.logged_tracebacks[:5]:
            lines.append("  " + tb.replace("\n", "\n  "))
        return "\n".join(lines)

    def summary_record(self) -> dict[str, object]:
        """The outcome in a few JSON-able fields (the ``FUZZ-SUMMARY`` line of the benchmark).

        Keys: ``inputs`` (sent), ``inputs_requested``, ``stopped_on_time``, ``seconds``,
        ``inputs_per_second``, ``protocols`` (distinct protocol IDs fuzzed),
        ``role_protocols`` (``"<role> <protocol ID>"`` pairs fuzzed), ``inputs_by_protocol``,
        ``inputs_by_role_protocol``, ``crashes``, ``hangs``, ``liveness_failures``,
        ``final_check_ok``, ``slowest_input_seconds``, ``slowest_input``, ``setup_error``
        (bool) and ``ok`` (no crash, no hang, final liveness round passed, every input sent).
        """
        ok = (not self.crashes and not self.hang_count and self.final_check_ok
              and not self.setup_error and not self.stopped_on_time)
        return {
            "ok": ok,
            "inputs": self.inputs,
            "inputs_requested": self.config.inputs,
            "stopped_on_time": self.stopped_on_time,
            "seconds": round(self.fuzz_seconds, 1),
            "inputs_per_second": round(self.inputs_per_second, 1),
            "protocols": len(self.inputs_by_protocol),
            "role_protocols": len(self.inputs_by_role_protocol),
            "inputs_by_protocol": dict(sorted(self.inputs_by_protocol.items())),
            "inputs_by_role_protocol": dict(sorted(self.inputs_by_role_protocol.items())),
            "crashes": len(self.crashes),
            "hangs": self.hang_count,
            "liveness_failures": len(self.liveness_failures),
            "final_check_ok": self.final_check_ok,
            "slowest_input_seconds": round(self.slowest_input_seconds, 3),
            "slowest_input": self.slowest_input,
            "setup_error": bool(self.setup_error),
        }

    def progress_line(self, elapsed: float, rate_now: float) -> str:
        """One line for long runs: inputs so far of those asked for, rates, counts per protocol."""
        short = ", ".join(
            f"{p.split('/')[2] if p.count('/') >= 3 else p}={n}"
            for p, n in sorted(self.inputs_by_protocol.items())
        )
        return (
            f"t={elapsed:.0f}s inputs {self.inputs}/{self.config.inputs} "
            f"({self.inputs / elapsed if elapsed > 0 else 0:.0f}/s overall, {rate_now:.0f}/s now); "
            f"crashes {len(self.crashes)}, hangs {self.hang_count}; {short}"
        )


def table_sizes(net: LocalNet) -> dict[str, int]:
    """Sizes of the containers the nodes' services hold, summed per role and attribute path.

    Walks ``overlay``, ``user``, ``model``, ``consensus`` and ``committee_directory`` of every
    node two levels deep (attributes that are dicts, lists, sets, deques or have ``__len__``),
    so new tables show up without editing this function.
    """
    out: Counter[str] = Counter()

    def walk(obj: object, prefix: str, depth: int, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        try:
            attrs = vars(obj)
        except TypeError:
            return
        for name, value in attrs.items():
            key = f"{prefix}.{name}"
            if isinstance(value, (dict, list, set, frozenset, deque, bytearray)):
                out[key] += len(value)
            elif depth < 2 and type(value).__module__.startswith("ps_p2p."):
                walk(value, key, depth + 1, seen)

    for role, nodes in (("verifier", [net.verifier]), ("model", net.models), ("user", net.users)):
        for node in nodes:
            seen: set[int] = set()
            for svc in ("overlay", "user", "model", "consensus", "committee_directory"):
                obj = getattr(node, svc, None)
                if obj is not None:
                    walk(obj, f"{role}.{svc}", 0, seen)
    return dict(out)


#: a base58 peer ID in a log message (Ed25519 ``12D3KooW...``, RSA/SHA-256 ``Qm...``)
_PEER_ID_TEXT = re.compile(r"\b(?:12D3KooW|Qm)[1-9A-HJ-NP-Za-km-z]{20,}")


class _LogTap(logging.Handler):
    """Counts WARNING+ records (of the nodes, of py-libp2p) by message template; keeps tracebacks."""

    def __init__(self, report: FuzzReport) -> None:
        super().__init__(logging.WARNING)
        self.report = report
        self._seen_tb: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        if record.args and isinstance(record.args, tuple):
            # keep the exception type names of "failed: %s: %s" style messages
            types = [a for a in record.args if isinstance(a, str) and a.endswith(("Error", "Exception"))]
            if types:
                msg += " [" + ",".join(types) + "]"
        # py-libp2p formats peer IDs into its messages: one template per message, not per peer
        key = _PEER_ID_TEXT.sub("<peer>", f"{record.name}: {msg}")[:160]
        self.report.node_log[key] += 1
        if key not in self.report.node_log_samples:
            try:
                self.report.node_log_samples[key] = record.getMessage()[:300]
            except Exception:  # a record whose args do not fit its format
                self.report.node_log_samples[key] = msg[:300]
        if record.exc_info and record.exc_info[1] is not None:
            tb = "".join(traceback.format_exception(*record.exc_info))
            key = tb.strip().splitlines()[-1]
            if key not in self._seen_tb and len(self._seen_tb) < 20:
                self._seen_tb.add(key)
                self.report.logged_tracebacks.append(f"{record.getMessage()}\n{tb}")


# ---------------------------------------------------------------------------------- the run


@dataclass
class _Watch:
    """One fuzz stream whose end is awaited (see :meth:`FuzzStreams.session`)."""

    stream: INetStream
    target: _Target
    label: str
    #: trio time the open began; seconds it took
    t0: float
    open_seconds: float
    #: we closed our side (not reset): the node is expected to end its side
    closed: bool = False
    #: around the reads; its deadline is set once our writes are over
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


@dataclass
class _Target:
    node_peer: bytes
    role: str
    protocol: str
    roots: list[type[Message]]


class FuzzStreams:
    """Fuzz streams from attacker hosts to nodes: open one, write the input, end it, and watch,
    in a task of its own, that the node finishes with it (see :meth:`session`).

    Args:
        config: ``hang_timeout`` (the bound on an input's handling, seconds),
            ``max_open_streams`` (streams open at once) and ``liveness_timeout`` (the deadline of
            a stream open, seconds).
        report: where stream counts, times, open failures and hangs are recorded.
        nursery: runs the watcher tasks (they end within ``hang_timeout`` of a session's end).
        who: names an attacker host in the report (``"outsider"``, ``"insider"``).
    """

    def __init__(self, config: FuzzConfig, report: FuzzReport, nursery: trio.Nursery,
                 who: Callable[[IHost], str] = lambda host: "attacker") -> None:
        self.config = config
        self.report = report
        self.nursery = nursery
        self.who = who
        #: one per fuzz stream open at once (held from the open until the node's end is seen)
        self.slots = trio.Semaphore(config.max_open_streams)

    async def _open(self, host: IHost, target: _Target) -> INetStream | None:
        try:
            with trio.fail_after(self.config.liveness_timeout):
                stream = await host.new_stream(ID(target.node_peer), [TProtocol(target.protocol)])
        except trio.TooSlowError:
            self._open_failed(host, target, "TooSlowError")
            return None
        except Exception as exc:
            self._open_failed(host, target, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}")
            return None
        self.report.streams_opened += 1
        return stream

    def _open_failed(self, host: IHost, target: _Target, what: str) -> None:
        peer = ID(target.node_peer).to_base58()[-6:]
        self.report.stream_open_failures[f"{self.who(host)} -> {target.role} {peer} {target.protocol}: {what}"] += 1

    async def session(self, host: IHost, target: _Target, writes: list[bytes], ending: str,
                      label: str, tail: bytes = b"") -> None:
        """Open a stream from ``host`` to ``target``, write ``writes`` (each one write() call),
        then ``tail``, and end it as ``ending`` says (``close``/``reset``, ``half-*`` alike).

        Returns once the writes are done (a worker never idles on a node's reply); a watcher
        task, started at the open and reading what the node sends back, then waits for the node
        to end or reset a stream we closed. A hang (counted in the report, input labelled
        ``label``): writes blocked ``config.hang_timeout`` seconds (the node stopped reading), or
        a node that has not ended a stream that long after our close. At most
        ``config.max_open_streams`` streams are open at once (this waits for a slot). A stream
        the node refuses to open is counted in ``report.stream_open_failures``.
        """
        await self.slots.acquire()
        t0 = trio.current_time()
        stream = await self._open(host, target)
        if stream is None:
            self.slots.release()
            return
        watch = _Watch(stream, target, f"{label}, then {ending}", t0, trio.current_time() - t0)
        self.nursery.start_soon(self._watch, watch)
        try:
            with trio.move_on_after(self.config.hang_timeout) as scope:
                for chunk in [*writes, tail] if tail else writes:
                    await stream.write(chunk)
            if scope.cancelled_caught:
                self._hang(target, watch.label, f"writes blocked for {self.config.hang_timeout:g} s "
                                                "(the node stopped reading)")
            if ending.endswith("reset") or scope.cancelled_caught:
                with trio.move_on_after(self.config.hang_timeout):
                    await stream.reset()
            else:
                with trio.move_on_after(self.config.hang_timeout):
                    await stream.close()
                    watch.closed = True
        except Exception:
            pass  # the remote reset the stream: expected for most inputs
        finally:
            if watch.closed:  # from now on the node has hang_timeout seconds to end its side
                watch.scope.deadline = trio.current_time() + self.config.hang_timeout
            else:  # we reset it (a reset does not wake our own pending read): nothing to await
                watch.scope.cancel()

    async def _watch(self, watch: _Watch) -> None:
        """Read what the node sends on ``watch.stream`` until it ends or resets it; a stream we
        closed that the node has not ended ``config.hang_timeout`` seconds after our close is a
        hang (the input's handling did not finish). Then reset it and free its slot."""
        target = watch.target
        try:
            with watch.scope:
                try:
                    while await watch.stream.read(65536):
                        pass
                except Exception:
                    pass  # reset: by the node (expected for most inputs) or by us
            if watch.scope.cancelled_caught and watch.closed:
                self.report.streams_left_open += 1
                self.report.streams_left_open_by_protocol[target.protocol] += 1
                self._hang(target, watch.label, "the node neither ended nor reset the stream within "
                                                f"{self.config.hang_timeout:g} s of our close")
            seconds = trio.current_time() - watch.t0
            stats = self.report.input_seconds.setdefault(target.protocol, [0, 0.0, 0.0])
            stats[0] += 1
            stats[1] += seconds
            stats[2] = max(stats[2], seconds)
            if seconds > self.report.slowest_input_seconds:
                self.report.slowest_input_seconds = seconds
                self.report.slowest_input = f"{watch.label} (the stream open took {watch.open_seconds:.2f} s)"
            with trio.move_on_after(self.config.hang_timeout):
                try:
                    await watch.stream.reset()
                except Exception:
                    pass
        finally:
            self.slots.release()

    def _hang(self, target: _Target, label: str, what: str) -> None:
        self.report.input_hangs_by_protocol[target.protocol] += 1
        if len(self.report.input_hangs) < 50:
            self.report.input_hangs.append(f"{label}: {what}")


class _Fuzzer:
    def __init__(self, config: FuzzConfig, net: LocalNet, outsider: IHost, insiders: list[IHost],
                 report: FuzzReport) -> None:
        self.config = config
        self.net = net
        self.attackers = [outsider, *insiders]
        self.insiders = insiders or [outsider]
        attackers = self.attackers
        self.report = report
        self.budget = config.inputs
        self.classes = message_classes()
        self.peer_ids = [n.peer_id for n in [net.verifier, *net.models, *net.users]]
        self.peer_ids += [h.get_id().to_bytes() for h in attackers]
        self.targets: list[_Target] = []
        for role, nodes in (("verifier", [net.verifier]), ("model", net.models), ("user", net.users)):
            for node in nodes:
                protocols = discover_protocols(node.host, include_libp2p=config.include_libp2p)
                report.protocols.setdefault(role, protocols)
                for p in protocols:
                    self.targets.append(_Target(node.peer_id, role, p, root_messages(p, self.classes)))
        self.protocols = sorted({t.protocol for t in self.targets})
        genesis = net.verifier.genesis_file
        self.chain_id = genesis.genesis.chain_id if genesis is not None else "localnet"
        self.recent: deque[str] = deque(maxlen=32)
        #: trio time to stop sending at (None: no time limit)
        self.deadline: float | None = None
        self.done = trio.Event()
        #: opens and watches the fuzz streams (set by run_fuzz, with the nursery of the watchers)
        self.streams: FuzzStreams

    # -- accounting

    def _take(self, n: int) -> int:
        n = min(n, self.budget)
        self.budget -= n
        return n

    def _count(self, target: _Target, kind: str, frames: list[bytes]) -> str:
        """Count ``frames`` as inputs of ``kind`` to ``target``; returns their label (role, peer,
        protocol, kind, number of frames, first bytes), also kept in :attr:`recent`."""
        self.report.inputs_by_protocol[target.protocol] += len(frames)
        self.report.inputs_by_role_protocol[f"{target.role} {target.protocol}"] += len(frames)
        self.report.inputs_by_kind[kind] += len(frames)
        label = (f"{target.role} {ID(target.node_peer).to_base58()[-6:]} {target.protocol} {kind}: "
                 f"{len(frames)} frame(s), first {frames[0][:48].hex() if frames else ''}")
        if frames:
            self.recent.append(label)
        return label

    def _out_of_time(self) -> bool:
        if self.budget <= 0:
            return True
        if self.deadline is not None and trio.current_time() >= self.deadline:
            self.report.stopped_on_time = True
            return True
        return False

    # -- frame generators

    def _frame_body(self, rng: random.Random, factory: MessageFactory, target: _Target) -> tuple[str, bytes]:
        r = rng.random()
        if r < 0.45:
            cls = rng.choice(target.roots) if rng.random() < 0.9 else rng.choice(list(self.classes.values()))
            return "proto", factory.build(cls).SerializeToString()
        if r < 0.80:
            cls = rng.choice(target.roots)
            return "mutated", mutate(rng, factory.build(cls).SerializeToString())
        if r < 0.93:
            return "raw", rng.randbytes(rng.choice((1, 2, 7, 16, 100, 1000, rng.randrange(1, 5000))))
        if r < 0.98:
            return "empty", b""
        return "big", rng.randbytes(rng.choice((4096, 4097, 65536, onion.CELL_BUCKETS[-1] + 1024, onion.CELL_BUCKETS[-1] + 1025)))

    def _tail(self, rng: random.Random, factory: MessageFactory, target: _Target, ending: str) -> bytes:
        """For a ``half-*`` ending: the first part of one more frame; else b""."""
        if not ending.startswith("half"):
            return b""
        frame = encode_frame(factory.build(rng.choice(target.roots)).SerializeToString() + rng.randbytes(8))
        return frame[: rng.randrange(1, len(frame))]

    async def _session(self, rng: random.Random, factory: MessageFactory, host: IHost, target: _Target,
                       writes: list[bytes], ending: str, label: str) -> None:
        await self.streams.session(host, target, writes, ending, label,
                                   self._tail(rng, factory, target, ending))

    def _pick_target(self, rng: random.Random) -> _Target:
        """A protocol uniformly, then a node serving it (the verifier's one protocol gets its share)."""
        protocol = rng.choice(self.protocols)
        return rng.choice([t for t in self.targets if t.protocol == protocol])

    async def _frames_scenario(self, rng: random.Random, factory: MessageFactory) -> None:
        target = self._pick_target(rng)
        n = self._take(rng.choices((1, 2, 4, 8, 16, 64, 256), (20, 15, 15, 15, 15, 12, 8))[0])
        if not n:
            return
        frames, kinds = [], Counter[str]()
        for _ in range(n):
            kind, body = self._frame_body(rng, factory, target)
            frames.append(encode_frame(body))
            kinds[kind] += 1
        if rng.random() < 0.7:
            writes = [b"".join(frames)]
        else:
            writes = frames
        ending = rng.choices(("close", "reset", "half-close", "half-reset"), (6, 2, 1, 1))[0]
        for kind, k in kinds.items():
            self._count(target, kind, frames[:k])  # k frames of this kind (the sample is the first frame)
        label = (f"{target.role} {ID(target.node_peer).to_base58()[-6:]} {target.protocol} "
                 f"{'+'.join(sorted(kinds))}: {n} frame(s) in {len(writes)} write(s), "
                 f"first {frames[0][:48].hex()}")
        await self._session(rng, factory, rng.choice(self.attackers), target, writes, ending, label)

    async def _framing_scenario(self, rng: random.Random, factory: MessageFactory) -> None:
        target = self._pick_target(rng)
        if not self._take(1):
            return
        r = rng.randrange(5)
        if r == 0:
            prefix = encode_varint(rng.choice(OVERSIZED_LENGTHS)) + rng.randbytes(rng.choice((0, 10, 1000)))
        elif r == 1:
            prefix = b"\xff" * rng.randrange(9, 20) + b"\x01"
        elif r == 2:
            prefix = b"\x80\x00" + rng.randbytes(4)
        elif r == 3:
            prefix = b"\x80" * rng.randrange(1, 9)  # continuation bits, then nothing
        else:
            prefix = b"\xff\xff\xff\xff\x0f" + rng.randbytes(100)  # 4 GiB - 1
        label = self._count(target, "framing", [prefix])
        await self._session(rng, factory, rng.choice(self.attackers), target, [prefix],
                            rng.choice(("close", "reset")), label)

    async def _burst_scenario(self, rng: random.Random, factory: MessageFactory) -> None:
        peer = self._pick_target(rng).node_peer
        targets = [t for t in self.targets if t.node_peer == peer]
        n = self._take(rng.choice((8, 16, 32, 64)))
        if not n:
            return
        host = rng.choice(self.attackers)
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                target = rng.choice(targets)
                kind, body = self._frame_body(rng, factory, target)
                label = self._count(target, "burst", [body])
                nursery.start_soon(
                    self._session, random.Random(rng.random()), factory, host, target,
                    [encode_frame(body)], rng.choice(("close", "reset", "half-close")), label,
                )

    def _clove_carrier(self, target: _Target) -> tuple[type[Message], str, str] | None:
        """(root class, oneof field, bytes field) of a root whose oneof holds a ``clove`` field."""
        for cls in target.roots:
            for f in cls.DESCRIPTOR.fields:
                if f.containing_oneof is None or f.type != FieldDescriptor.TYPE_MESSAGE:
                    continue
                sub = f.message_type
                names = [g.name for g in sub.fields]
                if "clove" in names and len(names) == 1:
                    return cls, f.name, "clove"
        return None

    async def _sida_scenario(self, rng: random.Random, factory: MessageFactory) -> None:
        models = [t for t in self.targets if t.role == "model" and self._clove_carrier(t) is not None]
        if not models:
            return await self._frames_scenario(rng, factory)
        target = rng.choice(models)
        carrier = self._clove_carrier(target)
        assert carrier is not None
        cls, oneof_field, clove_field = carrier
        request_cls = self.classes.get("planetserve.v1.InferenceRequest")
        if request_cls is not None:
            request = factory.build(request_cls)
            if rng.random() < 0.7:
                for name, value in (("model_id", "fake-model"), ("prompt", factory.random_text()[:200])):
                    if name in request.DESCRIPTOR.fields_by_name:
                        setattr(request, name, value)
            q = request.SerializeToString()
        else:
            q = rng.randbytes(rng.randrange(1, 500))
        if rng.random() < 0.2:
            q = mutate(rng, q)
        total = rng.choice((2, 3, 4, 4, 5, len(self.insiders)))
        threshold = rng.randrange(1, total + 1)
        cloves = sida.encode(q, total, threshold, random_bytes=rng.randbytes)
        from ps_p2p.protocols.clove_codec import clove_to_bytes

        bodies = []
        for clove in cloves:
            data = clove_to_bytes(clove)
            if rng.random() < 0.1:
                data = mutate(rng, data)
            frame = cls()
            setattr(getattr(frame, oneof_field), clove_field, data)
            bodies.append(frame.SerializeToString())
        n = self._take(len(bodies))
        if not n:
            return
        label = self._count(target, "sida", bodies[:n])
        async with trio.open_nursery() as nursery:
            for i, body in enumerate(bodies[:n]):
                nursery.start_soon(
                    self._session, rng, factory, self.insiders[i % len(self.insiders)], target,
                    [encode_frame(body)], "close", f"{label} (clove {i})",
                )

    def _directory_request(self, rng: random.Random, factory: MessageFactory, sender: bytes) -> bytes:
        """One hostile but well-formed ``CommitteeDirectoryRequest`` (module docstring)."""
        now = int(time.time() * 1000)
        other = Identity.from_private_bytes(rng.randbytes(32))
        request = directory_pb2.CommitteeDirectoryRequest
        kind = rng.randrange(5)
        if kind <= 1:
            record = sign_record(other, NodeRecord(
                other.peer_id, (f"/ip4/10.{rng.randrange(256)}.{rng.randrange(256)}.1/tcp/4001",),
                frozenset({Role.USER}), onion.OnionKeyPair.from_private_bytes(rng.randbytes(32)).public,
                issued_at_ms=now - 1000, expires_at_ms=now + 600_000))
            if kind == 0:  # in the sender's name (it passes "own record only"), another key's signature
                record = dataclasses.replace(record, peer_id=sender)
            return request(register=record_to_pb(record)).SerializeToString()
        if kind == 2:  # another node's own deregistration, of this chain or of a made-up one
            chain = self.chain_id if rng.random() < 0.8 else factory.random_text()[:64]
            return request(deregister=encode_tx(sign_deregister(other, chain, now))).SerializeToString()
        if kind == 3:
            return request(genesis=directory_pb2.GetGenesis()).SerializeToString()
        since = rng.choice((0, 1, 2, 2**32, 2**63, 2**64 - 1))
        return request(get=directory_pb2.GetCommittedDirectory(since_height=since)).SerializeToString()

    async def _directory_scenario(self, rng: random.Random, factory: MessageFactory) -> None:
        targets = [t for t in self.targets if t.protocol == COMMITTEE_DIRECTORY_PROTOCOL_ID]
        if not targets:
            return await self._frames_scenario(rng, factory)
        target = rng.choice(targets)
        host = rng.choice(self.attackers)
        n = self._take(rng.choice((1, 4, 8, 16, 32)))
        if not n:
            return
        sender = host.get_id().to_bytes()
        bodies = [self._directory_request(rng, factory, sender) for _ in range(n)]
        label = self._count(target, "directory", bodies)
        await self._session(rng, factory, host, target, [encode_frame(b) for b in bodies],
                            rng.choice(("close", "reset")), label)

    async def worker(self, index: int) -> None:
        rng = random.Random(f"{self.config.seed}/{index}")
        factory = MessageFactory(rng, self.classes, self.peer_ids)
        scenarios: list[Callable[[random.Random, MessageFactory], Any]] = [
            self._frames_scenario, self._framing_scenario, self._burst_scenario, self._sida_scenario,
            self._directory_scenario,
        ]
        weights = (62, 12, 6, 12, 8)
        while not self._out_of_time():
            scenario = rng.choices(scenarios, weights)[0]
            await scenario(rng, factory)


async def _check_liveness(net: LocalNet, probe: IHost, timeout: float, started: float,
                          report: FuzzReport) -> LivenessCheck:
    """Every user asks once and the verifier serves a directory, all at once, each within ``timeout``."""
    t0 = trio.current_time()
    failures: list[str] = []
    hangs: list[str] = []
    answered = 0

    async def ask(i: int) -> None:
        nonlocal answered
        node = net.users[i]
        assert node.user is not None
        with trio.move_on_after(timeout + 30) as scope:
            answer = await node.user.ask(f"liveness check {i} at {t0:.0f}", timeout=timeout)
        if scope.cancelled_caught:
            hangs.append(f"user {i}: ask() did not return")
        elif answer.ok:
            answered += 1
        elif "no answer within" in answer.error:
            hangs.append(f"user {i}: {answer.error}")
        else:
            failures.append(f"user {i}: {answer.error}")

    async def directory() -> None:
        verifier = net.verifier.peer_id
        assert net.verifier.genesis_file is not None
        replica = CommitteeReplica(net.verifier.genesis_file.genesis)  # the whole directory
        try:
            await fetch_committed_directory(
                probe, verifier, replica, now_ms=lambda: int(time.time() * 1000),
                timeout=timeout,
            )
        except trio.TooSlowError:
            hangs.append(f"verifier: no directory within {timeout:.0f} s")
        except Exception as exc:
            failures.append(f"verifier: directory fetch failed: {type(exc).__name__}: {exc}")

    async def fresh_stream(source_label: str, source: IHost, role: str, target: Any) -> None:
        protocols = discover_protocols(target.host)
        if not protocols:
            return
        # a protocol every honest node may open to it (others, e.g. GossipSub between a group's
        # model nodes, may refuse a user's stream as policy, racing the negotiation)
        protocols = [p for p in HONEST_PROTOCOLS if p in protocols] or protocols
        t = trio.current_time()
        try:
            with trio.fail_after(timeout):
                stream = await source.new_stream(ID(target.peer_id), [TProtocol(protocols[0])])
                await stream.reset()
        except trio.TooSlowError:
            hangs.append(f"{role} {ID(target.peer_id).to_base58()[-6:]}: no new {protocols[0]} stream "
                         f"from {source_label} within {timeout:.0f} s")
            return
        except Exception as exc:
            failures.append(f"{role} {ID(target.peer_id).to_base58()[-6:]}: new stream from {source_label} "
                            f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
            return
        report.slowest_fresh_stream = max(report.slowest_fresh_stream, trio.current_time() - t)

    async with trio.open_nursery() as nursery:
        for i in range(len(net.users)):
            nursery.start_soon(ask, i)
        nursery.start_soon(directory)
        # every node still accepts new streams from an honest node (not only on warm links)
        honest = net.users[0]
        assert honest.host is not None
        for role, nodes in (("verifier", [net.verifier]), ("model", net.models), ("user", net.users[1:])):
            for node in nodes:
                nursery.start_soon(fresh_stream, "user 0", honest.host, role, node)
        nursery.start_soon(fresh_stream, "the verifier", net.verifier.host, "user", honest)
    tables = table_sizes(net)
    rss = rss_kib()
    report.rss_peak_kib = max(report.rss_peak_kib, rss)
    return LivenessCheck(
        at=t0 - started, answered=answered, failures=failures, hangs=hangs,
        seconds=trio.current_time() - t0, rss_kib=rss, table_entries=sum(tables.values()),
    )


async def run_fuzz(config: FuzzConfig, *, progress: Callable[[str], None] | None = None) -> FuzzReport:
    """Start a localnet, fuzz it as :class:`FuzzConfig` says, and return the :class:`FuzzReport`.

    Never raises for what the nodes do: an exception that leaves the localnet (a node crashed)
    is recorded in ``report.crashes`` with its traceback and the last inputs sent.
    """
    report = FuzzReport(config=config)
    say = progress or (lambda text: None)
    # the nodes' and py-libp2p's records (its pubsub logs refused peers at ERROR) are counted in
    # the report: 100k refused frames must not flood stderr or pytest's capture
    loggers = [logging.getLogger("ps_p2p"), logging.getLogger("libp2p")]
    tap = _LogTap(report)
    saved = [(lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(tap)
        lg.propagate = False
        if lg.level == logging.NOTSET or lg.level > logging.WARNING:
            lg.setLevel(logging.WARNING)
    fuzzer: _Fuzzer | None = None
    fuzzing = False
    try:
        async with AsyncExitStack() as stack:
            net = await stack.enter_async_context(
                open_localnet(users=config.users, models=config.models, seed=config.seed,
                              ready_timeout=config.ready_timeout)
            )
            outsider = await stack.enter_async_context(
                open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"])
            )
            nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(nursery.cancel_scope.cancel)
            insiders = await _start_insiders(net, nursery, config)
            fuzzer = _Fuzzer(config, net, outsider, insiders, report)
            attackers = fuzzer.attackers
            await _setup_attackers(fuzzer)
            for role, nodes in (("verifier", [net.verifier]), ("model", net.models), ("user", net.users)):
                for node in nodes:
                    peer = ID(node.peer_id).to_base58()[-6:]
                    watch_handlers(
                        node.host, discover_protocols(node.host, include_libp2p=config.include_libp2p),
                        lambda protocol, tb, who=f"{role} {peer}": report.crashes.append(
                            f"the {protocol} handler of {who} raised (past its wrapper):\n{tb}"),
                    )
            say(f"localnet up; fuzzing {len(fuzzer.targets)} (node, protocol) pairs")
            fuzzing = True
            report.rss_before_kib = report.rss_peak_kib = rss_kib()
            report.tables_before = table_sizes(net)
            started = trio.current_time()
            report.checks.append(
                await _check_liveness(net, attackers[0], config.liveness_timeout, started, report)
            )
            fuzz_started = trio.current_time()
            if config.duration is not None:
                fuzzer.deadline = fuzz_started + config.duration

            async def checker() -> None:
                while config.check_interval > 0:
                    with trio.move_on_after(config.check_interval):
                        await fuzzer.done.wait()
                    if fuzzer.done.is_set():
                        return
                    check = await _check_liveness(net, attackers[0], config.liveness_timeout, started, report)
                    report.checks.append(check)
                    say(f"t={check.at:.0f}s inputs {report.inputs}, answered {check.answered}, "
                        f"RSS {check.rss_kib / 1024:.0f} MiB")

            async def show_progress() -> None:
                last_t, last_n = fuzz_started, 0
                while config.progress_interval > 0:
                    with trio.move_on_after(config.progress_interval):
                        await fuzzer.done.wait()
                    if fuzzer.done.is_set():
                        return
                    now = trio.current_time()
                    say(report.progress_line(now - fuzz_started, (report.inputs - last_n) / (now - last_t)))
                    last_t, last_n = now, report.inputs

            async with trio.open_nursery() as nursery:
                nursery.start_soon(checker)
                nursery.start_soon(show_progress)
                async with trio.open_nursery() as watchers:
                    fuzzer.streams = FuzzStreams(
                        config, report, watchers,
                        who=lambda host: "outsider" if host is attackers[0] else "insider",
                    )
                    async with trio.open_nursery() as workers:
                        for i in range(config.concurrency):
                            workers.start_soon(fuzzer.worker, i)
                    # the watchers end within hang_timeout: wait for the nodes' ends of the streams
                report.fuzz_seconds = trio.current_time() - fuzz_started
                fuzzer.done.set()
            say(f"sent {report.inputs} inputs in {report.fuzz_seconds:.1f} s; final liveness check")
            report.checks.append(
                await _check_liveness(net, attackers[0], config.liveness_timeout, started, report)
            )
            report.tables_after = table_sizes(net)
            report.rss_after_kib = rss_kib()
            report.rss_peak_kib = max(report.rss_peak_kib, report.rss_after_kib)
    except BaseException as exc:  # a node died: the localnet nursery raised
        if isinstance(exc, (KeyboardInterrupt, trio.Cancelled)) and not isinstance(exc, BaseExceptionGroup):
            raise
        text = "".join(traceback.format_exception(exc))
        if fuzzing:
            report.crashes.append(text)
        else:
            report.setup_error = text
        if not report.rss_after_kib:
            report.rss_after_kib = rss_kib()
    finally:
        for lg, (propagate, level) in zip(loggers, saved):
            lg.removeHandler(tap)
            lg.propagate = propagate
            lg.setLevel(level)
        if fuzzer is not None:
            report.last_inputs = list(fuzzer.recent)
    return report


async def _start_insiders(net: LocalNet, nursery: trio.Nursery, config: FuzzConfig) -> list[IHost]:
    """Start ``config.sybils`` user nodes of the attacker's; wait until the model nodes list them."""
    hosts = []
    boot = [net.verifier.listen_addrs[0]]
    for i in range(config.sybils):
        cfg = NodeConfig(
            roles=["user"], bootstrap=boot, directory_refresh=0.5, register_interval=2.0,
            record_lifetime=120.0,
            user=UserConfig(probe_interval=0.5, probe_timeout=2.0, attempt_timeout=5.0),
        )
        node = Node(cfg, NodeKeys.generate(), rng=random.Random(f"{config.seed}/sybil/{i}"))
        await nursery.start(node.run)
        assert node.host is not None
        hosts.append(node.host)
    for model in net.models:
        await model.wait_directory(
            min_users=config.users + config.sybils, timeout=config.ready_timeout
        )
    return hosts


def watch_handlers(host: IHost, protocols: list[str], on_raise: Callable[[str, str], None]) -> None:
    """Wrap ``host``'s stream handlers of ``protocols`` so that an exception escaping one (past
    the protocol's own wrapper, where py-libp2p ends the connection or the host) is reported as
    ``on_raise(protocol, traceback text)`` before it goes on as before (re-raised).
    Cancellation is not reported."""
    handlers = host.get_mux().handlers
    for protocol in protocols:
        handler = handlers.get(TProtocol(protocol))
        if handler is None:
            continue

        async def watched(stream: INetStream, _handler: Any = handler, _protocol: str = protocol) -> None:
            try:
                await _handler(stream)
            except Exception as exc:
                on_raise(_protocol, "".join(traceback.format_exception(exc)))
                raise

        handlers[TProtocol(protocol)] = watched


async def _setup_attackers(fuzzer: _Fuzzer) -> None:
    """Connect every attacker host to every node, and let them take (and drain) whatever the
    nodes send back on the fuzzed protocols (setup replies, response cloves)."""
    protocols = {t.protocol for t in fuzzer.targets}

    async def drain(stream: INetStream) -> None:
        try:
            while await stream.read(65536):
                pass
        except Exception:
            pass
        try:
            await stream.close()
        except Exception:
            pass

    net = fuzzer.net
    for host in fuzzer.attackers:
        served = set(str(p) for p in host.get_mux().handlers if p is not None)
        for p in protocols - served:
            host.set_stream_handler(TProtocol(p), drain)
        for node in [net.verifier, *net.models, *net.users]:
            await connect(host, node.listen_addrs[0], timeout=fuzzer.config.liveness_timeout)


def iter_report_lines(report: FuzzReport) -> Iterator[str]:
    """The summary, then the last inputs sent when a crash happened."""
    yield report.summary()
    if report.crashes and report.last_inputs:
        yield "last inputs before the crash (role, peer, protocol, kind, first bytes):"
        for line in report.last_inputs:
            yield "  " + line


__all__ = [
    "FuzzConfig",
    "FuzzReport",
    "FuzzStreams",
    "LivenessCheck",
    "MessageFactory",
    "discover_protocols",
    "watch_handlers",
    "iter_report_lines",
    "message_classes",
    "mutate",
    "root_messages",
    "rss_kib",
    "run_fuzz",
    "table_sizes",
]
