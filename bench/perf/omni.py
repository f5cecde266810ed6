"""``python -m bench.perf.omni``: Qwen2.5-Omni through ``trio-orch serve``: first text, first audio, RTF.

Loopback only.  Serves a Qwen2.5-Omni checkpoint (``--checkpoint``; default: a
tiny random one built in a temporary directory,
:func:`trio_orch.testing.omni_checkpoint.tiny_qwen_omni`) as thinker -> talker
-> token2wav, once in normal mode and once per ``--stream-codes`` value in
async-chunk mode (token2wav's ``stream_codes``: the codes of each sliding DiT
window; the talker ships a chunk of codes as often), and sends ``--requests``
streamed chats one after another, each asking for text and audio (greedy
thinker capped at ``--text-tokens``, greedy talker at ``--codes`` codes; the
server's first request, a warm-up, is not counted).  Per mode it reports, as
medians over the requests:

- time to the first text (the first SSE chunk with content) and to the first
  audio chunk, and to the end;
- the real-time factor end to end (seconds from the request to its last
  audio per second of audio) and per stage (the stage's compute time for the
  request, from a non-streamed request's ``timings``, per second of audio).

Prints one JSON object (``--json PATH`` writes it too); ``--markdown PATH``
renders it between the file's ``<!-- omni:begin -->`` / ``<!-- omni:end -->``
markers.  Nothing is asserted: the numbers come from the run (note how loaded
the machine was).  ``--device cuda`` serves on a GPU (``bench/perf/omni_gpu.sh``).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.perf.report import publish
from bench.perf.serving import start_server, stop_server
from trio_orch.testing.omni_checkpoint import omni_config, tiny_qwen_omni

__all__ = ["main", "markdown", "measure"]

BEGIN, END = "<!-- omni:begin -->", "<!-- omni:end -->"
SAMPLE_RATE = 24000

def _body(args: argparse.Namespace, stream: bool) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hello there, how are you today?"}],
            "temperature": 0, "max_tokens": args.text_tokens, "modalities": ["text", "audio"],
            "audio": {"voice": args.voice, "format": "pcm16" if stream else "wav"}, "stream": stream,
            "stage_sampling": {"omni-talker": {"temperature": 0, "max_tokens": args.codes}}}


def streamed(client: httpx.Client, args: argparse.Namespace) -> dict[str, float]:
    """One streamed request: seconds to its first text, first audio and end; seconds of audio."""
    t0 = time.perf_counter()
    first_text = first_audio = None
    samples = 0
    with client.stream("POST", "/v1/chat/completions", json=_body(args, True)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", ()):
                delta = choice.get("delta") or {}
                if delta.get("content") and first_text is None:
                    first_text = time.perf_counter() - t0
                data = (delta.get("audio") or {}).get("data")
                if data:
                    samples += len(base64.b64decode(data)) // 2
                    if first_audio is None:
                        first_audio = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return {"first_text_s": first_text or end, "first_audio_s": first_audio or end, "end_s": end,
            "audio_s": samples / SAMPLE_RATE}


def stage_compute(client: httpx.Client, args: argparse.Namespace) -> dict[str, Any]:
    """One non-streamed request: each stage's compute seconds (its ``timings``) and the seconds of audio."""
    r = client.post("/v1/chat/completions", json=_body(args, False))
    r.raise_for_status()
    answer = r.json()
    audio = base64.b64decode(answer["choices"][0]["message"]["audio"]["data"])
    seconds = (len(audio) - 44) / 2 / SAMPLE_RATE  # a WAV: its 44-byte header, then 16-bit samples
    return {"audio_s": seconds, "compute_s": {s["stage"]: (s["compute_ms"] or 0) / 1000
                                              for s in answer["timings"]["stages"]}}


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The medians of one mode (see the module's docstring)."""
    with httpx.Client(base_url=url, timeout=600) as client:
        streamed(client, args)  # warm-up: first requests pay for lazy initialisation
        runs = [streamed(client, args) for _ in range(args.requests)]
        stages = [stage_compute(client, args) for _ in range(max(1, args.requests // 2))]

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in runs) * 1000, 1)

    audio = statistics.median(r["audio_s"] for r in runs)
    return {"first_text_ms": med("first_text_s"), "first_audio_ms": med("first_audio_s"),
            "end_ms": med("end_s"), "audio_s": round(audio, 3),
            "rtf": round(statistics.median(r["end_s"] / r["audio_s"] for r in runs if r["audio_s"]), 3),
            "rtf_by_stage": {name: round(statistics.median(s["compute_s"].get(k, 0.0) / s["audio_s"]
                                                           for s in stages if s["audio_s"]), 3)
                             for k, name in enumerate(("thinker", "talker", "token2wav"))}}


def markdown(out: dict[str, Any]) -> str:
    lines = [f"`{out['command']}` ({out['date']}; {out['settings']['requests']} requests per mode, "
             f"{out['settings']['text_tokens']} text tokens and {out['settings']['codes']} codes each, "
             f"on {out['settings']['device']}; medians):", "",
             "| mode | first text (ms) | first audio (ms) | end (ms) | audio (s) | RTF | RTF thinker | "
             "RTF talker | RTF token2wav |", "|---|---|---|---|---|---|---|---|---|"]
    for m in out["modes"]:
        s = m["rtf_by_stage"]
        lines.append(f"| {m['mode']} | {m['first_text_ms']} | {m['first_audio_ms']} | {m['end_ms']} | "
                     f"{m['audio_s']} | {m['rtf']} | {s['thinker']} | {s['talker']} | {s['token2wav']} |")
    lines += ["", f"({out['checkpoint']}; {out['cpus']} CPUs, load average {out['loadavg']} at the start: "
              f"{out['machine']}.)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.omni", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a Qwen2.5-Omni checkpoint (default: a tiny random one, built for the run)")
    p.add_argument("--device", default="cpu", help="where the stages run (serve's --device; default cpu)")
    p.add_argument("--requests", type=int, default=5, help="requests per mode (default 5)")
    p.add_argument("--text-tokens", type=int, default=16, help="the thinker's max_tokens (default 16)")
    p.add_argument("--codes", type=int, default=150,
                   help="the talker's max_tokens: 3 s of audio (default 150)")
    p.add_argument("--stream-codes", default="4,8,16,32",
                   help="async-chunk modes: token2wav's stream_codes, comma-separated (default 4,8,16,32)")
    p.add_argument("--voice", default="Chelsie", help="the speaker (default Chelsie)")
    p.add_argument("--machine", default="", help="a note on the machine (e.g. 'loaded: a CI run beside')")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help=f"write the table between {BEGIN} and {END} of this file")
    args = p.parse_args(argv)
    modes: list[tuple[str, bool, dict[str, int], int]] = [("normal", False, {}, 16)] + [
        (f"async-chunk, stream_codes {n}", True, {"stream_codes": int(n)}, min(int(n), 16))
        for n in args.stream_codes.split(",") if n.strip()]
    with tempfile.TemporaryDirectory() as d:
        ckpt = args.checkpoint or str(tiny_qwen_omni(Path(d) / "tiny-omni"))
        out: dict[str, Any] = {
            "command": " ".join(["python -m bench.perf.omni",
                                 shlex.join(sys.argv[1:] if argv is None else argv)]).rstrip(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "cpus": os.cpu_count(),
            "loadavg": round(os.getloadavg()[0], 1), "machine": args.machine or "not described",
            "checkpoint": args.checkpoint or "the tiny random checkpoint",
            "settings": {k: getattr(args, k)
                         for k in ("device", "requests", "text_tokens", "codes", "voice")},
            "modes": []}
        for name, chunked, token2wav, talker_chunk in modes:
            config = Path(d) / "omni.toml"
            config.write_text(omni_config(ckpt, async_chunk=chunked, device=args.device,
                                          talker={"chunk_codes": talker_chunk}, token2wav=token2wav))
            proc, url = start_server(["--config", str(config), "--request-timeout", "600"])
            try:
                out["modes"].append({"mode": name, **measure(url, args)})
            finally:
                stop_server(proc)
    publish(out, args.json, args.markdown, markdown, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
