"""Replicas that join over loopback TCP: real worker processes, real CurveZMQ sockets.

The head is an in-test pipeline (local echo workers) with a registrar on
127.0.0.1; remote replicas are ``python -m stages.headless`` processes with
keys made by :func:`stages.auth.generate_keys`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq

from stages import membership_wire as mw
from stages.auth import Keypair, generate_keys, load_keypair
from stages.config import echo_config
from stages.wire import Dying, Heartbeat, OutboundMsg, OutItem, Outputs, WireCodec
from trio_orch import OrchError, OrchOutput, open_orchestrator
from trio_orch.cluster.launcher import Pipeline, open_pipeline
from trio_orch.cluster.registrar import HeadKeys, Registrar, open_registrar

pytestmark = pytest.mark.slow

TOML = """
[pipeline]
final_stages = [1]
heartbeat_interval = 0.2
heartbeat_timeout = 1.5
[[stages]]
kind = "echo"
[[stages]]
kind = "echo"
[stages.model]
outputs = {outputs}
"""


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate_keys(tmp_path / "keys", workers=2)
    return tmp_path / "keys"


def config_file(tmp_path: Path, outputs: int = 3) -> Path:
    p = tmp_path / "pipe.toml"
    p.write_text(TOML.format(outputs=outputs))
    return p


@asynccontextmanager
async def head(
    keys: Path, outputs: int = 3, delay_ms: int = 0
) -> AsyncIterator[tuple[Pipeline, Registrar, Any]]:
    """Stage 0 echoes once; stage 1 ``outputs`` times, each step taking ``delay_ms`` (local replica)."""
    config = echo_config(2, heartbeat_interval=0.2, heartbeat_timeout=1.5)
    config.stages[1].model = {"outputs": outputs}
    config.stages[1].worker_args = ["--step-delay-ms", str(delay_ms)]
    async with (
        open_pipeline(config, inbox_host="127.0.0.1") as pipe,
        open_registrar(pipe, "tcp://127.0.0.1:0", HeadKeys.load(keys)) as reg,
        open_orchestrator(pipe.stages, **pipe.orchestrator_kwargs()) as orch,
    ):
        yield pipe, reg, orch


async def start_worker(
    reg: Registrar, keys: Path, cfg: Path, *extra: str, stage: int = 1, key: str = "worker-1"
) -> trio.Process:
    argv = [
        sys.executable,
        "-m",
        "stages.headless",
        "--stage",
        str(stage),
        "--head",
        reg.address,
        "--keys",
        str(keys),
        "--key",
        key,
        "--config",
        str(cfg),
        "--advertise",
        "127.0.0.1",
        "--head-timeout",
        "2",
        *extra,
    ]
    return await trio.lowlevel.open_process(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def wait_for(pred: Any, timeout: float = 60.0) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.02)


async def stop(proc: trio.Process) -> None:
    if proc.returncode is None:
        proc.kill()
    await proc.wait()


async def run_requests(orch: Any, ids: list[str]) -> dict[str, Any]:
    for rid in ids:
        await orch.add_request(rid, f"p-{rid}")
    ends: dict[str, Any] = {}
    with trio.fail_after(60):
        while len(ends) < len(ids):
            msg = await orch.next_output()
            if msg.finished:
                assert msg.request_id not in ends, f"second terminal for {msg.request_id}"
                ends[msg.request_id] = msg
    return ends


async def test_a_remote_replica_joins_and_takes_new_requests(keys: Path, tmp_path: Path) -> None:
    async with head(keys, outputs=10, delay_ms=10) as (pipe, reg, orch):
        pool = pipe.stages[1]
        before = await run_requests(orch, [f"a{i}" for i in range(4)])
        assert all(isinstance(m, OrchOutput) for m in before.values())
        proc = await start_worker(reg, keys, config_file(tmp_path, 10), "--step-delay-ms", "10")
        try:
            await wait_for(lambda: reg.counters["joined"] == 1)
            assert pool.replica_counts() == (2, 2)
            ends = await run_requests(orch, [f"b{i}" for i in range(8)])
            assert all(isinstance(m, OrchOutput) for m in ends.values()), ends
            assert pool.placements[1] >= 3  # the joined replica took new requests
            assert reg.auth.refusals == 0
        finally:
            await stop(proc)
        await wait_for(lambda: reg.counters["lost"] == 1)
        assert pool.replica_counts() == (1, 2)


async def test_graceful_leave_under_load_loses_no_request(keys: Path, tmp_path: Path) -> None:
    async with head(keys, outputs=30, delay_ms=5) as (pipe, reg, orch):
        pool = pipe.stages[1]
        proc = await start_worker(reg, keys, config_file(tmp_path, outputs=30), "--step-delay-ms", "20")
        try:
            await wait_for(lambda: reg.counters["joined"] == 1)
            ids = [f"r{i}" for i in range(12)]
            for rid in ids:
                await orch.add_request(rid, rid)
            await wait_for(lambda: pool.in_flight()[1] > 0)
            proc.send_signal(signal.SIGTERM)  # leave: finish what it holds, take nothing new
            ends: dict[str, Any] = {}
            more = [f"s{i}" for i in range(6)]
            for rid in more:  # requests added during the leave go to the local replica
                await orch.add_request(rid, rid)
            with trio.fail_after(60):
                while len(ends) < len(ids) + len(more):
                    msg = await orch.next_output()
                    if msg.finished:
                        ends[msg.request_id] = msg
            assert all(isinstance(m, OrchOutput) for m in ends.values()), {
                r: m for r, m in ends.items() if isinstance(m, OrchError)
            }
            with trio.fail_after(30):
                assert await proc.wait() == 0
            await wait_for(lambda: reg.counters["left"] == 1)
            assert pool.placements[1] > 0
        finally:
            await stop(proc)


async def test_kill_9_of_a_remote_worker_fails_exactly_its_requests(keys: Path, tmp_path: Path) -> None:
    async with head(keys, outputs=200, delay_ms=50) as (pipe, reg, orch):
        pool = pipe.stages[1]
        proc = await start_worker(reg, keys, config_file(tmp_path, outputs=200), "--step-delay-ms", "50")
        try:
            await wait_for(lambda: reg.counters["joined"] == 1)
            ids = [f"k{i}" for i in range(6)]
            for rid in ids:
                await orch.add_request(rid, rid)
            await wait_for(lambda: all(pool.replica_of(r) is not None for r in ids), 30)
            on_remote = {r for r in ids if pool.replica_of(r) == 1}
            assert on_remote
            proc.kill()
            ends: dict[str, Any] = {}
            with trio.fail_after(60):
                while len(ends) < len(ids):
                    msg = await orch.next_output()
                    if msg.finished:
                        ends[msg.request_id] = msg
            died = {r for r, m in ends.items() if isinstance(m, OrchError) and m.kind == "replica_died"}
            # those that had produced output there fail; the others are failed over to the local replica
            retried = orch.statistics().core.retried_by_stage[1]
            assert died <= on_remote and len(on_remote - died) == retried
            assert all(isinstance(ends[r], OrchOutput) for r in set(ids) - died)
            assert reg.counters["lost"] == 1
        finally:
            await stop(proc)


async def test_a_worker_with_an_unknown_key_is_refused(keys: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    generate_keys(other, workers=1)
    (other / "head.key").write_text((keys / "head.key").read_text())  # it knows the right head
    async with head(keys) as (pipe, reg, _orch):
        proc = await start_worker(reg, other, config_file(tmp_path), "--register-timeout", "20")
        with trio.fail_after(40):
            code = await proc.wait()
        assert code == 1
        assert proc.stderr is not None
        err = (await proc.stderr.receive_some(65536)).decode()
        assert "refused this worker's key" in err
        assert reg.auth.refused["curve:register"] >= 1
        assert reg.counters["joined"] == 0
        assert pipe.stages[1].replica_counts() == (1, 1)


async def test_a_worker_refuses_a_head_whose_key_it_was_not_given(keys: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    generate_keys(other, workers=1)
    (other / "workers" / "worker-1.key_secret").write_text(
        (keys / "workers" / "worker-1.key_secret").read_text()
    )
    async with head(keys) as (_pipe, reg, _orch):
        proc = await start_worker(reg, other, config_file(tmp_path), "--register-timeout", "20")
        with trio.fail_after(40):
            assert await proc.wait() == 1
        assert proc.stderr is not None
        err = (await proc.stderr.receive_some(65536)).decode()
        assert "security handshake with the head failed" in err
        assert reg.counters["joined"] == 0


async def test_a_stale_identity_is_refused_and_a_new_one_joins(keys: Path, tmp_path: Path) -> None:
    cfg = config_file(tmp_path)
    async with head(keys) as (pipe, reg, orch):
        first = await start_worker(reg, keys, cfg, "--member-id", "m-stale")
        await wait_for(lambda: reg.counters["joined"] == 1)
        await stop(first)
        await wait_for(lambda: reg.counters["lost"] == 1)
        again = await start_worker(reg, keys, cfg, "--member-id", "m-stale")
        with trio.fail_after(40):
            assert await again.wait() == 1
        assert reg.counters["refused.stale"] == 1
        fresh = await start_worker(reg, keys, cfg)
        try:
            await wait_for(lambda: reg.counters["joined"] == 2)
            ends = await run_requests(orch, [f"n{i}" for i in range(4)])
            assert all(isinstance(m, OrchOutput) for m in ends.values())
            assert pipe.stages[1].replica_counts() == (2, 2)  # the dead member's slot was reused
        finally:
            await stop(fresh)


async def test_the_workers_own_key_cannot_take_the_place_of_a_worker_that_joined(keys: Path,
                                                                                  tmp_path: Path) -> None:
    """A joined worker's control link takes the session key it made for this join, not its key file's."""
    async with head(keys, outputs=2) as (pipe, reg, orch):
        proc = await start_worker(reg, keys, config_file(tmp_path, 2))
        ctx = zmq.Context()
        try:
            await wait_for(lambda: reg.counters["joined"] == 1)
            [member] = reg.members.values()
            stolen = load_keypair(keys / "workers" / "worker-1.key_secret")
            assert member.public_key == stolen.public.decode() != member.session_key
            intruder = ctx.socket(zmq.DEALER)
            intruder.linger = 0
            intruder.curve_serverkey = reg.keys.keypair.public
            intruder.curve_publickey, intruder.curve_secretkey = stolen.public, stolen.secret
            intruder.connect(member.client.address)
            await wait_for(lambda: reg.auth.refused["curve:ctl"] >= 1, 20)
            ends = await run_requests(orch, [f"s{i}" for i in range(8)])
            assert all(isinstance(m, OrchOutput) for m in ends.values())
            assert pipe.stages[1].placements[member.replica] >= 1 and intruder.poll(100) == 0
        finally:
            ctx.destroy(linger=0)
            await stop(proc)


async def register_raw(reg: Registrar, pair: Keypair, session: str) -> mw.RegistrationMsg | None:
    """One ``Register`` for stage 1 on a raw DEALER with ``pair``; the head's answer (None: none)."""
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.curve_serverkey = reg.keys.keypair.public
        s.curve_publickey, s.curve_secretkey = pair.public, pair.secret
        s.connect(reg.address)
        s.send(mw.encode(mw.Register("m-raw", 1, "echo", "", pair.public.decode(), {}, session_key=session)))
        with trio.move_on_after(5):
            while not s.poll(0):
                await trio.sleep(0.02)
            return mw.decode(s.recv())
        return None
    finally:
        ctx.destroy(linger=0)


