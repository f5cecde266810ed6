"""The worker's control table in-process: built-ins, a model's own methods, errors that name the call."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stages.base import EchoModel, StageModel
from stages.control import WorkerControl, rpc_method
from stages.registry import build_model
from stages.weights import state_of, tensor_bytes


class FakeWorker:
    """What the control methods read from a worker."""

    def __init__(self, model: StageModel) -> None:
        self.model = model
        self.active: dict[str, Any] = {}

    def health_info(self) -> dict[str, Any]:
        return {"ok": True}

    def stats_info(self) -> dict[str, Any]:
        return {"steps": 7}


class Tuned(EchoModel):
    @rpc_method("tune")
    def set_tune(self, level: int) -> int:
        return level * 2


class Clashing(EchoModel):
    @rpc_method()
    def stats(self) -> None: ...


def control(model: StageModel, tmp_path: Any = None) -> WorkerControl:
    return WorkerControl(FakeWorker(model), rebuild=lambda: model,
                         scratch_dir=str(tmp_path) if tmp_path else None)


def test_calls_answer_values_or_errors_that_name_the_method() -> None:
    ctl = control(Tuned())
    assert ctl.call("tune", [3], {}) == (6, None)
    assert ctl.call("stats", [], {})[0]["steps"] == 7
    value, error = ctl.call("tnue", [], {})
    assert value is None and error is not None and "unknown rpc method 'tnue'" in error and "tune" in error
    assert ctl.call("tune", [], {"nope": 1})[1].startswith("tune: TypeError:")  # type: ignore[union-attr]
    assert ctl.call("pause", [], {}) == ({"paused": True, "asleep": 0, "profiling": False}, None)
    assert not ctl.stepping
    ctl.call("resume", [], {})
    assert ctl.stepping and ctl.calls == 6


def test_a_model_method_named_like_a_builtin_is_refused() -> None:
    with pytest.raises(ValueError, match="'stats' clashes with a built-in"):
        control(Clashing())


def test_sleep_is_refused_while_a_request_runs_and_frees_every_module_tensor(tmp_path: Any) -> None:
    model = build_model("thinker", {"d_model": 32, "layers": 1, "heads": 2}, seed=1)
    ctl = control(model, tmp_path)
    ctl.worker.active["r"] = object()  # type: ignore[attr-defined]
    assert "running on this replica" in (ctl.call("sleep", [], {})[1] or "")
    ctl.worker.active.clear()  # type: ignore[attr-defined]
    before = {k: v.clone() for k, v in state_of(model).items()}
    size = tensor_bytes(model)
    value, error = ctl.call("sleep", [1], {})
    assert error is None and value["freed_bytes"] == size and tensor_bytes(model) == 0
    assert not ctl.stepping
    assert "asleep" in (ctl.call("reload_weights", ["/any.pt"], {})[1] or "")
    assert ctl.call("wake_up", [], {})[1] is None and ctl.stepping
    assert ctl.call("wake_up", [], {})[0]["restored_bytes"] == 0  # awake already: nothing to do
    assert all(torch.equal(before[k], v) for k, v in state_of(model).items())
    assert list(tmp_path.iterdir()) == []  # the level-1 copy is gone once awake


def test_level_two_rebuilds_from_the_constructor_then_the_last_file(tmp_path: Any) -> None:
    opts = {"d_model": 32, "layers": 1, "heads": 2}
    model = build_model("thinker", opts, seed=1)
    other = tmp_path / "other.pt"
    torch.save(state_of(build_model("thinker", opts, seed=9)), other)
    ctl = WorkerControl(FakeWorker(model), rebuild=lambda: build_model("thinker", opts, seed=1),
                        scratch_dir=str(tmp_path))

    def same_as(seed: int) -> bool:
        fresh = state_of(build_model("thinker", opts, seed=seed))
        return all(torch.equal(v, fresh[k]) for k, v in state_of(model).items())

    assert ctl.call("sleep", [2], {})[1] is None and tensor_bytes(model) == 0
    assert ctl.call("wake_up", [], {})[1] is None
    assert same_as(1)  # rebuilt from the constructor
    assert ctl.call("reload_weights", [str(other)], {})[1] is None and same_as(9)
    assert ctl.call("sleep", [2], {})[1] is None
    assert ctl.call("wake_up", [], {})[1] is None
    assert same_as(9)  # rebuilt, then the last file reloaded on top
