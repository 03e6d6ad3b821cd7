"""How a node registers and gets a verified directory: one interface, two modes (node layer).

:class:`~ps_p2p.node.Node` talks to verifiers only through a :class:`DirectoryClient`, so the
rest of the node (the user client's path and model choice, the overlay's directory checks)
sees the same :class:`~ps_p2p.records.Directory` whichever mode verified it:

* :class:`SingleVerifierClient` (no genesis file; the default): ``/planetserve/directory/
  1.0.0``; each verifier signs its own registry's head, and a directory needs ``quorum``
  signatures of trusted verifiers (:class:`~ps_p2p.records.DirectoryReplica`).
* :class:`CommitteeClient` (``--genesis FILE``): ``/planetserve/directory/2.0.0``; a
  registration is a REGISTER transaction of the committee, and a directory needs a commit of
  more than 2/3 of the genesis validators' power, the committed app hash, a height not below
  the one held and a block time at most ``max_age_ms`` old
  (:class:`~ps_p2p.consensus.replica.CommitteeReplica`). A registration is given to f+1
  verifiers (at least one honest one relays it to the rest).
"""

from __future__ import annotations

import time
from typing import Protocol

from libp2p.abc import IHost

from ps_p2p import records
from ps_p2p.consensus.app import Genesis
from ps_p2p.consensus.replica import CommitteeReplica
from ps_p2p.protocols import committee_directory as committee_proto
from ps_p2p.protocols import directory as directory_proto
from ps_p2p.records import Directory, NodeRecord


def _now_ms() -> int:
    return int(time.time() * 1000)


class DirectoryClient(Protocol):
    """What a node needs from the directory protocol.

    Attributes:
        trusted_verifiers: the verifiers to register with and fetch from (peer IDs).
        registrations_needed: verifiers that must take a registration before the node stops
            trying others in one round.
    """

    trusted_verifiers: frozenset[bytes]
    registrations_needed: int

    def preferred(self) -> bytes | None:
        """The verifier whose answer was accepted last (asked first next time), or None."""
        ...

    async def register(self, host: IHost, verifier: bytes, record: NodeRecord,
                       timeout: float) -> int:
        """Register ``record`` with ``verifier``; returns its expiry (unix ms).

        Raises:
            PsError, trio.TooSlowError, py-libp2p errors: refused or unreachable.
        """
        ...

    async def fetch(self, host: IHost, verifier: bytes,
                    timeout: float) -> tuple[Directory, tuple[NodeRecord, ...]]:
        """A verified directory from ``verifier`` and the records it added or changed.

        Raises:
            PsError (a refused directory), trio.TooSlowError, py-libp2p errors.
        """
        ...


class SingleVerifierClient:
    """The single-verifier mode (``/planetserve/directory/1.0.0``; module docstring).

    Args:
        trusted_verifiers: whose head signatures count.
        quorum: signatures a head needs.
    """

    def __init__(self, trusted_verifiers: frozenset[bytes], quorum: int) -> None:
        self.trusted_verifiers = trusted_verifiers
        self.quorum = quorum
        self.registrations_needed = len(trusted_verifiers)
        self.replica = records.DirectoryReplica(trusted_verifiers=trusted_verifiers,
                                                quorum=quorum)

    def preferred(self) -> bytes | None:
        return self.replica.source

    async def register(self, host: IHost, verifier: bytes, record: NodeRecord,
                       timeout: float) -> int:
        return await directory_proto.register(host, verifier, record, timeout=timeout)

    async def fetch(self, host: IHost, verifier: bytes,
                    timeout: float) -> tuple[Directory, tuple[NodeRecord, ...]]:
        directory = await directory_proto.fetch_directory(
            host, verifier, trusted_verifiers=self.trusted_verifiers, quorum=self.quorum,
            now_ms=_now_ms(), timeout=timeout, replica=self.replica,
        )
        return directory, self.replica.last_changed


class CommitteeClient:
    """The committee mode (``/planetserve/directory/2.0.0``; module docstring).

    Args:
        genesis: the chain every directory must be committed on.
        max_age_ms: oldest block time of a directory accepted (default 10 minutes).
    """

    def __init__(self, genesis: Genesis, **replica_options: int) -> None:
        self.genesis = genesis
        self.trusted_verifiers = frozenset(v.address for v in genesis.validators)
        n = len(genesis.validators)
        self.registrations_needed = (n - 1) // 3 + 1  # f + 1
        self.replica = CommitteeReplica(genesis, **replica_options)

    def preferred(self) -> bytes | None:
        return self.replica.source

    async def register(self, host: IHost, verifier: bytes, record: NodeRecord,
                       timeout: float) -> int:
        return await committee_proto.register_with_committee(host, verifier, record,
                                                             timeout=timeout)

    async def fetch(self, host: IHost, verifier: bytes,
                    timeout: float) -> tuple[Directory, tuple[NodeRecord, ...]]:
        directory = await committee_proto.fetch_committed_directory(
            host, verifier, self.replica, now_ms=_now_ms, timeout=timeout)
        return directory, self.replica.last_changed


__all__ = ["CommitteeClient", "DirectoryClient", "SingleVerifierClient"]
