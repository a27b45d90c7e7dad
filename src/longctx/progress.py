"""Progress a person can watch wherever a stage's output goes: tqdm's live bar in a terminal;
elsewhere (the flow's log, `dvc repro > log`, CI), where a bar's carriage returns reach nobody
until it closes, one plain line at most every LONGCTX_PROGRESS_SECONDS (default 30) and a last
line with the final count."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator

from tqdm import tqdm

EVERY = 30.0


class Lines:
    """The part of tqdm's interface the stages use (update, set_postfix, close, iteration, with),
    written as lines: 'train: 120/1250 step (9.6%), loss=2.3456, 3.10 step/s, elapsed 0:41, eta 6:04'."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, every: float | None = None):
        self.iterable = iterable
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.desc, self.unit, self.n, self.initial = desc, unit, initial, initial
        self.every = float(os.environ.get("LONGCTX_PROGRESS_SECONDS", EVERY)) if every is None else every
        self.postfix = ""
        self.start = self.shown = time.monotonic()
        self.closed = False
        self.written: int | None = None
        """The count of the last line written (close() adds the final one only if it differs)."""

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.shown >= self.every:
            self._write(now)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.written != self.n:
                self._write(time.monotonic())

    def line(self, now: float) -> str:
        elapsed = now - self.start
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        done = f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}"
        if self.total:
            done += f" ({100 * self.n / self.total:.1f}%)"
        parts = [done, self.postfix, f"{rate:.2f} {self.unit}/s", f"elapsed {_clock(elapsed)}"]
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f"eta {_clock((self.total - self.n) / rate)}")
        return f"{self.desc}: " + ", ".join(p for p in parts if p)

    def _write(self, now: float) -> None:
        self.shown, self.written = now, self.n
        print(self.line(now), file=sys.stderr, flush=True)


def progress(iterable: Iterable | None = None, total: int | None = None, desc: str = "", unit: str = "it",
             initial: int = 0, leave: bool = True) -> tqdm | Lines:
    """A live bar when stderr is a terminal, else `Lines`."""
    if sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=leave)
    return Lines(iterable, total, desc, unit, initial)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
