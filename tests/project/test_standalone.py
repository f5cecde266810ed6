"""The repository stands on its own: no pointer to material outside it.

Everything it needs to explain itself is in its own docs (docs/design.md);
references to a steering document, its sections or a tracker's issue numbers
would be dead links in a clone.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).parents[2]
#: built from pieces so that this file does not match itself
FORBIDDEN = re.compile("|".join([r"\.\./" + "shared", "DES" + "IGN", r"\bissue" + r"[- ]?#?[0-9]"]))


def project_files() -> list[pathlib.Path]:
    """Tracked files plus untracked ones git does not ignore (a clone's content)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if line and (ROOT / line).is_file()]


@pytest.mark.processes
def test_nothing_points_outside_the_repository() -> None:
    files = project_files()
    assert len(files) > 50
    hits = []
    for path in files:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary files (plots)
        for n, line in enumerate(text.splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "references outside the repository:\n" + "\n".join(hits)
