"""A py-libp2p network notifee that ignores every event.

py-libp2p 0.8.1's ``INotifee`` declares six abstract coroutines; a notifee that cares about one
event (a closed connection, say) subclasses :class:`QuietNotifee` and overrides only that one.
"""

from __future__ import annotations

from typing import Any

from libp2p.abc import INotifee


class QuietNotifee(INotifee):
    """``INotifee`` with every method a no-op; register a subclass with
    ``host.get_network().register_notifee``."""

    __slots__ = ()

    async def connected(self, network: Any, conn: Any) -> None:
        return None

    async def disconnected(self, network: Any, conn: Any) -> None:
        return None

    async def opened_stream(self, network: Any, stream: Any) -> None:
        return None

    async def closed_stream(self, network: Any, stream: Any) -> None:
        return None

    async def listen(self, network: Any, multiaddr: Any) -> None:
        return None

    async def listen_close(self, network: Any, multiaddr: Any) -> None:
        return None


__all__ = ["QuietNotifee"]
