"""Onion path crypto of the anonymous overlay (PlanetServe sec. 3.2, with DESIGN.md's fixes), pure.

Path setup is one fixed-size packet (Sphinx-like, not Tor's telescoping handshakes). The packet is
``MAX_HOPS`` slots of ``SLOT_BYTES``; slot 0 is always for the hop that receives it::

    slot = ephemeral X25519 public key (32) || AES-256-GCM(k_setup, routing info (64)) (80)

A hop derives ``X25519(onion key, ephemeral key)`` -> HKDF-SHA256 -> (k_setup, k_stream, k_fwd,
k_bwd), opens its routing info (the successor's peer ID or "you are the proxy", and the outgoing
path ID), XORs the remaining slots with an AES-CTR keystream of k_stream, shifts them up by one
and appends a random slot. The user pre-computes every slot so that each hop finds its own in
slot 0. Every hop therefore sees a packet of the same size with fresh-looking bytes, and learns
only its predecessor, its successor and the two link-local path IDs. Path IDs are 16 random
bytes chosen by the user per link (the paper's hash(user, proxy) ID would let anyone guess-and-
confirm the user; DESIGN.md).

Cells have one size on every link of a path: a 16-byte IV, then the body (a bucket-sized padded
payload plus one 16-byte AEAD tag). Each relay applies its own layer, keyed per hop and direction:
it XORs the body with an AES-256-CTR keystream (nonce from the IV it received) and passes the IV through a
per-hop block cipher (AES-256 as a pseudo-random permutation), so neither the IV nor the body
repeats from one link to the next. The user and the proxy add an end-to-end AES-256-GCM layer
(nonce from the proxy-side IV) that authenticates the payload: a cell altered by any relay fails
at the proxy (forward) or at the user (backward) and is dropped. Relay layers are length-preserving
on purpose: a per-hop authentication tag would grow the cell by 16 bytes per hop and tell every
relay how far it is from the user (the first relay would know its predecessor is the user). This is
Tor's relay-crypto trade-off; a relay that corrupts cells is found by the path probes instead. A
cell lost on a link costs that cell, never the path (a sequence number may skip). Relays do no
public-key work after setup. Payloads are padded to :data:`CELL_BUCKETS`.

Replays (issue 16: a captured setup was accepted again once a flood of valid setups flushed the
relay's replay cache, and a replayed cell was answered every time):

* routing info bytes 60..64 carry the path's *issue time* (unsigned 32-bit big-endian unix
  seconds, under the hop's AEAD): a relay refuses a setup issued outside its acceptance window,
  so its replay cache needs to remember a packet only as long as the window;
* the proxy-side IV of a forward cell is ``sequence number (8, big-endian, from 1 per path) ||
  random (8)``: the user picks it and derives the IVs of the earlier links through the inverse
  permutations, so every link still sees fresh-looking IVs, and only the last relay sees the
  number (it can count the path's cells anyway). The proxy checks it after the end-to-end AEAD
  (which authenticates the IV) against a sliding window of :data:`REPLAY_WINDOW` numbers
  (RFC 4303 sec. 3.4.3): a replayed or too-old cell raises :class:`~ps_p2p.errors.ReplayError`.
  The sequence number also makes the AES-GCM nonce (the IV's first 12 bytes) unique per path.

Nothing here does I/O, reads a clock or draws global randomness: randomness comes in as a
``random_bytes`` callable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ps_p2p.errors import CryptoError, LocalProtocolError, RemoteProtocolError, ReplayError

RandomBytes = Callable[[int], bytes]

#: Bytes of a link-local path ID.
PATH_ID_BYTES = 16
#: Longest path a setup packet can describe (relays + proxy).
MAX_HOPS = 5
#: Routing info of one hop: flags (1), successor length (1), successor peer ID (<= 42), padding,
#: outgoing path ID (16) at offset 44, issue time (4, unix seconds) at offset 60.
ROUTING_INFO_BYTES = 64
#: Forward cells a proxy accepts behind the highest sequence number seen on a path (RFC 4303
#: sec. 3.4.3's recommended 64: cells of one path share one stream, so they rarely reorder).
REPLAY_WINDOW = 64
_SEQ_BYTES = 8
MAX_PEER_ID_BYTES = 42
_TAG = 16
_KEY = 32
#: One slot of the setup packet.
SLOT_BYTES = 32 + ROUTING_INFO_BYTES + _TAG
#: The fixed size of every setup packet on every link.
SETUP_PACKET_BYTES = MAX_HOPS * SLOT_BYTES
#: Cell payload sizes (bytes, before the per-hop tags): a payload is padded to the smallest fitting.
CELL_BUCKETS: tuple[int, ...] = (1024, 4096, 16 * 1024, 64 * 1024, 256 * 1024)
#: Largest payload a cell carries (the 4-byte length prefix of the padding takes the rest).
MAX_CELL_PAYLOAD = CELL_BUCKETS[-1] - 4
#: Bytes of the per-cell IV that leads every cell.
CELL_IV_BYTES = 16
#: Largest cell on a link: IV, the biggest bucket and the end-to-end tag.
MAX_CELL_BYTES = CELL_IV_BYTES + CELL_BUCKETS[-1] + 16
_CELL_SIZES = frozenset(CELL_IV_BYTES + b + 16 for b in CELL_BUCKETS)

_FLAG_PROXY = 0x01
_SETUP_AAD = b"planetserve/v1/onion-setup"
_HKDF_INFO = b"planetserve/v1/onion-hop"
_ACK_PLAINTEXT = b"planetserve/v1/onion-ack\x00\x00\x00\x00\x00\x00\x00\x00"
_ZERO_NONCE = bytes(12)


# ---------------------------------------------------------------------------------- keys


class OnionKeyPair:
    """A node's X25519 onion key; the public half goes into its signed node record."""

    __slots__ = ("_private", "public")

    def __init__(self, private: X25519PrivateKey) -> None:
        self._private = private
        #: Raw 32-byte public key.
        self.public: bytes = private.public_key().public_bytes_raw()

    @classmethod
    def generate(cls) -> "OnionKeyPair":
        return cls(X25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, data: bytes) -> "OnionKeyPair":
        """Raises ValueError unless ``data`` is 32 bytes."""
        if len(data) != 32:
            raise ValueError("an X25519 private key is 32 bytes")
        return cls(X25519PrivateKey.from_private_bytes(data))

    def private_bytes(self) -> bytes:
        return self._private.private_bytes_raw()

    def exchange(self, peer_public: bytes) -> bytes:
        """X25519 shared secret with ``peer_public`` (32 bytes).

        Raises:
            CryptoError: not a valid X25519 public key (or a low-order point).
        """
        try:
            return self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError as exc:
            raise CryptoError(f"bad X25519 public key: {exc}") from exc


