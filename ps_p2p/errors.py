"""The ps_p2p exception tree.

Every error this package raises on purpose derives from :class:`PsError`::

    PsError
    ├── ConfigError                 bad configuration, key file or command line
    ├── LocalProtocolError          we were about to break a protocol (a bug on our side)
    ├── RemoteProtocolError         a peer broke a protocol: malformed/oversized frame, bad
    │   │                           indices, unknown path ID; costs one stream, never the node
    │   ├── FrameTooLargeError      a length prefix above the protocol's limit
    │   └── InvalidSignatureError   a record, directory or response whose signature fails
    ├── DecodeError                 S-IDA: no k-subset of the cloves decodes (tampered/too few)
    ├── CryptoError                 onion layer or AEAD check failed
    ├── DirectoryError              no valid, unexpired directory; not enough nodes to build paths
    │   └── ExpiredError            a record or directory past its expiry time
    ├── PathError                   onion path setup failed or a path died
    ├── RequestError                an anonymous request could not be answered
    │   ├── RequestTimeoutError     the request's deadline passed
    │   └── OverloadedError         the model node's queue is full
    └── EngineError                 the inference engine failed
        └── PromptTooLongError      prompt + max_tokens exceed the model's context

Naming follows h11/wsproto: ``LocalProtocolError`` means we broke the protocol,
``RemoteProtocolError`` means the peer did.
"""

from __future__ import annotations


class PsError(Exception):
    """Base class of every error ps_p2p raises on purpose."""


class ConfigError(PsError):
    """Bad configuration value, key file or command line."""


class LocalProtocolError(PsError):
    """We were about to violate a protocol (a bug on our side)."""


class RemoteProtocolError(PsError):
    """A peer violated a protocol; the stream it came on is reset, the node goes on."""


class FrameTooLargeError(RemoteProtocolError):
    """A frame's length prefix exceeds the protocol's limit."""


class InvalidSignatureError(RemoteProtocolError):
    """A signature over a record, directory or response does not verify."""


class DecodeError(PsError):
    """S-IDA decoding failed: fewer than k cloves, or no k-subset passes the AEAD check."""


class CryptoError(PsError):
    """An onion layer or AEAD authentication check failed."""


class DirectoryError(PsError):
    """No valid directory, or it holds too few nodes for the requested operation."""


class ExpiredError(DirectoryError):
    """A node record or directory is past its expiry time."""


class PathError(PsError):
    """An onion path could not be set up, or died."""


class RequestError(PsError):
    """An anonymous request could not be answered."""


class RequestTimeoutError(RequestError):
    """A request's deadline passed before k response cloves decoded."""


class OverloadedError(RequestError):
    """The model node's queue is full; it answered 'overloaded'."""


class EngineError(PsError):
    """The inference engine failed."""


class PromptTooLongError(EngineError):
    """The prompt (plus max_tokens) does not fit in the model's context window."""


def is_keyboard_interrupt(exc: BaseException) -> bool:
    """True when ``exc`` is a KeyboardInterrupt, or an exception group holding nothing else.

    trio delivers Ctrl-C (SIGINT) to the task that happens to run; inside a nursery it reaches the
    caller of ``trio.run`` wrapped in a ``BaseExceptionGroup``, which ``except KeyboardInterrupt``
    does not match.
    """
    if isinstance(exc, KeyboardInterrupt):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(is_keyboard_interrupt(e) for e in exc.exceptions)
    return False
