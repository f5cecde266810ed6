"""``trio-orch serve QWEN_OMNI_DIR``: a tiny random Qwen2.5-Omni served as thinker -> talker -> token2wav.

The real command, its three workers each loading one part of a checkpoint
built here, the official ``openai`` SDK (or plain HTTP where the SDK has no
field for it) as the client.  Greedy text is
``Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=False,
thinker_do_sample=False)`` decoded without special tokens; with a greedy
talker the waveform is ``generate()``'s (its codes, which no client sees, are
compared in tests/serve/test_serve_omni_codes.py); the same for one image and
one audio input.  Each worker
holds only its part (asked over the admin RPC), ``modalities: ["text"]``
never reaches the talker or token2wav, an unknown voice is a 400 listing the
checkpoint's, ``/v1/audio/speech`` speaks its input.  The server places each
stage with a stage config (``--stage-config``: every stage on CPU, by index,
name and kind, and one model option), and each worker reports the device and
``CUDA_VISIBLE_DEVICES`` it got; a stage config placing stage 0 on
``cuda:1`` (no GPU here), naming a stage the pipeline lacks or a key that is
no stage setting exits 2 before any worker starts.  In async-chunk mode (a
pipeline config), a realtime session gets text and audio turn after turn,
and ``kill -9`` of the talker's only worker after the first audio reached the
client ends that request with one terminal and its partial text; the talker
comes back and the next request is answered.  Every worker is gone after
each server.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from stages.lockdown import serving_pid
from tests.http_helpers import deltas, sse_events
from tests.serve_process import Server
from tests.waiting import HANG, wait_until
from trio_orch.testing import child_pids, processes_naming, worker_alive
from trio_orch.testing.omni_checkpoint import omni_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from PIL import Image  # noqa: E402

from stages.hf.omni.checkpoint import read_omni_config  # noqa: E402
from stages.hf.omni.parts import load_processor  # noqa: E402
from trio_orch.openai.media import MediaPolicy, decode_audio  # noqa: E402

pytestmark = pytest.mark.slow

MODEL, TOKEN = "omni", "admin-secret"
THINKER_MAX, TALKER_MAX = 8, 24
GREEDY_TALKER = {"stage_sampling": {"omni-talker": {"temperature": 0, "max_tokens": TALKER_MAX}}}


#: where each stage runs, as a user places a checkpoint's stages (by index, name and kind): CPU here;
#: token2wav's look-ahead changed (it only matters in async-chunk mode: seen in the worker's stats)
STAGE_CONFIG = """
[stages.0]
device = "cpu"

[stages.talker]
device = "cpu"

[stages.omni-token2wav]
device = ["cpu"]
[stages.omni-token2wav.model]
future_codes = 7
"""


@pytest.fixture(scope="module")
def served(tiny_omni: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    placed = tmp_path_factory.mktemp("omni-stages") / "stages.toml"
    placed.write_text(STAGE_CONFIG)
    s = Server(str(tiny_omni), "--served-model-name", MODEL, "--stage-config", str(placed),
               env={"TRIO_ORCH_ADMIN_TOKEN": TOKEN})
    try:
        yield s
    finally:
        s.stop()


def media_part(medium: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A chat part of ``medium`` and the processor's keyword for what the server decodes from it."""
    rng = np.random.default_rng(11)
    if medium == "text":
        return {"type": "text", "text": "hello there"}, {}
    if medium == "image":
        pixels = (rng.random((60, 80, 3)) * 255).astype(np.uint8)
        png = io.BytesIO()
        Image.fromarray(pixels).save(png, format="PNG")  # lossless: the server decodes these pixels
        url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        return {"type": "image_url", "image_url": {"url": url}}, {"images": [pixels]}
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((rng.standard_normal(16000) * 3000).astype("<i2").tobytes())
    part = {"data": base64.b64encode(wav.getvalue()).decode(), "format": "wav"}
    pcm = decode_audio(part, MediaPolicy(), "p").pcm
    return {"type": "input_audio", "input_audio": part}, {"audio": [pcm]}


def messages(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]