@dataclass(frozen=True)
class HopSpec:
    """One hop the user chose: its peer ID and onion public key (from the directory)."""

    peer_id: bytes
    onion_key: bytes


@dataclass(frozen=True)
class _HopKeys:
    setup: bytes
    stream: bytes
    forward_body: bytes
    forward_iv: bytes
    backward_body: bytes
    backward_iv: bytes
    end_forward: bytes  # user -> proxy AEAD (used when this hop is the proxy)
    end_backward: bytes  # proxy -> user AEAD


def _derive(shared: bytes, ephemeral_public: bytes, onion_public: bytes) -> _HopKeys:
    okm = HKDF(
        algorithm=hashes.SHA256(),
        length=8 * _KEY,
        salt=ephemeral_public + onion_public,
        info=_HKDF_INFO,
    ).derive(shared)
    return _HopKeys(*(okm[i : i + _KEY] for i in range(0, 8 * _KEY, _KEY)))


def _keystream(key: bytes, length: int) -> bytes:
    encryptor = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    return encryptor.update(bytes(length))


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).to_bytes(len(a), "big")


def _random_slot(random_bytes: RandomBytes) -> bytes:
    # Unmasked: only slot 0 must look like a key; slots 1+ of a real packet are XORed with
    # keystreams, so their bytes are uniform, and filler must be too (a cleared top bit would
    # tell a relay which slots are filler, hence how many hops follow it).
    return random_bytes(SLOT_BYTES)


# ---------------------------------------------------------------------------------- cells


def pad_payload(payload: bytes) -> bytes:
    """Length-prefix ``payload`` and zero-pad it to the smallest fitting :data:`CELL_BUCKETS` size.

    Raises:
        LocalProtocolError: more than :data:`MAX_CELL_PAYLOAD` bytes.
    """
    need = len(payload) + 4
    for bucket in CELL_BUCKETS:
        if need <= bucket:
            return len(payload).to_bytes(4, "big") + payload + bytes(bucket - need)
    raise LocalProtocolError(f"cell payload of {len(payload)} bytes over {MAX_CELL_PAYLOAD}")


