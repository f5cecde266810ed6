"""``python -m bench.perf.http_layer``: each server really serves the stream, and the table is rendered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.perf import http_layer

pytestmark = pytest.mark.processes  # a server process per run and the client processes


@pytest.mark.slow
def test_a_short_run_serves_every_server_and_app_and_writes_the_table(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{http_layer.BEGIN}\nold\n{http_layer.END}\nafter\n")
    out = tmp_path / "run.json"
    assert http_layer.main(["--rounds", "1", "--seconds", "0.5", "--concurrency", "2", "--procs", "1",
                            "--chunks", "5", "--json", str(out), "--markdown", str(doc)]) == 0
    run = json.loads(out.read_text())
    got = {(r["server"], r["app"]) for r in run["runs"]}
    assert got == {(s, a) for s in http_layer.SERVERS for a in ("raw", "starlette")}
    for r in run["runs"]:
        assert r["ok"] > 0 and r["failed"] == 0, r  # every streamed answer ended with [DONE]
        assert r["cpu_ms_per_req"] >= 0
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    for server in http_layer.SERVERS:
        assert f"| {server} | raw |" in text and f"| {server} | starlette |" in text
    assert "| uvicorn | raw |" in text and "| 1.00x |" in text


def test_unknown_servers_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        http_layer.main(["--servers", "hypercorn,nginx"])
    assert "unknown server or app: nginx" in capsys.readouterr().err
