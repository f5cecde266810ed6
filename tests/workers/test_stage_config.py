"""A stage config (``--stage-config FILE``): per-stage settings laid over a pipeline built elsewhere.

The overlay is applied as the commands apply it (``pipeline_config`` over
their parsed flags); the launch is inspected as the launcher computes it
(``worker_argv``, ``worker_env``), so placing the stages of a Qwen2.5-Omni
checkpoint on GPUs is checked on a host without one.  The real commands --
exit 2 before any worker, and serving with the overlay -- are
tests/serve/test_serve_omni.py's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stages.config import PipelineConfig, builtin_config
from stages.overlay import apply_overlay
from stages.placement import VISIBLE, check_devices
from trio_orch.cluster.launcher import worker_argv, worker_env
from trio_orch.serve.checkpoint import pipeline_config, resolve_model
from trio_orch.serve.command import configure


def serve_args(*argv: str) -> argparse.Namespace:
    """``trio-orch serve``'s flags, parsed and resolved as the command does."""
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(list(argv))
    resolve_model(args)
    return args


def overlay_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "stages.toml"
    path.write_text(text)
    return str(path)


def launch(cfg: PipelineConfig, k: int) -> tuple[str, str]:
    """Stage ``k``'s first worker as launched: the device it is told, the GPUs it may see."""
    argv = worker_argv(cfg, k, 0, cfg.stages[k], "ipc:///nowhere", "/tmp/nowhere")
    return argv[argv.index("--device") + 1], worker_env(cfg, k, 0)[VISIBLE]


def test_stages_are_named_by_index_name_or_kind_and_only_their_settings_change(tmp_path: Path) -> None:
    path = overlay_file(tmp_path, """
[pipeline]
heartbeat_timeout = 12.5

[stages.0]
max_batch = 4

[stages.talker]
replicas = 2
device = ["cpu", "cuda:1"]

[stages.code2wav.model]
chunk_frames = 7
""")
    cfg = pipeline_config(serve_args("--pipeline", "speech", "--stage-config", path))
    base = builtin_config("speech")
    assert [s.max_batch for s in cfg.stages] == [4, 32, 32]
    assert [s.replicas for s in cfg.stages] == [1, 2, 1]
    assert cfg.devices()[1:3] == [("stage 1 (talker) replica 0", "cpu"),
                                  ("stage 1 (talker) replica 1", "cuda:1")]
    assert cfg.stages[2].model == {**base.stages[2].model, "chunk_frames": 7}  # merged over the pipeline's
    assert cfg.heartbeat_timeout == 12.5 and cfg.kinds() == base.kinds()
    assert base.stages[1].replicas == 1 and base.heartbeat_timeout == 5.0  # the pipeline it came from: kept


def test_the_command_lines_device_and_replicas_still_win(tmp_path: Path) -> None:
    path = overlay_file(tmp_path, '[stages.thinker]\ndevice = "cuda:1"\nreplicas = 3\n')
    cfg = pipeline_config(serve_args("--stage-config", path, "--device", "cpu", "--replicas", "2"))
    assert cfg.where() == "cpu" and [s.replicas for s in cfg.stages] == [2, 2, 2]


BAD: dict[str, tuple[str, str]] = {
    "a stage it lacks": ('[stages.vocoder]\ndevice = "cpu"\n',
                         "[stages.vocoder]: the pipeline has no such stage (its stages: 0 thinker (thinker), "
                         "1 talker (talker), 2 code2wav (code2wav); name one by its index, name or kind)"),
    "an index past the last": ('[stages.3]\ndevice = "cpu"\n',
                               "[stages.3]: the pipeline has 3 stage(s), 0..2"),
    "no stage setting": ("[stages.talker]\nmax_batchs = 4\n",
                         "[stages.talker]: 'max_batchs' is not a stage setting (settings: replicas, model, "),
    "the stage's kind": ('[stages.talker]\nkind = "thinker"\n',
                         "[stages.talker]: 'kind' is not set by a stage config: it says which stages"),
    "the pipeline's outputs": ("[pipeline]\nfinal_stages = [0]\n",
                               "[pipeline]: 'final_stages' is not set by a stage config"),
    "no pipeline setting": ('[pipeline]\ndevise = "cpu"\n', "did you mean 'device'?"),
    "a bad device": ('[stages.1]\ndevice = "gpu"\n', "[stages.1] device: expected `str` matching regex"),
    "out of range": ("[stages.talker]\nmax_batch = 0\n", "[stages.talker] max_batch: expected `int` >= 1"),
    "a model option it lacks": ("[stages.code2wav.model]\nwidth = 3\n",
                                "stage 2: unknown model option 'width' for code2wav"),
    "one stage twice": ('[stages.1]\nreplicas = 2\n[stages.talker]\ndevice = "cpu"\n',
                        "[stages.1] and [stages.talker] are both stage 1 (talker): give its settings once"),
    "a pipeline config": ('[[stages]]\nkind = "echo"\n', "[[stages]] is a pipeline config's list of stages"),
    "not TOML": ("[stages.talker\n", "is not valid TOML"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_what_does_not_fit_is_refused_naming_the_file_the_table_and_the_key(tmp_path: Path,
                                                                            case: str) -> None:
    text, message = BAD[case]
    path = overlay_file(tmp_path, text)
    with pytest.raises(ValueError) as info:
        pipeline_config(serve_args("--stage-config", path))
    assert message in str(info.value) and path in str(info.value), str(info.value)


def test_a_kind_two_stages_share_is_named_by_index() -> None:
    cfg = builtin_config("speech-pd")
    with pytest.raises(ValueError, match=r"\[stages.thinker\]: stages 0, 1 are all 'thinker': name one by "
                                         r"its index \(\[stages.0\]\)"):
        apply_overlay(cfg, {"stages": {"thinker": {"max_batch": 4}}})
    assert apply_overlay(cfg, {"stages": {"thinker decode": {"replicas": 3}}}).stages[1].replicas == 3


# ------------------------------------------------------------------ a checkpoint's pipeline
@pytest.mark.slow
def test_each_stage_of_an_omni_checkpoint_is_launched_on_its_own_device(
        tiny_omni: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VISIBLE, raising=False)
    path = overlay_file(tmp_path, """
[stages.thinker]
device = "cuda:0"

[stages.omni-talker]
device = "cuda:1"

[stages.2]
device = "cpu"

[stages.2.model]
chunk_frames = 25
""")
    cfg = pipeline_config(serve_args(str(tiny_omni), "--stage-config", path))
    assert [s.kind for s in cfg.stages] == ["omni-thinker", "omni-talker", "omni-token2wav"]
    assert [launch(cfg, k) for k in range(3)] == [("cuda:0", "0"), ("cuda:0", "1"), ("cpu", "")]
    assert cfg.stages[2].model == {"checkpoint": str(tiny_omni), "chunk_frames": 25}
    assert cfg.heartbeat_timeout == 30.0  # the checkpoint pipeline's own settings are kept
    with pytest.raises(ValueError, match=r"^stage 1 \(talker\) replica 0: device cuda:1 asked for, but this "
                                         r"host has 1 CUDA device\(s\)"):
        check_devices(cfg.devices(), count=1)
    check_devices(cfg.devices(), count=2)
