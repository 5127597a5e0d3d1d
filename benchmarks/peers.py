"""The contenders: hoad and its peers, one column each.

Derivative workloads (:class:`benchmarks.workloads.Problem`) have the columns of :data:`COLUMNS`;
operator and training-step workloads (:mod:`benchmarks.operators`) have one column per
:class:`benchmarks.operators.Way` (hoad, hoad eager, torch.func, torch.compile, jax.jit, folx,
torch-jet, torch-jet compiled), built by :func:`operator_contenders`. A peer whose library is
not installed is ``n/a``; its import happens only when its column is built.

Each contender's ``start(ref)`` makes its first call (timed: trace and compile included), checks
the answer against the reference and returns an :class:`Outcome`; only a correct contender is
then timed through ``run(calls)``. ``torch.compile`` peers live in a worker process
(:mod:`benchmarks.worker`), because compiling nested torch.func can kill the process.

hoad is used in the best configuration this checkout offers, found by feature detection: an
option hoad does not know raises ``TypeError`` or ``hoad.InvalidArgumentError`` at
``hoad.compile``, and the next one is tried (see :func:`hoad_options`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

import hoad
from benchmarks import env, operators
from benchmarks.operators import chosen_mode
from benchmarks.reference import TORCH, MultiIndex, answer_fn, canonical, compare, jax_transforms, nested_blocks
from benchmarks.timing import median, synchronize, time_calls
from benchmarks.worker import PREFIX, summary
from benchmarks.workloads import Problem, Workload

COLUMNS = ("hoad", "torch.func", "torch.compile", "autograd.F", "jax.jit")
DENSE_LIMIT = 2**26  # elements: the Σ_b fallback's dense top-order block may not exceed this (512 MiB)


@dataclass
class Outcome:
    """What one contender did on one workload."""

    status: str  # ok | WRONG | error | crash | timeout | n/a | skipped
    config: str = ""  # how it ran (for hoad: backend/mode and how samples were handled)
    first_call_s: float | None = None  # the first call, trace and compile included
    times: list[float] = field(default_factory=list)  # per-call seconds, one per round
    error: float | None = None  # largest scaled difference from the reference
    note: str = ""  # the exception, the reason for a skip, a fallback taken, ...

    def as_dict(self) -> dict:
        return {**asdict(self), "median_s": median(self.times)}


def _failure(e: BaseException) -> Outcome:
    message = summary(e)
    return Outcome("error", note=f"{type(e).__name__}: {message}")


class Skipped:
    """A column that does not apply to this workload (or is left out of this run)."""

    def __init__(self, name: str, status: str, note: str):
        self.name, self.outcome = name, Outcome(status, note=note)

    def start(self, ref) -> Outcome:
        return self.outcome

    def run(self, calls: int) -> float:
        raise RuntimeError(f"{self.name} is not timed here")

    def close(self) -> None:
        pass


class InProcess:
    """A contender that runs in this process: ``first()`` answers (for the check), ``timed()`` is
    what is timed (the same work; it may skip the lower-order blocks that only the check needs)."""

    def __init__(self, name: str, config: str, first: Callable[[], dict], timed: Callable[[], object] | None = None):
        self.name, self.config = name, config
        self.first, self.timed = first, timed or first

    def start(self, ref) -> Outcome:
        synchronize()
        begin = time.perf_counter()
        try:
            got = self.first()
            synchronize()
        except Exception as e:  # a contender failing is a result, not a harness error
            outcome = _failure(e)
            outcome.config = self.config
            return outcome
        seconds = time.perf_counter() - begin
        check = compare(got, ref)
        return Outcome("ok" if check.ok else "WRONG", self.config, seconds, error=check.error, note=check.note)

    def run(self, calls: int) -> float:
        return time_calls(self.timed, calls)

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------- hoad
@dataclass(frozen=True)
class HoadOption:
    """How hoad is run in one column: the backend, how samples are handled, diagonal or full."""

    backend: str
    samples: str  # "dense" (not per-sample) | "batch_dim" | "summed" (Σ_b f(X_b), diagonal blocks read off)
    diagonal: bool = False  # pure derivatives only (a Laplacian needs no mixed ∂²/∂x_i∂x_j)
    packed: bool = False  # unique entries of one input's blocks (timed as res.packed: no dense block)


def hoad_options(p: Problem) -> Iterator[HoadOption]:
    """hoad configurations, best first: pure derivatives for a Laplacian, per-sample blocks via
    batch_dim before the Σ_b fallback, Inductor before eager. ``mode`` stays "auto": hoad picks
    the direction."""
    for diagonal in ((True, False) if p.laplacian else (False,)):
        for samples in (("batch_dim", "summed") if p.per_sample else ("dense",)):
            for backend in ("inductor", "eager"):
                yield HoadOption(backend, samples, diagonal, p.packed)


class Hoad:
    """hoad, in the best configuration that compiles and answers. A configuration that raises on
    its first call is noted (a hoad failure, reported) and the next one is tried; a wrong answer
    is final."""

    name = "hoad"

    def __init__(self, p: Problem):
        self.p = p
        self.timed: Callable[[], object] | None = None

    def start(self, ref) -> Outcome:
        failures: list[Outcome] = []
        notes: list[str] = []
        for option in hoad_options(self.p):
            if option.samples == "summed" and self._dense_numel() > DENSE_LIMIT:
                notes.append(self._too_big(batch_dim_offered=bool(failures)))
                break
            try:
                cf = self._compile(option)
            except (TypeError, hoad.InvalidArgumentError):
                continue  # this hoad does not offer the option yet
            answer = functools.partial(hoad_answer, self.p, cf, option, True)
            outcome = InProcess("hoad", "", first=answer).start(ref)
            outcome.config = hoad_config(cf, option)
            if outcome.status == "error":
                failures.append(outcome)
                continue
            outcome.note = "; ".join(filter(None, [outcome.note, *(f"{f.config}: {f.note}" for f in failures)]))
            self.timed = functools.partial(hoad_answer, self.p, cf, option, False)
            return outcome
        if failures:
            first = failures[0]
            first.note = "; ".join([first.note, *(f"{f.config}: {f.note}" for f in failures[1:]), *notes])
            return first
        return Outcome("n/a", note="; ".join(notes) or "no hoad configuration applies")

    def run(self, calls: int) -> float:
        return time_calls(self.timed, calls)

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------------------ helpers
    def _compile(self, option: HoadOption) -> hoad.Compiled:
        p = self.p
        # (packed=False, not the default "auto": the dense rows time the dense program, the packed
        # rows beside them the packed one, and the default picks one of the two)
        kwargs = dict(order=p.order, wrt=p.wrt, backend=option.backend, mode="auto", packed=option.packed)
        if option.diagonal:
            kwargs["diagonal"] = True
        if option.samples == "batch_dim":
            return hoad.compile(p.fn, batch_dim=0, **kwargs)
        if option.samples == "summed":
            def summed(X):
                return p.fn(X).sum(0)
            return hoad.compile(summed, **kwargs)
        return hoad.compile(p.fn, **kwargs)

    def _dense_numel(self) -> int:
        """Elements of the dense top-order block of Σ_b f(X_b)."""
        X = self.p.sample
        return math.prod(self.p.fn(X).shape[1:]) * X.numel() ** self.p.order

    def _too_big(self, batch_dim_offered: bool) -> str:
        gib = self._dense_numel() * self.p.sample.element_size() / 2**30
        why = "batch_dim failed" if batch_dim_offered else "no batch_dim in this hoad"
        return f"{why}, and the Σ_b fallback needs a dense order-{self.p.order} block of {gib:.0f} GiB"


def hoad_answer(p: Problem, cf: hoad.Compiled, option: HoadOption, every_order: bool) -> dict[MultiIndex, torch.Tensor]:
    """hoad's answer to ``p`` from one call of ``cf``: every order 1..N (what is checked) or the top
    order only (what is timed); ``option`` says how ``cf`` was compiled."""
    samples = option.samples
    res = cf(*p.args)
    orders = range(1, p.order + 1) if every_order and not p.laplacian else [p.order]
    blocks = {}
    for k in orders:
        for K in canonical(len(p.wrt), k):
            key = tuple(p.wrt[i] for i in K)
            if option.packed and not every_order:  # the unique entries as computed (checked densely)
                blocks[K] = res.packed(key)[0]
                continue
            block = res[key]
            if samples == "summed":  # res.value is Σ_b f(X_b): the output without its batch axis
                block = per_sample_blocks(block, res.value.ndim, p.sample.ndim - 1, k)
            if p.laplacian:  # pure derivatives hold the Hessian's diagonal itself
                block = block.sum(tuple(range(block.ndim - (p.sample.ndim - 1), block.ndim))) if option.diagonal \
                    else TORCH.trace(block)
            blocks[K] = block
    return blocks


def hoad_config(cf: hoad.Compiled, option: HoadOption) -> str:
    """The config label: backend/mode, then how per-sample blocks were obtained."""
    config = f"{option.backend}/{chosen_mode(cf.compiled if option.packed else cf)}"  # (packed: its jet program)
    config += {"dense": "", "batch_dim": ", batch_dim=0", "summed": ", Σ_b"}[option.samples]
    return config + (", diagonal" if option.diagonal else "") + (", packed" if option.packed else "")


def per_sample_blocks(block: torch.Tensor, out_ndim: int, sample_ndim: int, order: int) -> torch.Tensor:
    """Per-sample blocks read off a dense block of Σ_b f(X_b): ``block`` has shape
    ``out + (B, *x) * order``; the result ``(B, *out, *x * order)``, as ``vmap`` lays it out."""
    batch = block.shape[out_ndim]
    b = torch.arange(batch, device=block.device)
    index = (slice(None),) * out_ndim + ((b,) + (slice(None),) * sample_ndim) * order
    blocks = block[index]  # separated advanced indices: the batch axis goes first (order >= 2)
    return blocks.movedim(out_ndim, 0) if order == 1 else blocks


# ------------------------------------------------------------------------------- the peers
def nesting(p: Problem) -> str:
    """The nested transform the peers run, as a config label."""
    what = {1: "jacrev", 2: "hessian"}.get(p.order, f"jacfwd^{p.order - 1}(jacrev)")
    return f"vmap({what})" if p.per_sample else what


def torch_func(p: Problem) -> InProcess:
    answer = answer_fn(p)
    return InProcess("torch.func", nesting(p), lambda: answer(*p.args))


def autograd_functional(p: Problem) -> InProcess | Skipped:
    """``torch.autograd.functional.hessian`` (or ``jacobian`` at order 1) with ``vectorize=True``."""
    if p.per_sample or p.order > 2:
        return Skipped("autograd.F", "n/a", "dense orders 1-2 only")
    op = torch.autograd.functional.hessian if p.order == 2 else torch.autograd.functional.jacobian
    inputs = tuple(p.args[i] for i in p.wrt)

    def of_wrt(*values):
        args = list(p.args)
        for i, v in zip(p.wrt, values):
            args[i] = v
        return p.fn(*args)

    def answer():
        out = op(of_wrt, inputs if len(inputs) > 1 else inputs[0], vectorize=True)
        return nested_blocks(out, len(p.wrt), p.order)

    return InProcess("autograd.F", f"{op.__name__}(vectorize=True)", answer)


def jax_jit(p: Problem) -> InProcess | Skipped:
    if env.jax_version() is None:
        return Skipped("jax.jit", "skipped", "jax is not installed (pip install -e '.[bench]')")
    if p.jax is None:
        return Skipped("jax.jit", "n/a", "no JAX version of this workload")
    import jax
    import numpy as np

    fn, args = p.jax()
    compiled = jax.jit(answer_fn(p, fn, jax_transforms()))

    def first():
        out = jax.block_until_ready(compiled(*args))
        return {K: torch.from_numpy(np.array(v)) for K, v in out.items()}

    return InProcess("jax.jit", f"jit({nesting(p)})", first, timed=lambda: jax.block_until_ready(compiled(*args)))


class CompiledInWorker:
    """``torch.compile`` of the torch.func answer, run by :mod:`benchmarks.worker` in its own
    process. The worker reports its first call, saves its answer for the check, then times
    itself on request, so its rounds interleave with the in-process contenders'."""

    def __init__(self, w: Workload, timeout_s: float, config: str, name: str = "torch.compile",
                 way: str | None = None, dtype: torch.dtype = torch.float64):
        self.workload, self.timeout_s = w, timeout_s
        self.name, self.config = name, config
        # the worker's command line: the workload, and for operator workloads the column to build
        self.options = ([] if way is None else ["--way", way]) + \
            ([] if dtype == torch.float64 else ["--dtype", str(dtype).removeprefix("torch.")])
        self.proc: subprocess.Popen | None = None
        self.stderr = None
        self.timed_out = False
        self.replies: queue.Queue = queue.Queue()
        self.tmp = tempfile.TemporaryDirectory(prefix="hoad-bench-")

    def start(self, ref) -> Outcome:
        answer_path = os.path.join(self.tmp.name, "answer.pt")
        self.stderr = open(os.path.join(self.tmp.name, "stderr.txt"), "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.worker", self.workload.id, answer_path,
                                      *self.options], cwd=env.REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, bufsize=1)
        threading.Thread(target=self._read, daemon=True).start()
        reply = self._reply(self.timeout_s)
        if reply is None:
            return self._died(self.config)
        if "error" in reply:
            return Outcome("error", self.config, note=f"{reply['error']}: {reply['message']}")
        check = compare(torch.load(answer_path, weights_only=True), ref)
        return Outcome("ok" if check.ok else "WRONG", self.config, reply["first_call_s"], error=check.error,
                       note=check.note)

    def run(self, calls: int) -> float:
        self.proc.stdin.write(json.dumps({"run": calls}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(self.timeout_s)
        if reply is None or "seconds" not in reply:
            raise RuntimeError(self._died("").note)
        return reply["seconds"]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # nothing more is needed from it, and a clean exit takes seconds
            self.proc.wait()
        if self.stderr is not None:
            self.stderr.close()
        self.tmp.cleanup()

    # ----------------------------------------------------------------------------- helpers
    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self.replies.put(json.loads(line[len(PREFIX):]))
        self.replies.put(None)  # end of output: the worker is gone

    def _reply(self, timeout: float) -> dict | None:
        try:
            return self.replies.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            self.proc.wait()
            self.timed_out = True
            return None

    def _died(self, config: str) -> Outcome:
        if self.timed_out:
            return Outcome("timeout", config, note=f"no answer within {self.timeout_s:.0f} s")
        code = self.proc.wait()
        if code < 0:
            return Outcome("crash", config, note=f"worker killed by {signal.Signals(-code).name}")
        self.stderr.seek(0)
        tail = self.stderr.read().strip().splitlines()[-1:] or [""]
        return Outcome("crash", config, note=f"worker exited with code {code}: {tail[0][:200]}")


def contenders(p, w: Workload, quick: bool, compile_peers: bool, compile_timeout_s: float,
                dtype: torch.dtype = torch.float64) -> list:
    """One contender per column: :data:`COLUMNS` for a derivative problem, one per
    :func:`benchmarks.operators.ways` for an operator or a training step."""
    if not isinstance(p, Problem):
        return operator_contenders(p, w, quick, compile_peers, compile_timeout_s, dtype)
    if not compile_peers:
        compiled = Skipped("torch.compile", "skipped", "--no-compile")
    elif quick and not w.compiles_in_quick("torch.compile"):
        compiled = Skipped("torch.compile", "skipped", "--quick compiles a few peers only")
    else:
        compiled = CompiledInWorker(w, compile_timeout_s, f"torch.compile({nesting(p)})", dtype=dtype)
    return [Hoad(p), torch_func(p), compiled, autograd_functional(p), jax_jit(p)]


# ------------------------------------------------------------- operators and training steps
class Built:
    """A column of an operator or training-step workload that runs in this process: its
    :class:`~benchmarks.operators.Way`'s set-up (capture, trace, compile) and first call make the
    first-call time; the answer is checked, then ``timed`` is what is timed."""

    def __init__(self, way: operators.Way):
        self.name, self.way = way.name, way
        self.timed: Callable[[], object] | None = None

    def start(self, ref) -> Outcome:
        synchronize()
        begin = time.perf_counter()
        try:
            answer, self.timed = self.way.build()
            got = answer()
            synchronize()
        except Exception as e:  # a contender failing is a result, not a harness error
            outcome = _failure(e)
            outcome.config = self.way.config
            return outcome
        seconds = time.perf_counter() - begin
        if self.way.bound:  # computes no answer: nothing to check
            return Outcome("ok", self.way.config, seconds)
        check = compare(got, ref)
        config = self.way.config + (f", {answer.chosen()}" if hasattr(answer, "chosen") else "")
        return Outcome("ok" if check.ok else "WRONG", config, seconds, error=check.error, note=check.note)

    def run(self, calls: int) -> float:
        return time_calls(self.timed, calls)

    def close(self) -> None:
        self.timed = None  # frees what the contender holds (compiled programs, device memory)


def missing(way: operators.Way) -> str | None:
    """The first library ``way`` needs that is not installed (None when all are)."""
    for distribution in way.needs:
        if env.peer_version(distribution) is None:
            return distribution
    return None


def operator_contenders(p, w: Workload, quick: bool, compile_peers: bool, compile_timeout_s: float,
                        dtype: torch.dtype) -> list:
    out = []
    for way in operators.ways(p):
        absent = missing(way)
        if absent is not None:
            out.append(Skipped(way.name, "n/a", f"{absent} is not installed (pip install -e '.[bench]')"))
        elif quick and way.full_only:
            out.append(Skipped(way.name, "skipped", "left out of --quick"))
        elif way.worker and not compile_peers:
            out.append(Skipped(way.name, "skipped", "--no-compile"))
        elif way.worker and quick and not w.compiles_in_quick(way.name):
            out.append(Skipped(way.name, "skipped", "--quick compiles a few peers only"))
        elif way.worker:
            out.append(CompiledInWorker(w, compile_timeout_s, way.config, name=way.name, way=way.name, dtype=dtype))
        else:
            out.append(Built(way))
    return out

