"""The ps_p2p exception tree.

Every error this package raises on purpose derives from :class:`PsError`::

    PsError
    ├── ConfigError                 bad configuration, key file or command line
    ├── NetnsError                  a multi-host testbed (network namespaces) cannot run here
    ├── AddressInUseError           (also an OSError, EADDRINUSE) a listen/API/metrics address
    │                               another socket holds
    ├── LocalProtocolError          we were about to break a protocol (a bug on our side)
    │   └── DoubleSignError         a validator was about to sign a second value at one
    │                               (height, round, step): refused, nothing sent
    ├── StoreError                  a validator's consensus store cannot be read or written
    ├── RemoteProtocolError         a peer broke a protocol: malformed/oversized frame, bad
    │   │                           indices, unknown path ID; costs one stream, never the node
    │   ├── FrameTooLargeError      a length prefix above the protocol's limit
    │   ├── InvalidSignatureError   a record, directory or response whose signature fails
    │   │   └── InvalidMembershipError  a record's organization membership certificate that
    │   │                           its organization key did not sign (for that peer and name)
    │   ├── KVEventDecodeError      a KV-cache event message of the engine (vLLM's ZMQ
    │   │                           publisher) malformed or over a limit: that message dropped
    │   ├── SubtreeSyncError        an HR-subtree delta or snapshot that is malformed, over its
    │   │                           limits, or for another chunk-length version
    │   └── ConsensusError          a proposal, vote, commit, block or transaction of the
    │       │                       verifier committee breaks the consensus or registry rules
    │       ├── InvalidCommitError  not > 2/3 of the voting power signed valid precommits for
    │       │                       exactly that height and block ID
    │       ├── InvalidBlockError   a block's header, size or time does not follow the chain
    │       ├── InvalidTransactionError  a registry transaction refused (mempool or execution)
    │       │   └── AdmissionError  refused by the committed sybil admission policy or a full
    │       │                       mempool (a cap, not a fault of the transaction itself)
    │       ├── InvalidDirectoryError  (also a DirectoryError) directory deltas that do not
    │       │                       rebuild the committed app hash
    │       ├── VerificationError   a challenge plan, seed reveal, score or miss report of the
    │       │   │                   model verification (``ps_p2p.verification``) breaks its rules
    │       │   ├── InvalidPlanError    a challenge plan that is not the one the committed seed
    │       │   │                   and registry give (a node not in the registry, a prompt
    │       │   │                   twice, an index out of the pool)
    │       │   ├── InvalidRevealError  a revealed epoch secret that does not open its commitment
    │       │   └── InvalidScoreError   a credibility or reputation score that is not a number
    │       │                       in [0, 1]
    │       └── UntrustedGenesisError  (also a DirectoryError) a verifier serves a genesis
    │                               naming validators the node was not told to trust, or
    │                               another chain than the one it follows
    ├── HRTreeFullError             an HR-tree insert over the entries or peers allowed
    │                               (per peer or in total): refused, the tree unchanged
    ├── ReputationBookFullError     a reputation for one more subject than the book holds:
    │                               refused, the book unchanged
    ├── DecodeError                 S-IDA: no k-subset of the cloves decodes (tampered/too few)
    ├── CryptoError                 onion layer or AEAD check failed
    │   └── ReplayError             an authentic onion setup packet or cell seen before, or
    │                               outside its acceptance window (time, sequence)
    ├── DirectoryError              no valid, unexpired directory; not enough nodes to build paths
    │   ├── ExpiredError            a record or directory past its expiry time (or older
    │   │                           than the node accepts)
    │   └── DirectoryRollbackError  a directory older than one the node already verified
    ├── PathError                   onion path setup failed or a path died
    ├── RequestError                an anonymous request could not be answered
    │   ├── RequestTimeoutError     the request's deadline passed (attempts were sent)
    │   ├── RequestTooLargeError    the request Q does not fit a message or one cell per clove
    │   ├── NoPathError             (also a PathError) fewer than n paths ready until the deadline
    │   ├── NoModelNodeError        (also a DirectoryError) no model node for the request
    │   ├── ModelNodeLostError      the model node stopped answering: more than n - k of the
    │   │                           request's proxies lost their connection to it
    │   └── ModelNodeError          the model node answered with a signed error status
    │       ├── OverloadedError     status OVERLOADED: its queue is full
    │       └── RequestRefusedError status BAD_REQUEST or WRONG_MODEL: the request is at fault
    │           └── ContextLengthError  status PROMPT_TOO_LONG (also a PromptTooLongError)
    └── EngineError                 the inference engine failed
        ├── PromptTooLongError      prompt + max_tokens exceed the model's context
        └── EngineParameterError    (also a ValueError) the engine refused a request parameter

A request's outcome (``ps_p2p.overlay.requests``) is a verified answer or one of the
``RequestError`` classes above; layers above map the class, never its message (e.g. the local
API: timeout 504, ``NoPathError``/``NoModelNodeError``/``OverloadedError`` 503,
``RequestRefusedError``/``RequestTooLargeError`` 400, anything else 502).

Naming follows h11/wsproto: ``LocalProtocolError`` means we broke the protocol,
``RemoteProtocolError`` means the peer did.
"""

