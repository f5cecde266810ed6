"""``python -m bench.perf.chunk_security`` runs: real sender and receiver processes, both mechanisms."""

from __future__ import annotations

import json
from pathlib import Path

from bench.perf.chunk_security import BEGIN, END, main


def test_the_chunk_security_benchmark_measures_both_mechanisms_and_renders_its_table(tmp_path: Path) -> None:
    out, md = tmp_path / "out.json", tmp_path / "doc.md"
    md.write_text(f"before\n{BEGIN}\nold\n{END}\nafter\n")
    assert main(["--sizes", "100", "4096", "--seconds", "0.02", "--requests", "0", "--json", str(out),
                 "--markdown", str(md)]) == 0
    res = json.loads(out.read_text())
    assert [r["bytes"] for r in res["per_chunk"]] == [100, 4096]
    for r in res["per_chunk"]:
        assert (r["plain"]["mechanism"], r["curve"]["mechanism"]) == ("PLAIN", "CURVE")
        for m in ("plain", "curve"):
            assert r[m]["chunks"] >= 20 and r[m]["per_s"] > 0 and r[m]["cpu_us"] > 0
    text = md.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "| 100 B |" in text and "| 4 KB |" in text and "python -m bench.perf.chunk_security" in text