def reference(full: Any, ckpt: Path, medium: str, *,
              voice: str | None = None) -> tuple[str, np.ndarray | None]:
    """``generate()`` greedy on the chat-templated prompt: the reply decoded without special tokens, and
    (``voice`` given) the waveform as 16-bit PCM."""
    proc = load_processor(ckpt)
    part, media = media_part(medium)
    shown = {"text": part, "image": {"type": "image"}, "audio": {"type": "audio"}}[medium]
    text = proc.apply_chat_template(messages(shown), add_generation_prompt=True, tokenize=False)
    inputs = proc(text=text, return_tensors="pt", **media)
    n = inputs["input_ids"].shape[1]
    if voice is None:
        seq = full.generate(**inputs, return_audio=False, thinker_do_sample=False,
                            thinker_max_new_tokens=THINKER_MAX)
        return proc.batch_decode(seq[:, n:], skip_special_tokens=True)[0].rstrip("\ufffd"), None
    torch.manual_seed(0)
    seq, wav = full.generate(**inputs, speaker=voice, thinker_do_sample=False, talker_do_sample=False,
                             thinker_max_new_tokens=THINKER_MAX, talker_max_new_tokens=TALKER_MAX,
                             talker_eos_token_id=read_omni_config(ckpt).codec_stop)
    pcm = (np.clip(wav.reshape(-1).numpy(), -1, 1) * 32767).astype(np.int16)
    return proc.batch_decode(seq[:, n:], skip_special_tokens=True)[0].rstrip("\ufffd"), pcm


def wav_samples(data: str) -> np.ndarray:
    with wave.open(io.BytesIO(base64.b64decode(data))) as w:
        assert w.getframerate() == 24000
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def admin(served: Server, path: str, body: dict[str, Any] | None = None) -> Any:
    r = httpx.post(served.url + path, json=body or {}, headers={"Authorization": f"Bearer {TOKEN}"},
                   timeout=HANG)
    assert r.status_code == 200, r.text
    return r.json()["results"]