from __future__ import annotations


class PsError(Exception):
    """Base class of every error ps_p2p raises on purpose."""


class ConfigError(PsError):
    """Bad configuration value, key file or command line."""


class NetnsError(PsError):
    """A multi-host testbed (:mod:`ps_p2p.testing.netns`) cannot be built or run here: not
    root, ``ip``/``nft``/``tc`` missing, network namespaces refused, or a command of them
    failed (the message names it and its output)."""


class AddressInUseError(PsError, OSError):
    """A listen, API or metrics address is already bound by another socket.

    ``str()`` is the one line to show, e.g. ``listen address /ip4/127.0.0.1/tcp/4001 is already
    in use``; ``errno`` is ``EADDRINUSE``.
    """

    def __init__(self, message: str) -> None:
        import errno

        OSError.__init__(self, errno.EADDRINUSE, message)

    def __str__(self) -> str:
        return str(self.strerror)


class LocalProtocolError(PsError):
    """We were about to violate a protocol (a bug on our side)."""


class DoubleSignError(LocalProtocolError):
    """A validator was about to sign a second value at one (height, round, step) (its
    write-ahead log has the first): refused, nothing is sent."""


class StoreError(PsError):
    """A validator's consensus store (write-ahead log, blocks) cannot be read or written; the
    validator stops rather than sign from a state it does not know."""


class RemoteProtocolError(PsError):
    """A peer violated a protocol; the stream it came on is reset, the node goes on."""


class FrameTooLargeError(RemoteProtocolError):
    """A frame's length prefix exceeds the protocol's limit."""


class InvalidSignatureError(RemoteProtocolError):
    """A signature over a record, directory or response does not verify."""


class InvalidMembershipError(InvalidSignatureError):
    """A record names an organization with a membership certificate that its organization key
    did not sign for that peer ID, name and expiry (issue 16: organizations are keys)."""


class KVEventDecodeError(RemoteProtocolError):
    """A KV-cache event message from the engine (vLLM's ZMQ publisher,
    :mod:`ps_p2p.engines.vllm_kv_events`) is malformed or over a limit: bad frames, not msgpack,
    a field of the wrong type or range. Costs that message only; it is counted and logged."""


class SubtreeSyncError(RemoteProtocolError):
    """A peer's HR-subtree delta or snapshot (:mod:`ps_p2p.gossip.hr_tree`) is malformed,
    oversized, non-canonical, or for another chunk-length (L) version: refused, the peer's
    replica unchanged. (A well-formed delta whose insert names a prefix the replica does not
    hold is not this error: the replica drops that peer's entries and asks for a snapshot.)"""


class ConsensusError(RemoteProtocolError):
    """A proposal, vote, commit, block or registry transaction breaks the rules of the verifier
    committee (:mod:`ps_p2p.consensus`). Raised on what a peer sent: costs that message."""


class InvalidCommitError(ConsensusError):
    """A commit (quorum certificate) does not carry valid precommits of more than 2/3 of the
    validator set's voting power for exactly one height, round and block ID."""


class InvalidBlockError(ConsensusError):
    """A block's header does not follow the chain (height, previous block ID, app hash, time),
    or the block is over its byte or transaction limits."""


class InvalidTransactionError(ConsensusError):
    """A registry transaction is malformed, badly signed, or not applicable to the state."""


class AdmissionError(InvalidTransactionError):
    """A well-formed transaction refused by the committed admission policy (per-network,
    per-organization or per-block caps against sybils) or by a full mempool."""


