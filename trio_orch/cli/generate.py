"""``trio-orch generate "text"``: run a pipeline once, end to end.

Starts the stage workers of the pipeline (default: thinker -> talker ->
code2wav, one process per replica), sends one request through the Trio
orchestrator, streams the thinker's text to the terminal as it is generated,
writes the vocoder's audio to a WAV file and prints per-stage timings.  With
``--async-chunk`` the stages stream to each other chunk by chunk, so the
first audio comes long before the text is finished.  Sampling flags
(``--temperature``, ``--seed``, ``--voice``, ...) go to the stages they concern,
as the same fields of a chat request do (:mod:`trio_orch.openai.sampling`);
``--stage-param`` sets any stage's parameter explicitly.  With
``--stream-input`` the prompt comes from standard input, one input segment
per line, into one resumable request (:mod:`trio_orch.cli.generate_stream`).  A
pipeline whose output is an image (``--pipeline text2image``) draws the
denoising progress and writes a PNG instead (:mod:`trio_orch.cli.text2image`;
``--seed`` is then the image's seed).  ``--image FILE`` and ``--audio FILE``
send images and sounds (WAV, FLAC, Ogg or MP3, by the file's suffix) with
the prompt to a pipeline with encoder stages (``--pipeline omni-in``),
decoded as the chat route decodes them.  With ``--listen`` replicas may join
over TCP (docs/distributed.md); a stage with no local replica is waited for
(``--join-timeout``) before the request goes in.

Everything that can be checked is checked before a worker starts (the
prompt, ``--max-tokens``, where ``--out`` goes, the config): exit 2.
SIGINT and SIGTERM stop it cleanly (workers stopped, ipc files removed)
with exit code 130, the shell's Ctrl-C code (``serve`` drains instead, and exits 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

from stages.config import PIPELINES, PipelineConfig
from stages.placement import check_devices, device_arg
from stages.registry import (
    as_audio,
    as_text,
    input_media,
    spec_for,
    stage_params,
    takes_companions,
    text_stage,
)
from stages.sampling_params import VOICES
from stages.schema import seconds_arg
from trio_orch.cli import EXIT_SIGNAL, text2image
from trio_orch.cli.generate_stream import first_line, stream_input
from trio_orch.cluster import distributed
from trio_orch.cluster.distributed import ReplicasMissing, head_options, open_head_pipeline, wait_for_replicas
from trio_orch.cluster.launcher import Pipeline, WorkerStartupError
from trio_orch.cluster.pool import StageTiming
from trio_orch.cluster.ray_placement import PlacementError
from trio_orch.openai.audio_out import FILE_SUFFIXES, check_audio_format, encode_audio, pcm16
from trio_orch.openai.chat import check_max_tokens
from trio_orch.openai.media import AUDIO_FORMATS, MediaPolicy, audio_clip, read_image_file
from trio_orch.openai.sampling import SamplingError, map_sampling
from trio_orch.openai.validation import BadRequest
from trio_orch.serve.checkpoint import (
    add_model_arguments,
    add_stage_config_argument,
    checkpoint_template,
    model_dir,
    pipeline_config,
)
from trio_orch.shell.orchestrator import Orchestrator, open_orchestrator
from trio_orch.types import OrchError

__all__ = ["configure", "out_format", "read_media", "run", "write_audio"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Generate text and speech for a prompt with the stage-worker pipeline "
        "(thinker -> talker -> code2wav by default; torch models with seeded dummy weights, "
        "so the text is gibberish but every stage really computes). Streams the text, "
        "writes a WAV file, prints per-stage timings. With --pipeline text2image: an image "
        "(encoder -> diffusion with classifier-free guidance), written as a PNG. With --model "
        "MODEL_DIR: a local Hugging Face checkpoint's answer, the text in its chat template.")
    parser.add_argument("text", nargs="?", default="Hello", help="the prompt (default: Hello)")
    parser.add_argument("--pipeline", choices=list(PIPELINES), default=None,
                        help="a built-in pipeline: speech (default), speech-pd (the thinker split into "
                             "prefill and decode stages), text2image")
    parser.add_argument("--out", default=None,
                        help="file to write: the audio (default out.wav; its suffix names the format: "
                             ".wav, .flac, .opus or .ogg, .mp3, .aac, or .pcm for the bare 16-bit samples), "
                             "or the PNG (default out.png)")
    parser.add_argument("--async-chunk", action="store_true", default=None,
                        help="stream chunks stage to stage (first audio comes earlier)")
    parser.add_argument("--replicas", type=int, default=None, help="worker processes per stage")
    parser.add_argument("--device", type=device_arg, default=None, metavar="cpu|cuda|cuda:N",
                        help="torch device of every worker, over the config's own placement (default: "
                             "the config's; cpu). A worker on cuda:N sees only that GPU (docs/models.md)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="pipeline config TOML (default: the built-in 3-stage pipeline)")
    add_stage_config_argument(parser)
    parser.add_argument("--image", dest="image_files", action="append", default=[], metavar="FILE",
                        help="an image to send with the prompt (repeatable; the pipeline needs an "
                             "image-encoder stage: --pipeline omni-in)")
    parser.add_argument("--audio", dest="audio_files", action="append", default=[], metavar="FILE",
                        help="a sound to send with the prompt: .wav (PCM), .flac, .ogg or .mp3 "
                             "(repeatable; the pipeline needs an audio-encoder stage: --pipeline omni-in)")
    parser.add_argument("--priority", type=int, default=0, metavar="N",
                        help="the request's priority: an int, lower values are served first when "
                             "requests wait for room (vLLM's convention; default 0)")
    parser.add_argument("--stream-input", action="store_true",
                        help="read the prompt from standard input, one segment per line, into one "
                             "request that takes more input while it answers (end of input ends it); "
                             "each segment's answer streams as it comes (the workers start once the "
                             "first line is read: no input at all is an error, exit 2)")
    s = parser.add_argument_group(
        "sampling", "each goes to the stages it concerns: text parameters to the stage that gives the "
                    "text, --seed and --voice to every stage that takes them (see docs/sampling.md)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="most text tokens the thinker generates (default and cap: its config, 48)")
    s.add_argument("--temperature", type=float, default=None, help="text temperature (0: greedy)")
    s.add_argument("--top-p", type=float, default=None, help="text nucleus sampling mass (0, 1]")
    s.add_argument("--top-k", type=int, default=None, help="sample the text from the k most likely tokens")
    s.add_argument("--seed", type=int, default=None,
                   help="per-request seed: the same seed and parameters give the same text and audio")
    s.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="end the text before this string (repeatable)")
    s.add_argument("--voice", default=None, choices=VOICES, metavar="VOICE",
                   help=f"speaker of the talker and vocoder: {', '.join(VOICES)} (default alloy)")
    s.add_argument("--stage-param", action="append", default=[], metavar="STAGE.KEY=VALUE",
                   help="one parameter of one stage, the stage by kind or index, the value as JSON "
                        "(e.g. talker.temperature=0.7, 1.seed=3, thinker.stop='[\"x\"]'; repeatable)")
    parser.add_argument("--compare", action="store_true",
                        help="run the prompt twice, stage by stage and then with --async-chunk, "
                             "and compare the time to first audio")
    text2image.add_arguments(parser)
    parser.set_defaults(**dict.fromkeys(IMAGE_OPTIONS))  # None: not given (speech pipelines refuse them)
    add_model_arguments(parser, positional=False)
    distributed.add_arguments(parser)
    parser.add_argument("--join-timeout", type=seconds_arg, default=120.0, metavar="S",
                        help="with --listen: seconds to wait until every stage has a replica (a stage "
                             "with no local one waits for one to join) before sending the request")
    parser.add_argument("--max-retries", type=int, default=None, metavar="N",
                        help="resend the request up to N times when the replica holding it dies before "
                             "answering it (default: the config's [pipeline] max_retries, 1; 0: off)")


#: ``generate`` options that only an image pipeline takes (``text2image.add_arguments``)
IMAGE_OPTIONS = ("negative", "size", "steps", "guidance_scale")


def _image_defaults() -> dict[str, Any]:
    """The image options' own defaults (``text2image.add_arguments``), for an image pipeline."""
    parser = argparse.ArgumentParser(add_help=False)
    text2image.add_arguments(parser)
    return {k: v for k, v in vars(parser.parse_args([])).items() if k in IMAGE_OPTIONS}


