"""A stage model's tensors: its weights as a state dict, reloading them from a file, sleeping.

A model's *modules* are its attributes that are ``torch.nn.Module`` (the
thinker's ``emb``, ``dec``, ``head``); its *weights* are their state dicts
under the attribute's name (``"dec.qkv.0.weight"``), the form
``torch.save(state_of(model), path)`` writes and :func:`load_checked` reads
back.  Everything else a model holds (a sampler's generator, small constant
tensors) is left alone.

Sleeping frees every tensor of the modules -- weights and buffers, the KV
caches included -- by swapping each tensor's storage for an empty one in
place (the modules keep their structure, nothing else needs to know);
waking puts the saved storage back.  Level 1 keeps a copy off the device (in
host memory for a CUDA model, in a file for a CPU model, so the worker's
resident memory really drops); level 2 keeps nothing and rebuilds the tensors
on wake from where they came from (the constructor with the worker's seed,
then the last weights file reloaded, if any).  Needs torch: imported only by
workers whose model uses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["Sleeper", "apply_state", "load_checked", "modules_of", "state_of", "tensor_bytes"]


def modules_of(model: Any) -> dict[str, nn.Module]:
    """The model's attributes that are torch modules, by attribute name (sorted)."""
    return {name: m for name, m in sorted(vars(model).items()) if isinstance(m, nn.Module)}


def state_of(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights: every module's state dict under its attribute name."""
    return {f"{name}.{k}": v for name, m in modules_of(model).items() for k, v in m.state_dict().items()}


def _tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (persistent or not) of the model's modules, each once."""
    seen: set[int] = set()
    for name, m in modules_of(model).items():
        for k, t in (*m.named_parameters(), *m.named_buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                yield f"{name}.{k}", t


def tensor_bytes(model: Any) -> int:
    """Bytes held by the model's modules (weights and buffers)."""
    return sum(t.numel() * t.element_size() for _, t in _tensors(model))


def load_checked(path: str, model: Any) -> dict[str, torch.Tensor]:
    """Read a ``torch.save``'d state dict and check it fits ``model``; raises ValueError saying why.

    Every key the model has must be there, with the same shape, and nothing
    else; a floating tensor may come in another floating dtype (it is cast).
    Nothing of the model is touched.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"no weights file at {path!r}") from None
    except Exception as exc:
        raise ValueError(f"cannot read weights from {path!r}: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"{path!r} is not a state dict (a mapping of names to tensors)")
    want = state_of(model)
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    bad = [f"{k}: {tuple(state[k].shape)} instead of {tuple(v.shape)}"
           for k, v in want.items() if k in state and state[k].shape != v.shape]
    bad += [f"{k}: dtype {state[k].dtype} instead of {v.dtype}" for k, v in want.items()
            if k in state and state[k].dtype != v.dtype
            and not (state[k].is_floating_point() and v.is_floating_point())]
    if missing or extra or bad:
        why = [f"missing {_few(missing)}" if missing else "", f"unexpected {_few(extra)}" if extra else "",
               f"wrong {_few(bad)}" if bad else ""]
        raise ValueError(f"{path!r} does not fit this {type(model).__name__} model: "
                         + "; ".join(w for w in why if w))
    return dict(state)


def _few(items: list[str]) -> str:
    return ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")


@torch.no_grad()
def apply_state(model: Any, state: Mapping[str, torch.Tensor]) -> int:
    """Copy a checked state dict (:func:`load_checked`) into the model's weights; bytes copied."""
    n = 0
    for k, t in state_of(model).items():
        t.copy_(state[k])
        n += t.numel() * t.element_size()
    return n


def _trim_heap() -> None:
    """Give freed heap pages back to the system (glibc keeps small freed blocks otherwise)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class Sleeper:
    """Frees a model's tensors and restores them (see the module docstring).

    ``rebuild()`` makes a fresh model the same way the worker did (level 2's
    source); ``scratch_dir`` is where a CPU model's level-1 copy goes.
    """

    def __init__(self, model: Any, rebuild: Callable[[], Any], scratch_dir: str) -> None:
        self.model = model
        self.rebuild = rebuild
        self.scratch_dir = scratch_dir
        self.level = 0  # 0: awake
        self.weights_file: str | None = None  # the last weights file reloaded (level 2 reloads it)
        self._shapes: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}
        self._host: dict[str, torch.Tensor] | None = None
        self._file: str | None = None

    @property
    def asleep(self) -> bool:
        return self.level > 0

    def sleep(self, level: int) -> int:
        """Free every tensor of the model's modules; return the bytes freed (0: already asleep)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (keep a copy off the device) or 2 (discard), "
                             f"got {level!r}")
        if self.asleep:
            return 0
        tensors = dict(_tensors(self.model))
        self._shapes = {k: (t.shape, t.dtype, t.device) for k, t in tensors.items()}
        freed = sum(t.numel() * t.element_size() for t in tensors.values())
        if level == 1:
            if any(t.device.type != "cpu" for t in tensors.values()):
                self._host = {k: t.detach().to("cpu") for k, t in tensors.items()}
            else:
                os.makedirs(self.scratch_dir, exist_ok=True)
                self._file = os.path.join(self.scratch_dir, f"sleep-{os.getpid()}.pt")
                torch.save({k: t.detach() for k, t in tensors.items()}, self._file)
        for t in tensors.values():
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        del tensors
        self.level = level
        self._release_memory()
        return freed

    def wake_up(self) -> int:
        """Put the tensors back (level 1: the copy; level 2: rebuilt); the bytes restored (0: awake)."""
        if not self.asleep:
            return 0
        if self._host is not None:
            saved = self._host
        elif self._file is not None:
            saved = torch.load(self._file, map_location="cpu", weights_only=True)
        else:
            fresh = self.rebuild()
            saved = dict(_tensors(fresh))
            if self.weights_file is not None:
                state = load_checked(self.weights_file, fresh)
                apply_state(fresh, state)
        n = 0
        for k, t in _tensors(self.model):
            shape, dtype, device = self._shapes[k]
            src = saved[k]
            t.data = src.detach().to(device=device, dtype=dtype).reshape(shape)
            n += t.numel() * t.element_size()
        self.close()
        self.level = 0
        return n

    def close(self) -> None:
        """Forget the copy (and delete its file)."""
        self._host = None
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._file)
            self._file = None

    def _release_memory(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        _trim_heap()
