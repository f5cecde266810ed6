"""Where each replica runs: its torch device, and the one GPU its process may see.

A stage's ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``, or a list with one
entry per replica) defaults to the pipeline's.  A replica placed on
``cuda:N`` is started with ``CUDA_VISIBLE_DEVICES`` set to the head's N-th
CUDA device and told ``cuda:0``: it sees one GPU, the one it was given, so
nothing it (or a library in it) allocates lands on another stage's GPU.
``cuda`` alone is ``cuda:0``.  A CPU replica is started with
``CUDA_VISIBLE_DEVICES`` empty: it sees no GPU at all.

The head's N-th device is the N-th entry of its own ``CUDA_VISIBLE_DEVICES``
when that is set (an index, a ``GPU-<uuid>`` or a MIG id: passed on as
written), else index N -- the numbering ``torch`` in the head would use.

:func:`check_devices` runs before any worker starts: a CUDA device that this
host does not have (no CUDA at all, or an index past the last device) is a
``ValueError`` naming the stage, the replica and the device.  Devices are
counted by :func:`cuda_device_count` (``torch.cuda.device_count()``, which
asks NVML or the driver without creating a CUDA context in the head, and
honours the head's ``CUDA_VISIBLE_DEVICES``); torch is imported only when
some replica asks for CUDA.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["DEVICE_PATTERN", "VISIBLE", "Placement", "check_devices", "cuda_device_count", "cuda_index",
           "device_arg", "head_devices", "place"]

#: a device a config or a flag may name (the schema's pattern too)
DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"
#: the variable that gives a worker its one GPU (CUDA's own)
VISIBLE = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Placement:
    """One replica's placement: ``device`` as the worker is told it (``--device``), the ``env`` it is
    started with, and the device ``asked`` for in the config."""

    asked: str
    device: str
    env: dict[str, str] = field(default_factory=dict)


def cuda_index(device: str) -> int | None:
    """``cuda:N`` -> N, ``cuda`` -> 0, ``cpu`` -> None (ValueError for anything else)."""
    m = re.match(DEVICE_PATTERN, device)
    if m is None:
        raise ValueError(f"device {device!r}: expected cpu, cuda or cuda:N")
    if device == "cpu":
        return None
    return int(m.group(2)[1:]) if m.group(2) else 0


def head_devices(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The head's own ``CUDA_VISIBLE_DEVICES`` entries (None: unset, every device is visible).

    As CUDA reads it: comma-separated, and the list ends at the first empty
    entry (``""`` hides every device; ``"-1"`` too, CUDA finding no such device).
    """
    env = os.environ if environ is None else environ
    raw = env.get(VISIBLE)
    if raw is None:
        return None
    out: list[str] = []
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return out


def place(asked: str, environ: Mapping[str, str] | None = None) -> Placement:
    """Where a replica asked to run on ``asked`` runs: the device it is told and its environment.

    Pure: the head's ``CUDA_VISIBLE_DEVICES`` (``environ``, default this
    process's) is read, no device is counted (:func:`check_devices` does that).
    """
    n = cuda_index(asked)
    if n is None:
        return Placement(asked, "cpu", {VISIBLE: ""})
    listed = head_devices(environ)
    if listed is None:
        return Placement(asked, "cuda:0", {VISIBLE: str(n)})
    if n >= len(listed):
        raise ValueError(f"device {asked}: the head sees {len(listed)} CUDA device(s) "
                         f"({VISIBLE}={','.join(listed) or '(empty)'})")
    return Placement(asked, "cuda:0", {VISIBLE: listed[n]})


def cuda_device_count() -> int:
    """CUDA devices this process may use: 0 without a CUDA build of torch, a driver or a GPU."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count())


def check_devices(asked: Sequence[tuple[str, str]], count: int | None = None) -> None:
    """Every ``(who, device)`` names a device this host has; ValueError naming the first that does not.

    ``who`` says which replica asks (``"stage 0 (thinker) replica 1"``);
    ``count``: the host's CUDA devices (default: :func:`cuda_device_count`,
    asked only when some replica wants CUDA).
    """
    wanted = [(who, dev, n) for who, dev in asked if (n := cuda_index(dev)) is not None]
    if not wanted:
        return
    have = cuda_device_count() if count is None else count
    for who, dev, n in wanted:
        if n >= have:
            seen = ("no CUDA device is available here (torch without CUDA, no driver, or no GPU)"
                    if have == 0 else f"this host has {have} CUDA device(s): cuda:0..cuda:{have - 1}")
            raise ValueError(f"{who}: device {dev} asked for, but {seen}; place it on a device that "
                             "exists, or on cpu")


def device_arg(value: str) -> str:
    """argparse type of a ``--device`` flag: cpu, cuda or cuda:N."""
    try:
        cuda_index(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value
