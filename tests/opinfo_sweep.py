"""Run hoad over PyTorch's operator database (OpInfo) and classify every op.

For every OpInfo in ``op_db`` that supports float64 on CPU and autograd (random ops included:
hoad refuses them), take at most two small samples, build ``g(x) = (w * sin(out)).sum()`` with
``out = op(x, *args, **kwargs)`` (``x`` = the sample's input, or the first tensor of a list input;
everything else closed over; the first floating output of a tuple; ``w`` a fixed random weight),
and compare hoad's value and blocks ``res[(0,) * k]`` (k = 1..3, 1..2 when x has more than 25
entries; fewer where torch cannot differentiate an op's backward) in both directions
(``mode="forward"`` and ``mode="reverse"``, eager backend) with nested torch.func (jacrev, then
jacfwd per further order; jacrev where an op has no forward-mode derivative; a plain-op
stand-in where torch.func itself is wrong, see PLAIN_REFERENCE). Each op gets the worst class
over its samples and directions:

``exact``        every sample matches in both directions
``unsupported``  hoad raised UnsupportedOperatorError (the ATen overload is recorded)
``refused``      hoad raised another HoadError (capture, control flow, output, randomness...)
``wrong``        a value or block differs (rtol 1e-7, atol 1e-7 * max(1, |ref|max), NaN where
                 torch is finite is wrong; ops casting to float32/16 get that dtype's tolerance)
``crash``        anything else: HoadInternalError, ExecutionError (the program failed on inputs
                 the function itself runs on), raw torch exceptions, a timeout
``skipped``      no usable sample (not counted): no floating tensor input of 1..60 entries, a
                 non-floating or complex output, or no reference (torch.func raises at order 1,
                 or the value or gradient is not finite)

Each op is called two ways: as ``op.op`` (the function OpInfo wraps) and through the OpInfo
object's own ``__call__``, so the traced function closes over the OpInfo and hoad's guards read
its attributes (``VIA``: by default the forward direction goes through ``op.op`` and the reverse
one through ``OpInfo.__call__``; ``--via op`` or ``--via opinfo`` takes one way for both).

Samples: the OpInfo's own, the small ones first (see pick_samples); a skipped sample makes room
for the next candidate. Ops whose samples are all too large (the elementwise ops' only sample is
20x20) get them narrowed to the first few entries along every dim. Everything is seeded.

Run as a script: ``python tests/opinfo_sweep.py`` (the fast subset), ``--all`` (every op, ~6 min
on 2 cores), ``--op NAME`` (repeatable), ``--write-expected tests/opinfo_expected.py``
(regenerate the checked-in expectations from this run), ``--check-plain`` (verify the plain-op
references). ``tests/test_opinfo.py`` holds the pytest tests.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import math
import os
import re
import signal
import sys
import time
import warnings
import zlib

import torch
from torch.func import jacfwd, jacrev
from torch.utils import _pytree as pytree

import hoad

DT = torch.float64
MAX_NUMEL = 60          # larger inputs are skipped (dense order-2 blocks of 60^2 entries)
ORDER3_NUMEL = 25       # up to this many entries: orders 1..3, above: 1..2
SAMPLES_PER_OP = 2
CANDIDATES = 6          # samples tried in turn until SAMPLES_PER_OP of them are usable
SCAN_SAMPLES = 64       # at most this many samples of an op are looked at
MODES = ("forward", "reverse")
RTOL = 1e-7
TIMEOUT_S = 120         # per sample and mode (trace + run); a timeout is a crash
# how each direction calls the op: "op" (op.op) or "opinfo" (OpInfo.__call__); see the docstring
# ("packed": hoad.compile(..., packed=True), the unique entries from Taylor jets, mode "auto";
# "collapsed": hoad.taylor(..., collapse=True, weights=w) along 3 drawn directions, the rules'
# diagonal mode with the top order summed over the directions, as the Laplacian runs them; the
# op's input is curved through the sample point, so that every order of it reaches the rule)
VIA = {"mixed": {"forward": "op", "reverse": "opinfo", "auto": "opinfo", "packed": "op", "collapsed": "opinfo"},
       "op": {"forward": "op", "reverse": "op", "auto": "op", "packed": "op", "collapsed": "op"},
       "opinfo": {"forward": "opinfo", "reverse": "opinfo", "auto": "opinfo", "packed": "opinfo",
                  "collapsed": "opinfo"}}

STATUSES = ("exact", "unsupported", "refused", "wrong", "crash", "skipped")
# worst first: silently wrong numbers are worse than a crash, a crash worse than a clear refusal
_SEVERITY = {"wrong": 5, "crash": 4, "refused": 3, "unsupported": 2, "exact": 1, "skipped": 0}

# torch.func is itself wrong for some ops (torch 2.13): the third derivative through the batch
# statistics of layer_norm, batch_norm (training) and instance_norm (their fused backward
# kernels' double backward), from 1e-7 to O(1) off. For those ops the reference is nested
# torch.func of the same function written with plain ops (mean, variance as a mean of squares,
# rsqrt), PLAIN_FUNCTIONS below. ``python tests/opinfo_sweep.py --check-plain`` checks each: on
# every candidate sample torch.func of the plain function matches finite differences of its own
# lower order to ~1e-9 where torch.func of the op is off (layer_norm 0.02-0.4, batch_norm up to
# 2.7, instance_norm up to 96). group_norm, rms_norm and prod are checked too and agree (prod is
# wrong in torch.func only at an exact zero, which no picked sample has).
PLAIN_REFERENCE: dict = {}  # op name -> plain(sample) -> out(x); filled below (PLAIN_FUNCTIONS)


def op_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def eligible_ops():
    """Every OpInfo that supports float64 on CPU and autograd, sorted by name."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if op.supports_autograd and DT in op.supported_dtypes("cpu")]
    return sorted(ops, key=op_name)


