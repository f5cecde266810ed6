"""A head whose secrets the test knows: ``python -m tests.serve.secret_head --needles FILE --status FILE``.

A supervised two-stage echo pipeline.  It writes every secret of its
workers to ``--needles`` (JSON: the pipeline secret, the pipeline key pair's
secret key, and each launch's ticket *as it is minted*, before the worker
exists) for :mod:`tests.serve.same_user_attacker` to look for, and its
workers' pids and restart count to ``--status`` every 20 ms.  SIGTERM stops
it (and its workers).  Locked down first, as ``serve`` is: a worker is a copy
of its head between fork and exec, and so as readable as the head then.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import trio

from stages.config import echo_config
from stages.credentials import Launch
from stages.lockdown import lock_down
from trio_orch.cluster.supervisor import RestartPolicy, supervised_pipeline


def write(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(data))
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


async def main(needles_path: str, status_path: str) -> None:
    cfg = echo_config(2, outputs=2, heartbeat_interval=0.2, heartbeat_timeout=2.0, stop_grace=1.0)
    policy = RestartPolicy(max_restarts=20, window=60.0, backoff_initial=0.05)
    async with supervised_pipeline(cfg, policy) as pipe:
        auth, security = pipe.authenticator, pipe.security
        needles = {"pipeline_secret": security.secret.decode(),
                   "pipeline_key": security.keypair.secret.decode()}
        for w in pipe.workers:
            launch = auth.launches.current(w.client.zap_domain(w.client.address))
            needles[f"ticket-{len(needles)}"] = launch.ticket.decode()
        write(needles_path, needles)
        minted = auth.launches.open

        def open_and_tell(slot: str, label: str) -> Launch:
            launch = minted(slot, label)
            needles[f"ticket-{len(needles)}"] = launch.ticket.decode()
            write(needles_path, needles)  # before the worker is started: the attacker knows it at once
            return launch

        auth.launches.open = open_and_tell  # type: ignore[method-assign]
        while True:
            write(status_path, {"pids": pipe.pids, "restarts": pipe.supervisor.restarts})
            await trio.sleep(0.02)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--needles", required=True)
    p.add_argument("--status", required=True)
    args = p.parse_args()
    lock_down()
    try:
        trio.run(main, args.needles, args.status)
    except SystemExit as exc:  # SIGTERM: the pipeline stopped its workers
        raise SystemExit(0 if exc.code == 143 else exc.code) from None
