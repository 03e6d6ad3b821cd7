"""How a node registers and gets a verified directory from the committee (node layer).

:class:`~ps_p2p.node.Node` talks to verifiers only through a :class:`CommitteeClient`
(``/planetserve/directory/2.0.0``, :mod:`ps_p2p.protocols.committee_directory`): a registration
is a REGISTER transaction of the committee, given to f+1 verifiers (at least one honest one
relays it to the rest), and a directory needs a commit of more than 2/3 of the genesis
validators' power, the committed app hash, a height not below the one held and a block time at
most ``max_age_ms`` old (:class:`~ps_p2p.registry.replica.CommitteeReplica`).

Which committee: the genesis file the node was given (``--genesis``), or, without one, the
genesis its configured verifiers (``--verifier`` peer IDs, else the bootstrap peers) serve. A
served genesis is followed only when (1) **every** validator it names is a configured verifier
and (2) more than 2/3 of the configured verifiers served that same genesis (byte for byte): one
lying verifier cannot move a node onto a chain it alone controls (say, a genesis naming only
itself, or giving itself most of the power), as long as more than 2/3 of those configured are
honest, the committee's own assumption. A lone verifier started without a genesis is a committee
of one (:func:`ps_p2p.genesis.init_genesis`), and a node configured with it alone follows it.
The first genesis followed is kept for the life of the client: a later answer naming another
chain is refused.
"""

from __future__ import annotations

import time

from libp2p.abc import IHost

from ps_p2p.errors import ConfigError, RemoteProtocolError, UntrustedGenesisError
from ps_p2p.registry import Genesis, sign_deregister
from ps_p2p.registry.replica import CommitteeReplica


class GenesisPendingError(RemoteProtocolError):
    """Not enough configured verifiers confirmed the genesis yet (the node asks the next one)."""
from ps_p2p.genesis import GenesisFile, parse_genesis_text
from ps_p2p.protocols import committee_directory as committee_proto
from ps_p2p.records import Directory, NodeRecord
from ps_p2p.records.peer_ids import peer_label
from ps_p2p.records.types import Signer


def _now_ms() -> int:
    return int(time.time() * 1000)


