"""``trio-orch generate --image FILE --audio FILE``: refused before a worker starts, or encoded."""

from __future__ import annotations

import io
import tempfile
import wave
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trio_orch import cli

OMNI_TOML = """
[pipeline]
final_stages = [2]
seed = 5

[[stages]]
kind = "image-encoder"

[[stages]]
kind = "audio-encoder"

[[stages]]
kind = "thinker"
[stages.model]
d_model = 32
layers = 1
heads = 2
max_new_tokens = 12
min_new_tokens = 12
"""


def png(path: Path, rgb: tuple[int, int, int]) -> Path:
    Image.new("RGB", (64, 64), rgb).save(path)
    return path


def wav(path: Path, freq: float) -> Path:
    t = np.arange(8000) / 16000
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((0.5 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2").tobytes())
    path.write_bytes(buf.getvalue())
    return path


def test_media_for_a_pipeline_without_encoders_or_unreadable_is_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    red = png(tmp_path / "red.png", (255, 0, 0))
    assert cli.main(["generate", "hi", "--image", str(red)]) == 2  # the speech pipeline: no image encoder
    assert "no image-encoder stage" in capsys.readouterr().err
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"not a wav")
    cfg = tmp_path / "omni.toml"
    cfg.write_text(OMNI_TOML)
    assert cli.main(["generate", "hi", "--config", str(cfg), "--audio", str(junk)]) == 2
    assert "not a readable PCM WAV" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--config", str(cfg), "--image", str(tmp_path / "none.png")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.processes
def test_generate_sends_an_image_and_a_sound_to_the_encoders_and_the_answer_depends_on_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "omni.toml"
    cfg.write_text(OMNI_TOML)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    tone = wav(tmp_path / "tone.wav", 440)
    answers = []
    for rgb in ((255, 0, 0), (0, 0, 255)):
        image = png(tmp_path / f"{rgb}.png", rgb)
        rc = cli.main(["generate", "What is this?", "--config", str(cfg), "--seed", "3",
                       "--image", str(image), "--audio", str(tone), "--out", str(tmp_path / "x.wav")])
        assert rc == 0
        out = capsys.readouterr().out
        assert "--async-chunk" not in out  # no hint at a mode an encoder pipeline refuses
        [line] = [ln for ln in out.splitlines() if ln.startswith("text: ")]
        answers.append(line.removeprefix("text: "))
    assert all(answers) and answers[0] != answers[1]


def test_audio_files_are_read_by_their_suffix_flac_ogg_and_mp3_too(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    import soundfile

    from stages.config import builtin_config
    from trio_orch.cli.generate import read_media

    tone = wav(tmp_path / "tone.wav", 440)
    samples, rate = soundfile.read(tone, dtype="int16")
    soundfile.write(tmp_path / "tone.flac", samples, rate, subtype="PCM_16")
    soundfile.write(tmp_path / "tone.ogg", samples, rate, subtype="VORBIS")
    files = [str(tmp_path / n) for n in ("tone.wav", "tone.flac", "tone.ogg")]
    media = read_media(argparse.Namespace(image_files=[], audio_files=files), builtin_config("omni-in"))
    from_wav, from_flac, from_ogg = media["audios"]
    assert from_flac["sample_rate"] == from_ogg["sample_rate"] == 16000
    np.testing.assert_array_equal(from_flac["pcm"], from_wav["pcm"])  # lossless: the very samples
    assert len(from_ogg["pcm"]) == len(from_wav["pcm"])
    cfg = tmp_path / "omni.toml"
    cfg.write_text(OMNI_TOML)
    (tmp_path / "tone.aac").write_bytes(b"\0" * 64)
    (tmp_path / "junk.flac").write_bytes(b"fLaC" + b"\0" * 64)
    for name, says in (("tone.aac", "the suffix names none of wav, flac, ogg, mp3"),
                       ("junk.flac", "not a readable FLAC")):
        assert cli.main(["generate", "hi", "--config", str(cfg), "--audio", str(tmp_path / name)]) == 2
        assert says in capsys.readouterr().err
