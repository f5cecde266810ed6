"""The text-to-image pipeline: request options, the CFG companion through worker processes, the CLI."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from PIL import Image

from stages.config import PipelineConfig, StageConfig, text2image_config
from trio_orch import OrchError, OrchOutput, open_orchestrator
from trio_orch.cli import main
from trio_orch.cluster.launcher import open_pipeline
from trio_orch.openai.images import ImageOptionError, ImageRequest, parse_size
from trio_orch.testing import LeakProbe

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("size, ok", [("256x256", (256, 256)), ("64x16", (64, 16)), ("512x512", (512, 512)),
                                      ("65x64", None), ("0x16", None), ("1024x1024", None), ("64", None),
                                      ("64X64", None), (64, None)])
def test_sizes(size: Any, ok: tuple[int, int] | None) -> None:
    if ok is not None:
        assert parse_size(size) == ok
    else:
        with pytest.raises(ImageOptionError) as err:
            parse_size(size)
        assert err.value.field == "size"


@pytest.mark.parametrize("kw, field", [
    ({"prompt": " "}, "prompt"), ({"steps": 0}, "num_inference_steps"),
    ({"steps": 2.5}, "num_inference_steps"),
    ({"guidance_scale": -1}, "guidance_scale"), ({"guidance_scale": float("inf")}, "guidance_scale"),
    ({"seed": -3}, "seed"), ({"negative": 7}, "negative_prompt"), ({"width": 100}, "size")])
def test_out_of_range_options_name_their_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ImageOptionError) as err:
        ImageRequest(**{"prompt": "a cat", **kw}).checked()
    assert err.value.field == field


def test_guidance_adds_a_negative_prompt_companion_and_scale_one_does_not() -> None:
    req = ImageRequest("a cat", "blurry", 64, 32, steps=3, guidance_scale=5, seed=9).checked()
    assert req.stage0_prompt() == {"text": "a cat", "width": 64, "height": 32, "steps": 3,
                                   "guidance_scale": 5.0, "seed": 9}
    assert req.companions("r1") == {"r1:negative": {"text": "blurry"}}
    assert ImageRequest("a cat").companions("r1") == {"r1:negative": {"text": ""}}  # the empty prompt
    assert ImageRequest("a cat", "blurry", guidance_scale=1).companions("r1") == {}


@pytest.mark.parametrize("argv, message", [
    (["--pipeline", "text2image", "x", "--size", "65x64"], "--size: width and height must be multiples"),
    (["--pipeline", "text2image", "x", "--async-chunk"], "--compare and --stream-input are for streaming"),
    (["--pipeline", "speech", "x", "--negative", "blurry"], "--negative is for image pipelines"),
    (["--pipeline", "text2image", "x", "--steps", "0"], "num_inference_steps must be an integer from 1"),
    (["--pipeline", "text2image", "--config", "x.toml", "x"], "give --config or --pipeline, not both"),
])
def test_generate_refuses_bad_image_options_before_starting_workers(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", *argv]) == 2
    assert message in capsys.readouterr().err


SMALL = [StageConfig("encoder", model={"d_model": 32, "layers": 1, "heads": 2}, replicas=2),
         StageConfig("diffusion", worker_args=["--step-delay-ms", "20"],
                     model={"d_model": 32, "layers": 1, "heads": 2, "cond_dim": 32, "vae_dim": 8})]


async def finish(orch: Any, rid: str) -> tuple[list[Any], OrchOutput | OrchError]:
    seen = []
    with trio.fail_after(60):
        while True:
            msg = await orch.next_output()
            assert msg.request_id == rid
            if msg.finished:
                return seen, msg
            seen.append(msg.data)


@pytest.mark.slow
@pytest.mark.processes
async def test_guided_requests_through_worker_processes() -> None:
    probe = LeakProbe()
    async with open_pipeline(PipelineConfig(SMALL, final_stage_ids=[1]).validate()) as pipe:
        probe.saw(pipe.pids)
        probe.saw_dir(pipe.tmpdir)
        async with open_orchestrator(pipe.stages, **pipe.orchestrator_kwargs()) as orch:
            await orch.add_request("busy", ImageRequest("x", steps=1, guidance_scale=1).stage0_prompt())
            await finish(orch, "busy")
            req = ImageRequest("a cat", "blurry", 48, 32, steps=4, guidance_scale=6)
            await orch.add_request("r1", req.stage0_prompt(), companions=req.companions("r1"))
            progress, msg = await finish(orch, "r1")
            assert [p["progress"]["step"] for p in progress] == [1, 2, 3]  # only the parent is seen
            assert isinstance(msg, OrchOutput) and msg.stage_id == 1
            assert msg.data["guided_by"] == "r1:negative" and msg.data["guidance_scale"] == 6.0
            assert Image.open(io.BytesIO(msg.data["png"])).size == (48, 32)
            encoder = pipe.stages[0]
            assert encoder.timings["r1"].replica == encoder.timings["r1:negative"].replica  # on its parent's
            # while one request denoises, another joins its forward passes (3 rows: the other is guided)
            await orch.add_request("a", ImageRequest("a dog", steps=100, guidance_scale=1).stage0_prompt())
            with trio.fail_after(60):
                while "progress" not in (await orch.next_output()).data:
                    pass
            b = ImageRequest("a bird", steps=4)
            await orch.add_request("b", b.stage0_prompt(), companions=b.companions("b"))
            with trio.fail_after(60):
                while not (m := await orch.next_output()).finished:
                    pass
            assert isinstance(m, OrchOutput) and m.request_id == "b"
            [stats] = [s for s in await pipe.stats() if s["stage_id"] == 1]
            assert stats["model"]["guided"] == 2 and stats["model"]["max_rows"] == 3
            await orch.abort("a")  # abort while denoising: the terminal, and the worker drops it
            _, msg = await finish(orch, "a")
            assert isinstance(msg, OrchError) and msg.kind == "aborted"
            [stats] = [s for s in await pipe.stats() if s["stage_id"] == 1]
            assert stats["active"] + stats["waiting"] == 0
    assert probe.leaks() == {"processes": 0, "fds": 0, "ipc_files": 0}


@pytest.mark.slow
@pytest.mark.processes
def test_trio_orch_generate_writes_the_png_and_says_guidance_used_the_companion(tmp_path: Path) -> None:
    out = tmp_path / "out" / "sq.png"
    out.parent.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the launcher's ipc sockets and logs go here
    proc = subprocess.run([sys.executable, "-m", "trio_orch.cli", "generate", "--pipeline", "text2image",
                           "a red square", "--negative", "blurry", "--size", "64x48", "--steps", "3",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    said = "guidance: scale 4.0 used the companion 'generate-1:negative' (negative prompt 'blurry')"
    assert said in proc.stdout
    assert "denoising [########################] 3/3" in proc.stderr
    with Image.open(out) as img:
        img.verify()
    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == (64, 48) and img.mode == "RGB"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no ipc socket or log left behind


def test_the_built_in_pipeline_is_encoder_then_diffusion() -> None:
    cfg = text2image_config()
    assert [s.kind for s in cfg.stages] == ["encoder", "diffusion"]
    assert cfg.outputs() == ["embedding", "image"]
    assert cfg.final_stage_ids == [1] and not cfg.hands_off(0)
