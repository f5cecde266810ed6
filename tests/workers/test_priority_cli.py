"""``trio-orch generate --priority N``: the request's priority reaches the worker on the wire."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from stages import wire
from trio_orch import cli
from trio_orch.cluster import transport

pytestmark = pytest.mark.processes  # real worker processes

ECHO = """[pipeline]
final_stage_ids = [0]

[[stages]]
kind = "echo"
replicas = 1
model = {outputs = 2}
"""


@pytest.mark.parametrize("priority", [-3, 0])
def test_generate_sends_its_priority_with_the_submit_to_the_worker(
        priority: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    sent: list[wire.Submit] = []

    def recording(*args: Any, **kwargs: Any) -> wire.Submit:
        msg = wire.Submit(*args, **kwargs)
        sent.append(msg)
        return msg

    monkeypatch.setattr(transport, "Submit", recording)  # what the head puts on the worker's socket
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    cfg = tmp_path / "echo.toml"
    cfg.write_text(ECHO)
    rc = cli.main(["generate", "hello", "--config", str(cfg), "--priority", str(priority),
                   "--out", str(tmp_path / "out.wav")])
    assert rc == 0, capsys.readouterr()
    assert [(m.request_id, m.priority) for m in sent] == [("generate-1", priority)]
    assert "time to first token" in capsys.readouterr().out  # the worker answered it


@pytest.mark.parametrize("bad", ["high", "1.5"])
def test_generate_refuses_a_priority_that_is_not_an_int_before_any_worker_starts(
        bad: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "hello", "--priority", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--priority: invalid int value" in err and "starting workers" not in err
    assert not list(tmp_path.iterdir())
