"""The pieces of a launch's credentials: the ticket rule, the hand-over, the lock-down, a ``Ready``'s pid.

Real child processes for the hand-over and the lock-down (a copied socket, a
tracer that is not an ancestor, a stand-in and its fresh child); a real ZMQ
socket pair for the ``Ready`` check.
"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
import zmq

from stages.auth import Authenticator
from stages.credentials import Handover, Launch, check_launch, peer_pid
from stages.lockdown import serving_pid
from stages.wire import OutboundMsg, Ready, WireCodec
from tests.waiting import HANG, wait_until
from trio_orch.cluster.transport import ZmqStageClient

ROOT = Path(__file__).resolve().parents[2]

ASK = ("import sys\n"
       "from stages.lockdown import lock_down\n"
       "from stages.credentials import HandoverError, receive_credentials\n"
       "lock_down(fresh=sys.argv[2] == 'fresh')\n"
       "try:\n"
       "    print(receive_credentials(int(sys.argv[1]), timeout=30).decode(), flush=True)\n"
       "except HandoverError as exc:\n"
       "    print('refused:', exc, flush=True)\n"
       "    sys.exit(4)\n")


def test_a_slot_takes_its_current_ticket_from_the_launched_pid_and_nothing_else() -> None:
    launch = Launch("trio-orch:ctl:s", "stage 0 replica 0", b"t" * 64, pid=4242)
    ipc = b"localhost:1000:1000:%d"
    assert check_launch(launch, b"launch", b"t" * 64, ipc % 4242).ok
    assert check_launch(launch, b"launch", b"t" * 64, ipc % 4242).ok  # its reconnection too
    assert check_launch(launch, b"launch", b"t" * 64, ipc % 4243).reason == "stranger"
    assert check_launch(launch, b"launch", b"x" * 64, ipc % 4242).reason == "stale_ticket"
    assert check_launch(launch, b"pipeline", b"t" * 64, ipc % 4242).reason == "stale_ticket"
    assert check_launch(None, b"launch", b"t" * 64, ipc % 4242).reason == "no_launch"
    tcp = Launch("trio-orch:ctl:s", "stage 0 replica 0", b"t" * 64, pid=4242)  # no pid to check: once
    assert check_launch(tcp, b"launch", b"t" * 64, b"10.0.0.5").ok
    assert check_launch(tcp, b"launch", b"t" * 64, b"10.0.0.5").reason == "spent"


def test_the_peer_pid_is_read_from_libzmqs_ipc_peer_address_only() -> None:
    assert peer_pid(b"localhost:0:0:8783") == 8783 and peer_pid("localhost:1000:100:7") == 7
    assert peer_pid(b"10.0.0.5") is None and peer_pid(b"") is None and peer_pid(None) is None
    assert peer_pid("fe80::1:2:3") is None


def serve_handover(h: Handover, pid: int, payload: bytes) -> list[tuple[bool, int | None]]:
    """Answer until delivered (or the child's end closed); every answer in order."""
    answers = []
    end = time.monotonic() + HANG
    while time.monotonic() < end:
        select.select([h.fileno()], [], [], 1.0)
        answer = h.answer(pid, payload)
        if answer != (False, None):
            answers.append(answer)
        if answer[0]:
            return answers
    raise AssertionError("no request came")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCM_CREDENTIALS is Linux's")
def test_the_handover_answers_the_launched_process_or_its_fresh_child_and_no_one_else() -> None:
    h = Handover()
    # the stranger holds a copy of the inherited socket (as pidfd_getfd would give it) and asks first
    stranger = subprocess.Popen([sys.executable, "-c", ASK, str(h.child_fd), "plain"], cwd=ROOT,
                                pass_fds=(h.child_fd,), stdout=subprocess.PIPE, text=True)
    refused = serve_handover_once(h, 0)
    launched = subprocess.Popen([sys.executable, "-c", ASK, str(h.child_fd), "fresh"], cwd=ROOT,
                                pass_fds=(h.child_fd,), stdout=subprocess.PIPE, text=True)
    h.child_started(b"the-credentials")
    try:
        assert refused == (False, stranger.pid)
        out, _ = stranger.communicate(timeout=HANG)
        assert stranger.returncode == 4 and "the-credentials" not in out  # it got nothing
        # the launched one's socket cannot be reopened through /proc, even by root
        with pytest.raises(OSError):
            open(f"/proc/{launched.pid}/fd/{h.child_fd}", "rb").close()
        [(delivered, asker)] = serve_handover(h, launched.pid, b"the-credentials")
        assert delivered and asker != launched.pid  # its fresh child asked, and got them
        out, _ = launched.communicate(timeout=HANG)
        assert out.strip() == "the-credentials" and launched.returncode == 0
    finally:
        h.close()
        for p in (stranger, launched):
            if p.poll() is None:
                p.kill()
                p.wait()


def serve_handover_once(h: Handover, pid: int) -> tuple[bool, int | None]:
    end = time.monotonic() + HANG
    while time.monotonic() < end:
        select.select([h.fileno()], [], [], 1.0)
        answer = h.answer(pid, b"the-credentials")
        if answer != (False, None):
            return answer
    raise AssertionError("no request came")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stand-in is Linux's")
def test_a_fresh_lock_down_goes_on_in_a_child_whose_stand_in_passes_signals_on_and_dies_alike() -> None:
    code = ("import os, signal, sys, time\n"
            "from stages.lockdown import lock_down, dumpable\n"
            "lock_down(fresh=True)\n"
            "lock_down(fresh=True)\n"  # a fresh child forks no more
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
            "print(os.getpid(), os.getppid(), dumpable(), flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child, parent, dump = proc.stdout.readline().split()
    assert int(parent) == proc.pid != int(child) and dump == "False"
    assert serving_pid(proc.pid) == int(child) and serving_pid(int(child)) == int(child)
    assert os.getpgid(int(child)) == int(child) != os.getpgid(proc.pid)  # no terminal: a group of its own
    proc.send_signal(signal.SIGTERM)  # to the stand-in: the child's handler answers, and exits 7
    assert proc.wait(HANG) == 7
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child = proc.stdout.readline().split()[0]
    os.kill(int(child), signal.SIGKILL)  # the child killed: its stand-in dies the same way
    assert proc.wait(HANG) == -signal.SIGKILL
    assert not Path(f"/proc/{child}").exists()  # and it was reaped


def test_a_stand_in_whose_launcher_ignores_sigchld_still_waits_for_its_child_and_ends_as_it_ends() -> None:
    """Launched with SIGCHLD ignored (the kernel would reap the fresh child unseen), the stand-in still
    sees its child's exit and passes signals on; the child keeps the launcher's SIGCHLD disposition."""
    code = ("import signal, sys, time\n"
            "from stages.lockdown import lock_down\n"
            "lock_down(fresh=True)\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
            "print(signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN, flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGCHLD, signal.SIG_IGN))
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "True"  # the child: as launched
    child = serving_pid(proc.pid)
    assert child != proc.pid
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(HANG) == 7
    assert not Path(f"/proc/{child}").exists()


TERMINAL = ("import os, signal, sys\n"
            "from stages.lockdown import lock_down\n"
            "lock_down(fresh=True)\n"
            "for sig in (signal.SIGINT, signal.SIGUSR1):\n"
            "    signal.signal(sig, lambda n, f: print('got', signal.Signals(n).name, flush=True))\n"
            "print('group', os.getpgrp() == os.getpgid(os.getppid()), flush=True)\n"
            "print('read', sys.stdin.readline().strip(), flush=True)\n"
            "sys.stdin.readline()\n"
            "sys.exit(5)\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stand-in is Linux's")
def test_in_a_terminals_foreground_the_fresh_child_reads_the_terminal_and_gets_each_signal_once() -> None:
    """A terminal's Ctrl-C reaches the stand-in's whole group, the child with it: the stand-in passes on
    only what was sent to it alone (here SIGUSR1), and the child, in that foreground group, reads the
    terminal (in a group of its own it would be stopped by SIGTTIN)."""
    pid, fd = pty.fork()  # the child leads a session whose controlling terminal is the pty
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-c", TERMINAL])
    seen = b""

    def until(text: bytes) -> str:
        nonlocal seen
        end = time.monotonic() + HANG
        while not re.search(text, seen) and time.monotonic() < end:
            if select.select([fd], [], [], 1.0)[0]:
                try:
                    seen += os.read(fd, 4096)
                except OSError:  # EIO: the terminal's other end closed
                    break
        return seen.decode(errors="replace")

    try:
        assert "group True" in until(rb"group \w+\r?\n")
        os.write(fd, b"typed\n")
        assert "read typed" in until(rb"read \w+")
        os.kill(pid, signal.SIGSTOP)  # the stand-in takes the Ctrl-C only after the child took its own
        wait_until(lambda: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T",
                   "the stand-in is stopped", hang=HANG)
        os.write(fd, b"\x03")  # Ctrl-C: the terminal signals its foreground group, stand-in and child
        until(rb"got SIGINT")
        os.kill(pid, signal.SIGCONT)
        # to the stand-in alone: passed on -- after the SIGINT, had it passed that on (lowest number first)
        os.kill(pid, signal.SIGUSR1)
        until(rb"got SIGUSR1")
        os.write(fd, b"\n")
        _, status = os.waitpid(pid, 0)
        out = until(rb"$^")  # the rest
        assert re.findall(r"got (\w+)", out) == ["SIGINT", "SIGUSR1"], out
        assert os.waitstatus_to_exitcode(status) == 5
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ptrace is Linux's here")
def test_lock_down_refuses_to_go_on_under_a_tracer_that_is_not_an_ancestor() -> None:
    code = ("import sys\n"
            "sys.stdin.readline()\n"  # traced by now
            "from stages.lockdown import LockdownError, lock_down\n"
            "try:\n"
            "    lock_down()\n"
            "except LockdownError as exc:\n"
            "    print(exc, flush=True); sys.exit(3)\n")
    target = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    tracer = subprocess.Popen([sys.executable, "-c", (  # a sibling, not an ancestor: PTRACE_SEIZE
        "import ctypes, sys, time\n"
        "ok = ctypes.CDLL(None, use_errno=True).ptrace(0x4206, int(sys.argv[1]), 0, 0) == 0\n"
        "print('seized' if ok else 'denied', flush=True)\n"
        "time.sleep(60)\n"), str(target.pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert tracer.stdout is not None and target.stdin is not None
        if tracer.stdout.readline().strip() != "seized":
            pytest.skip("this host lets no process ptrace a sibling (Yama or a seccomp filter)")
        target.stdin.write("go\n")
        target.stdin.flush()
        assert target.stdout is not None
        out = target.stdout.readline()
        tracer.kill()  # a traced process's exit waits for its tracer
        tracer.wait()
        assert target.wait(HANG) == 3 and f"process {tracer.pid}" in out and "traces it" in out
    finally:
        for p in (tracer, target):
            if p.poll() is None:
                p.kill()
            p.wait()


async def test_a_ready_counts_only_from_the_pid_the_worker_was_launched_as(tmp_path: Path) -> None:
    ctx = zmq.Context()
    auth = Authenticator(ctx).start()
    codec = WireCodec(OutboundMsg)
    peer = ctx.socket(zmq.DEALER)
    try:
        client = ZmqStageClient(ctx, f"ipc://{tmp_path}/ctl", name="stage 0 (echo) replica 0",
                                authenticator=auth)
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            client.expected_pid = os.getpid() + 1  # launched as another process than this one
            peer.connect(client.address)
            peer.send_multipart(codec.encode(Ready(0, 0, os.getpid() + 1, "echo")))  # it lies about its pid
            with trio.fail_after(HANG):
                while auth.refused["ready:stranger"] < 1:
                    await trio.sleep(0.01)
            assert client.ready is None
            client.expected_pid = os.getpid()  # now this process is the launched one
            peer.send_multipart(codec.encode(Ready(0, 0, os.getpid(), "echo")))
            with trio.fail_after(HANG):
                await client.wait_ready()
            assert client.ready is not None and client.ready.pid == os.getpid()
            await client.aclose()
    finally:
        peer.close(linger=0)
        auth.stop()
        ctx.destroy(linger=0)