def write_audio(path: str, pcm: np.ndarray, sample_rate: int, fmt: str = "wav") -> None:
    """Write mono float PCM in [-1, 1] as a file in ``fmt`` (the server's encoder: the same bytes as
    its answer in that format)."""
    Path(path).write_bytes(encode_audio(pcm16(pcm), sample_rate, fmt))


def out_format(path: str | None) -> str:
    """The audio format ``--out`` names by its suffix (WAV for none); ValueError for one not written
    here, as the server's 400 says it."""
    suffix = Path(path or "out.wav").suffix.lower() or ".wav"
    if suffix not in FILE_SUFFIXES:
        raise ValueError(f"--out {path}: {suffix} names no audio format this writes (name the file "
                         f"{', '.join(FILE_SUFFIXES)})")
    try:
        return check_audio_format(FILE_SUFFIXES[suffix], "--out")
    except BadRequest as exc:
        raise ValueError(str(exc).replace("'--out'", f"--out {path}")) from None


def _config(args: argparse.Namespace) -> PipelineConfig:
    args.model_dir = model_dir(args)
    cfg = pipeline_config(args)  # the checkpoint's, --config's or built-in; --stage-config over it
    if _makes_images(cfg):
        if cfg.async_chunk or args.compare or args.stream_input:
            raise ValueError("an image pipeline runs whole requests stage by stage: --async-chunk, "
                             "--compare and --stream-input are for streaming pipelines")
        if not takes_companions(spec_for(cfg.stages[0].kind, cfg.stages[0].role)):
            raise ValueError(f"stage 0 ({cfg.stages[0].label}) does not condition on companion requests: "
                             "classifier-free guidance needs an encoder there")
        for name, default in _image_defaults().items():
            if getattr(args, name, None) is None:
                setattr(args, name, default)
    else:
        given = [f"--{n.replace('_', '-')}" for n in IMAGE_OPTIONS if getattr(args, n, None) is not None]
        if given:
            answers = " and ".join(sorted({cfg.outputs()[k] for k in cfg.final_stage_ids}))
            raise ValueError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for image pipelines "
                             f"(--pipeline text2image); this pipeline answers with {answers}, not an image")
    return cfg