async def test_a_one_time_key_opens_the_registration_once_and_a_join_needs_a_session_key(keys: Path) -> None:
    async with head(keys) as (_pipe, reg, _orch):
        pair = reg.one_time_key()
        answer = await register_raw(reg, pair, "")  # through the handshake once ...
        assert isinstance(answer, mw.Refused) and answer.reason == "no_session_key"
        assert reg.counters["one_time_keys_spent"] == 1
        before = reg.auth.refused["curve:register"]
        assert await register_raw(reg, pair, Keypair.generate().public.decode()) is None  # ... never again
        assert reg.auth.refused["curve:register"] > before


async def test_a_process_without_the_pipeline_secret_cannot_forge_or_steal(keys: Path) -> None:
    async with head(keys) as (pipe, reg, orch):
        client = pipe.stages[1].replicas[0]
        assert client.address.startswith("ipc://")
        ctx = zmq.Context()
        codec = WireCodec(OutboundMsg)
        try:
            plain = ctx.socket(zmq.DEALER)  # no security at all
            wrong = ctx.socket(zmq.DEALER)  # PLAIN with a guessed ticket
            wrong.plain_username, wrong.plain_password = b"launch", b"guess"
            for s in (plain, wrong):
                s.linger = 0
                s.connect(client.address)
                for msg in (Outputs([OutItem("x1", "forged", True)]), Heartbeat(0.0, 0), Dying("forged")):
                    try:
                        s.send_multipart(codec.encode(msg), zmq.NOBLOCK)
                    except zmq.Again:  # the handshake failed already and its pipe is gone: refused
                        pass
            refused = reg.auth.refused
            await wait_for(lambda: refused["handshake:ipc"] >= 1 and refused["launch:stale_ticket"] >= 1, 10)
            ends = await run_requests(orch, [f"f{i}" for i in range(6)])  # none of them is stolen
            assert all(isinstance(m, OrchOutput) for m in ends.values())
            assert client.alive and client.garbage_frames == 0
            assert orch.dropped_outputs == 0 and pipe.stages[1].stray_outputs["unknown"] == 0
            for s in (plain, wrong):
                assert s.poll(100) == 0  # no submit reached the forger
        finally:
            ctx.destroy(linger=0)


