"""HTTP faults of the chaos matrix, against a real ``trio-orch serve`` process.

The server runs the default torch pipeline with 2 replicas per stage under
the supervisor.  Clients are httpx streams (server-sent events) sending
text+audio chat completions.  Server-side accounting comes from ``/metrics``
(terminals by kind, active requests, client disconnects, supervisor restarts);
leaks are checked after the server exits: its worker processes, their ipc
directory, and this process's fds.  :class:`HttpFault` is one kind of
:class:`~bench.chaos.faults.Fault`; the registry (:data:`bench.chaos.faults.FAULTS`)
lists the HTTP faults with the others.  httpx (a development dependency) is
imported only when an HTTP fault runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from bench.chaos.hostile import SlowUploads, slow_uploads, smuggle
from bench.chaos.run import ChaosOptions, ChaosResult
from stages.lockdown import serving_pid
from trio_orch.http.limits import HTTPLimits
from trio_orch.testing import child_pids, fd_count, worker_alive

if TYPE_CHECKING:
    import httpx

__all__ = ["HttpFault", "ServerProcess", "chat_body", "parse_metrics"]


class ServerProcess:
    """``trio-orch serve --port 0`` as a child process; knows its URL, workers and ipc directory."""

    def __init__(self, opts: ChaosOptions, replicas: int = 2) -> None:
        self.opts = opts
        self.replicas = replicas
        self.proc: trio.Process | None = None
        self.url = ""
        self.worker_pids: set[int] = set()
        self.ipc_dirs: set[str] = set()
        self.output: list[str] = []

    async def start(self) -> None:
        argv = [sys.executable, "-m", "trio_orch.cli", "serve", "--port", "0",
                "--replicas", str(self.replicas), "--request-timeout", str(self.opts.request_timeout),
                "--device", self.opts.device]
        if self.opts.progress:  # the workers take seconds to start: say so rather than sit silent
            print("  starting trio-orch serve and its workers ...", file=sys.stderr, flush=True)
        self.proc = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     stdin=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        buf = b""
        with trio.fail_after(120):
            while b"serving on http://" not in buf:
                chunk = await self.proc.stdout.receive_some(4096)
                if not chunk:
                    text = buf.decode(errors="replace")
                    raise RuntimeError(f"trio-orch serve exited before serving:\n{text}")
                buf += chunk
        m = re.search(rb"serving on (http://[^\s]+)", buf)
        assert m is not None
        self.url = m.group(1).decode()
        self.output.append(buf.decode(errors="replace"))
        self.scan_workers()

    async def drain_output(self) -> None:
        """Keep reading the server's output so it never blocks on a full pipe."""
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            try:
                chunk = await self.proc.stdout.receive_some(65536)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return
            if not chunk:
                return
            self.output.append(chunk.decode(errors="replace"))

    def scan_workers(self) -> None:
        """Record the server's worker processes (and their ipc directory) from /proc."""
        assert self.proc is not None
        for pid in child_pids(serving_pid(self.proc.pid)):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if b"stages.worker" in cmd:
                self.worker_pids.add(pid)
                addr = cmd[cmd.index(b"--connect") + 1].decode()
                if addr.startswith("ipc://"):
                    self.ipc_dirs.add(os.path.dirname(addr[len("ipc://"):]))

    async def stop(self, sig: int | None = signal.SIGINT, timeout: float = 30.0,
                   t0: float | None = None) -> tuple[int | None, float]:
        """Send ``sig`` (None: it was sent already, at ``t0``); return (exit code, seconds to exit).

        SIGKILL after ``timeout`` (the exit code is then None).
        """
        assert self.proc is not None
        self.scan_workers()  # replacements started since
        t0 = time.monotonic() if t0 is None else t0
        if self.proc.returncode is None and sig is not None:
            self.proc.send_signal(sig)
        with trio.move_on_after(timeout):
            await self.proc.wait()
        code = self.proc.returncode
        if code is None:
            self.proc.kill()
            await self.proc.wait()
        took = time.monotonic() - t0
        if self.proc.stdout is not None:
            await self.proc.stdout.aclose()
        return code, took

    def leaks(self) -> tuple[int, int]:
        procs = sum(1 for p in self.worker_pids if worker_alive(p))
        ipc = sum(max(1, len(os.listdir(d))) for d in self.ipc_dirs if os.path.isdir(d))
        return procs, ipc


