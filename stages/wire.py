"""The ZMQ wire protocol between the orchestrator and stage workers.

A message is one ZMQ multipart message: frame 0 is the msgpack encoding of a
tagged :mod:`msgspec` struct (the header); frames 1..n are raw array buffers.
Any numpy array (or object with ``__array__``, e.g. a CPU torch tensor)
inside a payload is replaced in the header by an msgpack extension
(code :data:`ARRAY_EXT`) holding ``(frame_index, dtype, shape)``; its bytes
travel as their own frame, sent with ``copy=False`` and decoded with
``np.frombuffer`` (zero-copy, read-only).  Nothing is ever pickled.

This module must not import torch: the orchestrator routes tensors as
buffers.  See ``docs/wire-protocol.md`` for the one-page description.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

__all__ = [
    "ARRAY_EXT",
    "Abort",
    "Chunk",
    "Cordoned",
    "Dying",
    "Heartbeat",
    "InboundMsg",
    "Leaving",
    "OutItem",
    "OutboundMsg",
    "Outputs",
    "Peers",
    "Ready",
    "RequestError",
    "Rpc",
    "RpcReply",
    "Shutdown",
    "Submit",
    "Submits",
    "Update",
    "WireCodec",
    "WireError",
    "frames_nbytes",
]

#: msgpack extension code marking an array stored in a separate frame.
ARRAY_EXT = 1


class WireError(ValueError):
    """A multipart message that does not decode to a known message."""


# --------------------------------------------------------------------- inbound (orchestrator -> worker)
class Submit(msgspec.Struct, tag="submit", array_like=True):
    """Start ``request_id`` with ``payload``; ``downstream`` = replica index of the
    next stage that receives this request's chunks (async-chunk), or -1;
    ``sampling`` = this stage's sampling parameters for the request (None: its
    defaults); ``resumable``: more input segments follow as :class:`Update`
    messages, so the worker keeps the request (and its model state) after a
    segment finishes; ``priority`` (lower first) and ``deadline_in`` (seconds
    left until the request's deadline, None: none) order the worker's waiting
    requests as the orchestrator orders its queue (``stages/scheduling.py``).
    Fields only ever get appended with a default, so a peer one version
    behind still decodes the message (it ignores what it does not know; an
    absent priority is 0)."""

    request_id: str
    payload: Any
    downstream: int = -1
    sampling: dict[str, Any] | None = None
    resumable: bool = False
    priority: int = 0
    deadline_in: float | None = None


class Submits(msgspec.Struct, tag="submits", array_like=True):
    """Several submits that left together: what one pass of the orchestrator's scheduler decided for
    a replica that was busy.  The worker takes them in order, as one arrival, so its next step
    batches them all."""

    items: list[Submit]


class Update(msgspec.Struct, tag="update", array_like=True):
    """The next input segment of a resumable request (``final``: its last one).

    The worker starts it once the segment before it finished there, on the
    same model state (the thinker continues from its KV cache).
    """

    request_id: str
    payload: Any
    final: bool = False


class Abort(msgspec.Struct, tag="abort", array_like=True):
    """Stop these requests at the next step; no further output is sent for them.

    ``ack`` non-zero asks for a confirmation: the worker answers with
    ``RpcReply(ack, [ids it held and stopped])`` once they are gone (an older
    worker ignores the field and never confirms).
    """

    request_ids: list[str]
    ack: int = 0


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Stop the worker: send ``Dying`` and exit."""

    reason: str = ""


class Rpc(msgspec.Struct, tag="rpc", array_like=True):
    """A control call: ``method(*args, **kwargs)`` on the worker, answered by :class:`RpcReply`.

    The worker's methods are listed in ``stages/control.py`` (plug-in models
    add their own).  ``args``/``kwargs`` were appended with defaults: an older
    peer's ``[call_id, method]`` still decodes, and an older worker ignores them.
    """

    call_id: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class Peers(msgspec.Struct, tag="peers", array_like=True):
    """Where the next stage's replicas take chunks now, and who may send this worker chunks.

    Sent when membership changes (a replica joined or left somewhere), always
    before any ``Submit`` that names a new replica as its ``downstream``.
    ``downstream[i]``: ``[address, server_key]`` of replica ``i`` of the next
    stage (``server_key`` the Z85 public key of a TCP inbox, "" on ipc), or
    None for an empty slot.  ``upstream_keys``: the public keys allowed to
    connect to this worker's TCP inbox (the previous stage's replicas).
    """

    downstream: list[list[str] | None]
    upstream_keys: list[str] = []


class Cordoned(msgspec.Struct, tag="cordoned", array_like=True):
    """Answer to ``Leaving``: nothing more will be placed on this replica (every submit for it
    was sent before this message), so once it holds nothing it may go."""


InboundMsg = Submit | Submits | Update | Abort | Shutdown | Rpc | Peers | Cordoned


# --------------------------------------------------------------------- outbound (worker -> orchestrator)
class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The handshake: the worker loaded its model and serves."""

    stage_id: int
    replica: int
    pid: int
    kind: str
    info: dict[str, Any] = {}


class OutItem(msgspec.Struct, array_like=True):
    """One output of one request (``error`` set: the request failed).

    ``timing``, on the finishing output: ``(queue_s, compute_s)``, seconds the
    request waited for a place in the worker's batch and seconds it spent there.
    """

    request_id: str
    data: Any
    finished: bool = False
    error: str | None = None
    t_produced: float = 0.0
    timing: tuple[float, float] | None = None


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    """Everything one batched step produced, in one message."""

    items: list[OutItem]


class RequestError(msgspec.Struct, tag="error", array_like=True):
    """A request failed outside a step (e.g. a bad payload at admission)."""

    request_id: str
    message: str


class Heartbeat(msgspec.Struct, tag="hb", array_like=True):
    """Liveness: sent every heartbeat interval, even while idle."""

    t: float
    active: int


class Dying(msgspec.Struct, tag="dying", array_like=True):
    """The sentinel: the worker is about to exit (``reason`` says why)."""

    reason: str


class RpcReply(msgspec.Struct, tag="rpc_reply", array_like=True):
    """The answer to :class:`Rpc` (or to an :class:`Abort` with ``ack``): ``result``, or ``error``."""

    call_id: int
    result: Any
    error: str | None = None


class Leaving(msgspec.Struct, tag="leaving", array_like=True):
    """The worker leaves the pool gracefully: give it no new request.

    It keeps serving what it holds for up to ``grace`` seconds, then sends
    ``Dying``; requests still open then end as a replica death.
    """

    grace: float
    active: int = 0


OutboundMsg = Ready | Outputs | RequestError | Heartbeat | Dying | RpcReply | Leaving


# ------------------------------------------------- worker -> worker (async-chunk connector)
class Chunk(msgspec.Struct, tag="chunk", array_like=True):
    """A piece of stage k's output streamed straight to stage k+1 (``end``: last one).

    ``segment``: the input segment of a resumable request it belongs to (0 for
    any other request); ``end`` then closes that segment's input.
    """

    request_id: str
    data: Any
    end: bool = False
    segment: int = 0


def frames_nbytes(frames: list[Any]) -> int:
    """The bytes :meth:`WireCodec.encode`'s frames put on the wire (the header, then each array's buffer)."""
    return sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)


class WireCodec:
    """Encode/decode one direction's messages to/from multipart frames.

    ``WireCodec(InboundMsg)`` decodes what a worker receives, etc.  Not
    re-entrant (encode/decode are synchronous, so one per socket is enough).
    """

    def __init__(self, decode_type: Any) -> None:
        self._bufs: list[Any] = []
        self._frames: list[Any] = []
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._dec = msgspec.msgpack.Decoder(decode_type, ext_hook=self._ext_hook)

    # ------------------------------------------------------------ encode
    def encode(self, msg: msgspec.Struct) -> list[Any]:
        """``[header, *buffers]``, ready for ``send_multipart(..., copy=False)``."""
        self._bufs = bufs = []
        try:
            header = self._enc.encode(msg)
        finally:
            self._bufs = []
        return [header, *bufs]

    def _enc_hook(self, obj: Any) -> Any:
        if not isinstance(obj, np.ndarray):
            if not hasattr(obj, "__array__"):
                raise TypeError(f"cannot send {type(obj).__name__} over the wire")
            obj = np.asarray(obj)
        if obj.dtype.hasobject:
            raise TypeError("cannot send an object array over the wire")
        arr = np.ascontiguousarray(obj)
        self._bufs.append(arr.data if arr.size else b"")
        meta = msgspec.msgpack.encode((len(self._bufs), arr.dtype.str, list(arr.shape)))
        return msgspec.msgpack.Ext(ARRAY_EXT, meta)

    # ------------------------------------------------------------ decode
    def decode(self, frames: list[Any]) -> Any:
        """Decode ``frames`` (bytes or zmq Frames); raise :class:`WireError` if garbage."""
        if not frames:
            raise WireError("empty multipart message")
        self._frames = frames
        try:
            head = frames[0]
            return self._dec.decode(getattr(head, "buffer", head))
        except WireError:
            raise
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, IndexError) as exc:
            raise WireError(f"undecodable message ({len(frames)} frames): {exc}") from None
        finally:
            self._frames = []

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != ARRAY_EXT:
            raise WireError(f"unknown msgpack extension code {code}")
        idx, dtype, shape = msgspec.msgpack.decode(data)
        if not 1 <= idx < len(self._frames):
            raise WireError(f"array refers to frame {idx} but the message has {len(self._frames)} frames")
        frame = self._frames[idx]
        buf = getattr(frame, "buffer", frame)
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise WireError("object arrays are refused")
        arr = np.frombuffer(buf, dtype=dt) if len(buf) else np.empty(0, dtype=dt)
        try:
            return arr.reshape(shape)
        except ValueError:
            raise WireError(f"array frame {idx}: {len(buf)} bytes do not fit shape {shape} {dtype}") from None
