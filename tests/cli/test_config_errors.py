"""A bad pipeline config as a user meets it: exit 2, the key's path in one line, no traceback.

``generate`` and ``serve`` check the file against the typed schema (and each
model's options against its constructor's annotations) before any worker
starts, so the answer comes at once instead of as a worker's traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "tests" / "plugin_example"

pytestmark = pytest.mark.processes  # the real command line, in a process of its own

BAD = {
    "a string for an int": ('[[stages]]\nkind = "thinker"\n[stages.model]\nmax_new_tokens = "48"\n',
                            "stage 0: model option 'max_new_tokens' of thinker: expected `int`, got `str`"),
    "a misspelt table": ('[pipline]\nseed = 1\n[[stages]]\nkind = "echo"\n',
                         "unknown table 'pipline'"),
    "out of range": ('[[stages]]\nkind = "echo"\nreplicas = -2\n', "stages[0].replicas: expected `int` >= 0"),
    "a plug-in's option": (re.sub(r"(?m)^tone_hz = .*$", 'tone_hz = "loud"',
                                  (EXAMPLE / "morse.toml").read_text()),
                           "model option 'tone_hz' of morse_demo:Morse: expected `float`, got `str`"),
}


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_config_exits_2_naming_the_key(tmp_path: Path, command: str, case: str) -> None:
    toml, message = BAD[case]
    assert 'tone_hz = "loud"' in toml or case != "a plug-in's option"  # the example still sets it
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    if command == "generate":
        args = ["generate", "--config", str(path), "--out", str(tmp_path / "o.wav"), "Hi"]
    else:
        args = ["serve", "--config", str(path), "--port", "0"]
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE)}
    proc = subprocess.run([sys.executable, "-m", "trio_orch.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and str(path.name) in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o.wav").exists()


def test_a_stage_config_needs_worker_stages(tmp_path: Path) -> None:
    """``--stage-config`` places worker stages: the in-process toy has none to place (exit 2, not ignored)."""
    path = tmp_path / "stages.toml"
    path.write_text('[stages.0]\ndevice = "cpu"\n')
    proc = subprocess.run([sys.executable, "-m", "trio_orch.cli", "serve", "--in-process", "--port", "0",
                           "--stage-config", str(path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "error: --stage-config places worker stages: --in-process has none" in proc.stderr