def parse_metrics(text: str) -> dict[str, float]:
    """``name{labels}`` -> value, for the sample lines of Prometheus text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            out[key] = float(val)
    return out


def _sum(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


def chat_body(opts: ChaosOptions, i: int, stream: bool = True) -> dict[str, Any]:
    """A text+audio chat completion request body (streamed by default)."""
    return {"messages": [{"role": "user", "content": f"chaos request {i}: say something"}],
            "stream": stream, "modalities": ["text", "audio"], "max_tokens": opts.max_new_tokens}


async def _one_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], leave_after: int | None
                      ) -> str:
    """One SSE request: "ok", an error code, "left" (we disconnected), "cut" or "refused".

    "refused": no response at all (connection refused or closed before a status line: the server
    never accepted it); "cut": a 200 stream that ended without a terminal chunk.
    """
    import httpx

    started = False
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            started = True
            if resp.status_code != 200:
                return f"http_{resp.status_code}"
            seen = 0
            outcome = "cut"
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return outcome
                seen += 1
                if leave_after is not None and seen >= leave_after:
                    return "left"  # leaving the block closes the connection mid-stream
                obj = json.loads(data)
                if "error" in obj:
                    if outcome != "cut":
                        return "duplicate"
                    outcome = obj["error"].get("code") or "error"
                elif any(c.get("finish_reason") for c in obj.get("choices", [])):
                    if outcome != "cut":
                        return "duplicate"
                    outcome = "ok"
            return outcome if outcome != "cut" else "cut"
    except httpx.ConnectError:
        return "refused"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return "cut" if started else "refused"


#: answers that refuse a request before it is accepted (shed, draining): no terminal is owed, nothing
#: was lost -- counted as refused, not as failed or as without terminal
REFUSALS = ("http_429", "http_503")


def count_outcomes(res: ChaosResult, outcomes: dict[str, int]) -> None:
    """The clients' outcomes (:func:`_one_stream`'s) into the row: completed, failed by kind, cut
    (without terminal), duplicates, and refused -- before acceptance, which is not a loss."""
    not_failed = ("ok", "cut", "refused", *REFUSALS)
    res.failed = {k: n for k, n in sorted(outcomes.items()) if k not in not_failed}
    res.completed = outcomes.get("ok", 0)
    res.without_terminal += outcomes.get("cut", 0)
    res.duplicates += outcomes.get("duplicate", 0)
    refusals = {k: n for k, n in sorted(outcomes.items()) if k in REFUSALS}
    if refusals:
        res.notes["refused_by_status"] = ", ".join(f"{k[5:]}: {n}" for k, n in refusals.items())
    res.refused = outcomes.get("refused", 0) + sum(refusals.values())
    res.accepted = sum(outcomes.values()) - res.refused


#: hostile uploads of the slow_body fault: as many as the server reads bodies at once (its default)
SLOW_UPLOADS = HTTPLimits().max_body_reads
#: smuggling attempts of the smuggle fault
SMUGGLES = 20


@dataclass(frozen=True)
class HttpFault:
    """A fault of the HTTP front: ``mode`` "disconnect" (clients leave mid-stream), "sigint", or a
    hostile client beside the load (:mod:`bench.chaos.hostile`): "slow_body" (uploads at a byte a
    second in every read slot all along) or "smuggle" (Content-Length with Transfer-Encoding)."""

    name: str
    description: str
    mode: str

    async def run(self, opts: ChaosOptions) -> ChaosResult:
        res = ChaosResult(self.name, self.description, "torch (thinker/talker/code2wav), via trio-orch serve")
        res.requests = opts.requests
        t_start = time.monotonic()
        fds_before = fd_count()
        server = ServerProcess(opts)
        outcomes: dict[str, int] = {}
        try:
            await server.start()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.drain_output)
                t_sigint = await self._load(server, opts, res, outcomes)
                # one SIGINT only (the sigint fault sent it already): a second Ctrl-C is another fault
                code, took = await server.stop(None if t_sigint else signal.SIGINT, t0=t_sigint)
                res.notes["exit_code"] = code
                if self.mode == "sigint":
                    res.recover_s = took
                    res.detect_s = 0.0
                else:
                    res.notes["shutdown_s"] = round(took, 2)
        except Exception as exc:
            res.error = f"{type(exc).__name__}: {exc}"
            if server.proc is not None and server.proc.returncode is None:
                await server.stop(signal.SIGKILL)
        count_outcomes(res, outcomes)
        res.leaked_processes, res.leaked_ipc_files = server.leaks()
        res.leaked_fds = max(0, fd_count() - fds_before)
        if res.notes.get("exit_code") != 0:  # serve's documented code after a clean SIGINT drain
            res.error = res.error or f"server exit code {res.notes.get('exit_code')} (None: killed)"
        if res.error and opts.progress:
            tail = "".join(server.output)[-3000:]
            print(f"  {self.name}: server output (tail):\n{tail}", file=sys.stderr, flush=True)
        res.wall_s = time.monotonic() - t_start
        return res

    @staticmethod
    async def _smuggle(url: str, res: ChaosResult) -> None:
        seen = await smuggle(url, SMUGGLES)
        res.notes["smuggle"] = ", ".join(f"{k}: {n}" for k, n in sorted(seen.items()))
        if seen.get("refused", 0) != SMUGGLES:
            res.error = res.error or f"smuggling: {res.notes['smuggle']} (every attempt must be refused)"

    async def _load(self, server: ServerProcess, opts: ChaosOptions, res: ChaosResult,
                    outcomes: dict[str, int]) -> float | None:
        """Send the load; return when SIGINT was sent (sigint mode) or None."""
        import httpx

        limits = httpx.Limits(max_connections=opts.concurrency, max_keepalive_connections=opts.concurrency)
        timeout = httpx.Timeout(opts.request_timeout + 30)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            sent = 0
            stop_at = opts.requests // 2 if self.mode == "sigint" else None
            t_sigint: float | None = None
            slots = trio.Semaphore(opts.concurrency)

            async def one(i: int) -> None:
                try:
                    leave = 2 if self.mode == "disconnect" and i % 2 else None
                    kind = await _one_stream(client, server.url, chat_body(opts, i), leave)
                    outcomes[kind] = outcomes.get(kind, 0) + 1
                finally:
                    slots.release()

            stop_hostile = trio.Event()
            slow = SlowUploads()
            async with trio.open_nursery() as nursery:
                if self.mode == "slow_body":
                    nursery.start_soon(slow_uploads, server.url, SLOW_UPLOADS, stop_hostile, slow)
                    with trio.move_on_after(10):  # the attack in place before the load
                        while slow.started + sum(slow.answers.values()) < SLOW_UPLOADS:
                            await trio.sleep(0.05)
                if self.mode == "smuggle":
                    nursery.start_soon(self._smuggle, server.url, res)
                for i in range(opts.requests):
                    await slots.acquire()
                    if stop_at is not None and i == stop_at:
                        assert server.proc is not None
                        server.proc.send_signal(signal.SIGINT)
                        t_sigint = time.monotonic()
                    nursery.start_soon(one, i)
                    sent += 1
                    if opts.progress and sent % 250 == 0:
                        print(f"  {self.name}: {sent}/{opts.requests} sent", file=sys.stderr, flush=True)
                while slots.value < opts.concurrency:  # every request of the load answered: the attack ends
                    await trio.sleep(0.05)
                stop_hostile.set()
            if self.mode == "slow_body":
                res.notes["slow_uploads"] = SLOW_UPLOADS
                res.notes["slow_answers"] = ", ".join(f"{k}: {n}" for k, n in sorted(slow.answers.items()))
                if slow.answers.get("408", 0) == 0:
                    res.error = res.error or "no slow upload was refused (408): they held the read slots"
            if self.mode == "sigint":
                res.still_serving = "n/a (stopped)"
                res.notes["sigint_after"] = stop_at
                return t_sigint
            # server-side: every request ended (disconnected ones aborted), exactly once
            t_load_done = time.monotonic()
            metrics: dict[str, float] = {}
            with trio.move_on_after(30):
                while True:
                    metrics = parse_metrics((await client.get(server.url + "/metrics")).text)
                    if metrics.get("trio_orch_active_requests", 1) == 0:
                        break
                    await trio.sleep(0.05)
            res.recover_s = time.monotonic() - t_load_done
            terminals = _sum(metrics, "trio_orch_terminals_total")
            res.notes["server_terminals"] = int(terminals)
            res.notes["server_aborted"] = int(metrics.get('trio_orch_terminals_total{kind="aborted"}', 0))
            res.notes["disconnects_seen"] = int(metrics.get("trio_orch_http_client_disconnects_total", 0))
            res.notes["server_active_after"] = int(metrics.get("trio_orch_active_requests", -1))
            refused = sum(outcomes.get(k, 0) for k in (*REFUSALS, "refused"))  # never accepted: no terminal
            res.without_terminal += max(0, opts.requests - refused - int(terminals))
            res.duplicates += max(0, int(terminals) - opts.requests)
            ok = 0
            for i in range(opts.probe_requests):
                r = await client.post(server.url + "/v1/chat/completions",
                                      json=chat_body(opts, i, stream=False))
                ok += r.status_code == 200
            after = parse_metrics((await client.get(server.url + "/metrics")).text)
            res.still_serving = "yes" if ok == opts.probe_requests else "no"
            res.notes["probe_ok"] = ok
            res.restarts = int(_sum(after, "trio_orch_supervisor_restarts_total"))
            return None