def unpad_payload(data: bytes) -> bytes:
    """Inverse of :func:`pad_payload`.

    Raises:
        RemoteProtocolError: not a bucket size, or a length prefix past the end.
    """
    if len(data) not in CELL_BUCKETS:
        raise RemoteProtocolError(f"cell of {len(data)} bytes is no bucket size")
    n = int.from_bytes(data[:4], "big")
    if n > len(data) - 4:
        raise RemoteProtocolError("cell length prefix past the end of the cell")
    return data[4 : 4 + n]


def _split_cell(cell: bytes) -> tuple[bytes, bytes]:
    if len(cell) not in _CELL_SIZES:
        raise RemoteProtocolError(f"cell of {len(cell)} bytes is no cell size")
    return cell[:CELL_IV_BYTES], cell[CELL_IV_BYTES:]


class _Layer:
    """One relay layer in one direction: AES-CTR over the body, an AES block permutation of the IV."""

    __slots__ = ("_ctr", "_iv_key", "_iv_encrypt", "_iv_decrypt")

    def __init__(self, body_key: bytes, iv_key: bytes) -> None:
        # AES-GCM's ciphertext is the AES-CTR encryption of the plaintext (counter blocks
        # nonce || 2, 3, ...; NIST SP 800-38D); dropping its tag leaves a CTR layer. A reused
        # AESGCM object costs ~0.7 us per KiB against ~3.3 us for a new CTR Cipher per cell.
        self._ctr = AESGCM(body_key)
        self._iv_key = iv_key
        # ECB contexts are stateless: reused per cell; the decryptor only on the user's side
        self._iv_encrypt = Cipher(algorithms.AES(iv_key), modes.ECB()).encryptor()
        self._iv_decrypt: Any = None

    def xor_body(self, iv: bytes, body: bytes) -> bytes:
        """XOR ``body`` with this layer's keystream under ``iv`` (its own inverse)."""
        return self._ctr.encrypt(iv[:12], body, None)[:-16]

    def next_iv(self, iv: bytes) -> bytes:
        return self._iv_encrypt.update(iv)

    def previous_iv(self, iv: bytes) -> bytes:
        if self._iv_decrypt is None:
            self._iv_decrypt = Cipher(algorithms.AES(self._iv_key), modes.ECB()).decryptor()
        return self._iv_decrypt.update(iv)


class _EndToEnd:
    """The user <-> proxy AEAD of one direction: nonce the first 12 bytes of the proxy-side IV,
    the whole IV authenticated as associated data."""

    __slots__ = ("_aead",)

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def seal(self, iv: bytes, payload: bytes) -> bytes:
        return self._aead.encrypt(iv[:12], pad_payload(payload), iv)

    def open(self, iv: bytes, body: bytes) -> bytes:
        try:
            return unpad_payload(self._aead.decrypt(iv[:12], body, iv))
        except InvalidTag as exc:
            raise CryptoError("cell failed end-to-end authentication (altered on the path)") from exc


# ---------------------------------------------------------------------------------- relay side


