"""Terminal tables and progress for the bench commands (``bench``, ``chaos``), drawn with ``rich``.

One way to print a table for every command: it fits the terminal's width,
cells wrap at word boundaries (a word longer than its column is folded,
never cut off), and a legend under it says what its words mean.  Progress is
a bar on a terminal and one line per step elsewhere (a log keeps them).
"""

from __future__ import annotations

import io
import shutil
import sys
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

__all__ = ["StepProgress", "console", "render", "table", "text"]


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None,
          numeric_from: int = 2, wide: Sequence[int] = ()) -> Any:
    """A :class:`rich.table.Table`: columns from ``numeric_from`` on are right-aligned.

    ``wide``: the columns that take the spare width first (long text).
    Cells may be strings or :class:`rich.text.Text`.
    """
    from rich import box
    from rich.table import Table
    from rich.text import Text

    cells = [[c if isinstance(c, Text) else Text(str(c)) for c in row] for row in rows]
    t = Table(title=Text(title) if title else None, title_justify="left", title_style="bold",
              box=box.SIMPLE_HEAD, pad_edge=False, expand=False, show_edge=False, padding=(0, 1, 0, 0))
    for i, name in enumerate(header):
        # rich keeps a column at least as wide as its longest word while the width allows: cells wrap
        # between words, and fold inside one only on a terminal too narrow for the longest words
        t.add_column(Text(name), justify="right" if i >= numeric_from else "left", overflow="fold",
                     ratio=3 if i in wide else None)
    for row in cells:
        t.add_row(*row)
    return t


def console(*, stderr: bool = False, width: int | None = None, file: Any = None) -> Any:
    """A :class:`rich.console.Console` ``width`` wide (default: the terminal's; 120 where there is none)."""
    from rich.console import Console

    width = width or shutil.get_terminal_size((120, 24)).columns
    if file is not None:
        return Console(width=width, file=file, color_system=None, force_terminal=False,
                       legacy_windows=False, highlight=False)
    return Console(stderr=stderr, width=width, highlight=False)


def render(parts: Sequence[Any], columns: int | None = None) -> str:
    """``parts`` (tables, strings) as plain text, ``columns`` wide (default: the terminal's, 120 unknown)."""
    out = console(width=columns, file=io.StringIO())
    for p in parts:
        out.print(text(p) if isinstance(p, str) else p)
    return out.file.getvalue().rstrip("\n")


def text(s: str) -> Any:
    """Plain text for a console: brackets are text, not markup."""
    from rich.text import Text

    return Text(s)


class StepProgress:
    """Progress over ``total`` steps on stderr: a rich bar on a terminal, else one line per step.

    Use as a context manager; call :meth:`step` after each step with what it was.
    """

    def __init__(self, total: int, what: str = "bench") -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._bar: Any = None
        self._task: Any = None
        self.what = what

    def __enter__(self) -> StepProgress:
        if self.tty and self.total:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=self.total)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def step(self, label: str) -> None:
        """One step done: ``label`` says which."""
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=f"{self.what}: {label}")
        else:
            elapsed = time.perf_counter() - self.t0
            sys.stderr.write(f"{self.done}/{self.total} {elapsed:6.1f}s {label}\n")
            sys.stderr.flush()