class VerificationError(ConsensusError):
    """A challenge plan, a revealed epoch secret, a score or a miss report breaks the rules of
    model verification (:mod:`ps_p2p.verification`, PlanetServe sec. 3.4). Raised on what the
    epoch's leader or another verifier sent: the proposal is refused (prevote nil)."""


class InvalidPlanError(VerificationError):
    """A challenge plan that is not the one the committed seed and registry determine: a model
    node not in the registry, one named twice, a prompt used twice, an index out of the pool."""


class InvalidRevealError(VerificationError):
    """A revealed epoch secret that does not open the commitment its validator committed."""


class InvalidScoreError(VerificationError):
    """A credibility or reputation score that is not a finite number in [0, 1]."""


class ReputationBookFullError(PsError):
    """A reputation for one more subject than the book may hold
    (:class:`ps_p2p.verification.reputation.ReputationBook`): refused, the book unchanged."""


class HRTreeFullError(PsError):
    """An HR-tree insert would exceed the entries allowed for one peer or in total, or the
    peers a tree tracks (:class:`ps_p2p.gossip.hr_tree.HRTree`): refused, the tree unchanged."""


class DecodeError(PsError):
    """S-IDA decoding failed: fewer than k cloves, or no k-subset passes the AEAD check."""


class CryptoError(PsError):
    """An onion layer or AEAD authentication check failed."""


class ReplayError(CryptoError):
    """An authentic onion setup packet or cell that was seen before, or falls outside its
    acceptance window (a setup's issue time, a cell's sequence number): dropped, never acted on
    twice."""


class DirectoryError(PsError):
    """No valid directory, or it holds too few nodes for the requested operation."""


class ExpiredError(DirectoryError):
    """A node record or directory is past its expiry time."""


class DirectoryRollbackError(DirectoryError):
    """A directory at a lower height than one the node already verified (a rollback)."""


class InvalidDirectoryError(ConsensusError, DirectoryError):
    """Directory deltas that, applied to the node's view, do not give the app hash the
    committed header carries (tampered, missing or reordered pages)."""


class UntrustedGenesisError(ConsensusError, DirectoryError):
    """A verifier served a genesis whose validators are not all verifiers this node trusts,
    or another chain than the one the node follows (``ps_p2p.directory_client``)."""


class PathError(PsError):
    """An onion path could not be set up, or died."""


class EngineError(PsError):
    """The inference engine failed."""


class PromptTooLongError(EngineError):
    """The prompt (plus max_tokens) does not fit in the model's context window."""


class EngineParameterError(EngineError, ValueError):
    """The engine refused a request parameter that no prompt could make acceptable, e.g.
    ``max_tokens`` above the whole context window or more prompt logprobs than the server allows.

    The request is at fault, not the engine; shortening the prompt would not help (so it is not a
    :class:`PromptTooLongError`). Also a ``ValueError``, like the checks of ``SamplingParams``.
    """


class RequestError(PsError):
    """An anonymous request could not be answered."""


class RequestTimeoutError(RequestError):
    """A request's deadline passed before k response cloves decoded."""


class RequestTooLargeError(RequestError):
    """The encoded request is over the S-IDA message limit, or its cloves over one cell."""


class NoPathError(PathError, RequestError):
    """Fewer than n paths (one per clove) were ready before the request's deadline."""


class NoModelNodeError(DirectoryError, RequestError):
    """The directory lists no model node that could serve the request."""


class ModelNodeLostError(RequestError):
    """The model node asked stopped answering before it answered: more than n - k of the
    request's reply proxies lost their connection to it (so k response cloves can no longer
    come), and no other model node of the model was left to ask."""


class ModelNodeError(RequestError):
    """The model node answered with a signed error status.

    Attributes:
        status: the ``ResponseStatus`` value it signed (``ps_p2p.inference.ResponseStatus``);
            -1 when not known.
    """

    status: int = -1

    def __init__(self, message: str = "", *, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class OverloadedError(ModelNodeError):
    """The model node's queue is full; it answered 'overloaded'."""


class RequestRefusedError(ModelNodeError):
    """The model node refused the request itself (bad parameters, a model it does not serve)."""


class ContextLengthError(RequestRefusedError, PromptTooLongError):
    """The model node answered that the prompt does not fit its model's context."""


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