# stage 1 has no local replica: it waits for one to join
LISTEN_TOML = TOML.replace('kind = "echo"\n[stages.model]', 'kind = "echo"\nreplicas = 0\n[stages.model]')


async def start_generate(tmp_path: Path, keys: Path, *extra: str) -> tuple[trio.Process, str]:
    """``trio-orch generate`` listening on an ephemeral port; (process, stderr up to its waiting line)."""
    cfg = tmp_path / "listen.toml"
    cfg.write_text(LISTEN_TOML.format(outputs=3))
    argv = [sys.executable, "-m", "trio_orch.cli", "generate", "hi", "--config", str(cfg),
            "--listen", "tcp://127.0.0.1:0", "--keys", str(keys), "--out", str(tmp_path / "o.wav"), *extra]
    proc = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = b""
    with trio.fail_after(60):
        while b"waiting up to" not in err or not err.endswith(b"\n"):
            chunk = await proc.stderr.receive_some(65536)
            assert chunk, err.decode()
            err += chunk
    return proc, err.decode()


async def rest_of(stream: Any) -> str:
    out = b""
    while chunk := await stream.receive_some(65536):
        out += chunk
    return out.decode()


async def test_generate_with_listen_waits_until_a_replica_joins_then_answers(
    keys: Path, tmp_path: Path
) -> None:
    gen, err = await start_generate(tmp_path, keys)
    worker: trio.Process | None = None
    try:
        assert "stage(s) 1 (echo) have none yet" in err, err
        head = err.split("--head ")[1].split()[0]  # the port the registrar got
        assert head.startswith("tcp://127.0.0.1:") and not head.endswith(":0")
        cfg = tmp_path / "listen.toml"
        worker = await trio.lowlevel.open_process(
            [sys.executable, "-m", "stages.headless", "--stage", "1", "--head", head, "--keys", str(keys),
             "--config", str(cfg), "--advertise", "127.0.0.1"], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        assert gen.stdout is not None and gen.stderr is not None
        with trio.fail_after(60):
            out, rest = await rest_of(gen.stdout), await rest_of(gen.stderr)
            assert await gen.wait() == 0, err + rest
        assert "stage 1 (echo): a replica joined" in rest
        assert "text: hihihi\n" in out  # the joined replica's three outputs
        assert "(not run)" not in out  # both stages ran it (the timings table)
        with trio.fail_after(30):
            assert await worker.wait() == 0  # the head told it that it was going
    finally:
        for p in (gen, worker):
            if p is not None:
                await stop(p)


async def test_generate_with_listen_gives_up_naming_the_stage_without_a_replica(
    keys: Path, tmp_path: Path
) -> None:
    gen, _ = await start_generate(tmp_path, keys, "--join-timeout", "0.5")
    try:
        assert gen.stderr is not None
        with trio.fail_after(60):
            rest = await rest_of(gen.stderr)
            assert await gen.wait() == 1
        assert "error: no replica joined stage(s) 1 (echo) within 0.5 s" in rest
    finally:
        await stop(gen)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def namespaces() -> Any:
    """Two network namespaces joined by a veth pair: the head at 10.231.0.1, the worker at .2.

    Nothing else is reachable from either (no default route, no other interface but
    loopback), so a pipeline that works across them needs nothing but the TCP address.
    Skipped where network namespaces cannot be made (not root, no ``ip``).
    """
    tag = f"{os.getpid() % 100000}"
    names = (f"trio-orch-head-{tag}", f"trio-orch-worker-{tag}")
    try:
        for n in names:
            _ip("netns", "add", n)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {exc}")
    try:
        head_ns, worker_ns = names
        _ip("link", "add", f"toh{tag}", "netns", head_ns, "type", "veth", "peer", "name", f"tow{tag}",
            "netns", worker_ns)
        ends = ((head_ns, f"toh{tag}", "10.231.0.1/30"), (worker_ns, f"tow{tag}", "10.231.0.2/30"))
        for ns, dev, addr in ends:
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


async def test_head_and_worker_in_separate_network_namespaces_need_only_the_tcp_address(
    keys: Path, tmp_path: Path, namespaces: tuple[str, str]
) -> None:
    """``generate --listen`` in one namespace, its only stage-1 replica joins from another."""
    head_ns, worker_ns = namespaces
    cfg = tmp_path / "listen.toml"
    cfg.write_text(LISTEN_TOML.format(outputs=3))
    gen = await trio.lowlevel.open_process(
        ["ip", "netns", "exec", head_ns, sys.executable, "-m", "trio_orch.cli", "generate", "hi", "--config",
         str(cfg), "--listen", "tcp://10.231.0.1:0", "--keys", str(keys), "--out", str(tmp_path / "o.wav")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    worker: trio.Process | None = None
    try:
        assert gen.stdout is not None and gen.stderr is not None
        err = b""
        with trio.fail_after(60):
            while b"waiting up to" not in err or not err.endswith(b"\n"):
                chunk = await gen.stderr.receive_some(65536)
                assert chunk, err.decode()
                err += chunk
        address = err.decode().split("--head ")[1].split()[0]
        assert address.startswith("tcp://10.231.0.1:")
        worker = await trio.lowlevel.open_process(
            ["ip", "netns", "exec", worker_ns, sys.executable, "-m", "stages.headless", "--stage", "1",
             "--head", address, "--keys", str(keys), "--config", str(cfg), "--advertise", "10.231.0.2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        with trio.fail_after(60):
            out, rest = await rest_of(gen.stdout), await rest_of(gen.stderr)
            assert await gen.wait() == 0, err.decode() + rest
        assert "stage 1 (echo): a replica joined" in rest
        assert "text: hihihi\n" in out  # from the replica in the other namespace
        with trio.fail_after(30):
            assert await worker.wait() == 0
    finally:
        for p in (gen, worker):
            if p is not None:
                await stop(p)
