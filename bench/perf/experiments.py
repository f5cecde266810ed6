"""``python -m bench.perf.experiments``: the measurements behind docs/performance.md.

Each experiment isolates one cost on the dispatch path and prints p50/p99
(µs) or a per-operation cost measured in this run, interleaved across
variants so machine drift hits all alike.  Nothing here is asserted: it is
the record of what was tried and what it changed.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import trio

from bench.implementations import make_driver
from bench.perf import workloads
from bench.perf.stats import percentiles_us
from trio_orch.core import Router
from trio_orch.types import StageOutput

#: label -> (implementation, driver options): the Trio shell and the TaskGroup reference (the same
#: design on asyncio) with and without the push fast path, the floor, vLLM-Omni's design
INPROC_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "floor": ("floor", {}),
    "trio": ("trio", {"push": True}),
    "trio (receive loop)": ("trio", {"push": False}),  # readers loop on receive()
    "asyncio-taskgroup": ("asyncio-taskgroup", {"push": True}),
    "asyncio-taskgroup (receive loop)": ("asyncio-taskgroup", {"push": False}),
    "omni-event": ("omni-event", {}),
}


def router_cost(n: int = 100_000) -> float:
    """µs per output spent in Router.route for one request on a final stage."""
    r = Router(3, {0, 2})
    r.add("a", "p", final_stage_id=0)
    outs = [StageOutput("a", i, False) for i in range(n)]
    t = time.perf_counter()
    for o in outs:
        r.route(0, o)
    return (time.perf_counter() - t) / n * 1e6


def trio_hop(n: int = 20_000) -> float:
    """µs per one-way hop between two Trio tasks over memory channels."""
    result: list[float] = []

    async def main() -> None:
        s1, r1 = trio.open_memory_channel[int](float("inf"))
        s2, r2 = trio.open_memory_channel[int](float("inf"))

        async def echo() -> None:
            async for x in r1:
                s2.send_nowait(x)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(echo)
            await trio.sleep(0)
            t = time.perf_counter()
            for i in range(n):
                s1.send_nowait(i)
                await r2.receive()
            result.append((time.perf_counter() - t) / n / 2 * 1e6)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return result[0]


def asyncio_hop(n: int = 20_000) -> float:
    """µs per one-way hop between two asyncio tasks over asyncio.Queue."""

    async def main() -> float:
        q1: asyncio.Queue[int] = asyncio.Queue()
        q2: asyncio.Queue[int] = asyncio.Queue()

        async def echo() -> None:
            while True:
                q2.put_nowait(await q1.get())

        task = asyncio.create_task(echo())
        await asyncio.sleep(0)
        t = time.perf_counter()
        for i in range(n):
            q1.put_nowait(i)
            await q2.get()
        dt = (time.perf_counter() - t) / n / 2 * 1e6
        task.cancel()
        return dt

    return asyncio.run(main())


def inproc(rounds: int, n: int) -> None:
    """a_seq and c_chain forward latency: push fast path vs receive loop, with references."""
    lat: dict[str, list[float]] = {}
    fwd: dict[str, list[float]] = {}
    for _ in range(rounds):
        for label, (impl, options) in INPROC_VARIANTS.items():
            d = make_driver(impl, 3, {0, 2}, **options).start()
            r = workloads.seq(d, n, paced=False)
            d.close()
            lat.setdefault(label, []).extend(r["latency"])
            if impl != "floor":
                d = make_driver(impl, 3, {0, 2}, **options).start()
                c = workloads.chain(d, n // 10)
                d.close()
                fwd.setdefault(label, []).extend(c["forward"])
    print(f"{'in-process':34s} {'a_seq p50':>10s} {'a_seq p99':>10s} {'fwd p50':>9s}")
    for name, xs in lat.items():
        p = percentiles_us(xs)
        f = percentiles_us(fwd.get(name, []))
        print(f"{name:34s} {p['p50_us']:10.1f} {p['p99_us']:10.1f} {f['p50_us']:9.1f}")


def zmq(rounds: int, n: int) -> None:
    """a_seq over ZMQ echo workers: ReplicaPool.pump (push) vs pool.receive()."""
    from trio_orch.cluster.pool import ReplicaPool

    pump = ReplicaPool.pump
    res: dict[str, list[float]] = {"push (pool.pump)": [], "receive loop": []}
    try:
        for _ in range(rounds):
            for name in res:
                if name == "receive loop":
                    del ReplicaPool.pump  # type: ignore[misc]
                else:
                    ReplicaPool.pump = pump  # type: ignore[method-assign]
                d = make_driver("trio", workers=workloads.echo_pipeline(1)).start()
                res[name].extend(workloads.zmq_seq(d, n)["latency"])
                d.close()
    finally:
        ReplicaPool.pump = pump  # type: ignore[method-assign]
    print(f"{'ZMQ echo workers':24s} {'a_seq p50':>10s} {'a_seq p99':>10s}")
    for name, xs in res.items():
        p = percentiles_us(xs)
        print(f"{name:24s} {p['p50_us']:10.1f} {p['p99_us']:10.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.experiments", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n", type=int, default=2000, help="outputs per a_seq run")
    parser.add_argument("--skip-zmq", action="store_true")
    args = parser.parse_args(argv)
    print(f"Router.route: {router_cost():.2f} us per output")
    hops: dict[str, Any] = {"trio": [], "asyncio": []}
    for _ in range(args.rounds):
        hops["trio"].append(trio_hop())
        hops["asyncio"].append(asyncio_hop())
    print("task-to-task hop (median of rounds): trio {:.2f} us, asyncio {:.2f} us".format(
        sorted(hops["trio"])[len(hops["trio"]) // 2], sorted(hops["asyncio"])[len(hops["asyncio"]) // 2]))
    inproc(args.rounds, args.n)
    if not args.skip_zmq:
        zmq(args.rounds, args.n // 2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