def read_media(args: argparse.Namespace, cfg: PipelineConfig) -> dict[str, Any]:
    """The ``--image`` and ``--audio`` files, decoded as the chat route decodes them (ValueError)."""
    given = {"image": args.image_files, "audio": args.audio_files}
    for medium, files in given.items():
        if files and medium not in input_media(cfg.kinds()):
            raise ValueError(f"--{medium}: this pipeline has no {medium}-encoder stage "
                             "(try --pipeline omni-in)")
    policy = MediaPolicy(max_parts=10**6)
    try:
        images = [read_image_file(Path(f), policy, f"--image {f}", anywhere=True) for f in args.image_files]
        audios = [audio_clip(_read(f, "--audio"), _audio_format(f), policy, f"--audio {f}").payload()
                  for f in args.audio_files]
    except BadRequest as exc:
        raise ValueError(str(exc).replace("'", "")) from None
    return {k: v for k, v in (("images", images), ("audios", audios)) if v}


def _audio_format(path: str) -> str:
    """An ``--audio`` file's format, from its suffix (ValueError for one not decoded)."""
    fmt = {".oga": "ogg", ".opus": "ogg"}.get(Path(path).suffix.lower(), Path(path).suffix.lower()[1:])
    if fmt not in AUDIO_FORMATS:
        raise ValueError(f"--audio {path}: the suffix names none of {', '.join(AUDIO_FORMATS)} (name the "
                         "file .wav, .flac, .ogg or .mp3 as it is)")
    return fmt


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from None


