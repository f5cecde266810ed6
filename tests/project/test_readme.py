"""The README starts where a user starts, and points at everything it does not say itself.

It stays short (under 300 lines); its first two code blocks are the two set-up
commands -- set up and run the main job, set up and run the whole test suite,
the second the very command ``.ci/run`` runs; every route the server offers is
named in it or in a document it links; and every link it (or a doc) makes to a
doc, anchors included, leads somewhere.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from starlette.routing import BaseRoute, Route, WebSocketRoute

from trio_orch.engine import ThreadEngine
from trio_orch.http.app import create_app
from trio_orch.testing.toy_pipeline import toy_pipeline

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```[\w-]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def code_blocks(text: str) -> list[str]:
    return [block.strip() for block in FENCE.findall(text)]


def ci_command() -> str:
    """What ``.ci/run`` runs: its set-up line, then its pytest line, as one ``&&`` command."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    setup = [line for line in lines if line.startswith("python3.11 -m venv .venv")]
    tests = [line for line in lines if line.startswith(".venv/bin/python -m pytest")]
    assert len(setup) == 1 and len(tests) == 1, ".ci/run: expected one set-up line and one pytest line"
    return f"{setup[0]} && {tests[0]}"


def test_the_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert 50 < lines < 300, f"README.md has {lines} lines; keep it under 300 (the rest goes to docs/)"


def test_the_first_two_code_blocks_are_the_set_up_commands() -> None:
    main_job, suite = code_blocks(README.read_text())[:2]
    for block in (main_job, suite):
        assert "\n" not in block, f"a set-up command is one line to paste: {block!r}"
        steps = [shlex.split(step) for step in block.split(" && ")]
        assert steps[0] == ["python3.11", "-m", "venv", ".venv"], block
        install = steps[1]
        assert install[:3] == [".venv/bin/pip", "install", "-q"] and "-e" in install, block
        assert install[install.index("-c") + 1] == "constraints-cpu.txt", block  # the CPU torch pin
    assert shlex.split(main_job.split(" && ")[-1])[:2] == [".venv/bin/trio-orch", "generate"], main_job
    assert suite == ci_command(), "the README's test command and .ci/run's differ"
    pins = (ROOT / "constraints-cpu.txt").read_text()
    assert re.search(r"^torch==\S+$", pins, re.M), "constraints-cpu.txt no longer pins torch"


def linked_docs(text: str) -> list[Path]:
    """The docs a README links to (``docs/NAME.md``, any anchor dropped)."""
    found = {ROOT / m.split("#")[0] for m in LINK.findall(text) if m.startswith("docs/") and ".md" in m}
    return sorted(found)


def route_paths(routes: list[BaseRoute]) -> set[str]:
    """The paths the app answers, ``{name:path}`` written as ``{name}``."""
    served = [r for r in routes if isinstance(r, Route | WebSocketRoute)]
    return {re.sub(r"\{(\w+):\w+\}", r"{\1}", r.path) for r in served}


def test_every_route_of_the_app_is_named_in_the_readme_or_a_doc_it_links() -> None:
    with ThreadEngine(toy_pipeline(token_delay=0.001, audio_delay=0.001)) as engine:
        app = create_app(engine, admin_token="t")  # with the control plane: every route there is
        paths = route_paths(app.routes)
    assert {"/v1/chat/completions", "/v1/realtime", "/admin/stats", "/v1/models/{name}"} <= paths
    readme = README.read_text()
    texts = [readme, *(doc.read_text() for doc in linked_docs(readme))]
    named = [re.compile(r"(?<![A-Za-z_/.-])" + re.escape(p) + r"(?![\w/{])") for p in sorted(paths)]
    missing = [rx.pattern for rx in named if not any(rx.search(t) for t in texts)]
    assert not missing, f"routes named neither in README.md nor in a doc it links: {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())  # a '#' line in a code block is no heading
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_every_link_to_a_doc_leads_somewhere() -> None:
    broken = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto: -- outside the repository
                continue
            name, _, anchor = target.partition("#")
            path = (page.parent / name).resolve() if name else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)
