"""Checks ``ps-node run`` makes before it writes a key file or imports anything heavy.

A node that will fail should fail in the first second, with one line that names the flag and the
value, not after loading a model for a minute or while logging the same error forever:

* :func:`check_model_path`: ``--model`` is a Hugging Face model folder (with ``config.json``)
  or a ``.gguf`` file (its first 4 bytes are ``GGUF``), before torch and transformers load;
* :func:`check_address_free`: a ``--listen`` multiaddr, ``--api`` or ``--metrics`` address is
  not in use, by a probe bind without ``SO_REUSEPORT`` (so a socket that set it is still found;
  ``SO_REUSEADDR`` lets a port in TIME_WAIT pass, as the real listener allows it).

A probe can race with another process that binds in between; the real bind then fails and says
so too (:func:`ps_p2p.protocols.host.open_host`). Multiaddrs themselves are parsed by
:meth:`ps_p2p.config.NodeConfig.validate`.
"""

from __future__ import annotations

import errno
import pathlib
import socket

import multiaddr

from ps_p2p.errors import AddressInUseError, ConfigError

#: First bytes of a GGUF file (GGUF spec, "File Structure": magic ``0x46554747``, little endian).
GGUF_MAGIC = b"GGUF"


def check_model_path(model: str, flag: str = "--model") -> pathlib.Path:
    """Check that ``model`` names a model the transformers engine can load, without loading it.

    Returns:
        the path, with ``~`` expanded.

    Raises:
        ConfigError: nothing at ``model``; a folder without ``config.json``; a file that is not
            a ``.gguf`` file starting with the GGUF magic; an unreadable file.
    """
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{flag} {model}: folder without config.json (not a Hugging Face model folder)"
            )
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(f"{flag} {model}: a file that is not a .gguf model")
        try:
            with open(path, "rb") as fh:
                magic = fh.read(len(GGUF_MAGIC))
        except OSError as exc:
            raise ConfigError(f"{flag} {model}: cannot read it: {exc.strerror or exc}") from None
        if magic != GGUF_MAGIC:
            raise ConfigError(f"{flag} {model}: not a GGUF file (no GGUF magic)")
        return path
    raise ConfigError(f"{flag} {model}: no such model folder or .gguf file")


def check_address_free(host: str, port: int, what: str) -> None:
    """Probe-bind ``(host, port)`` over TCP without ``SO_REUSEPORT``; port 0 always passes.

    Args:
        host: an IP address (a name is resolved, first address).
        port: 0..65535.
        what: how the error names the address, e.g. ``"listen address /ip4/.../tcp/4001"``.

    Raises:
        AddressInUseError: ``"<what> is already in use"``.
        ConfigError: ``"cannot bind <what>: <reason>"`` for other bind errors (an address not
            on this machine, a privileged port...).
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"cannot bind {what}: {exc.strerror or exc}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUseError(f"{what} is already in use") from None
            raise ConfigError(f"cannot bind {what}: {exc.strerror or exc}") from None


def check_listen_free(listen: str) -> None:
    """:func:`check_address_free` of a ``/ip4|ip6/<host>/tcp/<port>`` multiaddr (others, such
    as ``/dns4/``, are left to the real bind).

    Raises:
        AddressInUseError: ``"listen address <multiaddr> is already in use"``.
        ConfigError: another bind error, named likewise.
    """
    addr = multiaddr.Multiaddr(listen)
    names = [p.name for p in addr.protocols()]
    if names[:2] not in (["ip4", "tcp"], ["ip6", "tcp"]):
        return
    host = addr.value_for_protocol(names[0])
    port = int(addr.value_for_protocol("tcp"))
    check_address_free(host, port, f"listen address {listen}")


__all__ = [
    "AddressInUseError", "GGUF_MAGIC", "check_address_free", "check_listen_free",
    "check_model_path",
]
