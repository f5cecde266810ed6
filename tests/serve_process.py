"""``trio-orch serve ARGS`` as a process of its own, the way a user runs it (the tests of real checkpoints).

:class:`Server` starts the command, reads its output until it says where it
serves, knows its worker processes, and stops it with SIGINT -- checking that
every worker is gone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from stages.lockdown import serving_pid
from tests.waiting import HANG
from trio_orch.testing import child_pids, worker_alive

ROOT = Path(__file__).resolve().parents[1]


class Server:
    """``trio-orch serve ARGS`` started and read until it says where it serves; stopped with SIGINT.

    ``env``: variables set for it on top of this process's (an admin token).
    """

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--port", "0", *args],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        assert self.proc.stdout is not None
        self.lines: list[str] = []
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"serving on (https?://\S+)", line)
            if m:
                self.url = m.group(1)
                # keep reading what it says (an access-log line per request): a full pipe would block it
                threading.Thread(target=self.lines.extend, args=(self.proc.stdout,), daemon=True).start()
                break
        else:
            self.proc.wait(HANG)
            raise AssertionError(f"serve exited {self.proc.returncode} before serving: {''.join(self.lines)}")
        self.workers = {p for p in child_pids(serving_pid(self.proc.pid)) if worker_alive(p)}

    def sdk(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=HANG * 2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(HANG * 3)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        assert not [p for p in self.workers if worker_alive(p)]
