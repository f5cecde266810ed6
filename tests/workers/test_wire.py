"""The wire protocol: typed messages, arrays as separate zero-copy frames, garbage refused."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from stages.wire import (
    Abort,
    Chunk,
    Dying,
    Heartbeat,
    InboundMsg,
    OutboundMsg,
    OutItem,
    Outputs,
    Ready,
    RequestError,
    Rpc,
    RpcReply,
    Shutdown,
    Submit,
    WireCodec,
    WireError,
)


def roundtrip(codec: WireCodec, msg: object) -> object:
    frames = codec.encode(msg)  # type: ignore[arg-type]
    return codec.decode([bytes(f) for f in frames])


@pytest.mark.parametrize("msg", [
    Submit("r1", "hello", 1), Abort(["a", "b"]), Shutdown("bye"), Rpc(7, "stats"),
])
def test_inbound_messages_roundtrip(msg: object) -> None:
    assert roundtrip(WireCodec(InboundMsg), msg) == msg


@pytest.mark.parametrize("msg", [
    Ready(0, 1, 1234, "echo", {"x": 1}), RequestError("r", "bad"), Heartbeat(1.5, 3),
    Dying("SIGTERM"), RpcReply(7, {"ok": True}), Outputs([OutItem("r", {"t": "a"}, True, None, 2.0)]),
])
def test_outbound_messages_roundtrip(msg: object) -> None:
    assert roundtrip(WireCodec(OutboundMsg), msg) == msg


def test_arrays_travel_as_separate_frames_with_dtype_and_shape() -> None:
    codec = WireCodec(InboundMsg)
    pcm = np.linspace(-1, 1, 4800, dtype=np.float32)
    codes = np.arange(24, dtype=np.int32).reshape(6, 4)[:, ::2]  # non-contiguous view
    frames = codec.encode(Submit("r", {"pcm": pcm, "codes": codes, "empty": np.zeros((0, 3))}))
    assert len(frames) == 4  # header + one frame per array
    assert len(frames[0]) < 200  # the header holds no array bytes
    assert bytes(frames[1]) == pcm.tobytes()
    got = codec.decode(frames)
    assert got.payload["pcm"].dtype == np.float32
    np.testing.assert_array_equal(got.payload["pcm"], pcm)
    np.testing.assert_array_equal(got.payload["codes"], codes)
    assert got.payload["empty"].shape == (0, 3)


def test_decoded_arrays_are_views_of_the_received_frame() -> None:
    codec = WireCodec(OutboundMsg)
    frames = codec.encode(Outputs([OutItem("r", np.arange(1000, dtype=np.int64))]))
    buf = bytearray(bytes(frames[1]))
    arr = codec.decode([frames[0], buf]).items[0].data
    buf[0:8] = (42).to_bytes(8, "little")  # no copy was made: the array sees the frame's bytes
    assert arr[0] == 42


def test_objects_that_provide_array_are_sent_as_arrays() -> None:
    class Tensorish:
        def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
            return np.ones(3, dtype=np.float32)

    got = roundtrip(WireCodec(Chunk), Chunk("r", Tensorish(), True))
    np.testing.assert_array_equal(got.data, np.ones(3, dtype=np.float32))


@pytest.mark.parametrize("frames", [
    [],
    [b"\xc1 not msgpack"],
    [b"\x92\xa6submit\xa1r"],  # a submit without a payload
    [b"\x91\xa7unknown"],  # unknown tag
])
def test_garbage_raises_wire_error(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        WireCodec(InboundMsg).decode(frames)


def test_array_reference_to_a_missing_or_short_frame_is_refused() -> None:
    codec = WireCodec(InboundMsg)
    frames = codec.encode(Submit("r", np.arange(10, dtype=np.int32)))
    with pytest.raises(WireError, match="frame"):
        codec.decode([frames[0]])
    with pytest.raises(WireError, match="do not fit"):
        codec.decode([frames[0], b"\x00" * 8])
    with pytest.raises(WireError):
        codec.decode([frames[0], b"\x00" * 7])


def test_unsendable_payloads_raise_type_error() -> None:
    codec = WireCodec(InboundMsg)
    with pytest.raises(TypeError):
        codec.encode(Submit("r", object()))
    with pytest.raises(TypeError):
        codec.encode(Submit("r", np.array([object()])))


@pytest.mark.processes
def test_importing_trio_orch_never_imports_torch() -> None:
    """The orchestrator routes tensors as buffers: no module under trio_orch may pull in torch."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import trio_orch, stages.worker, stages.connector\n"
        "for m in pkgutil.walk_packages(trio_orch.__path__, 'trio_orch.'):\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ImportError as exc:\n"
        "        if 'torch' in str(exc):\n"
        "            raise\n"
        "cmds = trio_orch.cli.commands()\n"
        "for name in cmds:\n"
        "    trio_orch.cli.build_parser(cmds, configure=name)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_control_fields_were_appended_so_peers_one_version_apart_still_decode() -> None:
    import msgspec

    class OldRpc(msgspec.Struct, tag="rpc", array_like=True):
        call_id: int
        method: str

    class OldAbort(msgspec.Struct, tag="abort", array_like=True):
        request_ids: list[str]

    class OldReply(msgspec.Struct, tag="rpc_reply", array_like=True):
        call_id: int
        result: dict

    new_in, old = WireCodec(InboundMsg), msgspec.msgpack
    # an old orchestrator's messages reach a new worker: the new fields take their defaults
    assert new_in.decode([old.encode(OldRpc(3, "stats"))]) == Rpc(3, "stats", [], {})
    assert new_in.decode([old.encode(OldAbort(["r"]))]) == Abort(["r"], 0)
    # a new orchestrator's messages reach an old worker: the extra fields are ignored
    assert old.decode(new_in_frame(Rpc(4, "sleep", [2], {"x": 1})), type=OldRpc) == OldRpc(4, "sleep")
    assert old.decode(new_in_frame(Abort(["r"], 9)), type=OldAbort) == OldAbort(["r"])
    # an old worker's reply still decodes (no error field: a success)
    assert WireCodec(OutboundMsg).decode([old.encode(OldReply(3, {"ok": True}))]) == RpcReply(3, {"ok": True})


def new_in_frame(msg: object) -> bytes:
    return bytes(WireCodec(InboundMsg).encode(msg)[0])  # type: ignore[arg-type]