def _makes_images(cfg: PipelineConfig) -> bool:
    return any(cfg.outputs()[k] == "image" for k in cfg.final_stage_ids)


def request_sampling(args: argparse.Namespace, cfg: PipelineConfig) -> dict[int, dict[str, Any]]:
    """The per-stage sampling parameters asked for on the command line (ValueError if one does not fit)."""
    fields: dict[str, Any] = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                              "max_tokens": args.max_tokens, "seed": args.seed, "stop": args.stop,
                              "voice": args.voice}
    explicit: dict[str, dict[str, Any]] = {}
    for item in args.stage_param:
        where, eq, raw = item.partition("=")
        stage, dot, key = where.rpartition(".")  # a plug-in's kind may have dots, a key has none
        if not (eq and dot and stage and key):
            raise ValueError(f"--stage-param {item!r}: expected STAGE.KEY=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare word: a string (voice=nova)
        explicit.setdefault(stage, {})[key] = value
    fields["stage_sampling"] = explicit or None
    kinds = [st.kind for st in cfg.stages]
    try:
        return map_sampling(fields, stage_params(kinds), text_stage=text_stage(cfg.final_stage_ids,
                            cfg.outputs()), last_stage=max(cfg.final_stage_ids))
    except SamplingError as exc:
        flag = ("--stage-param" if exc.param.startswith("stage_sampling") else "--voice"
                if exc.param == "audio.voice" else "--" + exc.param.replace("_", "-"))
        raise ValueError(f"{flag}: {exc}") from None


def _ms(t: float | None, t0: float) -> str:
    return f"{(t - t0) * 1000:9.1f}" if t is not None else "        -"


def _dur(seconds: float | None) -> str:
    return f"{seconds * 1000:9.1f}" if seconds is not None else "        -"


def prompt_of(args: argparse.Namespace) -> str:
    """The prompt sent: a checkpoint's chat template around the text as one user message (the text as
    it is without a checkpoint, or for a checkpoint with no template)."""
    template = checkpoint_template(args.model_dir) if getattr(args, "model_dir", None) else None
    if template is None:
        return str(args.text)
    return template.render([{"role": "user", "content": args.text}])


def _check_args(args: argparse.Namespace) -> None:
    """What can be wrong before any worker starts; ValueError saying what."""
    if not args.text.strip():
        raise ValueError("the prompt is empty: give some text, e.g. trio-orch generate \"Hello\"")
    if args.max_tokens is not None:
        try:
            check_max_tokens(args.max_tokens, "--max-tokens")
        except BadRequest as exc:
            raise ValueError(str(exc).replace("'--max-tokens'", "--max-tokens")) from None
    if args.replicas is not None and args.replicas < (0 if args.listen else 1):
        raise ValueError("--replicas must be >= 1 (0 only with --listen: replicas join over TCP)")
    if args.join_timeout <= 0:
        raise ValueError("--join-timeout must be > 0")
    if args.max_retries is not None and args.max_retries < 0:
        raise ValueError("--max-retries must be >= 0 (0: no failover)")
    out = os.path.abspath(args.out or "out.wav")  # the default lands in the current directory
    folder = os.path.dirname(out)
    if os.path.isdir(out):
        raise ValueError(f"--out {args.out} is a directory: name the file to write")
    if not os.path.isdir(folder):
        raise ValueError(f"--out {args.out}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--out {args.out}: the directory {folder} is not writable")


async def _generate(args: argparse.Namespace, cfg: PipelineConfig, pipe: Pipeline,
                    orch: Orchestrator) -> tuple[int, float | None]:
    """Run the prompt once; return (exit code, time to first audio in ms or None)."""
    payload: Any = prompt_of(args)  # what stage 0 takes: the prompt (a token limit goes in the sampling)
    if args.media:  # and the images and sounds beside it, for the encoder stages (stages.media)
        payload = {"text": args.text, **args.media}
    outputs = cfg.outputs()  # how each stage's outputs are shown
    rid = "generate-1"
    pcm: list[np.ndarray] = []
    rate = 24000
    t_text = t_audio = t_last_audio = None
    t0 = time.perf_counter()
    await orch.add_request(rid, payload, sampling=args.sampling, priority=args.priority)
    print("text: ", end="", flush=True)
    while True:
        msg = await orch.next_output()
        now = time.perf_counter()
        if isinstance(msg, OrchError):
            print(f"\nerror: request failed at stage {msg.stage_id} ({msg.kind}): {msg.message}",
                  file=sys.stderr)
            return 1, None
        data = msg.data
        text = as_text(outputs[msg.stage_id], data)
        audio = as_audio(outputs[msg.stage_id], data) if text is None else None
        if text is not None:
            t_text = t_text or now
            print(text, end="", flush=True)
        elif audio is not None:
            samples, rate = audio
            if len(samples):
                t_audio = t_audio or now
                t_last_audio = now
                pcm.append(samples)
        elif data is not None:
            t_text = t_text or now
            print(f"[stage {msg.stage_id}] {data!r}", flush=True)
        if msg.finished:
            break
    t_end = time.perf_counter()
    print()
    mode = "async-chunk" if cfg.async_chunk else "normal (stage by stage)"
    print(f"\ntimings, {mode} mode, ms after the request was added (queued / in batch: as the "
          "worker reports them):")
    print(f"  {'stage':<22} {'submitted':>9} {'first out':>9} {'finished':>9} {'queued':>9} {'in batch':>9}")
    for k, pool in enumerate(pipe.stages):
        tm: StageTiming | None = pool.timing_of(rid)
        label = f"{k} {cfg.stages[k].label}"
        if tm is None:
            print(f"  {label:<22} (not run)")
            continue
        print(f"  {label:<22} {_ms(tm.t_submit, t0)} {_ms(tm.t_first, t0)} {_ms(tm.t_done, t0)} "
              f"{_dur(tm.queue_s)} {_dur(tm.compute_s)}")
    print(f"  time to first token: {_ms(t_text, t0).strip()} ms")
    speaks = any(outputs[k] == "audio" for k in cfg.final_stage_ids)
    if speaks:
        print(f"  time to first audio: {_ms(t_audio, t0).strip()} ms")
    print(f"  total:               {(t_end - t0) * 1000:.1f} ms")
    seconds = sum(len(p) for p in pcm) / rate
    if seconds and t_last_audio is not None:
        print(f"  real-time factor:    {(t_last_audio - t0) / seconds:.2f} "
              f"(seconds to the last audio per second of audio; < 1 is faster than real time)")
    if not cfg.async_chunk and len(cfg.stages) > 1 and speaks and not input_media(cfg.kinds()):
        # the hint only where --async-chunk applies: audio out, and no encoder (those run stage by stage)
        print("  (each stage starts when the previous one finished; --async-chunk streams chunks "
              "stage to stage, so audio starts while the text is still being generated)")
    if pcm:
        audio = np.concatenate(pcm)
        out = args.out or "out.wav"
        try:
            write_audio(out, audio, rate, args.audio_format)
        except OSError as exc:
            print(f"error: cannot write {out}: {exc}", file=sys.stderr)
            return 1, None
        print(f"wrote {out}: {len(audio) / rate:.2f} s of audio, {rate} Hz mono 16-bit, "
              f"{len(audio)} samples, as {args.audio_format}")
    return 0, (t_audio - t0) * 1000 if t_audio is not None else None


async def _run_once(args: argparse.Namespace, cfg: PipelineConfig) -> tuple[int, float | None]:
    head, local = head_options(args, cfg)  # checked in _job: no error here
    kinds = ", ".join(f"{s.label} x{s.replicas}" for s in local.stages)
    print(f"starting workers ({kinds}) on {cfg.where()} ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    try:
        # _main handles SIGTERM; a one-shot job restarts no worker
        async with (open_head_pipeline(local, head, full_config=cfg, supervised=False, handle_sigterm=False)
                    as pipe, open_orchestrator(pipe.stages, **pipe.orchestrator_kwargs()) as orch):
            print(f"workers ready in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
            await wait_for_replicas(pipe, args.join_timeout)  # replicas join through the orchestrator
            if _makes_images(cfg):
                return await text2image.generate_image(orch, args.image, args.out or "out.png"), None
            if args.stream_input:
                out = args.out or "out.wav"
                rc, pcm, rate = await stream_input(cfg, orch, args.sampling, first=args.first_line,
                                                   priority=args.priority)
                if pcm is not None:
                    write_audio(out, pcm, rate, args.audio_format)
                    print(f"wrote {out}: {len(pcm) / rate:.2f} s of audio", file=sys.stderr)
                return rc, None
            return await _generate(args, cfg, pipe, orch)
    except (WorkerStartupError, ReplicasMissing, PlacementError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1, None


async def _main(args: argparse.Namespace) -> int:
    """Run the job; SIGINT or SIGTERM cancels it (workers are stopped on the way out): exit 130."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        result: list[int] = []
        async with trio.open_nursery() as nursery:
            async def job() -> None:
                result.append(await _job(args))
                nursery.cancel_scope.cancel()

            async def on_signal() -> None:
                async for signum in signals:
                    print(f"\n{signal.Signals(signum).name}: stopping ...", file=sys.stderr, flush=True)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(job)
            nursery.start_soon(on_signal)
    return result[0] if result else EXIT_SIGNAL


async def _job(args: argparse.Namespace) -> int:
    try:
        _check_args(args)
        cfg = _config(args)
        if _makes_images(cfg):
            args.image, args.sampling = text2image.request_from_args(args), None
        else:
            args.image, args.sampling = None, request_sampling(args, cfg)  # checked before any worker starts
            args.audio_format = out_format(args.out)
        _, local = head_options(args, cfg)  # --listen, --keys, stages without a local replica
        check_devices(local.devices())  # every local replica's device exists here
        args.media = read_media(args, cfg)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.stream_input and args.compare:
        print("error: --stream-input and --compare do not go together", file=sys.stderr)
        return 2
    if args.stream_input:  # read before any worker starts: no input means nothing to start them for
        args.first_line = await first_line(sys.stdin)
        if args.first_line is None:
            print("error: --stream-input read no line from standard input", file=sys.stderr)
            return 2
    if not args.compare:
        return (await _run_once(args, cfg))[0]
    results = []
    for async_chunk in (False, True):
        print(f"\n=== {'async-chunk' if async_chunk else 'stage by stage'} ===", flush=True)
        rc, ttfa = await _run_once(args, cfg.with_overrides(async_chunk=async_chunk))
        if rc:
            return rc
        results.append(ttfa)
    if None not in results:
        normal, chunked = results
        verdict = (f"{normal / max(chunked, 1e-3):.1f}x earlier with async-chunk" if chunked < normal
                   else "async-chunk was not earlier this time: is the machine overloaded?")
        print(f"\ntime to first audio: stage by stage {normal:.1f} ms, async-chunk {chunked:.1f} ms "
              f"({verdict})")
    return 0


def run(args: argparse.Namespace) -> int:
    return trio.run(_main, args)