@pytest.mark.parametrize("medium", ["text", "image", "audio"])
def test_greedy_text_and_speech_are_generate_s(served: Server, full: Any, tiny_omni: Path,
                                               medium: str) -> None:
    part, _ = media_part(medium)
    text, _ = reference(full, tiny_omni, medium)
    spoken_text, pcm = reference(full, tiny_omni, medium, voice="Ethan")
    assert spoken_text == text and pcm is not None and np.abs(pcm).max() > 1000  # sound, not silence
    with served.sdk() as client:
        only = client.chat.completions.create(model=MODEL, messages=messages(part), temperature=0,
                                              max_tokens=THINKER_MAX)
        assert only.choices[0].message.content == text
        assert only.usage.completion_tokens == THINKER_MAX and only.choices[0].finish_reason == "length"
        spoken = client.chat.completions.create(
            model=MODEL, messages=messages(part), temperature=0, max_tokens=THINKER_MAX,
            modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"}, extra_body=GREEDY_TALKER)
    assert spoken.choices[0].message.content == text
    got = wav_samples(spoken.choices[0].message.audio.data)
    assert got.shape == pcm.shape
    assert np.abs(got.astype(np.int32) - pcm).max() <= 1  # float tolerance, seen through 16-bit rounding


def test_text_and_audio_stream_in_pieces_that_join_into_the_whole(served: Server) -> None:
    part, _ = media_part("text")
    talker = {"omni-talker": {"temperature": 0, "max_tokens": 80}}  # 158 mel frames: pieces of 50
    body = {"model": MODEL, "messages": messages(part), "temperature": 0, "max_tokens": THINKER_MAX,
            "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "pcm16"},
            "stage_sampling": talker}
    with httpx.Client(base_url=served.url, timeout=HANG * 3) as c:
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = sse_events(r.iter_lines())
        whole = c.post("/v1/chat/completions",
                       json={**body, "audio": {"voice": "Chelsie", "format": "wav"}}).json()
    ds = deltas(events)
    texts = [d["content"] for d in ds if d.get("content")]
    pieces = [base64.b64decode(d["audio"]["data"]) for d in ds if d.get("audio", {}).get("data")]
    assert events[-1] == "[DONE]" and len(texts) > 1 and len(pieces) == 4
    assert "".join(texts) == whole["choices"][0]["message"]["content"]
    assert np.array_equal(np.frombuffer(b"".join(pieces), "<i2"), wav_samples(whole["choices"][0]["message"]
                                                                              ["audio"]["data"]))


def test_each_worker_holds_only_its_part(served: Server, full: Any) -> None:
    reference_names = {n for n, _ in [*full.named_parameters(), *full.named_buffers()]}
    held = {r["stage_id"]: r["value"] for r in admin(served, "/admin/rpc", {"method": "weights"})}
    assert [held[k]["part"] for k in range(3)] == ["thinker", "talker", "token2wav"]
    for value in held.values():
        part = value["part"]
        assert set(value["names"]) == {n.removeprefix(f"{part}.") for n in reference_names
                                       if n.startswith(f"{part}.")}
        others = sum(p.numel() for n, p in full.named_parameters() if not n.startswith(f"{part}."))
        assert value["parameters"] == sum(p.numel() for p in full.parameters()) - others
    assert not any("code2wav" in n or "bigvgan" in n for n in held[0]["names"])  # no token2wav in the thinker


def test_each_stage_runs_where_its_stage_config_placed_it(served: Server) -> None:
    stats = {r["stage_id"]: r["value"] for r in admin(served, "/admin/stats")}
    assert [(stats[k]["device"], stats[k]["cuda_visible_devices"]) for k in range(3)] == [("cpu", "")] * 3
    assert [stats[k]["model"]["device"] for k in range(3)] == ["cpu"] * 3
    assert stats[2]["model"]["future_codes"] == 7  # a model option of the stage config's, over the default
    assert "on cpu" in served.lines[0]


@pytest.mark.parametrize(("text", "said"), [
    ('[stages.0]\ndevice = "cuda:1"\n',
     "stage 0 (thinker) replica 0: device cuda:1 asked for, but no CUDA device is available here"),
    ('[stages.vocoder]\ndevice = "cpu"\n', "[stages.vocoder]: the pipeline has no such stage (its stages: 0 "
     "thinker (omni-thinker), 1 talker (omni-talker), 2 token2wav (omni-token2wav)"),
    ("[stages.talker]\nmax_batchs = 4\n", "[stages.talker]: 'max_batchs' is not a stage setting"),
])
def test_a_stage_config_that_does_not_fit_exits_2_before_any_worker(tiny_omni: Path, tmp_path: Path,
                                                                     text: str, said: str) -> None:
    placed = tmp_path / "stages.toml"
    placed.write_text(text)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path)}  # no GPU, on any host
    proc = subprocess.run([sys.executable, "-m", "trio_orch.cli", "serve", str(tiny_omni), "--port", "0",
                           "--stage-config", str(placed)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=HANG)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: {said}" in proc.stderr or f"{placed}: {said}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "serving" not in proc.stdout
    assert not list(tmp_path.glob("trio-orch-*"))  # no worker's private directory: none was started
    assert not processes_naming(tmp_path)  # no process names the run's TMPDIR, as its workers' would


def test_text_only_runs_the_thinker_only(served: Server) -> None:
    def submits() -> list[int]:
        stats = sorted(admin(served, "/admin/stats"), key=lambda r: r["stage_id"])
        return [r["value"]["submits"] for r in stats]

    before = submits()
    with served.sdk() as client:
        for modalities in (None, ["text"]):
            extra = {"modalities": modalities} if modalities else {}
            r = client.chat.completions.create(model=MODEL, messages=messages(media_part("text")[0]),
                                               max_tokens=4, **extra)
            assert r.choices[0].message.content is not None and r.choices[0].message.audio is None
    after = submits()
    assert after[0] == before[0] + 2 and after[1:] == before[1:]


def test_an_unknown_voice_is_a_400_listing_the_checkpoint_s(served: Server) -> None:
    with served.sdk() as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages(media_part("text")[0]),
                                       modalities=["text", "audio"],
                                       audio={"voice": "alloy", "format": "wav"})
    assert info.value.body["param"] == "audio.voice"
    assert "must be one of Chelsie, Ethan, got 'alloy'" in info.value.body["message"]


def test_speech_speaks_its_input_through_the_three_stages(served: Server) -> None:
    with served.sdk() as client:
        a = client.audio.speech.create(model=MODEL, input="hello world", voice="Chelsie",
                                       response_format="wav", extra_body=GREEDY_TALKER)
        b = client.audio.speech.create(model=MODEL, input="hello world", voice="Ethan",
                                       response_format="wav", extra_body=GREEDY_TALKER)
    with wave.open(io.BytesIO(a.content)) as w:
        assert w.getframerate() == 24000
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert np.abs(pcm).max() > 1000 and a.content != b.content  # sound, and the voice reaches every part