class RelayHop:
    """What one hop learned from a setup packet, and its layer of the path's cell crypto.

    Attributes:
        is_proxy: this hop is the path's last (the user's proxy).
        next_peer_id: the successor's peer ID; None for the proxy.
        out_path_id: the path ID on the link to the successor; for the proxy, the path's *exit
            path ID*, which only the path's owner and the proxy know (requests name proxies by
            per-request reply tags, never by it).
        issued_at: the path's issue time the user put in the packet (unix seconds; 0: none).
    """

    def __init__(self, is_proxy: bool, next_peer_id: bytes | None, out_path_id: bytes,
                 keys: _HopKeys, random_bytes: RandomBytes, issued_at: int = 0) -> None:
        self.is_proxy = is_proxy
        self.next_peer_id = next_peer_id
        self.out_path_id = out_path_id
        self.issued_at = issued_at
        # proxy: the highest forward sequence number accepted and the window below it (bit i:
        # number top - i seen)
        self._top = 0
        self._seen = 0
        # Only the objects this hop's role uses: a cipher object costs ~2.7 KB (an AESGCM holds
        # OpenSSL contexts), and a relay table holds thousands of hops (issue 16: 10,000 paths
        # cost 161 MB with all four).
        self._forward: _Layer | None = None
        self._backward: _Layer | None = None
        self._end_forward: _EndToEnd | None = None
        self._end_backward: _EndToEnd | None = None
        if is_proxy:
            self._end_forward = _EndToEnd(keys.end_forward)
            self._end_backward = _EndToEnd(keys.end_backward)
        else:
            self._forward = _Layer(keys.forward_body, keys.forward_iv)
            self._backward = _Layer(keys.backward_body, keys.backward_iv)
        self._random_bytes = random_bytes

    def __repr__(self) -> str:
        return f"RelayHop(is_proxy={self.is_proxy}, out_path_id={self.out_path_id.hex()})"

    def relay_forward(self, cell: bytes) -> bytes:
        """Apply this hop's layer to a cell going towards the proxy.

        Raises:
            RemoteProtocolError: not a cell size.
            LocalProtocolError: this hop is the proxy (it has no relay layer).
        """
        layer = _need(self._forward, "a proxy has no relay layer")
        iv, body = _split_cell(cell)
        return layer.next_iv(iv) + layer.xor_body(iv, body)

    def open_forward(self, cell: bytes) -> bytes:
        """Proxy: check and open the user's end-to-end layer; returns the user's payload.

        Raises:
            CryptoError: the cell was altered on the path (or is not for this path).
            ReplayError: an authentic cell whose sequence number was seen before, or is
                :data:`REPLAY_WINDOW` or more below the highest seen (or 0).
            RemoteProtocolError: not a cell size, or bad padding.
            LocalProtocolError: this hop is a relay, not the proxy.
        """
        end = _need(self._end_forward, "only the proxy opens the end-to-end layer")
        iv, body = _split_cell(cell)
        payload = end.open(iv, body)
        self._accept_sequence(int.from_bytes(iv[:_SEQ_BYTES], "big"))
        return payload

    def _accept_sequence(self, seq: int) -> None:
        """RFC 4303 sec. 3.4.3 anti-replay window, updated only for authentic cells."""
        if seq == 0:
            raise ReplayError("cell without a sequence number")
        if seq > self._top:
            shift = seq - self._top
            self._seen = ((self._seen << shift) | 1) & ((1 << REPLAY_WINDOW) - 1) \
                if shift < REPLAY_WINDOW else 1
            self._top = seq
            return
        behind = self._top - seq
        if behind >= REPLAY_WINDOW:
            raise ReplayError(f"cell {behind} behind the newest, outside the replay window")
        if self._seen >> behind & 1:
            raise ReplayError("replayed cell")
        self._seen |= 1 << behind

    def seal_backward(self, payload: bytes) -> bytes:
        """Proxy: seal a payload for the user (the end-to-end layer, under a fresh IV).

        Raises:
            LocalProtocolError: payload over :data:`MAX_CELL_PAYLOAD` bytes, or this hop is a
                relay, not the proxy.
        """
        end = _need(self._end_backward, "only the proxy seals the end-to-end layer")
        iv = self._random_bytes(CELL_IV_BYTES)
        return iv + end.seal(iv, payload)

    def relay_backward(self, cell: bytes) -> bytes:
        """Apply this hop's layer to a cell going back to the user.

        Raises:
            RemoteProtocolError: not a cell size.
            LocalProtocolError: this hop is the proxy (it has no relay layer).
        """
        layer = _need(self._backward, "a proxy has no relay layer")
        iv, body = _split_cell(cell)
        out_iv = layer.next_iv(iv)
        return out_iv + layer.xor_body(out_iv, body)

    def make_ack(self) -> bytes:
        """Proxy: the setup acknowledgement (a backward cell the user can check)."""
        return self.seal_backward(_ACK_PLAINTEXT)


_T = TypeVar("_T")


def _need(part: _T | None, why: str) -> _T:
    if part is None:
        raise LocalProtocolError(why)
    return part


