"""The chat route's input side, in process: the chat template, and image and audio parts decoded or refused.

What a served pipeline does with the media (encoder workers, the thinker's
answer) is tests/http/test_omni_serving.py; here, the rendering and every
refusal, each naming the part it refuses.
"""

from __future__ import annotations

import base64
import io
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from trio_orch.cli import main
from trio_orch.openai.chat import parse_chat_request
from trio_orch.openai.chat_template import DEFAULT_TEMPLATE, ChatInput, ChatTemplate
from trio_orch.openai.media import MediaPolicy, decode_audio, decode_image, wav_clip
from trio_orch.openai.protocol import ServedModels
from trio_orch.openai.validation import BadRequest

MODELS = ServedModels("m")
OMNI = ChatInput().for_kinds(["image-encoder", "audio-encoder", "thinker"])


def png(color: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def wav(freq: float, *, rate: int = 16000, seconds: float = 0.25, channels: int = 1, width: int = 2) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    x = np.sin(2 * np.pi * freq * t)
    if width == 1:
        raw = np.repeat(((x * 127) + 128).astype(np.uint8), channels).tobytes()
    else:
        raw = np.repeat((x * 32767).astype("<i2"), channels).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


def chat(*parts: dict[str, Any], text: str = "what is this?") -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]}


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def audio_part(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def path_of(folder: Path, template: str) -> Path:
    path = folder / "template.jinja"
    path.write_text(template)
    return path


def refusal(body: dict[str, Any], chat_input: ChatInput = OMNI) -> BadRequest:
    with pytest.raises(BadRequest) as err:
        parse_chat_request(body, MODELS, chat=chat_input)
    return err.value


# ------------------------------------------------------------------------------------------ templates
def test_the_default_template_gives_role_lines_ending_with_the_assistant_s_turn() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": None},
            {"role": "user", "content": "hi"}]
    assert ChatTemplate().render(msgs) == "system: Be brief.\nuser: hi\nassistant:"
    assert ChatTemplate().render(msgs, add_generation_prompt=False) == "system: Be brief.\nuser: hi\n"
    assert parse_chat_request({"messages": msgs}, MODELS).prompt == "system: Be brief.\nuser: hi\nassistant:"


