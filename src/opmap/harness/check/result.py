"""One line of a check run: what `opmap check` prints, writes and resumes from (the runner, the
sanitizer driver and the report share it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@dataclass
class Result:
    section: str
    op: str
    backend: str
    case: str
    passed: bool
    figure: str
    value: Optional[float] = None
    limit: Optional[float] = None
    seconds: float = 0.0
    family: str = ""

    @property
    def title(self) -> str:
        return f"{self.op}/{self.backend} {self.case}"


def progress_bar():
    """The check's progress bar (cases done of all, elapsed time, the last case's title)."""
    return Progress(TextColumn("[bold]check"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.description}"), transient=True)