def process_setup(
    onion_key: OnionKeyPair, packet: bytes, *, random_bytes: RandomBytes = os.urandom
) -> tuple[RelayHop, bytes | None]:
    """Process a setup packet addressed to this hop.

    Args:
        onion_key: this node's onion key pair.
        packet: exactly :data:`SETUP_PACKET_BYTES` bytes.

    Returns:
        (the hop state, the packet for the successor), or (hop, None) when this hop is the proxy.

    Raises:
        RemoteProtocolError: wrong packet size or malformed routing info.
        CryptoError: the slot does not open with this node's onion key.
    """
    if len(packet) != SETUP_PACKET_BYTES:
        raise RemoteProtocolError(
            f"setup packet of {len(packet)} bytes, expected {SETUP_PACKET_BYTES}"
        )
    ephemeral = packet[:32]
    shared = onion_key.exchange(ephemeral)
    keys = _derive(shared, ephemeral, onion_key.public)
    try:
        info = AESGCM(keys.setup).decrypt(_ZERO_NONCE, packet[32:SLOT_BYTES], _SETUP_AAD)
    except InvalidTag as exc:
        raise CryptoError("setup slot does not open with this onion key") from exc
    flags, peer_len = info[0], info[1]
    if flags & ~_FLAG_PROXY:
        raise RemoteProtocolError(f"unknown routing flags {flags:#x}")
    out_path_id = info[44 : 44 + PATH_ID_BYTES]
    issued_at = int.from_bytes(info[60:64], "big")
    is_proxy = bool(flags & _FLAG_PROXY)
    if is_proxy:
        if peer_len:
            raise RemoteProtocolError("proxy routing info names a successor")
        return RelayHop(True, None, out_path_id, keys, random_bytes, issued_at), None
    if not 1 <= peer_len <= MAX_PEER_ID_BYTES:
        raise RemoteProtocolError(f"successor peer ID of {peer_len} bytes")
    next_peer = bytes(info[2 : 2 + peer_len])
    rest = packet[SLOT_BYTES:]
    next_packet = _xor(rest, _keystream(keys.stream, len(rest))) + _random_slot(random_bytes)
    return RelayHop(False, next_peer, out_path_id, keys, random_bytes, issued_at), next_packet


# ---------------------------------------------------------------------------------- user side


class UserPath:
    """The user's end of one path: every hop's layer and the end-to-end keys of the proxy.

    Attributes:
        hops: relay peer IDs in order; the last is the proxy.
        first_hop, first_path_id: where the user sends cells.
        proxy: the proxy's peer ID (a request names it, with a fresh reply tag).
        exit_path_id: the proxy's own label of the path (kept for diagnostics and tests).
    """

    def __init__(self, hops: list[bytes], path_ids: list[bytes], exit_path_id: bytes,
                 keys: list[_HopKeys], random_bytes: RandomBytes = os.urandom) -> None:
        self.hops = hops
        self.path_ids = path_ids
        self.first_hop = hops[0]
        self.first_path_id = path_ids[0]
        self.proxy = hops[-1]
        self.exit_path_id = exit_path_id
        # relay layers of every hop but the proxy (the proxy only opens the end-to-end layer)
        self._forward = [_Layer(k.forward_body, k.forward_iv) for k in keys[:-1]]
        self._backward = [_Layer(k.backward_body, k.backward_iv) for k in keys[:-1]]
        self._end_forward = _EndToEnd(keys[-1].end_forward)
        self._end_backward = _EndToEnd(keys[-1].end_backward)
        self._random_bytes = random_bytes
        self._sequence = 0  # forward cells sealed so far

    def seal_forward(self, payload: bytes) -> bytes:
        """Pad and seal ``payload`` for the proxy and pre-apply every relay's layer.

        The proxy-side IV is the next sequence number and 8 random bytes (drawn from
        ``random_bytes``); the IVs of the earlier links follow through the relays' inverse IV
        permutations.

        Raises:
            LocalProtocolError: payload over :data:`MAX_CELL_PAYLOAD` bytes.
        """
        self._sequence += 1
        ivs = [self._sequence.to_bytes(_SEQ_BYTES, "big")
               + self._random_bytes(CELL_IV_BYTES - _SEQ_BYTES)]
        for layer in reversed(self._forward):
            ivs.append(layer.previous_iv(ivs[-1]))
        ivs.reverse()
        body = self._end_forward.seal(ivs[-1], payload)
        for layer, iv in zip(self._forward, ivs):  # CTR layers commute: any order
            body = layer.xor_body(iv, body)
        return ivs[0] + body

    def open_backward(self, cell: bytes) -> bytes:
        """Remove every relay's layer from a backward cell and open the end-to-end layer.

        Raises:
            CryptoError: the cell was altered on the path.
            RemoteProtocolError: not a cell size, or bad padding.
        """
        iv, body = _split_cell(cell)
        for layer in self._backward:
            body = layer.xor_body(iv, body)
            iv = layer.previous_iv(iv)
        return self._end_backward.open(iv, body)

    def check_ack(self, ack: bytes) -> None:
        """Check the setup acknowledgement that came back along the path.

        Raises:
            CryptoError: it does not authenticate, or is not the acknowledgement.
        """
        try:
            plaintext = self.open_backward(ack)
        except RemoteProtocolError as exc:
            raise CryptoError(f"bad acknowledgement: {exc}") from exc
        if plaintext != _ACK_PLAINTEXT:
            raise CryptoError("acknowledgement has the wrong content")