# ---------------------------------------------------------------------------- async-chunk mode
@pytest.fixture(scope="module")
def chunked(tiny_omni: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The same checkpoint in async-chunk mode, from a pipeline config (the talker's default budget
    bounded: realtime has no per-stage parameters)."""
    config = tmp_path_factory.mktemp("omni-config") / "omni.toml"
    config.write_text(omni_config(tiny_omni, async_chunk=True, talker={"max_tokens": TALKER_MAX,
                                                                        "chunk_codes": 4}))
    s = Server("--config", str(config), "--served-model-name", MODEL, env={"TRIO_ORCH_ADMIN_TOKEN": TOKEN})
    try:
        yield s
    finally:
        s.stop()


def test_a_realtime_session_hears_text_and_audio_turn_after_turn(chunked: Server) -> None:
    """Each turn is the next input segment of one request: the thinker goes on from the conversation in
    its cache, the talker speaks each answer from the whole conversation's rows."""
    with openai.OpenAI(base_url=chunked.url + "/v1", api_key="unused", max_retries=0).realtime.connect(
            model=MODEL) as conn:
        assert conn.recv().type == "session.created"
        conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": "Ethan"}},
                                     "max_output_tokens": 6})
        assert conn.recv().type == "session.updated"
        for text in ("Hello", "How are you"):
            conn.conversation.item.create(item={"type": "message", "role": "user",
                                                "content": [{"type": "input_text", "text": text}]})
            conn.response.create()
            pcm, transcript = b"", ""
            while (e := conn.recv()).type != "response.done":
                assert e.type != "error", e
                if e.type == "response.output_audio.delta":
                    pcm += base64.b64decode(e.delta)
                elif e.type == "response.output_audio_transcript.delta":
                    transcript += e.delta
            assert e.response.status == "completed" and transcript
            samples = np.frombuffer(pcm, "<i2")
            assert len(samples) == (TALKER_MAX - 1) * 2 * 240 and np.abs(samples).max() > 1000


def stage_pid(server: Server, stage: int) -> int:
    for pid in server.workers:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--stage-id" in args and args[args.index(b"--stage-id") + 1] == str(stage).encode():
            return pid
    raise AssertionError(f"no worker of stage {stage}")


def test_a_killed_talker_ends_its_request_with_partial_text_then_comes_back(chunked: Server) -> None:
    server = chunked
    talker = stage_pid(server, 1)
    body = {"model": MODEL, "messages": messages(media_part("text")[0]), "temperature": 0,
            "max_tokens": THINKER_MAX, "stream": True, "modalities": ["text", "audio"],
            "audio": {"voice": "Chelsie", "format": "pcm16"},
            "stage_sampling": {"omni-talker": {"temperature": 0, "max_tokens": 4000}}}
    events: list[Any] = []
    with httpx.Client(base_url=server.url, timeout=HANG * 3) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                events += sse_events([line])
                if any(d.get("audio", {}).get("data") for d in deltas(events)):
                    os.kill(talker, signal.SIGKILL)  # the first audio is in: the talker is still talking
                    break
            events += sse_events(lines)
        ends = [e for e in events if isinstance(e, dict) and ("error" in e or (
            e.get("choices") and e["choices"][0]["finish_reason"]))]
        assert len(ends) == 1 and "error" in ends[0], ends  # one terminal: the failure
        assert "replica_died" in json.dumps(ends[0]) and events[-1] == "[DONE]"
        assert "".join(d.get("content") or "" for d in deltas(events))  # the text it had made
        wait_until(lambda: not worker_alive(talker), "the killed talker gone")
        wait_until(lambda: any(r["stage_id"] == 1 and (r["value"] or {}).get("pid") not in (None, talker)
                               for r in admin(server, "/admin/stats")), "a new talker", hang=HANG * 6)
        again = c.post("/v1/chat/completions", json={**body, "stream": False, "audio": {
            "voice": "Chelsie", "format": "wav"}, **GREEDY_TALKER})
    assert again.status_code == 200, again.text
    assert len(wav_samples(again.json()["choices"][0]["message"]["audio"]["data"])) > 0
    # the new talker too
    server.workers = {p for p in child_pids(serving_pid(server.proc.pid)) if worker_alive(p)}
    assert stage_pid(server, 1) != talker
