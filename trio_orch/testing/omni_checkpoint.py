"""A tiny Qwen2.5-Omni checkpoint with random weights, built on the spot (nothing is downloaded).

:func:`tiny_qwen_omni` writes the directory a Qwen2.5-Omni model ships in, at a
size that builds in about a second and runs ``generate()`` on a CPU in well
under one:

- ``config.json``: a ``Qwen2_5OmniConfig`` -- a thinker of 2 layers of width 64
  with a 2-layer vision encoder and a 2-layer audio encoder, a 2-layer talker
  of width 32, a 4-layer DiT and a small BigVGAN (the real upsampling rates:
  240 samples per mel frame at 24 kHz); every special id points into this
  checkpoint's own vocabularies (its codec end and pad codes are NOT the ids
  ``generate()`` hard-codes, so code that reads them from the config is tested);
- ``model.safetensors`` (the ``thinker.``, ``talker.`` and ``token2wav.``
  prefixes of the real one; BigVGAN's convolutions drawn wider than the
  library draws them, so the waveform is loud enough to be heard and
  compared), ``generation_config.json``;
- a byte-level BPE tokenizer of a few hundred tokens trained here, with the
  Omni special tokens (``<|IMAGE|>``, ``<|AUDIO|>``, ``<|vision_bos|>``, ...)
  and the attributes its processor reads (``tokenizer.json``,
  ``tokenizer_config.json``);
- ``chat_template.jinja``: the shape of the real one (a default system turn,
  image and audio parts become their placeholders);
- ``preprocessor_config.json``: the image processor's and the Whisper feature
  extractor's settings in one file, as the real checkpoint has them (audio
  padded to 5 s here, 300 s there);
- ``spk_dict.pt``: two speakers, each a start token, a conditioning vector and
  a reference mel.

Needs ``transformers`` (the ``hf`` extra), imported when a checkpoint is
built.  ``python -m trio_orch.testing.omni_checkpoint DIR`` builds one from
the command line (``docs/performance.md`` measures on it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["OMNI_SPEAKERS", "OMNI_TEMPLATE", "omni_config", "tiny_qwen_omni"]

#: the speakers of the tiny checkpoint, as the real one names its two
OMNI_SPEAKERS = ("Chelsie", "Ethan")

#: the shape of Qwen2.5-Omni's chat template: a default system turn, a placeholder per image or audio part
OMNI_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
             "<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>")
#: the processor's names for its special tokens (``tokenizer_config.json`` carries them)
_NAMED = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
          "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
          "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
_CORPUS = (
    "the quick brown fox jumps over the lazy dog. hello, how are you today? i am fine, thank you. "
    "system user assistant: you are a helpful assistant. what is in this image? describe the sound. "
    "a thinker reads text, images and audio; a talker speaks; a vocoder turns codes into a waveform. "
    "café naïve über 東京 こんにちは 🙂 one two three four five six seven eight nine ten. "
)
_TEXT_VOCAB = 384  # the thinker's embedding rows: the tokenizer's 320, then ids only the talker's inputs use
_CODEC = {"tts_codec_pad_token_id": 300, "tts_codec_start_token_id": 301, "tts_codec_end_token_id": 302,
          "tts_codec_mask_token_id": 303}
_TTS_TEXT = {"tts_text_pad_token_id": 379, "tts_text_start_token_id": 380, "tts_text_end_token_id": 381}
_SPEAKER_BOS = (382, 383)  # thinker ids whose embedding starts each speaker's reply


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 8, trainer)
    hf = Qwen2TokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            extra_special_tokens=dict(_NAMED))
    hf.chat_template = OMNI_TEMPLATE
    return hf


def _config(ids: dict[str, int]) -> Any:
    from transformers import Qwen2_5OmniConfig

    media = {"image_token_index": ids["<|IMAGE|>"], "audio_token_index": ids["<|AUDIO|>"],
             "video_token_index": ids["<|VIDEO|>"], "vision_start_token_id": ids["<|vision_bos|>"],
             "audio_start_token_id": ids["<|audio_bos|>"], "audio_end_token_id": ids["<|audio_eos|>"]}
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}  # head_dim 16
    thinker = {
        "text_config": {"vocab_size": _TEXT_VOCAB, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "max_position_embeddings": 2048, "rope_parameters": rope,
                        "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]},
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "out_hidden_size": 64, "fullatt_block_indexes": [1]},
        "audio_config": {"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2,
                         "encoder_ffn_dim": 64, "d_model": 32, "output_dim": 64},
        "user_token_id": ids["<|im_start|>"],
        **media,  # the rope index reads vision_start_token_id, which the thinker's config class lacks
    }
    talker = {"vocab_size": 304, **_CODEC, **_TTS_TEXT, "embedding_size": 64, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 4096,
              "rope_parameters": rope, "vision_end_token_id": ids["<|vision_eos|>"], **media}
    dit = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2, "head_dim": 16, "ff_mult": 2,
           "emb_dim": 16, "mel_dim": 80, "block_size": 8, "look_ahead_layers": [1],
           "look_backward_layers": [0, 2], "repeats": 2, "num_embeds": 304, "enc_emb_dim": 16, "enc_dim": 16,
           "enc_channels": [16, 16, 16, 16, 48], "enc_kernel_sizes": [5, 3, 3, 3, 1],
           "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": 8, "enc_res2net_scale": 2,
           "enc_se_channels": 8, "max_position_embeddings": 8192}
    bigvgan = {"mel_dim": 80, "upsample_initial_channel": 64, "resblock_kernel_sizes": [3],
               "resblock_dilation_sizes": [[1, 3, 5]]}
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                             token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan})


def _preprocessor() -> dict[str, Any]:
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    image = Qwen2VLImageProcessorPil().to_dict()
    audio = WhisperFeatureExtractor(feature_size=128, chunk_length=5, return_attention_mask=True).to_dict()
    audio.pop("mel_filters", None)  # derived from the settings when loaded
    return {**image, **audio, "image_processor_type": "Qwen2VLImageProcessor",
            "feature_extractor_type": "WhisperFeatureExtractor", "processor_class": "Qwen2_5OmniProcessor"}


def _audible(vocoder: Any, seed: int) -> None:
    """Redraw BigVGAN's convolutions at 0.7 / sqrt(fan-in): at the library's initial scale a random
    vocoder's waveform is about 1e-8, which 16-bit PCM rounds to silence; at this one it peaks near
    0.75 without clipping, so tests that compare audio compare sound."""
    import math

    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for module in vocoder.modules():
            if isinstance(module, nn.Conv1d | nn.ConvTranspose1d):
                w = module.weight
                fan_in = (w.shape[1] * w.shape[2] if isinstance(module, nn.Conv1d)
                          else w.shape[0] * w.shape[2] / module.stride[0])
                w.copy_(torch.randn(w.shape, generator=g) * (0.7 / math.sqrt(fan_in)))


def tiny_qwen_omni(path: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny random Qwen2.5-Omni checkpoint into directory ``path`` (created); return it."""
    import torch
    from transformers import GenerationConfig, Qwen2_5OmniForConditionalGeneration

    from stages.hf.omni.parts import quiet_transformers

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_transformers():  # the talker's config warns of text ids outside the codec vocabulary
        tok = _tokenizer()
        ids = {s: tok.convert_tokens_to_ids(s) for s in _SPECIALS}
        config = _config(ids)
        torch.manual_seed(seed)
        model = Qwen2_5OmniForConditionalGeneration(config).eval()
        _audible(model.token2wav.code2wav_bigvgan_model, seed)
        model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"],
                                                   pad_token_id=ids["<|endoftext|>"])
        model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "chat_template.jinja").write_text(OMNI_TEMPLATE, encoding="utf-8")
    (out / "preprocessor_config.json").write_text(json.dumps(_preprocessor(), indent=2, default=str) + "\n",
                                                  encoding="utf-8")
    g = torch.Generator().manual_seed(seed + 1)
    dit_config = config.token2wav_config.dit_config
    mel_dim, cond_dim = dit_config.mel_dim, dit_config.enc_emb_dim
    speakers = {name: {"bos_token": bos, "cond": torch.randn(1, cond_dim, generator=g),
                       "ref_mel": torch.randn(1, 40, mel_dim, generator=g)}
                for name, bos in zip(OMNI_SPEAKERS, _SPEAKER_BOS, strict=True)}
    torch.save(speakers, out / "spk_dict.pt")
    return out


