"""Tiered execution: a program runs eagerly until its Inductor twin, compiled in the background,
is ready; and the one lock every build holds (make_fx and Inductor keep process-wide state).

A background compile runs Inductor twice: first in a process of its own (``python -m
hoad.warm``), which fills Inductor's on-disk cache, then in this process, where the same compile
is a cache hit (1-2 s). The user's work keeps this process's interpreter to itself meanwhile:
compiling on a thread here, a PINN's eager training steps ran at 5-9 ms instead of 2.5 (the
compile holds the interpreter lock for most of its 10-20 s, and took longer for sharing it). And a
process whose work ends first does not wait: the child finishes on its own and the next run finds
the program in the cache.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable

from hoad.progress import COMPILE_THREAD

log = logging.getLogger(__name__)

# Builds run one at a time in the process: tracing (make_fx) and Inductor keep process-wide state.
# Reentrant: a program called inside another's trace builds inside that build.
BUILDS = threading.RLock()


_EXITING = False
_EXIT = threading.Event()   # set as the process ends: a compile not yet in this process never starts here
_REGISTRY = threading.Lock()  # orders _EXIT against a compile entering _IN_FLIGHT
_IN_FLIGHT: dict[threading.Thread, threading.Event] = {}  # compiles running in this process: set once over
_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # every compile's thread, until it is gone
_CHILDREN: dict[subprocess.Popen, str] = {}   # compiles running in a process of their own, with labels
_STARTING: set[threading.Event] = set()  # compiles not yet in a child or in _IN_FLIGHT: set once they are
# compiles that had no child yet when the process began to end, (job file, label): one child runs
# them one after another (_exiting); None once it started
_HANDED_OVER: list[tuple[str, str]] | None = []

# A background compile runs Inductor in a child first (False: only in this process, as the tests
# of the exit wait need). A compile whose program does not pickle, or whose child fails, runs here.
CHILD_COMPILES = True
# children compiling at a time: each imports torch and runs Inductor (hundreds of MB and a core), so
# a model whose programs start compiling together has them take turns on a small machine
CHILD_SLOTS = threading.BoundedSemaphore(max(1, (os.cpu_count() or 2) // 2))

Job = tuple  # (module, function, arguments): a compile a child runs to fill Inductor's cache

# A child's first lines, before it imports torch or hoad (2 s of a core at the user's priority
# otherwise): nice 10 and, since hoad starts each child in a session of its own, that session's
# autogroup at nice 10 too. Linux shares the CPUs fairly between autogroups whatever their
# processes' nice values. Measured on 2 cores, a Burgers PINN's 300 eager steps while a compile
# and the kernels' build ran beside them: 0.9-1.3 s with the nice set after the child's imports,
# 0.60-0.63 s now (0.55-0.58 with the idle class as well, which was left out: it would starve the
# compile for as long as the user's own threads keep every core busy).
_BACKGROUND = """import contextlib, os
with contextlib.suppress(OSError, AttributeError):  # (Windows has neither)
    os.nice(10)
    if os.getsid(0) == os.getpid():
        with open("/proc/self/autogroup", "w") as f:  # (Linux alone has it)
            f.write("10")
