"""Progress for long runs: a tqdm bar on a terminal, a line every few seconds otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

_MIN_TOTAL = 64 << 20  # below this a run is short: show nothing
_LINE_EVERY_S = 2.0


class Progress:
    """Counts bytes done out of ``total``; ``update(n)`` is cheap enough to call per chunk."""

    def __init__(self, total: int, desc: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = total
        self.desc = desc
        self.done = 0
        self._bar = None
        self._lines = False
        self._last = time.monotonic()
        if not enabled or total < _MIN_TOTAL:
            return
        if self.stream.isatty():
            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=self.stream, leave=False)
        else:
            self._lines = True

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._lines and time.monotonic() - self._last >= _LINE_EVERY_S:
            self._last = time.monotonic()
            pct = 100.0 * self.done / self.total if self.total else 100.0
            print(f"{self.desc}: {self.done / 2**20:.0f} / {self.total / 2**20:.0f} MiB ({pct:.0f}%)", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._lines:
            print(f"{self.desc}: done, {self.done / 2**20:.0f} MiB", file=self.stream, flush=True)
