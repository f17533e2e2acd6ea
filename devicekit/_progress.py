"""``Progress``: how far a map has got, on stderr, for ``progress=True``.

Shared by both executors of [`gpu_map()`][devicekit.gpu_map]: the local
workers (``_parallel``) and Ray tasks (``_ray``) step it once per finished item.
"""

from __future__ import annotations

import sys

from ._options import check_flag

__all__ = ["Progress"]


class Progress:
    """``progress=True``: a tqdm bar on stderr, or a line where tqdm is not installed.

    Without tqdm, a terminal gets one line redrawn in place; a log file or a
    pipe (where a carriage return redraws nothing: the counts ran together on one
    line) gets a line at every tenth of the items, and at the last.
    """

    def __init__(self, total: int, enabled: bool | None, *, label: str = "gpu_map") -> None:
        """Progress over ``total`` items, shown if ``enabled``, named ``label`` (the call)."""
        check_flag(enabled, name="progress", none="no progress")
        self.total, self.done, self.bar, self.label = total, 0, None, label
        self.enabled = bool(enabled)
        self.redraw = False  # a terminal: redraw one line
        if self.enabled:
            try:
                from tqdm import tqdm  # noqa: PLC0415 - optional

                self.bar = tqdm(total=total, file=sys.stderr, desc=label)
            except ImportError:
                isatty = getattr(sys.stderr, "isatty", None)
                self.redraw = bool(isatty and isatty())

    def step(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.redraw:
            end = "\n" if self.done == self.total else ""
            print(f"\r{self.label}: {self.done}/{self.total}", end=end, file=sys.stderr, flush=True)
        elif self.enabled:
            tenth = max(1, self.total // 10)
            if self.done % tenth == 0 or self.done == self.total:
                print(f"{self.label}: {self.done}/{self.total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.redraw and 0 < self.done < self.total:
            print(file=sys.stderr, flush=True)  # end the line a failure or Ctrl-C cut short