"""


def background_command(code: str) -> list[str]:
    """The command that runs ``code`` in a Python process of its own as background work (start it
    with ``start_new_session=True``); arguments appended to it are its ``sys.argv[1:]``."""
    return [sys.executable, "-c", _BACKGROUND + code]


class _Abandoned(BaseException):
    """Raised inside a background compile whose wait at exit the user interrupted (Ctrl-C)."""


def _exiting() -> None:
    """A process ends after the compiles running in it, but not after those running in children.

    A thread left inside Inductor's native code while the interpreter tears down aborted the
    process ('terminate called without an active exception', measured on examples/quickstart.py),
    and a finished compile is in the cache for the next process. Ctrl-C during the wait abandons
    them: each stops at its next Python line (:class:`_Abandoned`), within seconds, and the process
    ends cleanly. A compile still in a child goes on there and fills the cache for the next run.

    This runs among threading's own exit calls, before concurrent.futures refuses new work:
    waiting later, from an atexit handler, let every compile in flight fail with "cannot schedule
    new futures after interpreter shutdown" (Inductor submits to its pools), so the process waited
    for nothing and the next one started cold."""
    global _EXITING
    with _REGISTRY:
        if _EXIT.is_set():  # (registered twice: threading's exit calls, and atexit where those did not run)
            return
        _EXIT.set()
        starting = list(_STARTING)
    for ready in starting:  # (a compile just started reaches its child or this process within a second)
        ready.wait(30)
    global _HANDED_OVER
    with _REGISTRY:
        handed, _HANDED_OVER = _HANDED_OVER or [], None
    if handed:
        _in_turn(handed)
    with _REGISTRY:
        left = [(t, over) for t, over in _IN_FLIGHT.items() if t.is_alive()]
        children = [(child.pid, label) for child, label in _CHILDREN.items() if child.poll() is None]
    for pid, label in children:
        log.warning("hoad: Inductor goes on compiling %s in process %d after this one ends; it fills the cache "
                    "for the next run", label, pid)
    try:
        if left:
            log.warning("hoad: finishing %d background compile%s before the process ends, so that the next run "
                        "finds %s in Inductor's cache (Ctrl-C abandons %s)", len(left), "s" if len(left) > 1 else "",
                        "them" if len(left) > 1 else "it", "them" if len(left) > 1 else "it")
        for _, over in left:  # (not Thread.join: see _until_gone)
            over.wait()
    except KeyboardInterrupt:
        _EXITING = True
        log.warning("hoad: background compile abandoned; the next run compiles again")
        for t, _ in left:
            if t.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(_Abandoned))
        for t, _ in left:
            _until_gone(t, 60)
    with _REGISTRY:
        ending = [t for t in _THREADS if t.is_alive()]
    for t in ending:  # (the compiles waited for above, and those that were just ending or left it to a child)
        _until_gone(t, 60)
    _EXITING = True


def _until_gone(thread: threading.Thread, timeout: float) -> None:
    """Block until ``thread`` has ended, its last frames freed, or ``timeout`` seconds pass.

    A compile's thread frees its program's tensors as it ends, after it signalled the end of the
    compile, and the tensors' deallocation lets go of the interpreter lock: a process that
    finalizes meanwhile aborts ('terminate called without an active exception', the thread
    killed inside torch's native code). ``Thread.join`` waits for that, unless an earlier join of
    the same thread was interrupted by Ctrl-C: CPython then marks the running thread stopped
    (bpo-45274) and every later join returns at once. So the wait at exit never joins before it
    is over, and where the system lists a process's threads (Linux's /proc) this also waits for
    the thread to leave the list."""
    deadline = time.monotonic() + timeout
    thread.join(timeout)
    task = f"/proc/self/task/{thread.native_id}"
    while thread.native_id is not None and os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.005)


def _in_a_child(job: Callable[[], Job], label: str, ready: threading.Event) -> bool:
    """Run ``job`` in a process of its own (:mod:`hoad.warm`) and wait for it, or until
    this process ends (the child then goes on); whether a child ran. It only fills Inductor's
    cache: a failure is logged and left to the compile in this process, which reports its own.
    ``ready`` is set once the child runs: an ending process waits for that much. Children take
    turns (:data:`CHILD_SLOTS`); once the process ends, the compiles still waiting go to one child
    that runs them one after another (:func:`_in_turn`)."""
    try:
        payload = pickle.dumps(job())
    except Exception as e:  # noqa: BLE001 - whatever does not pickle compiles in this process
        log.info("hoad: %s compiles in this process (its program does not pickle: %s)", label, e)
        return False
    fd, path = tempfile.mkstemp(prefix="hoad-compile-", suffix=".job")
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    slot = False
    while not slot and not _EXIT.is_set():
        slot = CHILD_SLOTS.acquire(timeout=0.1)
    if _EXIT.is_set():  # the process is ending: one child runs this compile after the others (_in_turn)
        if slot:  # (one just ended there: its slot is free, but another child would run beside it)
            CHILD_SLOTS.release()
        with _REGISTRY:
            handed = _HANDED_OVER is not None
            if handed:
                _HANDED_OVER.append((path, label))
        if not handed:  # (too late even for that: the next run compiles it)
            with contextlib.suppress(OSError):
                os.remove(path)
        ready.set()
        return True
    try:
        start = time.perf_counter()
        with _REGISTRY:
            child, output = _warm_child([path])
            _CHILDREN[child] = label
        ready.set()
        while child.poll() is None:
            if _EXIT.wait(0.1):
                return True  # (the child finishes on its own)
    finally:
        if slot:
            CHILD_SLOTS.release()
    with _REGISTRY:
        del _CHILDREN[child]
    if child.returncode == 0:
        log.info("hoad: a child process compiled %s into Inductor's cache in %.1f s", label,
                 time.perf_counter() - start)
    else:
        with open(output, errors="replace") as f:
            tail = f.read()[-2000:]
        log.info("hoad: compiling %s in a child process failed (exit status %d), so it compiles in this one: %s",
                 label, child.returncode, tail)
    with contextlib.suppress(OSError):
        os.remove(output)
    return True


def _warm_child(paths: list[str]) -> tuple[subprocess.Popen, str]:
    """Start :func:`hoad.warm.main` on the job files ``paths`` in a process of its own, as
    background work; the child and the file its output goes to (a file, not a pipe: the child may
    outlive this process)."""
    output = paths[0][: -len(".job")] + ".log"
    with open(output, "wb") as out:
        child = subprocess.Popen(background_command("import sys; from hoad.warm import main; main(*sys.argv[1:])")
                                 + paths, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 env=dict(os.environ, HOAD_COMPILE="wait", HOAD_PROGRESS="0"), start_new_session=True)
    return child, output


def _in_turn(handed: list[tuple[str, str]]) -> None:
    """Start one child that runs the compiles ``handed`` over at the end of the process, one after
    another, and outlives it. Each compile starting a child of its own there ran 33 at once after a
    script that built 28 programs: 6.4 GB of interpreters on a 2-core machine."""
    try:
        child, _ = _warm_child([path for path, _ in handed])
    except OSError:
        return  # (no interpreter to start: the next run compiles them)
    log.warning("hoad: Inductor goes on compiling %d program%s one after another in process %d after this one ends "
                "(%s); they fill the cache for the next run", len(handed), "s" if len(handed) > 1 else "", child.pid,
                ", ".join(label for _, label in handed))


# threading runs these exit calls last-registered first: importing the executors' modules now
# puts their shutdown (registered at their import) after this wait.
import concurrent.futures.process  # noqa: E402,F401
import concurrent.futures.thread  # noqa: E402,F401

threading._register_atexit(_exiting)  # (CPython's hook for exactly this: the executors use it)
atexit.register(_exiting)  # (a no-op by then, unless threading's hook did not run)


class Tiered:
    """A program that runs eagerly until its compiled twin is ready, then runs that.

    The compile runs on a daemon thread holding :data:`BUILDS` (Inductor keeps process-wide
    state), so the first calls return at once instead of after Inductor's 5-60 s; calls switch to
    the compiled program as soon as it exists (one attribute swap: a call in flight finishes on the
    eager program). A failed compile keeps the eager program, with a warning: a call never fails
    for it. :meth:`wait` blocks until the compile is over."""

    def __init__(self, eager: Callable, compile: Callable[[], Callable], label: str, stats: dict,
                 job: Callable[[], Job] | None = None):
        self.current, self.label, self.compiled = eager, label, None
        self.done = threading.Event()
        # the compile starts at the first call; ``job`` gives the same compile for a child process
        self._pending: tuple | None = (compile, stats, job)
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the compile (once): at the first call, so a program only ever called under
        autograd (whose own compiled twin serves those calls) is not compiled for nothing."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        self._start = time.perf_counter()
        ready = threading.Event()
        with _REGISTRY:
            _STARTING.add(ready)
        thread = threading.Thread(target=self._compile, args=(*pending, ready), name=COMPILE_THREAD, daemon=True)
        with _REGISTRY:
            _THREADS.add(thread)
        thread.start()
        # no wait for it, even from a warm cache: loading a compiled program takes 1-2 s (an order-3
        # MLP's 1.15 s, a training program's 2 s), which an eager first call never costs
        log.info("hoad: %s runs eagerly while Inductor compiles it in the background (HOAD_COMPILE=wait waits "
                     "for it instead)", self.label)

    def _compile(self, compile: Callable[[], Callable], stats: dict, job: Callable[[], Job] | None,
                 ready: threading.Event) -> None:
        try:
            in_a_child = job is not None and CHILD_COMPILES and _in_a_child(job, self.label, ready)
            with _REGISTRY:
                if in_a_child and _EXIT.is_set():
                    return  # (the child fills the cache; this process is ending)
                _IN_FLIGHT[threading.current_thread()] = self.done  # (an ending process waits for it)
            ready.set()
            with BUILDS:
                compiled = compile()
        except _Abandoned:
            return
        except Exception as e:  # noqa: BLE001 - the eager program goes on serving the calls
            if not _EXITING:  # (an interpreter shutting down fails a compile in flight: no news)
                log.warning("hoad: %s stays eager: %s", self.label, e)
        else:
            self.compiled = self.current = compiled
            if hasattr(compiled, "cache_hit"):
                stats["inductor"] = {"seconds": compiled.seconds, "cache_hit": compiled.cache_hit}
            log.info("hoad: %s is compiled (%.1f s after its build); calls now run the compiled program",
                     self.label, time.perf_counter() - self._start)
        finally:
            ready.set()
            with _REGISTRY:
                _STARTING.discard(ready)
                _IN_FLIGHT.pop(threading.current_thread(), None)
            self.done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Start the compile if it has not started, and block until it is over (True) or
        ``timeout`` seconds have passed (False)."""
        self.start()
        return self.done.wait(timeout)

    def __call__(self, *tensors):
        if self._pending is not None:
            self.start()
        return self.current(*tensors)

    def __getattr__(self, name: str):  # (a compiled program's attributes, once it exists: graphs, ...)
        compiled = self.__dict__.get("compiled")
        if compiled is None:
            raise AttributeError(name)
        return getattr(compiled, name)
