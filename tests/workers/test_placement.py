"""Placement without a GPU: which device each replica asks for, what its launch gives it, what is refused.

The launch is inspected as the launcher computes it (``worker_argv`` and
``worker_env``): a replica placed on ``cuda:1`` is started with
``CUDA_VISIBLE_DEVICES=1`` and told ``--device cuda:0``.  The device count is
passed in where a test needs a host with GPUs; the real count on this host
(CPU torch) is 0.
"""

from __future__ import annotations

import argparse

import pytest

from stages.config import PipelineConfig, StageConfig, echo_config, from_dict
from stages.placement import VISIBLE, check_devices, cuda_index, device_arg, head_devices, place
from trio_orch.cluster.launcher import worker_argv, worker_env


def two_stages(**pipeline: object) -> PipelineConfig:
    """The issue's example: stage 0 on cuda:1, stage 1 on CPU."""
    return from_dict({"pipeline": {"final_stages": [1], **pipeline},
                      "stages": [{"kind": "echo", "device": "cuda:1"}, {"kind": "echo", "device": "cpu"}]})


def argv_device(cfg: PipelineConfig, k: int, r: int) -> str:
    argv = worker_argv(cfg, k, r, cfg.stages[k], "ipc:///nowhere", "/tmp/nowhere")
    return argv[argv.index("--device") + 1]


def test_a_replica_on_cuda_1_is_started_seeing_gpu_1_as_cuda_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VISIBLE, raising=False)
    cfg = two_stages()
    assert worker_env(cfg, 0, 0)[VISIBLE] == "1"
    assert argv_device(cfg, 0, 0) == "cuda:0"
    assert worker_env(cfg, 1, 0)[VISIBLE] == ""  # a CPU replica sees no GPU
    assert argv_device(cfg, 1, 0) == "cpu"


def test_the_launch_env_keeps_the_head_environment_but_its_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIO_ORCH_PLACEMENT_PROBE", "kept")
    monkeypatch.setenv("SOME_API_KEY", "hidden")
    env = worker_env(two_stages(), 0, 0)
    assert env["TRIO_ORCH_PLACEMENT_PROBE"] == "kept" and "SOME_API_KEY" not in env


def test_the_heads_own_visible_devices_are_numbered_as_its_torch_numbers_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VISIBLE, "5,GPU-8f2a,7")
    cfg = from_dict({"stages": [{"kind": "echo", "replicas": 3, "device": ["cuda:1", "cuda", "cuda:2"]}]})
    assert [worker_env(cfg, 0, r)[VISIBLE] for r in range(3)] == ["GPU-8f2a", "5", "7"]
    assert {argv_device(cfg, 0, r) for r in range(3)} == {"cuda:0"}
    monkeypatch.setenv(VISIBLE, "3")
    with pytest.raises(ValueError, match=r"device cuda:1: the head sees 1 CUDA device\(s\) "
                                         r"\(CUDA_VISIBLE_DEVICES=3\)"):
        place("cuda:1")


@pytest.mark.parametrize(("raw", "seen"), [("0,1", ["0", "1"]), ("", []), ("-1", []), ("2,,3", ["2"]),
                                           (" 1 , 0 ", ["1", "0"])])
def test_the_heads_variable_is_read_as_cuda_reads_it(raw: str, seen: list[str]) -> None:
    assert head_devices({VISIBLE: raw}) == seen
    assert head_devices({}) is None


def test_per_stage_and_per_replica_devices_default_to_the_pipelines() -> None:
    cfg = from_dict({"pipeline": {"device": "cuda", "final_stages": [2]},
                     "stages": [{"kind": "echo"}, {"kind": "echo", "device": "cpu"},
                                {"kind": "echo", "replicas": 2, "device": ["cuda:1", "cpu"]}]})
    assert cfg.devices() == [("stage 0 (echo) replica 0", "cuda"), ("stage 1 (echo) replica 0", "cpu"),
                             ("stage 2 (echo) replica 0", "cuda:1"), ("stage 2 (echo) replica 1", "cpu")]
    assert [cfg.stage_device(k) for k in range(3)] == ["cuda", "cpu", "cuda"]  # a list: no one device
    assert cfg.where() == "stage 0 on cuda, stage 1 on cpu, stage 2 on cpu/cuda:1"
    assert cfg.with_overrides(device="cpu").where() == "cpu"


def test_the_command_lines_device_places_every_stage() -> None:
    cfg = two_stages().with_overrides(device="cpu")
    assert {d for _, d in cfg.devices()} == {"cpu"}
    assert cfg.with_overrides(device="cuda:2").devices()[1] == ("stage 1 (echo) replica 0", "cuda:2")


def test_a_device_list_has_one_entry_per_replica() -> None:
    with pytest.raises(ValueError, match=r"stage 0 \(echo\): device lists 2 devices, one per replica, "
                                         r"but it has 3 replica\(s\)"):
        from_dict({"stages": [{"kind": "echo", "replicas": 3, "device": ["cpu", "cuda:0"]}]})
    cfg = from_dict({"stages": [{"kind": "echo", "replicas": 2, "device": ["cpu", "cuda:0"]}]})
    with pytest.raises(ValueError, match="device lists 2 devices"):
        cfg.with_overrides(replicas=3)  # --replicas: the list no longer fits


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "CUDA:0", "mps"])
def test_a_device_that_is_no_device_is_refused_naming_the_key(bad: str) -> None:
    with pytest.raises(ValueError, match=r"stages\[0\]\.device"):
        from_dict({"stages": [{"kind": "echo", "device": bad}]})
    with pytest.raises(ValueError, match=r"stages\[0\]\.device\[1\]"):
        from_dict({"stages": [{"kind": "echo", "replicas": 2, "device": ["cpu", bad]}]})
    with pytest.raises(argparse.ArgumentTypeError, match="expected cpu, cuda or cuda:N"):
        device_arg(bad)


def test_a_config_written_back_reads_the_same_placement() -> None:
    from stages.config import to_dict

    cfg = from_dict({"stages": [{"kind": "echo", "replicas": 2, "device": ["cuda:1", "cpu"]},
                                {"kind": "echo"}]})
    assert from_dict(to_dict(cfg)).devices() == cfg.devices()


def test_a_missing_cuda_device_is_refused_naming_the_replica_and_the_device() -> None:
    cfg = two_stages()
    with pytest.raises(ValueError, match=r"^stage 0 \(echo\) replica 0: device cuda:1 asked for, but no CUDA "
                                         r"device is available here"):
        check_devices(cfg.devices(), count=0)
    with pytest.raises(ValueError, match=r"stage 0 \(echo\) replica 0: device cuda:1 asked for, but this "
                                         r"host has 1 CUDA device\(s\): cuda:0\.\.cuda:0"):
        check_devices(cfg.devices(), count=1)
    check_devices(cfg.devices(), count=2)  # two GPUs: it fits


def test_a_cpu_pipeline_never_counts_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_count() -> int:
        raise AssertionError("counted GPUs for a CPU pipeline")

    monkeypatch.setattr("stages.placement.cuda_device_count", no_count)
    check_devices(echo_config(2).devices())
    with pytest.raises(AssertionError, match="counted"):
        check_devices(echo_config(1, device="cuda").devices())


def test_cuda_alone_is_the_first_device() -> None:
    assert [cuda_index(d) for d in ("cpu", "cuda", "cuda:0", "cuda:3")] == [None, 0, 0, 3]
    assert StageConfig("echo").device is None
