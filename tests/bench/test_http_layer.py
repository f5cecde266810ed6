"""``python -m bench.perf.http_layer``: each server really serves the stream, and the table is rendered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.perf import http_layer


@pytest.mark.slow
@pytest.mark.processes  # a server process per run and the client processes
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


def test_a_profile_is_charged_to_the_innermost_frames_package_and_rendered() -> None:
    assert http_layer.package_of("run (trio/_core/_run.py:2532)") == "trio"
    assert http_layer.package_of("f (/x/site-packages/hypercorn/protocol/h11.py:3)") == "hypercorn"
    assert http_layer.package_of("__init__ (<attrs generated methods outcome._impl.Value>:15)") == "outcome"
    assert http_layer.package_of("app (bench/perf/http_layer.py:72)") == "http_layer (the app)"
    prof = {"samples": 100, "innermost": {"trio": 0.7, "hypercorn": 0.3},
            "functions": {"Server.run": 0.95, "H11Protocol.stream_send": 0.6}}
    runs = [{"server": "hypercorn", "app": "raw", "ok": 10, "failed": 0, "req_per_s": 5.0,
             "cpu_ms_per_req": 2.0, "cpu_us_per_chunk": 50.0, "round": r, "profile": prof} for r in range(2)]
    text = http_layer.markdown({"command": "c", "date": "d", "cpus": 2, "loadavg": [1.0], "machine": "m",
                                "settings": {"chunks": 40, "concurrency": 64, "seconds": 4, "procs": 2,
                                             "rounds": 2}, "runs": runs})
    assert "| hypercorn | raw | 5 | 2.00 ms | 50 us | -- |" in text  # no uvicorn run: no ratio
    assert "| hypercorn | raw | 200 | trio 70 %, hypercorn 30 % | `H11Protocol.stream_send` 60 % |" in text


def test_the_table_in_the_docs_is_the_one_the_recorded_run_renders() -> None:
    """docs/performance.md's block is ``markdown()`` of docs/bench/http_layer.json: one run wrote both."""
    root = Path(__file__).resolve().parents[2]
    run = json.loads((root / "docs/bench/http_layer.json").read_text())
    doc = (root / "docs/performance.md").read_text()
    block = doc.split(http_layer.BEGIN, 1)[1].split(http_layer.END, 1)[0]
    assert block.strip() == http_layer.markdown(run).strip()
