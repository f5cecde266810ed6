"""The wire between API-server processes (fronts) and the head that runs the engine.

One ZMQ ``DEALER`` pair per front, on ipc: the head binds one socket per
front slot, the front connects.  A message is a tagged :mod:`msgspec`
struct, msgpack-encoded by :class:`~stages.wire.WireCodec`, so an array in a
prompt or an output (an image in, audio out) travels as its own zero-copy
frame, as between the head and its workers; nothing is pickled.  What is
typed on one side only (the engine's statistics, a stage's sampling
parameters, per-stage timings) crosses as a msgpack blob the receiver
decodes into its own dataclass (:func:`pack`, :func:`unpack`).

:class:`Link` is the one owner of a socket, on either side: other tasks of
the same Trio run hand it frames (:meth:`Link.send`, never blocking: a
message is queued and the owner wakes), and it alone reads and writes the
socket, draining it to ``EAGAIN`` (ZMQ's fd is edge-triggered) before it
waits again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import msgspec
import trio
import zmq

from stages.wire import WireCodec, WireError
from trio_orch.types import Message, OrchError, OrchOutput

__all__ = ["Abort", "Accepted", "Add", "Batch", "Call", "Count", "Counted", "Ended", "Err", "Hello", "Link",
           "Out", "Refused", "Reply", "State", "ToFront", "ToHead", "Update", "Welcome", "from_wire", "pack",
           "to_wire", "unpack"]


# ------------------------------------------------------------------ front -> head
class Hello(msgspec.Struct, tag="hello", array_like=True):
    """The front is up (its pid, for the logs); the head answers :class:`Welcome`."""

    pid: int


class Add(msgspec.Struct, tag="add", array_like=True):
    """``add_request_async``; the head answers :class:`Accepted` or :class:`Refused` with ``call``."""

    call: int
    prompt: Any
    request_id: str | None = None
    final_stage_id: int | None = None
    request_timeout: float | None = None
    resumable: bool = False
    sampling: Any = None
    want_timings: bool = False
    priority: int = 0


class Update(msgspec.Struct, tag="update", array_like=True):
    """One more input segment of a resumable request; answered with :class:`Reply`."""

    call: int
    request_id: str
    segment: Any
    final: bool = False


class Abort(msgspec.Struct, tag="abort", array_like=True):
    """Abort a request (``gone``: its client left, the head counts it so); nothing is answered."""

    request_id: str
    gone: bool = False


class Call(msgspec.Struct, tag="call", array_like=True):
    """An awaitable call of the engine by name (control plane, statistics); answered with :class:`Reply`."""

    call: int
    method: str
    kwargs: dict[str, Any] = {}


class Counted(msgspec.Struct, tag="counted", array_like=True):
    """The answer to :class:`Count`: the front's HTTP counters (:func:`pack` of ``FrontMetrics.counts()``)."""

    call: int
    counts: bytes


ToHead = Hello | Add | Update | Abort | Call | Counted


# ------------------------------------------------------------------ head -> front
class State(msgspec.Struct, tag="state", array_like=True):
    """What a front reads without asking (the engine's state properties), pushed when it changes."""

    running: bool
    closed_reason: str | None
    paused: str | None
    shedding: bool
    capacity: float
    retry_after: float


class Welcome(msgspec.Struct, tag="welcome", array_like=True):
    """The answer to :class:`Hello`: the pipeline as a front sees it, and the state now."""

    final_stage_ids: list[int]
    stage_kinds: list[str] | None
    stage_params: bytes  #: :func:`pack` of ``list[StageParams] | None``
    stage_info: list[dict[str, Any]]
    state: State


class Out(msgspec.Struct, tag="out", array_like=True):
    """An :class:`~trio_orch.types.OrchOutput` on the wire."""

    request_id: str
    stage_id: int
    data: Any
    finished: bool
    t_produced: float = 0.0
    segment: int = 0
    segment_done: bool = False


class Err(msgspec.Struct, tag="err", array_like=True):
    """An :class:`~trio_orch.types.OrchError` on the wire."""

    request_id: str
    stage_id: int | None
    kind: str
    message: str
    partial: dict[int, list[Any]] | None = None


class Accepted(msgspec.Struct, tag="accepted", array_like=True):
    """The request of ``call`` is registered in the head as ``request_id`` (``rejection``: ended at once)."""

    call: int
    request_id: str
    rejection: Err | None = None


class Refused(msgspec.Struct, tag="refused", array_like=True):
    """A call raised in the head: ``kind`` names the error the front raises again (see :mod:`.remote`)."""

    call: int
    kind: str  #: value, overloaded, closed, control, runtime
    message: str
    retry_after: float = 1.0
    results: bytes = b""  #: a control error's :func:`pack`-ed ``list[RpcResult]``