def omni_config(checkpoint: str | Path, *, async_chunk: bool, device: str = "cpu",
                talker: dict[str, Any] | None = None, token2wav: dict[str, Any] | None = None) -> str:
    """A pipeline config (TOML, for ``serve --config``) serving ``checkpoint`` as ``serve DIR`` does,
    in async-chunk mode or not, with model options for the talker and token2wav (a benchmark's chunk
    sizes, a test's talker budget)."""
    def options(extra: dict[str, Any] | None) -> str:
        items = {"checkpoint": str(checkpoint), **(extra or {})}
        return ", ".join(f"{k} = {json.dumps(v)}" for k, v in items.items())

    stages = [("omni-thinker", "thinker", None), ("omni-talker", "talker", talker),
              ("omni-token2wav", "token2wav", token2wav)]
    head = (f"[pipeline]\nasync_chunk = {str(async_chunk).lower()}\nfinal_stage_ids = [0, 2]\n"
            f"heartbeat_timeout = 60.0\ndevice = {json.dumps(device)}\n")
    return head + "".join(f'\n[[stages]]\nkind = "{kind}"\nname = "{name}"\nmodel = {{{options(extra)}}}\n'
                          for kind, name, extra in stages)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m trio_orch.testing.omni_checkpoint DIR")
    print(tiny_qwen_omni(sys.argv[1]))
