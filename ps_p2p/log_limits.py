"""Rate limit for repeated log lines (standard :mod:`logging`).

A node that cannot reach a peer, or that keeps dropping the same kind of cell, would otherwise log
the same warning many times a second and bury everything else. :class:`RepeatFilter` passes the
first record of each (logger, level, message template) and then at most one per ``interval``
seconds; the next one it passes says how many it held back::

    12:00:00 WARNING ps_p2p.protocols.links: queue to ...x full, dropped 1 frame(s)
    12:01:00 WARNING ps_p2p.protocols.links: queue to ...y full, dropped 1 frame(s) [42 similar
             messages suppressed in the last 60 s]

The key is the template (``record.msg``), not the formatted text: "the same warning about
another peer" counts as a repeat, which is what floods a log. Records below ``min_level`` (INFO
by default in the CLI: WARNING and above are limited) always pass. ``ps-node``'s logging setup
installs one on its stderr handler (:func:`setup_logging`, also used by ``ps-node devnet``'s node processes).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable

#: Seconds between two records with the same key (default of :class:`RepeatFilter`).
DEFAULT_INTERVAL = 60.0
#: Keys remembered at most (least recently passed forgotten first); templates are few, so this
#: only bounds memory if some code logs non-constant templates.
MAX_KEYS = 4096


class RepeatFilter(logging.Filter):
    """Pass the same (logger, level, template) at most once per ``interval`` seconds.

    Args:
        interval: seconds; a repeat within it is dropped and counted.
        min_level: records below this level are never limited (default WARNING).
        clock: seconds, monotonic (injectable for tests).

    Attributes:
        suppressed: records dropped so far, all keys.
    """

    def __init__(
        self,
        interval: float = DEFAULT_INTERVAL,
        *,
        min_level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, not {interval!r}")
        self.interval = interval
        self.min_level = min_level
        self._clock = clock
        # key -> [time it last passed, records dropped since]; least recently passed first
        self._seen: OrderedDict[tuple[str, int, str], list[float | int]] = OrderedDict()
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        """True to emit ``record``; a passed record after drops gets the count appended."""
        if record.levelno < self.min_level:
            return True
        template = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
        key = (record.name, record.levelno, template)
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.interval:
            seen[1] += 1
            self.suppressed += 1
            return False
        if seen is not None and seen[1]:
            # ``msg`` is formatted with ``args`` later: escape nothing, add no "%"
            record.msg = (
                f"{record.getMessage()} [{seen[1]} similar message(s) suppressed in the last "
                f"{now - seen[0]:.0f} s]"
            )
            record.args = None
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        while len(self._seen) > MAX_KEYS:
            self._seen.popitem(last=False)
        return True


#: The py-libp2p logger whose stream failures :class:`StreamFailureFilter` quiets.
LIBP2P_HOST_LOGGER = "libp2p.host.basic_host"


class StreamFailureFilter(logging.Filter):
    """Quiet py-libp2p 0.8.1's report of a stream it could not open.

    ``BasicHost.new_stream`` logs an ERROR of seven lines (error, protocols, timeout,
    connection state, registry stats) for every stream it could not open, then raises
    ``StreamFailure`` to its caller, who decides what it means: GossipSub asks every new peer
    for ``/meshsub/...`` and gives up quietly on one that does not speak it (every user and
    verifier, seen from a model node), and our own services log their failures themselves. So
    the record is dropped, or with ``verbose`` (``--log-level DEBUG``) passed as one DEBUG line.
    Install it on the :data:`LIBP2P_HOST_LOGGER` logger (a logger's filters see the records it
    creates). Other records pass unchanged.
    """

    PREFIX = "Failed to open stream to peer"

    def __init__(self, verbose: bool = False) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.PREFIX):
            return True
        if not self.verbose:
            return False
        record.msg = " ".join(line.strip() for line in message.splitlines())
        record.args = None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def setup_logging(
    level: str, *, libp2p_level: str = "WARNING", network: bool = True
) -> None:
    """Logs to stderr at ``level``; repeated warnings limited to one a minute per template
    (:class:`RepeatFilter`; at DEBUG nothing is limited). Does nothing to the root logger's
    handlers when it already has some (an embedding program's). Without ``network`` libp2p is
    not imported (its loggers are set only when it will be used)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S")
    )
    if level.upper() != "DEBUG":
        handler.addFilter(RepeatFilter())
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not network:
        return
    import libp2p  # noqa: F401  (import first: it resets its logger's level on import)

    logging.getLogger("libp2p").setLevel(getattr(logging, libp2p_level.upper(), logging.WARNING))
    logging.getLogger("libp2p").propagate = True
    host_logger = logging.getLogger(LIBP2P_HOST_LOGGER)
    for old in [f for f in host_logger.filters if isinstance(f, StreamFailureFilter)]:
        host_logger.removeFilter(old)
    host_logger.addFilter(StreamFailureFilter(verbose=level.upper() == "DEBUG"))
    if level.upper() != "DEBUG":
        # a dial to a peer that went away logs an ERROR there; our link manager already logs
        # "link down" with the reason, and a dead relay is routine in an overlay
        logging.getLogger("libp2p.transport.tcp").setLevel(logging.CRITICAL)


__all__ = ["DEFAULT_INTERVAL", "LIBP2P_HOST_LOGGER", "MAX_KEYS", "RepeatFilter", "setup_logging",
           "StreamFailureFilter"]