def _routing_info(next_peer: bytes | None, out_path_id: bytes, issued_at: int = 0) -> bytes:
    info = bytearray(ROUTING_INFO_BYTES)
    if next_peer is None:
        info[0] = _FLAG_PROXY
    else:
        if not 1 <= len(next_peer) <= MAX_PEER_ID_BYTES:
            raise LocalProtocolError(f"peer ID of {len(next_peer)} bytes")
        info[1] = len(next_peer)
        info[2 : 2 + len(next_peer)] = next_peer
    info[44 : 44 + PATH_ID_BYTES] = out_path_id
    info[60:64] = issued_at.to_bytes(4, "big")
    return bytes(info)


def create_path(
    hops: list[HopSpec], *, random_bytes: RandomBytes = os.urandom, issued_at: int = 0
) -> tuple[UserPath, bytes]:
    """Build the setup packet for a path through ``hops`` (the last one is the proxy).

    Args:
        hops: 1..MAX_HOPS hops with their onion keys (32 bytes each).
        issued_at: the path's issue time, unix seconds (0 <= issued_at < 2**32), told to every
            hop (:attr:`RelayHop.issued_at`); relays refuse a setup outside their window.

    Returns:
        (the user's path state, the :data:`SETUP_PACKET_BYTES`-byte packet for ``hops[0]``, to send
        with ``path.first_path_id``).

    Raises:
        LocalProtocolError: no hops, too many, or a malformed onion key or peer ID.
    """
    count = len(hops)
    if not 1 <= count <= MAX_HOPS:
        raise LocalProtocolError(f"a path has 1..{MAX_HOPS} hops, not {count}")
    if not 0 <= issued_at < 2**32:
        raise LocalProtocolError(f"issue time {issued_at} out of range")
    path_ids = [random_bytes(PATH_ID_BYTES) for _ in range(count)]
    exit_path_id = random_bytes(PATH_ID_BYTES)
    keys: list[_HopKeys] = []
    targets: list[bytes] = []
    for i, hop in enumerate(hops):
        if len(hop.onion_key) != 32:
            raise LocalProtocolError("an onion key is 32 bytes")
        ephemeral = X25519PrivateKey.from_private_bytes(random_bytes(32))
        ephemeral_public = ephemeral.public_key().public_bytes_raw()
        try:
            shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(hop.onion_key))
        except ValueError as exc:
            raise LocalProtocolError(f"bad onion key of hop {i}: {exc}") from exc
        k = _derive(shared, ephemeral_public, hop.onion_key)
        keys.append(k)
        if i + 1 < count:
            info = _routing_info(hops[i + 1].peer_id, path_ids[i + 1], issued_at)
        else:
            info = _routing_info(None, exit_path_id, issued_at)
        sealed = AESGCM(k.setup).encrypt(_ZERO_NONCE, info, _SETUP_AAD)
        targets.append(ephemeral_public + sealed)
    # Hop m XORs the slots after its own with keystream S_m and shifts them up by one, so slot 0
    # of the packet hop i receives is P0[i] ^ S_0[i-1] ^ S_1[i-2] ^ ... ^ S_{i-1}[0] (slot units).
    streams = [_keystream(k.stream, (MAX_HOPS - 1) * SLOT_BYTES) for k in keys]
    slots: list[bytes] = []
    for i in range(MAX_HOPS):
        if i >= count:
            slots.append(_random_slot(random_bytes))
            continue
        slot = targets[i]
        for m in range(i):
            offset = (i - 1 - m) * SLOT_BYTES
            slot = _xor(slot, streams[m][offset : offset + SLOT_BYTES])
        slots.append(slot)
    path = UserPath([h.peer_id for h in hops], path_ids, exit_path_id, keys, random_bytes)
    return path, b"".join(slots)


__all__ = [
    "CELL_BUCKETS",
    "CELL_IV_BYTES",
    "MAX_CELL_BYTES",
    "MAX_CELL_PAYLOAD",
    "MAX_HOPS",
    "PATH_ID_BYTES",
    "REPLAY_WINDOW",
    "SETUP_PACKET_BYTES",
    "HopSpec",
    "OnionKeyPair",
    "RelayHop",
    "UserPath",
    "create_path",
    "pad_payload",
    "process_setup",
    "unpad_payload",
]
