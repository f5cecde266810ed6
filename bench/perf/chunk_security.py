"""``python -m bench.perf.chunk_security``: what CurveZMQ on the async-chunk links costs.

Two parts, one run:

* **per chunk** -- a sender process streams chunks of each ``--sizes`` to a
  receiver process over ipc, through sockets set up the way the outbox and
  the inbox set theirs up (:class:`stages.auth.Security`, the wire codec, the
  inbox's ZAP handler): once with PLAIN (a handshake, then messages in clear:
  what the inboxes used before) and once with CurveZMQ (every message
  encrypted: what they use now).  For each: chunks per second, and CPU per
  chunk of both processes together (their libzmq I/O threads included:
  where the encryption runs).
* **per request** -- real async-chunk pipelines (the built-in speech
  pipeline's toy models, async-chunk mode; and its prefill/decode split,
  whose KV cache is one chunk) answer ``--requests`` requests; the workers'
  own counts (``stats``: chunks and bytes sent) give the chunks a request
  makes on each link and their mean size; times the extra CPU per chunk of
  the nearest measured size, the extra CPU per request.

Prints one JSON object (``--json PATH`` writes it too); ``--markdown PATH``
renders it between the file's ``<!-- chunk-security:begin -->`` /
``<!-- chunk-security:end -->`` markers.  Nothing is asserted: the numbers
come from the run (note how loaded the machine was).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shlex
import sys
import time
from typing import Any

import numpy as np

from bench.perf.report import publish

__all__ = ["link_cost", "main", "markdown", "pipeline_counts"]

BEGIN, END = "<!-- chunk-security:begin -->", "<!-- chunk-security:end -->"
#: 100 B: a chunk of tokens or codec codes; 8 KB: a few hidden states; 1 MB, 16 MB: a KV cache
SIZES = (100, 8 << 10, 64 << 10, 1 << 20, 16 << 20)


def _receiver(address: str, secret: bytes, public: bytes, private: bytes, curve: bool, n: int,
              out: Any) -> None:
    """Bind, take ``n`` chunks (decoded, as the inbox does), report when the last came and the CPU spent."""
    import zmq

    from stages.auth import Authenticator, Keypair, Security
    from stages.connector import INBOX_DOMAIN
    from stages.wire import Chunk, WireCodec

    ctx = zmq.Context()
    security = Security(secret, Keypair(public, private), server_key=public)
    codec = WireCodec(Chunk)
    with Authenticator(ctx, secret) as auth:
        auth.allow([public])
        sock = ctx.socket(zmq.PULL)
        security.server(sock, address, domain=INBOX_DOMAIN, curve=curve)
        sock.bind(address)
        out.put("bound")
        codec.decode(sock.recv_multipart(copy=False))  # the warm-up chunk: the handshake is done
        out.put("warm")
        cpu0 = time.process_time()
        for _ in range(n):
            codec.decode(sock.recv_multipart(copy=False))
        out.put((time.perf_counter(), time.process_time() - cpu0))
        sock.close(linger=0)
    ctx.term()


def link_cost(size: int, curve: bool, n: int) -> dict[str, float]:
    """``n`` chunks of ``size`` bytes from this process to a receiver process: rate and CPU per chunk."""
    import tempfile

    import zmq

    from stages.auth import Keypair, Security
    from stages.wire import Chunk, WireCodec

    keys = Keypair.generate()
    secret = os.urandom(16).hex().encode()
    mp = multiprocessing.get_context("spawn")
    q: Any = mp.Queue()
    with tempfile.TemporaryDirectory(prefix="chunk-security-") as d:
        address = f"ipc://{d}/in"
        proc = mp.Process(target=_receiver, args=(address, secret, keys.public, keys.secret, curve, n, q))
        proc.start()
        try:
            assert q.get(timeout=60) == "bound"
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PUSH)
            sock.linger = 1000
            Security(secret, keys, server_key=keys.public).client(sock, address, curve=curve)
            sock.connect(address)
            codec = WireCodec(Chunk)
            data = np.zeros(size, np.uint8)
            sock.send_multipart(codec.encode(Chunk("warm", data, False)), copy=False)
            assert q.get(timeout=60) == "warm"
            t0, cpu0 = time.perf_counter(), time.process_time()
            for i in range(n):
                sock.send_multipart(codec.encode(Chunk(f"r{i}", data, i == n - 1)), copy=False)
            t_end, rx_cpu = q.get(timeout=600)
            tx_cpu = time.process_time() - cpu0
            mechanism = {zmq.PLAIN: "PLAIN", zmq.CURVE: "CURVE"}.get(sock.getsockopt(zmq.MECHANISM), "?")
            sock.close()
            ctx.term()
        finally:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join()
    wall = t_end - t0
    return {"mechanism": mechanism, "chunks": n, "per_s": n / wall, "wall_us": 1e6 * wall / n,
            "cpu_us": 1e6 * (tx_cpu + rx_cpu) / n}


def _chunks_for(size: int, seconds: float) -> int:
    """How many chunks of ``size`` make about ``seconds`` of traffic (at a guessed 1 GB/s, 20 us a chunk)."""
    return max(20, min(20000, int(seconds / (20e-6 + size / 1e9))))


async def _run_pipeline(name: str, requests: int) -> dict[str, Any]:
    import trio

    from stages.config import default_config, pd_config
    from trio_orch.cluster.launcher import open_pipeline
    from trio_orch.shell.orchestrator import Orchestrator
    from trio_orch.types import OrchError

    cfg = default_config(async_chunk=True) if name == "speech, async-chunk" else pd_config(decode_replicas=1)
    async with open_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            for i in range(requests):
                await orch.add_request(f"r{i}", f"Say something short, number {i}.")
            done = errors = 0
            with trio.fail_after(600):
                while done < requests:
                    msg = await orch.next_output()
                    done += msg.finished
                    errors += isinstance(msg, OrchError)
            stats = await pipe.stats()
            await orch.shutdown()
    links = []
    for k, s in enumerate(stats):
        sent = s.get("connector", {}).get("sent", 0)
        if sent:
            nxt = cfg.stages[k + 1]
            links.append({"from": cfg.stages[k].label, "to": nxt.label, "chunks_per_request": sent / requests,
                          "mean_bytes": s["connector"]["bytes_sent"] / sent})
    return {"pipeline": name, "requests": requests, "errors": errors, "links": links}


def pipeline_counts(requests: int) -> list[dict[str, Any]]:
    """The chunks each link of the two pipelines carries per request (the workers' own counts)."""
    import trio

    return [trio.run(_run_pipeline, name, requests) for name in ("speech, async-chunk", "speech-pd")]


def _nearest(per_size: list[dict[str, Any]], size: float) -> dict[str, Any]:
    return min(per_size, key=lambda r: abs(np.log(max(size, 1)) - np.log(r["bytes"])))


def _size(n: float) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def markdown(out: dict[str, Any]) -> str:
    """The per-chunk table, the per-request one, and a line saying how it was run."""
    lines = ["| chunk | chunks/s PLAIN | chunks/s CurveZMQ | CPU per chunk PLAIN | CurveZMQ "
             "| CurveZMQ's extra |", "|---|---|---|---|---|---|"]
    for r in out["per_chunk"]:
        p, c = r["plain"], r["curve"]
        lines.append(f"| {_size(r['bytes'])} | {p['per_s']:,.0f} | {c['per_s']:,.0f} | {p['cpu_us']:,.1f} us "
                     f"| {c['cpu_us']:,.1f} us | {c['cpu_us'] - p['cpu_us']:+,.1f} us |")
    lines += ["", "| pipeline | link | chunks per request | mean chunk | extra CPU per request |",
              "|---|---|---|---|---|"]
    for run in out["per_request"]:
        for link in run["links"]:
            lines.append(f"| {run['pipeline']} | {link['from']} -> {link['to']} "
                         f"| {link['chunks_per_request']:.1f} | {_size(link['mean_bytes'])} "
                         f"| {link['extra_cpu_us']:,.0f} us |")
    lines.append("")
    lines.append(f"(`{out['command']}`, {out['date']}: sender and receiver processes on one host over "
                 f"ipc; CPU of both, libzmq's I/O threads included; per request: {out['requests']} requests "
                 f"of the toy models, the extra CPU per chunk taken at the nearest measured size; "
                 f"{out['cpus']} CPUs, load average {out['loadavg']} at the start: {out['machine']}.)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.chunk_security",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), metavar="BYTES",
                   help="chunk sizes (default: 100 B, 8 KB, 64 KB, 1 MB, 16 MB)")
    p.add_argument("--seconds", type=float, default=1.0, help="about this much traffic per size and mode")
    p.add_argument("--requests", type=int, default=4, help="requests per pipeline for the counts (0: skip)")
    p.add_argument("--machine", default="", help="a note on the machine (e.g. 'loaded: a CI run beside')")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help=f"write the tables between {BEGIN} and {END} of this file")
    args = p.parse_args(argv)
    out: dict[str, Any] = {
        "command": "python -m bench.perf.chunk_security "
                   + shlex.join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "cpus": os.cpu_count(),
        "loadavg": round(os.getloadavg()[0], 1), "machine": args.machine or "not described",
        "requests": args.requests, "per_chunk": [], "per_request": []}
    for size in args.sizes:
        n = _chunks_for(size, args.seconds)
        out["per_chunk"].append({"bytes": size, "plain": link_cost(size, False, n),
                                 "curve": link_cost(size, True, n)})
    if args.requests > 0:
        for run in pipeline_counts(args.requests):
            for link in run["links"]:
                r = _nearest(out["per_chunk"], link["mean_bytes"])
                extra = r["curve"]["cpu_us"] - r["plain"]["cpu_us"]
                link["extra_cpu_us"] = link["chunks_per_request"] * extra
            out["per_request"].append(run)
    publish(out, args.json, args.markdown, markdown, BEGIN, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