def test_a_custom_template_builds_the_prompt_and_marks_media_where_it_puts_them(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("You are a test.\n{% for m in messages %}<{{ m.role }}>"
                    "{% for p in m.content %}{{ p.text if p.type == 'text' else '[' + p.type + ']' }}"
                    "{% endfor %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    chat_input = ChatInput(ChatTemplate.from_file(path), accepts=frozenset({"image"}))
    req = parse_chat_request(chat(image_part(data_url(png((255, 0, 0))))), MODELS, chat=chat_input)
    assert req.prompt == "You are a test.\n<user>what is this?[image]<assistant>"
    assert len(req.images) == 1 and req.payload()["text"] == req.prompt


def test_a_template_that_raises_refuses_the_messages_and_a_broken_file_is_named(tmp_path: Path) -> None:
    strict = ChatTemplate("{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}"
                          "{% endif %}{{ messages[0].content }}")
    err = refusal({"messages": [{"role": "user", "content": "hi"}]}, ChatInput(strict))
    assert err.param == "messages" and "system first" in str(err)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=r"bad\.jinja"):
        ChatTemplate.from_file(bad)
    with pytest.raises(ValueError, match="cannot read"):
        ChatTemplate.from_file(tmp_path / "missing.jinja")
    assert ChatTemplate(DEFAULT_TEMPLATE) == ChatTemplate()
    inline = ChatTemplate.from_arg("{{ messages[-1].content }}!")  # vLLM's flag: no such file, Jinja
    assert inline.render([{"role": "user", "content": "hi"}]) == "hi!"
    assert ChatTemplate.from_arg(str(path_of(tmp_path, "{{ 'file' }}"))).render([]) == "file"


# ------------------------------------------------------------------------------------------ images
def test_an_image_data_url_becomes_rgb_pixels_beside_the_prompt() -> None:
    req = parse_chat_request(chat(image_part(data_url(png((255, 0, 0))))), MODELS, chat=OMNI)
    assert req.prompt == "user: what is this?<image>\nassistant:"
    payload = req.payload()
    [img] = payload["images"]
    assert img.dtype == np.uint8 and img.shape == (64, 64, 3)
    assert (img[..., 0] == 255).all() and (img[..., 1:] == 0).all()


def test_a_large_image_is_shrunk_to_the_policy_s_longest_side() -> None:
    img = decode_image(data_url(png((0, 0, 255), (300, 100))), MediaPolicy(max_side=60), "p")
    assert img.shape == (20, 60, 3)


@pytest.mark.parametrize(("url", "says"), [
    (data_url(b"\x89PNG\r\n\x1a\nnot really"), "not a readable image"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:text/plain;base64,aGk=", "data URL must be"),
    ("https://example.com/cat.png", "remote image URLs are not fetched"),
    ("ftp://example.com/cat.png", "unsupported image URL scheme"),
    ("file:///etc/hostname", "local image files are not allowed"),
])
def test_a_bad_image_part_is_a_400_naming_it(url: str, says: str) -> None:
    err = refusal(chat({"type": "text", "text": " and "}, image_part(url)))
    assert err.status == 400 and err.param == "messages[0].content[2]" and says in str(err)


def test_image_size_limits_are_checked_before_decoding() -> None:
    with pytest.raises(BadRequest, match="over the limit of 100 bytes"):
        decode_image(data_url(png((1, 2, 3))), MediaPolicy(max_image_bytes=100), "p")
    with pytest.raises(BadRequest, match="64x64, over the limit of 1000 pixels"):
        decode_image(data_url(png((1, 2, 3))), MediaPolicy(max_image_pixels=1000), "p")
    err = refusal(chat(*[image_part(data_url(png((9, 9, 9))))] * 3),
                  ChatInput(media=MediaPolicy(max_parts=2), accepts=frozenset({"image"})))
    assert err.param == "messages[0].content[3]" and "more than 2" in str(err)


def test_local_files_only_inside_the_allowed_directory(tmp_path: Path) -> None:
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "red.png").write_bytes(png((255, 0, 0)))
    (tmp_path / "secret.png").write_bytes(png((0, 255, 0)))
    policy = MediaPolicy(allowed_local_media_path=inside)
    img = decode_image(f"file://{inside / 'red.png'}", policy, "p")
    assert img.shape == (64, 64, 3) and img[0, 0].tolist() == [255, 0, 0]
    for escape in (tmp_path / "secret.png", inside / ".." / "secret.png"):
        with pytest.raises(BadRequest, match="outside the allowed local media path"):
            decode_image(f"file://{escape}", policy, "p")
    with pytest.raises(BadRequest, match="cannot read"):
        decode_image(f"file://{inside / 'missing.png'}", policy, "p")
    with pytest.raises(ValueError, match="not a directory"):
        MediaPolicy(allowed_local_media_path=tmp_path / "nope")


def test_a_pipeline_without_an_encoder_refuses_the_medium_naming_the_part() -> None:
    text_only = ChatInput().for_kinds(["thinker", "talker", "code2wav"])
    err = refusal(chat(image_part(data_url(png((255, 0, 0))))), text_only)
    assert err.param == "messages[0].content[1]" and "no image input" in str(err)
    err = refusal(chat(audio_part(wav(440))), ChatInput().for_kinds(["image-encoder", "thinker"]))
    assert "no audio input" in str(err)
    assert refusal(chat({"type": "video_url"}), OMNI).param == "messages[0].content[1]"


# ------------------------------------------------------------------------------------------ audio
def test_wav_audio_becomes_mono_float_samples() -> None:
    req = parse_chat_request(chat(audio_part(wav(440, channels=2))), MODELS, chat=OMNI)
    assert req.prompt == "user: what is this?<audio>\nassistant:"
    [clip] = req.payload()["audios"]
    assert clip["sample_rate"] == 16000 and clip["pcm"].dtype == np.float32 and len(clip["pcm"]) == 4000
    assert 0.9 < np.abs(clip["pcm"]).max() <= 1.0
    eight = wav_clip(wav(440, width=1), MediaPolicy(), "p")
    assert np.allclose(eight.pcm, clip["pcm"], atol=0.02)


@pytest.mark.parametrize(("part", "says"), [
    ({"data": "aGk=", "format": "aac"}, "audio format 'aac' is not supported"),
    ({"data": "aGk=", "format": "mp3"}, "not a readable MP3"),
    ({"data": base64.b64encode(b"RIFF....WAVEjunk").decode(), "format": "wav"}, "not a readable PCM WAV"),
    ({"data": "", "format": "wav"}, "non-empty base64"),
    ("a string", "object"),
])
def test_a_bad_audio_part_is_a_400_naming_it(part: Any, says: str) -> None:
    err = refusal(chat({"type": "input_audio", "input_audio": part}))
    assert err.param is not None and err.param.startswith("messages[0].content[1]")
    assert says in str(err)


def test_audio_limits_in_bytes_and_seconds() -> None:
    with pytest.raises(BadRequest, match=r"1\.0 s long, over the limit of 0\.5 s"):
        wav_clip(wav(440, seconds=1.0), MediaPolicy(max_audio_seconds=0.5), "p")
    with pytest.raises(BadRequest, match="over the limit of 100 bytes"):
        decode_audio({"data": base64.b64encode(wav(440)).decode(), "format": "wav"},
                     MediaPolicy(max_audio_bytes=100), "p")


def test_a_chat_of_media_alone_says_something_and_an_empty_one_does_not() -> None:
    req = parse_chat_request({"messages": [{"role": "user", "content": [audio_part(wav(220))]}]}, MODELS,
                             chat=OMNI)
    assert req.prompt == "user: <audio>\nassistant:" and len(req.audios) == 1
    assert refusal({"messages": [{"role": "user", "content": [{"type": "text", "text": " "}]}]}).param == \
        "messages"


def test_serve_refuses_a_broken_template_or_media_folder_before_it_listens(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ messages[0].content ")
    for argv, says in ((["--chat-template", str(bad)], "bad.jinja: line 1"),
                       (["--chat-template", str(tmp_path / "none.jinja")], "cannot read chat template"),
                       (["--allowed-local-media-path", str(bad)], "is not a directory"),
                       (["--allowed-media-domains", "images.example.com", "http://cdn.example.com/"],
                        "--allowed-media-domains: allowed media domain 'http://cdn.example.com/'")):
        assert main(["serve", "--in-process", "--port", "0", *argv]) == 2
        captured = capsys.readouterr()
        assert says in captured.err and "starting" not in captured.out


def test_only_common_raster_formats_are_decoded() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, format="JPEG")
    assert decode_image(data_url(buf.getvalue(), "image/jpeg"), MediaPolicy(), "p").shape == (8, 8, 3)
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, format="PPM")  # Pillow reads it, this server does not
    with pytest.raises(BadRequest, match="not a readable image"):
        decode_image(data_url(buf.getvalue(), "image/x-portable-pixmap"), MediaPolicy(), "p")
