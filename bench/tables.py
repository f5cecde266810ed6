"""Terminal tables and progress for the bench commands (``bench``, ``chaos``), drawn with ``rich``.

One way to print a table for every command: a :class:`rich.table.Table`
whose columns say what they hold (numbers, names or text), so that rich
fits it to the terminal -- text wraps between words, numbers and names
keep their width -- and a legend under it says what its words mean.
Progress is a bar on a terminal and one line per step elsewhere (a log
keeps them).
"""

from __future__ import annotations

import io
import shutil
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from types import TracebackType
from typing import Any

__all__ = ["StepProgress", "console", "markdown_table", "render", "table", "text"]


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None,
          numbers: Collection[int] = (), names: Collection[int] = (),
          flex: Mapping[int, int] | None = None, rule: bool = True) -> Any:
    """A :class:`rich.table.Table`; rich fits it to the width it is printed in.

    Columns in ``numbers`` hold numbers (right-aligned), columns in ``names``
    names (an implementation, a fault): both keep the width of their longest
    line (a ``\\n`` in a cell or header is where such a cell breaks: a header
    wider than its numbers needs one).  The other columns hold text: where
    the table is too wide, rich narrows the widest of them first and their
    cells wrap between words.  ``flex`` (column -> ratio): text columns that
    share the width the others leave, in that ratio (the table then takes the
    whole width).  Only where even that does not fit does rich narrow every
    column; a word longer than its column is folded, never cut off.  Cells
    may be strings or :class:`rich.text.Text`.  ``rule``: a line under the
    header and one space between columns (else no lines, two spaces).
    """
    from rich import box
    from rich.table import Table
    from rich.text import Text

    flex = dict(flex or {})
    cells = [[c if isinstance(c, Text) else Text(str(c)) for c in row] for row in rows]
    t = Table(title=Text(title) if title else None, title_justify="left", title_style="bold",
              box=box.SIMPLE_HEAD if rule else None, pad_edge=False, show_edge=False,
              padding=(0, 0) if rule else (0, 1), expand=bool(flex))
    for i, name in enumerate(header):
        head = Text(name)  # brackets in a header are text, not markup
        fixed = i in numbers or i in names
        width = max(line.cell_len for c in (head, *(r[i] for r in cells)) for line in c.split()) \
            if fixed else None
        t.add_column(head, justify="right" if i in numbers else "left", overflow="fold", width=width,
                     ratio=flex.get(i))
    for row in cells:
        t.add_row(*row)
    return t


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """The same rows as a markdown table, header first (a cell's line breaks, there for the terminal,
    become spaces)."""
    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("\n", " ").replace("|", "/") for c in r) + " |"

    return "\n".join([line(rows[0]), "|" + "---|" * len(rows[0]), *(line(r) for r in rows[1:])])


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
