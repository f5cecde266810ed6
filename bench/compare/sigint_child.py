"""Child process of scenario 10: a serving main thread, the orchestrator in a background thread.

Run as ``python -m bench.compare.sigint_child IMPL N``: starts IMPL, puts N
streaming requests in flight, prints ``READY``, consumes until SIGINT, then
(in ``except KeyboardInterrupt``) shuts the orchestrator down and prints one
JSON line: how many in-flight requests got their terminal, how long it took.
"""

from __future__ import annotations

import json
import signal
import sys
import time

from bench.compare.scenarios.base import CUT, start


def main() -> int:
    # SIGINT as a terminal's Ctrl-C delivers it: a parent started as a shell's background job passes
    # SIGINT on ignored, and a process that starts so never gets KeyboardInterrupt (it would hang here).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    impl, n = sys.argv[1], int(sys.argv[2])
    h = start(impl, 2, {0, 1})
    rids = [f"r{i}" for i in range(n)]
    for r in rids:
        h.add_request(r, "p")
    for r in rids:
        h.emit(0, r, "partial")
    h.collect(n, timeout=10)
    try:
        print("READY", flush=True)  # inside the try: SIGINT may come right after it
        while True:
            try:
                h.next_output(timeout=0.5)
            except TimeoutError:
                pass
    except KeyboardInterrupt:
        t0 = time.perf_counter()
        rep = h.shutdown(wait=CUT)
        msgs, ended = h.drain(1.0)
        print(json.dumps({
            "terminals": sum(1 for m in msgs if m.finished and m.request_id in rids),
            "shutdown_s": time.perf_counter() - t0,
            "hung": rep.hung,
            "stream_ended": ended,
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