# the fast subset (tests/test_opinfo.py's default test): a fixed list spread over the families,
# cheap to trace (~25 s on 2 idle cores; an op is ~0.3-2 s, the norms and softmaxes the dearest)
FAST_OPS = (
    # elementwise
    "sin", "sigmoid", "rsqrt", "pow", "div.no_rounding_mode", "addcmul", "fmod", "clamp", "where",
    "sign", "atan2", "nn.functional.elu",
    # reductions, scans, order statistics
    "sum", "amax", "cumsum", "topk", "kthvalue",
    # views, layout, indexing
    "reshape", "expand_as", "transpose", "t_copy", "H", "cat", "narrow_copy", "index_select", "gather",
    "take_along_dim",
    # products, linalg
    "matmul", "addmm", "einsum", "kron", "trace", "linalg.det", "cdist",
    # nn.functional (batch_norm: a plain-op reference)
    "nn.functional.batch_norm", "log_softmax", "nn.functional.mse_loss", "nn.functional.l1_loss",
    "nn.functional.linear", "nn.functional.conv1d",
)


# ---------------------------------------------------------------------------------------------
# samples


@dataclasses.dataclass
class Sample:
    x: torch.Tensor                 # the differentiated input
    call: object                    # call(x) -> the op's output (args and kwargs closed over)
    desc: str
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    # the same call through the OpInfo object itself (OpInfo.__call__): the function then closes
    # over the OpInfo, whose attributes hoad's guards read (a class default the instance serves
    # through __getattribute__, say)
    call_opinfo: object = None


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"T{list(t.shape)}" if t.dtype == DT else f"T{list(t.shape)}:{str(t.dtype)[6:]}"
    if isinstance(t, (list, tuple)):
        inner = ", ".join(_desc(a) for a in t)
        return f"[{inner}]" if isinstance(t, list) else f"({inner})"
    s = repr(t)
    return s if len(s) <= 24 else s[:21] + "..."


def _sample_to(op, sample) -> Sample | None:
    inp = sample.input
    if isinstance(inp, torch.Tensor):
        x, rest = inp, None
    elif isinstance(inp, (list, tuple)) and inp and all(isinstance(t, torch.Tensor) for t in inp):
        x, rest = inp[0], list(inp[1:])   # differentiate the first tensor, the others fixed
    else:
        return None
    if not x.dtype.is_floating_point or x.is_complex() or not (0 < x.numel() <= MAX_NUMEL):
        return None
    if x.layout != torch.strided:
        return None
    x = x.detach()
    args, kwargs = sample.args, sample.kwargs
    listy, kind = rest is not None, type(inp)
    post = sample.output_process_fn_grad
    wrapper, fn = op.gradcheck_wrapper, op.get_op()   # as OpInfo's gradcheck tests call them

    def call(x):
        first = kind([x, *rest]) if listy else x
        return post(wrapper(fn, first, *args, **kwargs))

    def call_opinfo(x):
        first = kind([x, *rest]) if listy else x
        return post(wrapper(op, first, *args, **kwargs))

    parts = [_desc(list(inp) if listy else inp)] + [_desc(a) for a in args]
    parts += [f"{k}={_desc(v)}" for k, v in kwargs.items()]
    return Sample(x, call, "(" + ", ".join(parts) + ")", tuple(args), dict(kwargs), call_opinfo)


def _seed(name: str, salt: str = "") -> int:
    return zlib.crc32((name + "/" + salt).encode()) & 0x7FFFFFFF


def _narrowed_samples(sample):
    """Copies of ``sample`` whose input keeps only the first k entries along each dim, k the
    largest leaving at most ORDER3_NUMEL entries: first with every tensor argument of the input's
    shape narrowed alike, then with every floating tensor argument narrowed to k along each dim
    (matmul-like shape relations survive that); none when the input cannot be narrowed."""
    from torch.testing._internal.opinfo.core import SampleInput

    inp = sample.input
    if not isinstance(inp, torch.Tensor) or inp.ndim == 0 or inp.numel() == 0:
        return []
    shape = tuple(inp.shape)
    k = max(shape)
    while k > 1 and math.prod(min(s, k) for s in shape) > ORDER3_NUMEL:
        k -= 1
    if math.prod(min(s, k) for s in shape) > MAX_NUMEL:
        return []

    def cut(t):
        return t[tuple(slice(0, k) for _ in t.shape)].clone()

    def same_shape(t):
        return cut(t) if isinstance(t, torch.Tensor) and tuple(t.shape) == shape else t

    def floating(t):
        return cut(t) if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.ndim else t

    return [SampleInput(cut(inp), args=tuple(f(a) for a in sample.args),
                        kwargs={key: f(v) for key, v in sample.kwargs.items()},
                        output_process_fn_grad=sample.output_process_fn_grad)
            for f in (same_shape, floating)]


