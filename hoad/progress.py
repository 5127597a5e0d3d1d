"""Where a long build is, said while it runs.

A build that takes longer than :data:`AFTER_S` reports its stages as it goes, at the default log
level (WARNING): where stderr is a terminal and nothing else handles hoad's log, as one status
line redrawn in place; otherwise as a log line per stage, a second or more apart. Each report gives the stage and the
seconds so far, and the last one the time of every stage. A build that ends sooner says nothing.
A build inside another, or on a thread compiling in the background while the eager program
serves the calls, says nothing. ``HOAD_PROGRESS=0`` turns the reports off; a number of seconds
sets :data:`AFTER_S`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

log = logging.getLogger(__name__)

AFTER_S = 2.0     # a build quicker than this says nothing
REDRAW_S = 0.25   # the status line's redraw period on a terminal
EVERY_S = 1.0     # elsewhere, the least time between two log lines of one build (a stage changing)
SPINNER = "|/-\\"
COMPILE_THREAD = "hoad-compile"  # the threads that compile in the background: their builds say nothing here
_DEPTH = threading.local()  # builds in progress on this thread: one inside another reports nothing


def _after() -> float | None:
    """Seconds before a build reports, from HOAD_PROGRESS (None: never)."""
    value = os.environ.get("HOAD_PROGRESS", "").strip().lower()
    if value in ("0", "off", "no", "false"):
        return None
    try:
        return max(float(value), 0.0) if value else AFTER_S
    except ValueError:
        return AFTER_S


def _terminal() -> bool:
    """Reports go to a status line: stderr is a terminal and hoad's records reach it only
    through logging's last-resort handler (no handler is configured on the way up)."""
    stream = sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)()) and not log.hasHandlers()


class Progress:
    """``with Progress(label) as p: p.stage("capture"); ...``: the stages of one build."""

    def __init__(self, label: str):
        self.label = label
        self.advice = ""  # a way to a faster program, said at the end of a reported build
        self.after = _after()
        self.times: dict[str, float] = {}
        self.current: str | None = None
        self._start = self._stage_start = time.perf_counter()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._reported = False
        self._said = 0.0  # when the last log line was written
        self._terminal = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        self._outer = getattr(_DEPTH, "n", 0) == 0 and threading.current_thread().name != COMPILE_THREAD
        _DEPTH.n = getattr(_DEPTH, "n", 0) + 1
        if self.after is not None and self._outer:
            self._terminal = _terminal()
            self._thread = threading.Thread(target=self._watch, name="hoad-progress", daemon=True)
            self._thread.start()
        return self

    def stage(self, name: str | None) -> None:
        """The build enters stage ``name`` (None: it is over), and the one before it ends."""
        with self._lock:
            now = time.perf_counter()
            if self.current is not None:
                self.times[self.current] = self.times.get(self.current, 0.0) + now - self._stage_start
            self.current, self._stage_start = name, now
            if name is not None and self._reported and not self._terminal and now - self._said >= EVERY_S:
                self._said = now
                log.warning("hoad: building %s: %s (%.1f s so far)", self.label, name, now - self._start)

    def __exit__(self, kind, error, trace) -> None:
        _DEPTH.n -= 1
        self.stage(None)
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if not self._reported:
            return
        total = time.perf_counter() - self._start
        stages = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.times.items() if seconds >= 0.05)
        how = "built" if kind is None else "stopped building"
        advice = f"; {self.advice}" if self.advice and kind is None else ""
        self._say(f"hoad: {how} {self.label} in {total:.1f} s ({stages}){advice}", last=True)

    def _watch(self) -> None:
        if self._done.wait(self.after):
            return
        with self._lock:
            self._reported = True
            if self._terminal:
                logging.lastResort.addFilter(self._clear)
            else:
                self._said = time.perf_counter()
                log.warning("hoad: building %s: %s (%.1f s so far)", self.label, self.current, self._said - self._start)
        turn = 0
        while self._terminal and not self._done.wait(REDRAW_S):
            with self._lock:
                turn += 1
                self._say(f"hoad {SPINNER[turn % len(SPINNER)]} building {self.label}: {self.current} "
                          f"({time.perf_counter() - self._start:.1f} s)")

    def _say(self, text: str, last: bool = False) -> None:
        if not self._terminal:
            log.warning("%s", text)
            return
        sys.stderr.write("\r\033[K" + text + ("\n" if last else ""))
        sys.stderr.flush()
        if last:
            logging.lastResort.removeFilter(self._clear)

    @staticmethod
    def _clear(record: logging.LogRecord) -> bool:
        """A record on its way to stderr while the status line is shown: the line is cleared
        first (and redrawn after it)."""
        sys.stderr.write("\r\033[K")
        return True