class Batch(msgspec.Struct, tag="batch", array_like=True):
    """One dispatcher batch of a request's messages (the terminal last, with its ``timings`` if asked)."""

    request_id: str
    t: float
    msgs: list[Out | Err] = msgspec.field(default_factory=list)
    timings: bytes = b""  #: :func:`pack` of ``tuple[StageTiming | None, ...]`` (empty: none)


class Ended(msgspec.Struct, tag="ended", array_like=True):
    """A request's stream ended without its terminal: the engine stopped (the front raises EngineClosed)."""

    request_id: str
    message: str


class Reply(msgspec.Struct, tag="reply", array_like=True):
    """The answer to :class:`Call` or :class:`Update`: ``result`` :func:`pack`-ed (typed by the caller)."""

    call: int
    result: bytes = b""
    #: requests each front added, as the head counted them (so ``/metrics`` read after a call is current)
    fronts: list[int] = msgspec.field(default_factory=list)


class Count(msgspec.Struct, tag="count", array_like=True):
    """The head asks a front for its HTTP counters (``/metrics`` scraped on any front): :class:`Counted`."""

    call: int


ToFront = Count | Welcome | State | Accepted | Refused | Batch | Ended | Reply


# ------------------------------------------------------------------ conversions
def _builtin(obj: Any) -> Any:
    if isinstance(obj, MappingProxyType):
        return dict(obj)
    raise TypeError(f"cannot pack {type(obj).__name__}")


def pack(obj: Any) -> bytes:
    """msgpack of a dataclass-shaped value (read-only mappings as dicts), for :func:`unpack` there."""
    return msgspec.msgpack.encode(obj, enc_hook=_builtin)


def unpack(raw: bytes, kind: Any) -> Any:
    """The inverse of :func:`pack`, typed as ``kind``; :class:`~stages.wire.WireError` if it does not fit."""
    try:
        return msgspec.msgpack.decode(raw, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"undecodable {kind}: {exc}") from None


def to_wire(m: Message) -> Out | Err:
    if isinstance(m, OrchError):
        return Err(m.request_id, m.stage_id, m.kind, m.message, m.partial)
    return Out(m.request_id, m.stage_id, m.data, m.finished, m.t_produced, m.segment, m.segment_done)


def from_wire(m: Out | Err) -> Message:
    if isinstance(m, Err):
        return OrchError(m.request_id, m.stage_id, m.kind, m.message, m.partial)
    return OrchOutput(m.request_id, m.stage_id, m.data, m.finished, m.t_produced, m.segment, m.segment_done)


# ------------------------------------------------------------------ the owner of a socket
class Link:
    """The one owner task of a front's socket (either side): see the module docstring.

    ``on_message(msg)`` runs in the owner task for each decoded message; it
    must not block (it hands work to other tasks).  Undecodable messages are
    counted in ``garbage`` and dropped.
    """

    def __init__(self, sock: zmq.Socket, decode_type: Any, on_message: Callable[[Any], None]) -> None:
        self.sock = sock
        self._in = WireCodec(decode_type)
        self._out = WireCodec(decode_type)  # encode only: its decode type is unused
        self._on_message = on_message
        self._queue: deque[list[Any]] = deque()
        self._wake: trio.CancelScope | None = None
        self.garbage = 0

    def clear(self) -> None:
        """Drop what is queued and not sent (its peer is gone: a new one must not get it)."""
        self._queue.clear()

    def send(self, msg: msgspec.Struct) -> None:
        """Queue ``msg`` for the owner to send (any task of the owner's run; never blocks)."""
        self._queue.append(self._out.encode(msg))
        if self._wake is not None:
            self._wake.cancel()

    async def run(self) -> None:
        """Read and write the socket until cancelled."""
        sock = self.sock
        while True:
            while True:  # drain to EAGAIN: the fd only signals a change
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    msg = self._in.decode(frames)
                except WireError:
                    self.garbage += 1
                    continue
                self._on_message(msg)
            while self._queue:
                try:
                    sock.send_multipart(self._queue[0], zmq.NOBLOCK, copy=False)
                except zmq.Again:  # the peer is not there (yet) or its queue is full: wait for the fd
                    break
                self._queue.popleft()
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                await trio.lowlevel.checkpoint()
                continue
            with trio.CancelScope() as self._wake:
                if self._queue:  # the peer takes no more now (not connected yet, or full): look again soon
                    with trio.move_on_after(_RETRY_SEND):
                        await trio.lowlevel.wait_readable(sock.getsockopt(zmq.FD))
                else:
                    await trio.lowlevel.wait_readable(sock.getsockopt(zmq.FD))
            self._wake = None


#: seconds between two tries of a send the peer could not take (ZMQ's fd does not say when it can)
_RETRY_SEND = 0.02