def pick_samples(op) -> list[Sample]:
    """At most CANDIDATES samples, in the order they are tried: the first with 2..ORDER3_NUMEL
    entries, then the others with at most ORDER3_NUMEL entries (they get order 3), then those with
    up to MAX_NUMEL, each group in the OpInfo's own order. An op without any gets its first
    too-large samples narrowed (the first k entries along every dim; the elementwise ops' only
    sample is 20x20), those the op runs on."""
    torch.manual_seed(_seed(op_name(op), "samples"))
    found, large = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, s in enumerate(op.sample_inputs("cpu", DT, requires_grad=False)):
            if i >= SCAN_SAMPLES:
                break
            sm = _sample_to(op, s)
            if sm is not None:
                found.append((sm.x.numel() > ORDER3_NUMEL, i, sm))
            elif not found and len(large) < 2 * CANDIDATES and (
                    not isinstance(s.input, torch.Tensor) or s.input.numel() > 0):
                large.append(s)
        if not found:
            for s in large:
                for small in _narrowed_samples(s):
                    sm = _sample_to(op, small)
                    if not sm:
                        continue
                    try:
                        sm.call(sm.x)
                    except Exception:  # noqa: BLE001 - the narrowed sample is not valid for this op
                        continue
                    sm.desc = "narrowed " + sm.desc
                    found.append((False, len(found), sm))
                    break
                if len(found) == CANDIDATES:
                    break
    # first the first sample with 2..ORDER3_NUMEL entries (a 0-d or one-entry input is the first
    # sample of many ops), then the first of the rest with at most ORDER3_NUMEL, then larger ones
    found.sort(key=lambda t: (t[0], t[2].x.numel() < 2, t[1]))
    picked = found[:1]
    rest = sorted(found[1:], key=lambda t: t[:2])
    return [sm for _, _, sm in (picked + rest)[:CANDIDATES]]


def first_float_output(out):
    """The op's output to differentiate: the tensor, or the first floating tensor of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
            return t
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            return t
    return None


def make_g(call, x, seed):
    """g(x) = (w * sin(out)).sum(), or None and why when out is not a real floating tensor; and
    the relative tolerance for out's dtype (ops casting to float32/16 compute in that precision)."""
    out = first_float_output(call(x))
    if out is None:
        return None, "no tensor output"
    if out.is_complex():
        return None, f"complex output ({out.dtype})"
    if not out.dtype.is_floating_point:
        return None, f"non-floating output ({out.dtype})"
    rtol = RTOL if out.dtype == DT else 16 * torch.finfo(out.dtype).eps
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, dtype=DT, generator=gen)

    def g(x):
        return (w * torch.sin(first_float_output(call(x)))).sum()

    g.rtol = rtol
    return g, None


# ---------------------------------------------------------------------------------------------
# reference and comparison


def nested_reference(g, x, order, partial=False):
    """{k: d^k g / dx^k} for k = 1..order by jacrev, then jacfwd per further order; where an op
    has no forward-mode derivative in torch, jacrev per further order (the same layout). With
    ``partial``, the orders up to the one torch cannot differentiate (an op whose backward has no
    derivative): at least order 1, else it raises."""
    try:
        return _nested(g, x, order, jacfwd, partial=False)
    except (NotImplementedError, RuntimeError) as e:
        if not partial and not any(s in str(e) for s in ("forward AD", "jvp", "forward-mode")):
            raise
        return _nested(g, x, order, jacrev, partial)


def _nested(g, x, order, outer, partial):
    f = jacrev(g)
    out = {1: f(x)}
    for k in range(2, order + 1):
        f = outer(f)
        try:
            out[k] = f(x)
        except (NotImplementedError, RuntimeError):
            if not partial:
                raise
            break
    return out


def compare(got, ref, rtol=RTOL) -> str | None:
    """None when close (rtol, atol = rtol * max(1, |ref|max), NaN where ref has NaN), else a
    one-line reason."""
    if not isinstance(got, torch.Tensor):
        return f"not a tensor: {type(got).__name__}"
    if tuple(got.shape) != tuple(ref.shape):
        return f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    ref = ref.to(DT)
    got = got.to(DT)
    finite = ref[torch.isfinite(ref)]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    try:
        torch.testing.assert_close(got, ref, rtol=rtol, atol=rtol * scale, equal_nan=True)
    except AssertionError:
        nan_got, nan_ref = torch.isnan(got), torch.isnan(ref)
        if (nan_got & ~nan_ref).any():
            return f"NaN where torch has {float(ref[nan_got & ~nan_ref].flatten()[0]):.3g} " \
                   f"({int((nan_got & ~nan_ref).sum())} entries)"
        if (nan_ref & ~nan_got).any():
            return f"{float(got[nan_ref & ~nan_got].flatten()[0]):.3g} where torch has NaN"
        inf = torch.isinf(got) != torch.isinf(ref)
        if inf.any():
            return f"inf mismatch ({int(inf.sum())} entries)"
        both = ~nan_ref & ~torch.isinf(ref)
        err = (got[both] - ref[both]).abs()
        i = int(err.argmax())
        return f"max abs err {float(err[i]):.3g} (got {float(got[both][i]):.6g}, want {float(ref[both][i]):.6g}, " \
               f"|ref|max {scale:.3g})"
    return None


class Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds):
    """SIGALRM-based limit (main thread, POSIX only); a no-op elsewhere."""
    usable = seconds and hasattr(signal, "SIGALRM") and _in_main_thread()
    if not usable:
        yield
        return

    def handler(signum, frame):
        raise Timeout(f"timed out after {seconds} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _in_main_thread():
    import threading
    return threading.current_thread() is threading.main_thread()


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _short(e: BaseException, n: int = 200) -> str:
    """'Type: message' on one line, at most n characters of message; paths in the repository are
    relative and without line numbers (the expectations file stays stable under edits)."""
    msg = " ".join(str(e).split()).replace(_ROOT, "")
    msg = re.sub(r"(\.py):\d+", r"\1", msg)
    return f"{type(e).__name__}: {msg[:n]}"


def _unsupported_overload(e: BaseException) -> str:
    """The ATen overload an UnsupportedOperatorError names ("no derivative rule for aten.x.y", or
    "aten.x.y ... computes complex values", marked "(complex)")."""
    msg = str(e)
    m = re.search(r"aten\.\w+\.\w+", msg)
    if m is None:
        return _short(e, 120)
    return m.group(0) + (" (complex)" if "complex values" in msg else "")


def classify_exception(e: BaseException) -> tuple[str, str]:
    if isinstance(e, hoad.UnsupportedOperatorError):
        return "unsupported", _unsupported_overload(e)
    if isinstance(e, (hoad.HoadInternalError, hoad.ExecutionError)):
        return "crash", _short(e)
    if isinstance(e, hoad.HoadError):
        return "refused", _short(e)
    if isinstance(e, Timeout):
        return "crash", f"Timeout: {e}"
    return "crash", _short(e)


# ---------------------------------------------------------------------------------------------
# one op


@dataclasses.dataclass
class SampleResult:
    desc: str
    status: str
    reason: str = ""
    order: int = 0


@dataclasses.dataclass
class OpResult:
    name: str
    status: str
    reason: str
    samples: list
    seconds: float = 0.0

    @property
    def order(self) -> int:
        """The highest order compared (torch.func cannot differentiate some ops' backward)."""
        return max((r.order for r in self.samples if r.status != "skipped"), default=0)


def run_sample(name, index, sample, modes=MODES, timeout=TIMEOUT_S, via="mixed") -> SampleResult:
    x = sample.x
    order = 3 if x.numel() <= ORDER3_NUMEL else 2
    seed = _seed(name, f"w{index}")
    try:
        with time_limit(timeout):
            g, why = make_g(sample.call, x, seed)
    except Exception as e:  # noqa: BLE001 - the op itself fails on this sample
        return SampleResult(sample.desc, "skipped", f"op fails: {_short(e, 100)}", order)
    try:
        with time_limit(timeout):
            g_opinfo, _ = make_g(sample.call_opinfo, x, seed)
    except Exception:  # noqa: BLE001 - a gradcheck wrapper that needs the function (its __name__): op.op only
        g_opinfo = g
    if g is None:
        return SampleResult(sample.desc, "skipped", f"not-differentiable: {why}", order)
    # the reference (or its plain-op stand-in) and the value
    plain = PLAIN_REFERENCE.get(name)
    try:
        with time_limit(timeout), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = g(x)
            if not torch.equal(value, g(x)) and not (value.isnan() and g(x).isnan()):
                return SampleResult(sample.desc, "skipped", "no reference: not deterministic", order)
            gref = g
            if plain is not None:
                gp, _ = make_g(plain(sample), x, seed)
                gp_value = gp(x)
                if compare(gp_value, value) is not None:
                    return SampleResult(sample.desc, "skipped",
                                        f"plain-op reference differs in value: {compare(gp_value, value)}", order)
                gref = gp
            # orders torch.func cannot reach (double backward not implemented) are left out
            ref = nested_reference(gref, x, order, partial=True)
            order = len(ref)
    except Exception as e:  # noqa: BLE001
        return SampleResult(sample.desc, "skipped", f"no reference: {_short(e, 100)}", order)
    if not torch.isfinite(value).all() or not torch.isfinite(ref[1]).all():
        return SampleResult(sample.desc, "skipped", "no reference: value or gradient not finite", order)

    worst = SampleResult(sample.desc, "exact", "", order)
    for mode in modes:
        try:
            with time_limit(timeout), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                traced = g_opinfo if VIA[via][mode] == "opinfo" else g
                if mode == "collapsed":
                    problems = _collapsed_problems(traced, gref, x, order, g.rtol, _seed(name, f"v{index}"))
                else:
                    how = dict(packed=True) if mode == "packed" else dict(mode=mode)
                    res = hoad.compile(traced, order=order, backend="eager", **how)(x)
                    problems = []
                    bad = compare(res.value, value, g.rtol)
                    if bad:
                        problems.append(f"value: {bad}")
                    for k in range(1, order + 1):
                        bad = compare(res[(0,) * k], ref[k], g.rtol)
                        if bad:
                            problems.append(f"order {k}: {bad}")
                            break
            how = f"{mode} via {VIA[via][mode]}"
            r = SampleResult(sample.desc, "wrong", f"{how}: " + "; ".join(problems), order) if problems else \
                SampleResult(sample.desc, "exact", "", order)
        except Exception as e:  # noqa: BLE001 - classified
            status, reason = classify_exception(e)
            how = f"{mode} via {VIA[via][mode]}"
            r = SampleResult(sample.desc, status, reason if status == "unsupported" else f"{how}: {reason}", order)
        if _SEVERITY[r.status] > _SEVERITY[worst.status]:
            worst = r
        if r.status in ("unsupported", "refused") and VIA[via][mode] == "opinfo":
            break  # the other direction captures the same graph (and reads the OpInfo no more)
    return worst


def _collapsed_problems(traced, gref, x, order, rtol, seed) -> list[str]:
    """hoad.taylor(..., collapse=True, weights=w) along 3 drawn directions, of the function at
    x0 + expm1(x - x0) (the same point; every derivative of its input is 1, not 0; infinite
    entries of x0 stay x), against the dense reference contracted with them: orders below the top per direction,
    the top summed."""
    gen = torch.Generator().manual_seed(seed)
    V = torch.randn((3,) + tuple(x.shape), generator=gen, dtype=DT)
    w = torch.rand(3, generator=gen, dtype=DT)
    x0 = x.detach().clone()
    finite = torch.isfinite(x0)

    def curve(f):
        def curved(y):
            d = torch.where(finite, y - x0, 0.0)
            return f(y + (torch.expm1(d) - d))
        return curved

    ref = nested_reference(curve(gref), x, order, partial=True)
    res = hoad.taylor(curve(traced), order=order, directions=V.to(x.dtype), weights=w.to(x.dtype), collapse=True,
                      backend="eager")(x)
    problems = []
    bad = compare(res[0], curve(traced)(x), rtol)  # (a new tensor: as_strided reads its storage, not x's)
    if bad:
        problems.append(f"value: {bad}")
    flat = V.reshape(3, -1)
    for k in range(1, len(ref) + 1):
        t = ref[k].to(DT).reshape(tuple(res[0].shape) + (flat.shape[1],) * k)
        slots = "abcdefgh"[:k]
        jets = torch.einsum("..." + slots + "," + ",".join("s" + c for c in slots) + "->...s", t, *[flat] * k)
        bad = compare(res[k], jets @ w if k == order else jets, rtol)
        if bad:
            problems.append(f"order {k}: {bad}")
            break
    return problems


def run_op(op, modes=MODES, timeout=TIMEOUT_S, via="mixed") -> OpResult:
    name = op_name(op)
    t0 = time.perf_counter()
    try:
        samples = pick_samples(op)
    except Exception as e:  # noqa: BLE001
        return OpResult(name, "skipped", f"sample_inputs fails: {_short(e, 100)}", [], time.perf_counter() - t0)
    results, used = [], 0
    for i, s in enumerate(samples):  # a skipped sample (no reference, say) makes room for the next
        r = run_sample(name, i, s, modes, timeout, via)
        results.append(r)
        used += r.status != "skipped"
        if used == SAMPLES_PER_OP:
            break
    dt = time.perf_counter() - t0
    if used:
        results = [r for r in results if r.status != "skipped"]
    if not results:
        return OpResult(name, "skipped", "no sample with a floating tensor input of 1..60 entries", [], dt)
    worst = max(results, key=lambda r: _SEVERITY[r.status])
    if worst.status == "skipped":
        return OpResult(name, "skipped", "; ".join(dict.fromkeys(r.reason for r in results)), results, dt)
    reason = worst.reason
    if worst.status != "unsupported" and worst.status != "exact":
        reason = f"{reason} [sample {worst.desc}, order<={worst.order}]"
    return OpResult(name, worst.status, reason, results, dt)


def sweep(names=None, modes=MODES, timeout=TIMEOUT_S, progress=None, via="mixed"):
    """Run every eligible op (or those named) and return their OpResults, sorted by name. One
    thread; the global RNG state and thread count are restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # op_db's samples and ops warn a lot
            return _sweep(names, modes, timeout, progress, via)
    finally:
        torch.set_num_threads(threads)


def _sweep(names, modes, timeout, progress, via):
    ops = eligible_ops()
    if names is not None:
        wanted = set(names)
        unknown = wanted - {op_name(o) for o in ops}
        if unknown:
            raise SystemExit(f"unknown or ineligible ops: {sorted(unknown)}")
        ops = [o for o in ops if op_name(o) in wanted]
    results = []
    for op in ops:
        r = run_op(op, modes, timeout, via)
        results.append(r)
        if progress:
            progress(r)
    return results


# ---------------------------------------------------------------------------------------------
# plain-op references (torch.func is wrong for the originals, see PLAIN_REFERENCE above)


def _plain_affine(y, weight, bias, shape):
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


def _normalize(x, dims, eps):
    mean = x.mean(dim=dims, keepdim=True)
    d = x - mean
    var = (d * d).mean(dim=dims, keepdim=True)
    return d / torch.sqrt(var + eps)


def _plain_layer_norm(sample):
    a = list(sample.args) + [None] * 4
    kw = sample.kwargs
    shape, weight, bias = a[0], kw.get("weight", a[1]), kw.get("bias", a[2])
    eps = kw.get("eps", a[3] if a[3] is not None else 1e-5)
    dims = tuple(range(-len(shape), 0))
    return lambda x: _plain_affine(_normalize(x, dims, eps), weight, bias, tuple(shape))


def _plain_rms_norm(sample):
    a = list(sample.args) + [None] * 3
    kw = sample.kwargs
    shape, weight = a[0], kw.get("weight", a[1])
    eps = kw.get("eps", a[2])
    dims = tuple(range(-len(shape), 0))

    def f(x):
        e = torch.finfo(x.dtype).eps if eps is None else eps
        y = x / torch.sqrt((x * x).mean(dim=dims, keepdim=True) + e)
        return y * weight if weight is not None else y

    return f


def _plain_group_norm(sample):
    a = list(sample.args) + [None] * 4
    kw = sample.kwargs
    groups, weight, bias = a[0], kw.get("weight", a[1]), kw.get("bias", a[2])
    eps = kw.get("eps", a[3] if a[3] is not None else 1e-5)

    def f(x):
        n, c = x.shape[0], x.shape[1]
        y = _normalize(x.reshape(n, groups, -1), (-1,), eps).reshape(x.shape)
        return _plain_affine(y, weight, bias, (c,) + (1,) * (x.ndim - 2))

    return f


def _batch_norm_fn(running_mean, running_var, weight, bias, training, eps):
    def f(x):
        shape = (x.shape[1],) + (1,) * (x.ndim - 2)
        if training:
            y = _normalize(x, tuple(d for d in range(x.ndim) if d != 1), eps)
        else:
            y = (x - running_mean.reshape(shape)) / torch.sqrt(running_var.reshape(shape) + eps)
        return _plain_affine(y, weight, bias, shape)

    return f


def _plain_batch_norm(sample):
    # F.batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
    #              momentum=0.1, eps=1e-5)
    names = ("running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
    p = {"weight": None, "bias": None, "training": False, "eps": 1e-5, **dict(zip(names, sample.args)),
         **sample.kwargs}
    return _batch_norm_fn(p["running_mean"], p["running_var"], p["weight"], p["bias"], p["training"], p["eps"])


def _plain_native_batch_norm(sample):
    # native_batch_norm / _native_batch_norm_legit(input, weight, bias, running_mean, running_var,
    #   training, momentum, eps); _native_batch_norm_legit(input, weight, bias, training, momentum,
    #   eps) (no running statistics); _batch_norm_with_update(input, weight, bias, running_mean,
    #   running_var, momentum, eps) (training)
    a = sample.args
    if len(a) == 7:
        w, b, rm, rv, training, _, eps = a
    elif len(a) == 6 and isinstance(a[2], torch.Tensor):
        (w, b, rm, rv, _, eps), training = a, True
    else:
        (w, b, training, _, eps), rm, rv = a, None, None
    return _batch_norm_fn(rm, rv, w, b, training, eps)


def _plain_instance_norm(sample):
    # F.instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
    #                 use_input_stats=True, momentum=0.1, eps=1e-5)
    names = ("running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps")
    p = dict(zip(names, sample.args))
    p.update(sample.kwargs)
    eps = p.get("eps", 1e-5)

    def f(x):
        shape = (x.shape[1],) + (1,) * (x.ndim - 2)
        if p.get("use_input_stats", True):
            y = _normalize(x, tuple(range(2, x.ndim)), eps)
        else:
            y = (x - p["running_mean"].reshape(shape)) / torch.sqrt(p["running_var"].reshape(shape) + eps)
        return _plain_affine(y, p.get("weight"), p.get("bias"), shape)

    return f


def _plain_prod(sample):
    # torch.prod(x) / torch.prod(x, dim, keepdim=False, dtype=None) as a chain of multiplications
    args, kw = list(sample.args), dict(sample.kwargs)
    dim = kw.pop("dim", args[0] if args else None)
    keepdim = kw.pop("keepdim", args[1] if len(args) > 1 else False)

    def f(x):
        if dim is None:
            parts, keep = x.reshape(-1).unbind(0), False
        elif x.ndim == 0:
            return x.clone()
        else:
            parts, keep = x.unbind(dim), keepdim
        out = parts[0]
        for p in parts[1:]:
            out = out * p
        if dim is None:
            return out.reshape(()) if not keep else out
        return out.unsqueeze(dim) if keep else out

    return f


def _plain_solve(sample):
    # torch.linalg.solve(A, B, left=...) as the inverse times B: torch.func's forward-over-forward
    # of linalg.solve is wrong from order 3 (torch 2.13), that of linalg.inv is right
    B, left = sample.args[0], sample.kwargs.get("left", True)

    def f(a):
        inv = torch.linalg.inv(a)
        if B.ndim == 1 or (B.ndim == a.ndim - 1 and tuple(B.shape) == tuple(a.shape[:-1])):
            return (inv @ B.unsqueeze(-1)).squeeze(-1) if left else (B.unsqueeze(-2) @ inv).squeeze(-2)
        return inv @ B if left else B @ inv

    return f


def _plain_logdet(sample):
    # log det as Σ log|U_ii| of the LU factors (NaN where the determinant is negative, as logdet):
    # torch.func's third derivative of logdet, slogdet and det is wrong (torch 2.13), lu_factor's right
    def f(a):
        lu = torch.linalg.lu_factor(a)[0]
        return lu.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1) + 0 * torch.logdet(a.detach())

    return f


def _plain_det(sample):
    # det as ± Π U_ii of the LU factors: torch.func's third derivative of det is wrong (torch 2.13:
    # 44.9 where the LU product gives 0.80 on linalg.det's 5x5 sample), lu_factor's right
    def f(a):
        lu, pivots = torch.linalg.lu_factor(a)
        n = a.shape[-1]
        swaps = (pivots != torch.arange(1, n + 1, dtype=pivots.dtype)).sum(-1)
        return lu.diagonal(dim1=-2, dim2=-1).prod(-1) * (1 - 2 * (swaps % 2)).to(a.dtype)

    return f


def _plain_cholesky_inverse(sample):
    # cholesky_inverse(L) as inv(L Lᵀ) (upper: inv(Uᵀ U)) of the triangle the wrapper passes:
    # torch.func's second derivative of cholesky_inverse is wrong (torch 2.13), inv's right
    upper = sample.kwargs.get("upper", False)

    def f(x):
        t = x - torch.diag_embed(x.diagonal(0, -2, -1)) + torch.eye(x.shape[-1], dtype=x.dtype)
        t = t.triu() if upper else t.tril()
        return torch.linalg.inv(t.mT @ t if upper else t @ t.mT)

    return f


def _plain_householder_product(sample):
    # the product of reflectors H_i = I − τ_i v_i v_iᵀ in matrix products: torch.func's third
    # derivative of householder_product is wrong (torch 2.13: 246 where the products give -176 on
    # its 5x5 sample), that of matmul right
    tau = sample.args[0]

    def f(a):
        m, n, k = a.shape[-2], a.shape[-1], tau.shape[-1]
        eye = torch.eye(m, dtype=a.dtype)
        v = a[..., :, :k].tril(-1) + eye[:, :k]
        q = eye.expand(*a.shape[:-2], m, m)
        for i in range(k):
            vi = v[..., :, i:i + 1]
            q = q - (q @ vi) @ (vi.mT * tau[..., i, None, None])
        return q[..., :, :n]

    return f


def _plain_scatter_reduce_prod(sample):
    # torch.func's second derivative of scatter_reduce 'prod' is wrong (its backward divides by src;
    # central differences agree with this product-by-product form and with hoad)
    # scatter_reduce(x, dim, index, src, "prod", include_self) one product at a time
    dim, index, src = sample.args[:3]
    include_self = sample.kwargs.get("include_self", True)

    def f(x):
        shape = list(x.shape) or [1]
        xi = x.reshape(shape)
        ind = index.reshape(list(index.shape) or [1])
        s = src.reshape(list(src.shape) or [1])
        d = dim % len(shape)
        factors = {}
        for p in itertools.product(*[range(n) for n in ind.shape]):
            q = list(p)
            q[d] = int(ind[p])
            factors.setdefault(tuple(q), []).append(s[p])
        entries = []
        for q in itertools.product(*[range(n) for n in shape]):
            fs = list(factors.get(q, []))
            out = xi[q] if include_self or not fs else fs.pop(0)
            for t in fs:
                out = out * t
            entries.append(out)
        return torch.stack(entries).reshape(x.shape)

    return f


def _plain_as_strided_scatter(sample):
    # torch's backward of as_strided_scatter into a non-contiguous view (size (2, 2), stride (1, 2))
    # gives self's gradient inside the overwritten view and 0 outside; central differences agree here
    # as_strided_scatter(x, src, size, stride, storage_offset) of a contiguous x: src written into
    # the flat x at offset + Σ i_k·stride_k
    src, size, stride = sample.args[:3]
    offset = sample.kwargs.get("storage_offset", sample.args[3] if len(sample.args) > 3 else 0) or 0

    def f(x):
        index = torch.full(list(size), int(offset), dtype=torch.long)
        for k, (n, s) in enumerate(zip(size, stride)):
            shape = [1] * len(size)
            shape[k] = n
            index = index + torch.arange(n).reshape(shape) * s
        return x.reshape(-1).index_put((index.reshape(-1),), src.reshape(-1)).view(x.shape)

    return f


PLAIN_FUNCTIONS = {
    "scatter_reduce.prod": _plain_scatter_reduce_prod,
    "as_strided_scatter": _plain_as_strided_scatter,
    "linalg.householder_product": _plain_householder_product,
    "linalg.det": _plain_det,
    "cholesky_inverse": _plain_cholesky_inverse,
    "linalg.solve": _plain_solve,
    "linalg.solve_ex": _plain_solve,
    "logdet": _plain_logdet,
    "nn.functional.layer_norm": _plain_layer_norm,
    "native_layer_norm": _plain_layer_norm,
    "native_batch_norm": _plain_native_batch_norm,
    "_native_batch_norm_legit": _plain_native_batch_norm,
    "_batch_norm_with_update": _plain_native_batch_norm,
    "nn.functional.batch_norm": _plain_batch_norm,
    "nn.functional.instance_norm": _plain_instance_norm,
}
# checked by --check-plain too, but torch.func agrees with them on the sweep's samples (torch
# 2.13: group_norm's order 3 is right; prod's samples with an exact zero are too large to be
# picked), so their ops keep torch.func of the op itself as the reference
PLAIN_CHECK_ONLY = {
    "nn.functional.group_norm": _plain_group_norm,
    "nn.functional.rms_norm": _plain_rms_norm,
    "prod": _plain_prod,
}
PLAIN_REFERENCE.update(PLAIN_FUNCTIONS)


def check_plain(names=None, order=3, h=1e-5):
    """For the ops with a plain-op stand-in: nested torch.func of the op against nested torch.func
    of the plain function, and where they differ at order k, central differences of the plain
    function's order k-1 (which agrees) say which one is right. Prints one line per sample."""
    torch.set_num_threads(1)
    ops = {op_name(o): o for o in eligible_ops()}
    plain_for = {**PLAIN_FUNCTIONS, **PLAIN_CHECK_ONLY}
    for name in names or sorted(plain_for):
        for i, sample in enumerate(pick_samples(ops[name])):
            seed = _seed(name, f"w{i}")
            g, _ = make_g(sample.call, sample.x, seed)
            gp, _ = make_g(plain_for[name](sample), sample.x, seed)
            x = sample.x
            n = min(order, 3 if x.numel() <= ORDER3_NUMEL else 2)
            line = f"{name} {sample.desc}: value {compare(gp(x), g(x)) or 'ok'}"
            try:
                ref, alt = nested_reference(g, x, n), nested_reference(gp, x, n)
            except Exception as e:  # noqa: BLE001
                print(f"{line}; torch.func fails: {_short(e, 100)}")
                continue
            for k in range(1, n + 1):
                bad = compare(ref[k], alt[k])
                if bad is None:
                    line += f"; order {k} agrees"
                    continue
                # d/dx of the plain function's order k-1 by central differences
                lower = (lambda y: gp(y)) if k == 1 else _nest(gp, k - 1)
                fd = torch.zeros_like(alt[k])
                flat = x.reshape(-1)
                for j in range(x.numel()):
                    e = torch.zeros_like(flat)
                    e[j] = h
                    d = (lower((flat + e).reshape(x.shape)) - lower((flat - e).reshape(x.shape))) / (2 * h)
                    fd.reshape(*alt[k].shape[:-x.ndim] if x.ndim else alt[k].shape, -1)[..., j] = d
                err = lambda t: float((t - fd).abs().max())  # noqa: E731
                line += (f"; order {k}: torch.func of the op differs ({bad}); finite differences: "
                         f"op err {err(ref[k]):.2g}, plain err {err(alt[k]):.2g}")
                break
            print(line)


def _nest(g, k):
    f = jacrev(g)
    for _ in range(k - 1):
        f = jacfwd(f)
    return f


# ---------------------------------------------------------------------------------------------
# reporting


def counts(results) -> dict:
    c = {s: 0 for s in STATUSES}
    for r in results:
        c[r.status] += 1
    return c


def format_counts(results) -> str:
    c = counts(results)
    return f"{len(results)} ops: " + ", ".join(f"{c[s]} {s}" for s in STATUSES)


def format_row(r: OpResult) -> str:
    return f"{r.name:<50} {r.status:<11} {r.order or '-':>5} {r.seconds:6.1f}s  {r.reason}"


def format_table(results) -> str:
    lines = [f"{'op':<50} {'status':<11} {'order':>5} {'time':>7}  reason", "-" * 110]
    lines += [format_row(r) for r in results]
    lines += ["", format_counts(results)]
    by_overload: dict = {}
    for r in results:
        if r.status == "unsupported":
            by_overload.setdefault(r.reason, []).append(r.name)
    if by_overload:
        lines += ["", "unsupported overloads:"]
        for ov, names in sorted(by_overload.items(), key=lambda t: (-len(t[1]), t[0])):
            lines.append(f"  {len(names):3d}  {ov}: {', '.join(names)}")
    return "\n".join(lines)


def expected_source(results) -> str:
    """tests/opinfo_expected.py for these results."""
    def block(name, doc, status_set):
        rows = [r for r in results if r.status in status_set]
        out = [f"# {doc}", f"{name} = {{"]
        for r in rows:
            out.append(f"    {r.name!r}: {r.reason[:200]!r},")
        out.append("}")
        return "\n".join(out)

    head = f'''"""Expected results of the OpInfo sweep (tests/opinfo_sweep.py, tests/test_opinfo.py).

Regenerate from a full run: ``python tests/opinfo_sweep.py --all --write-expected tests/opinfo_expected.py``.
Coverage only goes up: tests fail when an op listed here becomes exact (remove it), and when an op
not listed becomes unsupported, refused, wrong or crashes.
Last full run: {format_counts(results)}.
"""
'''
    return "\n\n".join([
        head.rstrip("\n"),
        block("UNSUPPORTED", "op -> the ATen overload hoad has no rule for", {"unsupported"}),
        block("REFUSED", "op -> the HoadError hoad raises (capture, control flow, output, ...)", {"refused"}),
        block("KNOWN_BROKEN", "op -> why it is wrong or crashes today: reported, not failed; remove entries as they "
                              "are fixed", {"wrong", "crash"}),
    ]) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--all", action="store_true", help="every eligible op (default: the fast subset)")
    p.add_argument("--op", action="append", help="only this op (repeatable)")
    p.add_argument("--mode", action="append", choices=["forward", "reverse", "auto", "packed", "collapsed"],
                   help="directions to check (default: forward and reverse; packed: hoad.compile(..., packed=True))")
    p.add_argument("--timeout", type=int, default=TIMEOUT_S)
    p.add_argument("--via", choices=sorted(VIA), default="mixed",
                   help="call the op as op.op, through OpInfo.__call__, or mixed (forward: op.op, reverse: OpInfo)")
    p.add_argument("--write-expected", metavar="PATH")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--check-plain", action="store_true",
                   help="check the plain-op references against torch.func and finite differences")
    a = p.parse_args(argv)
    if a.check_plain:
        return check_plain(a.op)
    names = a.op
    if names is None and not a.all:
        names = FAST_OPS
    t0 = time.perf_counter()

    def progress(r):
        if not a.quiet:
            print(format_row(r), file=sys.stderr, flush=True)

    results = sweep(names, tuple(a.mode or MODES), a.timeout, progress, a.via)
    print(format_table(results))
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if a.write_expected:
        with open(a.write_expected, "w") as fh:
            fh.write(expected_source(results))
        print(f"wrote {a.write_expected}")
    return results


if __name__ == "__main__":
    main()
