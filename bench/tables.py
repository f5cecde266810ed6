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
    """A table that fits the width it is printed in: columns from ``numeric_from`` on are right-aligned.

    Cells may be strings (``\\n`` breaks a line) or :class:`rich.text.Text`.  Each
    column gets at least its longest word, and the width left over goes to
    the columns whose lines are longer than that, in proportion (``wide``:
    columns that take twice their share) -- so cells wrap between words and
    a word is folded only where the width cannot hold the longest words.
    """
    return _Fitted(list(header), [list(r) for r in rows], title, numeric_from, tuple(wide))


class _Fitted:
    """A rich renderable: the table laid out for the width at hand (see :func:`table`)."""

    GAP = 1  # the box's column divider: one space between columns (no padding)

    def __init__(self, header: list[str], rows: list[list[Any]], title: str | None, numeric_from: int,
                 wide: tuple[int, ...]) -> None:
        from rich.text import Text

        self.header = [Text(h) for h in header]
        self.rows = [[c if isinstance(c, Text) else Text(str(c)) for c in r] for r in rows]
        self.title, self.numeric_from, self.wide = title, numeric_from, wide

    def widths(self, width: int) -> list[int] | None:
        """Column widths for ``width`` columns, or None where even the longest words do not fit."""
        cols = list(zip(self.header, *self.rows, strict=True))
        low = [max(len(w) for c in col for w in (c.plain.split() or [""])) for col in cols]
        high = [max(len(line) for c in col for line in (c.plain.splitlines() or [""])) for col in cols]
        room = width - self.GAP * (len(cols) - 1)
        if sum(high) <= room:
            return high
        if sum(low) > room:
            return None
        spare = room - sum(low)
        want = [(h - lo) * (2 if i in self.wide else 1)
                for i, (lo, h) in enumerate(zip(low, high, strict=True))]
        total = sum(want) or 1
        out = [lo + min(h - lo, spare * w // total) for lo, h, w in zip(low, high, want, strict=True)]
        return out

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        widths = self.widths(options.max_width)
        t = Table(title=Text(self.title) if self.title else None, title_justify="left", title_style="bold",
                  box=box.SIMPLE_HEAD, pad_edge=False, expand=False, show_edge=False,
                  padding=0)
        for i, name in enumerate(self.header):
            t.add_column(name, justify="right" if i >= self.numeric_from else "left", overflow="fold",
                         width=None if widths is None else widths[i])
        for row in self.rows:
            t.add_row(*row)
        yield t


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
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=console(stderr=True),
                                 transient=True)
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
