"""The registration link: how a replica started elsewhere asks a running orchestrator to join.

The head binds a ROUTER socket on its ``--listen`` address (CurveZMQ: only
workers whose public keys are allowed get through the handshake); a worker
connects a DEALER and sends :class:`Register`.  The head answers
:class:`Accepted` -- where its control socket is (a TCP port of its own,
CurveZMQ, only this worker's key passes), its replica slot and the
pipeline's facts it needs -- or :class:`Refused`.  From then on the worker
speaks the ordinary control protocol (:mod:`stages.wire`) on that
socket, starting with ``Ready``.  Same framing as the wire protocol: one
msgpack header frame, tagged array-like structs; nothing is pickled.  This
module must not import trio or torch (the worker imports it).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["Accepted", "Refused", "Register", "RegistrationMsg", "decode", "encode"]


class Register(msgspec.Struct, tag="register", array_like=True):
    """A worker asks to join stage ``stage_id`` as ``member_id`` (a fresh random identity per attempt).

    ``public_key``: the worker's Z85 CurveZMQ public key (must be the key it
    authenticated with).  ``kind``/``role``: what it runs (must match the
    stage).  ``capabilities``: device, max_batch, host, pid (informative).
    ``session_key``: the public half of a key pair the worker made for this
    join alone: the only key its control socket lets in, and its identity on
    the data plane (required; a worker without one is refused).
    """

    member_id: str
    stage_id: int
    kind: str
    role: str = ""
    public_key: str = ""
    capabilities: dict[str, Any] = {}
    session_key: str = ""


class Accepted(msgspec.Struct, tag="accepted", array_like=True):
    """The head takes the worker: connect to ``control`` and send ``Ready`` within the startup timeout.

    ``replica``: its slot in the stage's pool (async-chunk peers address it by
    this index).  ``seed``: of its dummy weights.  ``inbox``: bind an
    async-chunk inbox (the previous stage streams to it).  ``control_only``:
    send the head only finishing control outputs.  ``downstream`` /
    ``upstream_keys``: as in :class:`stages.wire.Peers`.
    """

    member_id: str
    replica: int
    control: str
    heartbeat_interval: float
    seed: int = 0
    inbox: bool = False
    control_only: bool = False
    downstream: list[list[str] | None] = []
    upstream_keys: list[str] = []


class Refused(msgspec.Struct, tag="refused", array_like=True):
    """The head does not take the worker: ``reason`` is a short code, ``message`` says why."""

    member_id: str
    reason: str
    message: str


RegistrationMsg = Register | Accepted | Refused

_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(RegistrationMsg)


def encode(msg: RegistrationMsg) -> bytes:
    return _ENC.encode(msg)


def decode(data: bytes | memoryview) -> RegistrationMsg:
    """Decode one registration message; raises ``msgspec.DecodeError``/``ValidationError`` if garbage."""
    return _DEC.decode(data)