class CommitteeClient:
    """Registration and verified directories from one committee (module docstring).

    Args:
        genesis: the chain every directory must be committed on; None: learn it from the first
            of ``trusted`` that serves an acceptable one.
        trusted: the configured verifiers (peer IDs); ignored when ``genesis`` is given (its
            validators are the trusted ones).
        max_age_ms: oldest block time of a directory accepted (default 10 minutes).

    Attributes:
        trusted_verifiers: the verifiers to register with and fetch from: the genesis
            validators once the genesis is known, else the configured ones.
        registrations_needed: f + 1 of the committee (1 before the genesis is known).
        genesis_file: the genesis followed, when learnt from a verifier (else None).

    Raises:
        ConfigError: neither a genesis nor a trusted verifier.
    """

    def __init__(self, genesis: Genesis | None, trusted: frozenset[bytes] = frozenset(),
                 **replica_options: int) -> None:
        if genesis is None and not trusted:
            raise ConfigError("no verifier to trust: give --genesis, --verifier or --bootstrap")
        self._replica_options = replica_options
        self._configured = trusted
        self._served: dict[bytes, bytes] = {}  # configured verifier -> genesis it served
        self.genesis: Genesis | None = None
        self.genesis_file: GenesisFile | None = None
        self.replica: CommitteeReplica | None = None
        self.trusted_verifiers = trusted
        self.registrations_needed = 1
        #: one open directory stream per verifier asked, reused by every refresh
        self.streams = committee_proto.DirectoryStreams()
        if genesis is not None:
            self._follow(genesis)

    def _follow(self, genesis: Genesis) -> None:
        self.genesis = genesis
        self.trusted_verifiers = frozenset(v.address for v in genesis.validators)
        self.registrations_needed = (len(genesis.validators) - 1) // 3 + 1  # f + 1
        self.replica = CommitteeReplica(genesis, **self._replica_options)

    def preferred(self) -> bytes | None:
        """The verifier whose answer was accepted last (asked first next time), or None."""
        return None if self.replica is None else self.replica.source

    def accept_genesis(self, verifier: bytes, text: bytes) -> GenesisFile:
        """Check a genesis that ``verifier`` served and follow it (module docstring).

        Raises:
            UntrustedGenesisError: a validator that is not a configured verifier, ``verifier``
                not among its validators, or a chain other than the one already followed.
            GenesisPendingError: not yet served by more than 2/3 of the configured verifiers.
            RemoteProtocolError: not a valid genesis file.
        """
        try:
            served = parse_genesis_text(text, source=f"genesis of {peer_label(verifier)}")
        except ConfigError as exc:
            raise RemoteProtocolError(str(exc)) from None
        genesis = served.genesis
        validators = {v.address for v in genesis.validators}
        if self.genesis is not None:
            if genesis != self.genesis:
                raise UntrustedGenesisError(
                    f"{peer_label(verifier)} serves chain {genesis.chain_id!r}, not the "
                    f"{self.genesis.chain_id!r} this node follows")
            return served
        strangers = validators - self._configured
        if strangers or verifier not in validators:
            raise UntrustedGenesisError(
                f"{peer_label(verifier)} serves chain {genesis.chain_id!r} whose validators "
                f"{sorted(peer_label(p) for p in validators)} are not all trusted verifiers "
                "of this node (give --genesis, or name them with --verifier)")
        if verifier in self._configured:
            self._served[verifier] = bytes(text)
        agreeing = sum(1 for t in self._served.values() if t == text)
        if 3 * agreeing <= 2 * len(self._configured):
            raise GenesisPendingError(
                f"{agreeing} of {len(self._configured)} configured verifiers serve chain "
                f"{genesis.chain_id!r}; more than 2/3 must agree before it is followed")
        self.genesis_file = served
        self._follow(genesis)
        return served

    async def _ensure_genesis(self, host: IHost, verifier: bytes, timeout: float) -> None:
        if self.genesis is None:
            text = await committee_proto.fetch_genesis(host, verifier, timeout=timeout)
            self.accept_genesis(verifier, text)

    async def register(self, host: IHost, verifier: bytes, record: NodeRecord,
                       timeout: float) -> int:
        """Register ``record`` with ``verifier``; returns its expiry (unix ms).

        Raises:
            PsError (refused, or an untrusted genesis), trio.TooSlowError, py-libp2p errors.
        """
        await self._ensure_genesis(host, verifier, timeout)
        return await committee_proto.register_with_committee(host, verifier, record,
                                                             timeout=timeout)

    async def deregister(self, host: IHost, verifier: bytes, identity: Signer,
                         timeout: float) -> None:
        """Give ``verifier`` a DEREGISTER transaction of ``identity`` issued now: the node
        leaves the directory at the next block.

        Raises:
            PsError (refused, or an untrusted genesis), trio.TooSlowError, py-libp2p errors.
        """
        await self._ensure_genesis(host, verifier, timeout)
        assert self.genesis is not None
        tx = sign_deregister(identity, self.genesis.chain_id, _now_ms())
        await committee_proto.deregister_from_committee(host, verifier, tx, timeout=timeout)

    async def fetch(self, host: IHost, verifier: bytes,
                    timeout: float) -> tuple[Directory, tuple[NodeRecord, ...]]:
        """A verified directory from ``verifier`` and the records it added or changed.

        Raises:
            PsError (a refused directory or genesis), trio.TooSlowError, py-libp2p errors.
        """
        await self._ensure_genesis(host, verifier, timeout)
        assert self.replica is not None
        directory = await committee_proto.fetch_committed_directory(
            host, verifier, self.replica, now_ms=_now_ms, timeout=timeout,
            streams=self.streams)
        return directory, self.replica.last_changed


__all__ = ["CommitteeClient", "GenesisPendingError", "UntrustedGenesisError"]
