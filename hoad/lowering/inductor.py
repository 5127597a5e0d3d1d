"""Lowering for Inductor: how contractions become ops when a fusing compiler runs the program.

Measured on the CPUs hoad was tuned on (AMD EPYC, one thread, float64):

- orientation: BLAS runs a short-wide product (m <= n) up to twice as fast as a tall-skinny one
  (MKL dgemm: 64x64 @ 64x4096 at 51 GFLOP/s, 4096x64 @ 64x64 at 27), and the permutes a wide
  layout needs fuse into neighbouring kernels. ``hoad::mm`` runs a tall one with 32+ columns as
  fast (4096x64 @ 64x64 in 344 us, 64x64 @ 64x4096 in 506), and its result is sample-major for
  per-sample products; with 16 columns the wide form still won (order 3 at a point: 66 vs 75 us).
- small batched products (per-sample Gram matrices, up to 64x64) as a broadcast product summed
  over the contracted labels, which Inductor fuses into one reduction kernel with the operands'
  producers: MKL's bmm runs [256,16,64]@[256,64,16] at 20 GFLOP/s (9 with a transposed operand),
  the fused reduction at 56. Not when a contracted axis is an operand's innermost: Inductor then
  vectorizes the reduction itself, 3.6x slower than bmm (256 Gram matrices, 16x16 over 64).
- batched operands packed densely: MKL's batched product is ~2.5x slower on batches that are not
  (the copy fuses into the kernel that produces the operand).
- vector-matrix products (one row or one column) of at most TINY_PRODUCT multiply-adds as a fused
  reduction, about 1 us, where an extern call to MKL costs ~3 (order 3 at a point: 61 -> 59 us),
  and fused with the kernel that computes the operand, which is then never written: a Laplacian's
  output layer and its first layer's collapsed term ([256,64]@[64,1], [1,64]@[64,256]; Laplacians
  2-4% faster). Not larger ones: [1,768]@[768,4096] as a reduction took 7.3 ms, MKL 1.3. Not
  matrix-matrix ones ([40,10]@[10,10] chains as reductions took a seed-MLP gradient 29 -> 68 us).
- ``hoad::mm`` and ``hoad::gram`` (:mod:`hoad.lowering.kernels`) where they run faster; on CPUs
  with AVX2 but not AVX-512, ``hoad::mm``'s AVX2 kernel (:func:`kernels.suits_avx2`; the
  orientation stays MKL's: that kernel is faster than MKL's in both). A product whose right
  operand is a transposed activation (a gradient through the first layer, [16,64]@[64,256]ᵀ) runs
  transposed, ``(bᵀ @ aᵀ)ᵀ``, reading it in place, where its result is small (``lower_products``).
- ``hoad::jet_sqnorm`` and ``hoad::jet_mm`` for a collapsed Laplacian's squared jets at a layer:
  the product, its scaled operand and the squares in one kernel (D=16 Laplacian's 256 points:
  0.87 ms for all three, MKL's product alone 1.55 ms in the same run).
- float64 tanh in Inductor's vectorized C++ as Cephes computes it (:func:`tanh`), where
  Inductor calls SLEEF's, in half the time (:func:`cephes_tanh`, entered by hoad's compiles only).
- no 2-D tiling over a reduction nested below another loop, nor of a kernel that accumulates into
  its output (:func:`safe_tiling`): torch 2.13's C++ code stores the first's result a whole tile
  wide past a tail, and the second's at a doubled offset (out-of-bounds writes).

:func:`hoad_inductor` enters both around every Inductor compile of hoad's.

The custom kernels are chosen by the ``fuse_jet_squares`` and ``lower_products`` passes
(``hoad/passes/lower.py``) after clean, and by :meth:`InductorLowering.einsum` for Gram matrices;
everything else here is layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import platform

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from hoad.algebra.einsum import _arrange
from hoad.algebra.target import Lowering
from hoad.errors import CompileError
from hoad.lowering import kernels

SMALL_MATRIX = 64
TINY_PRODUCT = 1 << 16
# entries of the largest product computed transposed: its consumers read it across rows, which
# costs nothing while it is small ([16,256]: the stochastic Laplacian 5% faster) but more than the
# kernel gains once it is not (a stochastic biharmonic's [64,512] jets: the program 15% slower)
TRANSPOSED_RESULT = 1 << 14

# The torch releases whose C++ codegen hoad's CPU programs have been checked on. torch 2.11's
# corrupts the heap on some of them (a PINN's one-program training step aborted with "invalid
# fastbin entry"; a backward through a compiled order-2 program gave NaN), with hoad's Inductor
# hooks or without them; its Triton (CUDA) codegen is another matter.
CPU_CODEGEN_CHECKED = (2, 13)


def cpu_codegen_problem(tensors) -> str | None:
    """Why Inductor may not compile a program on these (example) tensors for the CPU under this
    torch; None where it may (a CUDA program, or a torch whose C++ codegen has been checked)."""
    from torch.torch_version import TorchVersion

    if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors):
        return None
    if TorchVersion(torch.__version__) >= CPU_CODEGEN_CHECKED:
        return None
    return (f"hoad's CPU programs under Inductor need torch >= {'.'.join(map(str, CPU_CODEGEN_CHECKED))}: "
            f"torch {torch.__version__}'s C++ codegen corrupts memory on some of them (a crash, or NaN "
            "derivatives). Pass backend='eager' (the same program, not compiled), or install torch 2.13")


# cpp_wrapper: the compiled program calls its kernels from C++ rather than Python, which cuts
# ~30% off small programs (order-2 MLP Hessian at a point: 38 -> 27 µs per call here).
INDUCTOR_OPTIONS = {"cpp_wrapper": True}


class InductorLowering(Lowering):
    """Layouts for Inductor programs; ``kernels``: whether hoad's AVX-512 kernels may be used,
    ``avx2``: whether its AVX2 kernels (``hoad::jet_sqnorm``, ``jet_mm``, ``mm`` without AVX-512) may."""

    fused = True

    def __init__(self, kernels: bool = False, avx2: bool = False):
        self.kernels, self.avx2 = kernels, avx2

    def __repr__(self) -> str:
        return f"InductorLowering(kernels={self.kernels}, avx2={self.avx2})"

    def orientation(self, moves, tall, batched, m, k, n, like) -> tuple:
        if self.kernels and not batched and n >= kernels.MIN_COLUMNS and kernels.fits(like, m, k, n):
            return (0, moves)
        return (int(tall), moves)

    def batched_as_reduction(self, m, n, innermost) -> bool:
        return max(m, n) <= SMALL_MATRIX and not innermost

    def dense_batches(self, t: torch.Tensor) -> torch.Tensor:
        return _dense_batches(t)

    def einsum(self, terms, out, size):
        return gram(terms, out, size) if self.kernels else None

    def jets_suit(self, k: int) -> bool:
        """Whether a collapsed Laplacian's jets through a layer of ``k`` inputs run as hoad's jet
        kernels (``fuse_jet_squares``)."""
        return self.avx2 and kernels.jets_suit(k)

    def product(self, a: torch.Tensor, b: torch.Tensor) -> str:
        """How a 2-D product a @ b (shapes and strides of the traced values) runs: "kernel"
        (``hoad::mm``), "transposed" (``hoad::mm`` as ``(bᵀ @ aᵀ)ᵀ``), "reduction" (a fused
        broadcast product and sum), or "mm". Transposed where the kernel takes it so and ``a``,
        the larger operand (jets through a layer), is stored column-major, as the program keeps
        its jets: the result is then stored as they are, where a straight product would store it
        the other way round and every kernel reading it beside them would transpose it, tile by
        tile (a packed order-5 program's [792, 64] jets: 1.7 -> 1.0 ms per call). Otherwise where
        its result is small (TRANSPOSED_RESULT), if the kernel takes it so and not straight, or
        with fewer entries copied dense first (none where ``b`` is a transposed activation)."""
        how = self._straight(a, b)
        if how == "reduction" or self._straight(b.t(), a.t()) != "kernel":
            return how
        if a.numel() >= b.numel() and a.t().is_contiguous() and not a.is_contiguous():
            return "transposed"
        if a.shape[0] * b.shape[1] <= TRANSPOSED_RESULT and (how == "mm" or _copied(b.t(), a.t()) < _copied(a, b)):
            return "transposed"
        return how

    def _straight(self, a: torch.Tensor, b: torch.Tensor) -> str:
        (m, k), n = a.shape, b.shape[1]
        if (self.kernels and kernels.suits(a, b)) or (self.avx2 and kernels.suits_avx2(a, b)):
            return "kernel"
        if min(m, n) == 1 and m * k * n <= TINY_PRODUCT:
            return "reduction"
        return "mm"


def _copied(*operands: torch.Tensor) -> int:
    """Entries of ``operands`` the kernel copies dense first."""
    return sum(t.numel() for t in operands if not t.is_contiguous())


def this_machine() -> InductorLowering:
    """The Inductor lowering with hoad's kernels where they run here (builds the library on the
    first call: ask before tracing)."""
    return InductorLowering(kernels=kernels.available(), avx2=kernels.avx2_available())


def _dense_batches(t: torch.Tensor) -> torch.Tensor:
    """``t`` (batch, rows, cols) with each matrix stored densely (row- or column-major)."""
    b, r, c = t.shape
    stride = t.stride()
    if stride[0] == r * c and (stride[1:] == (c, 1) or stride[1:] == (1, r)):
        return t
    return t.contiguous()


def gram(terms: list[tuple[torch.Tensor, list]], out: list, size: dict) -> torch.Tensor | None:
    """Per-sample weighted Gram matrices as one ``hoad::gram`` call, or None if ``terms`` are not that.

    The pattern is the second-order chain rule through an elementwise node under a batch:
    sum over k of w[b,k] J[b,k,i] J[b,k,j], the same Jacobian J twice (its free labels i and j
    differ), every other term a weight over the batch and contracted labels. Only for programs
    laid out for Inductor, float64 on CPU where the kernel runs.
    """
    twice = [i for i, (t, _ls) in enumerate(terms) if sum(u is t for u, _l in terms) == 2]
    if len(twice) != 2:
        return None
    (j, first), (_j, second) = terms[twice[0]], terms[twice[1]]
    if len(first) != len(second) or len(set(first)) != len(first):
        return None
    shared = [a for a, b in zip(first, second) if a == b]
    free = [(a, b) for a, b in zip(first, second) if a != b]
    f1, f2 = [a for a, _b in free], [b for _a, b in free]
    batch, con = [l for l in shared if l in out], [l for l in shared if l not in out]
    weights = [terms[i] for i in range(len(terms)) if i not in twice]
    if (not (free and batch and con) or len(out) != len(batch + f1 + f2) or set(out) != set(batch + f1 + f2)
            or set(f1) & set(f2) or any(not set(ls) <= set(shared) for _t, ls in weights)
            or any(j.shape[i] != size.get(l) for i, l in enumerate(first))):  # a broadcast J: matrix products do better
        return None
    nb, nk, nf = ([size[l] for l in ls] for ls in (batch, con, f1))
    if not kernels.gram_suits(j, math.prod(nk), math.prod(nf)):
        return None
    w = j.new_ones(())
    for t, ls in weights:
        w = w * _arrange(t, ls, batch + con)
    w = w.expand(nb + nk).reshape(math.prod(nb), math.prod(nk))
    jj = _arrange(j, first, batch + con + f1).reshape(math.prod(nb), math.prod(nk), math.prod(nf))
    g = torch.ops.hoad.gram(jj, w).reshape(nb + nf + nf)
    return _arrange(g, batch + f1 + f2, out)


# ------------------------------------------------------------------------------ the cache
def cache_dir() -> str:
    """Where Inductor's compiled programs persist across processes: ``TORCHINDUCTOR_CACHE_DIR``
    when the user set it, else ``<cache_root>/inductor`` (:func:`~hoad.lowering.kernels.cache_root`).
    Reads, never writes, the environment."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is not None and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        return current
    return os.path.join(kernels.cache_root(), "inductor")


def use_cache_dir() -> str:
    """Point Inductor at :func:`cache_dir` (Inductor reads only the environment for it); called
    by the compile pass before it compiles. A path with whitespace is refused: Inductor's C++
    build passes it to g++ unquoted ("input file ... is the same as output file", every program)."""
    where = cache_dir()
    if any(c.isspace() for c in where):
        raise CompileError(f"Inductor cannot build C++ programs under a path with spaces ({where!r}: it passes "
                           "it to the compiler unquoted); set HOAD_CACHE_DIR (or TORCHINDUCTOR_CACHE_DIR) to a "
                           "directory whose path has none, or use backend='eager'")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = where
    return where


# ------------------------------------------------------------------------------ tanh
# Cephes' tanh: x + x z P(z)/Q(z) (z = x²) where |x| < 0.625, else 1 - 2/(e^{2|x|} + 1), with the
# sign of x (so -0 stays -0); one division serves both branches; NaN and ±inf pass as tanh's.
_TANH_P = (-9.64399179425052238628e-1, -9.92877231001918586564e1, -1.61468768441708447952e3)
_TANH_Q = (1.12811678491632931402e2, 2.23548839060100448583e3, 4.84406305325125486048e3)


def tanh(a):  # the name Inductor's scalar fallback looks up
    """Vectorized float64 tanh in Inductor's C++ as Cephes computes it, one exp (SLEEF's) and one
    division, where Inductor calls SLEEF's tanh (twice the time). Within 1 ulp of tanh (2.4M points
    against long double, as SLEEF's). One op to Inductor's scheduler, as before: the same formula
    written as ATen ops was inlined into every kernel reading tanh's result, and lost. Tanh MLPs'
    Laplacians 5-8% faster (D=16, 256 points, same-process A/B), Hessians at a point too."""
    if getattr(a, "dtype", None) != torch.float64:
        return f"{a}.tanh()"
    (p0, p1, p2), (q0, q1, q2) = _TANH_P, _TANH_Q
    return ("[&]() { auto x = " f"{a}" "; using V = decltype(x); auto ax = x.abs(); auto z = x * x; "
            "auto small = ax < V(0.625); "
            f"auto P = (V({p0!r}) * z + V({p1!r})) * z + V({p2!r}); "
            f"auto Q = ((z + V({q0!r})) * z + V({q1!r})) * z + V({q2!r}); "
            "auto s = (ax + ax).exp(); "
            "auto f = V::blendv(V(2.0), x * z * P, small) / V::blendv(s + V(1.0), Q, small); "
            "return V::blendv(V(1.0) - f, x + f, small).copysign(x); }()")


@contextlib.contextmanager
def cephes_tanh():
    """Inductor's vectorized C++ computes float64 tanh by :func:`tanh` while this is entered (hoad's
    programs only). Sets ``cpp.use_decompose_tanh``, which only the replaced method reads, so the
    compiled programs' cache keys differ from those with SLEEF's tanh."""
    try:
        from torch._inductor.codegen.cpp import CppVecOverrides
    except ImportError:  # another torch: its own tanh
        yield
        return
    stock = CppVecOverrides.__dict__.get("tanh")
    CppVecOverrides.tanh = staticmethod(tanh)
    try:
        with torch._inductor.config.patch({"cpp.use_decompose_tanh": True}):
            yield
    finally:
        CppVecOverrides.tanh = stock


# ------------------------------------------------------------------------------ tiling
# torch 2.13's C++ codegen tiles a loop nest in two dimensions where an input is read transposed:
# an outer non-reduction loop and the innermost one. When that innermost loop is a reduction and
# other loops lie between the two, the reduction's result is stored by the main tile's suffix
# alone (CppKernelProxy.aggregate_reduction_buffers: the tail's suffix is chosen only when the
# reduction loop is directly inside the tiled one): a full tile wide (16 doubles with AVX-512)
# also where the outer loop's tail has fewer entries. That writes past the buffer at its last
# row (heap corruption: a stochastic biharmonic with 8 directions crashed the process), and over
# the next row's finished entries where the outer loop also has a main part (silently wrong).


#
# A 2-D tile whose store accumulates (a scatter-add: the transpose of a reflect or replicate pad
# along the last dim, index_put with accumulate) applies the inner loop's offset twice on the
# parallel atomic_add path (pytorch#191837, fixed after 2.13): writes past the buffer, with two or
# more threads. Such kernels get the innermost loop's tiling alone.


def _select_tiling(stock):
    def select_tiling(self, fn_list, var_sizes_list):
        chosen = stock(self, fn_list, var_sizes_list)  # (factors, indices[, stats]): 2.11 returns no stats
        factors, indices, rest = chosen[0], chosen[1], tuple(chosen[2:])
        if len(indices) == 2:
            group, reduction = max(var_sizes_list, key=lambda sizes: len(sizes[1]))
            if reduction and indices[0] < len(group) - 1:  # loops between the tiled one and the reduction
                return (factors[1:], indices[1:], *rest)   # the reduction's loop alone: horizontal
            if _accumulates(fn_list):
                return (factors[1:], indices[1:], *rest)
        return chosen

    select_tiling.hoad_safe = True
    return select_tiling


def _accumulates(fn_list) -> bool:
    """Whether a kernel's loop bodies store with atomic_add (true where torch's internals differ)."""
    try:
        from torch._inductor.codegen.cpp_utils import _get_loop_body
        from torch._inductor.loop_body import MemoryUsageType

        return any(entry.mode == "atomic_add" for body in _get_loop_body(fn_list)
                   for entry in body.memory_usage[MemoryUsageType.STORE])
    except (ImportError, AttributeError, AssertionError):
        return True


class SafeTiling(CustomGraphPass):
    """Does nothing to the graph; its uuid enters Inductor's and AOTAutograd's cache keys
    (``post_grad_custom_pre_pass``), so a program compiled before :func:`safe_tiling` existed, or
    without it, is never served. The uuid also hashes hoad's kernels (``kernels.cpp``): their C++
    autograd formulas are traced into the backward programs of training compiles, which a changed
    formula must not reuse."""

    def __call__(self, graph) -> None:
        pass

    def uuid(self):
        from hoad.lowering import kernels

        return get_hash_for_files((__file__, str(kernels.SOURCE)))


@contextlib.contextmanager
def safe_tiling():
    """Inductor's C++ codegen tiles a loop nest whose reduction lies below other loops in one
    dimension only, the reduction's, while this is entered (see the comment above)."""
    try:
        from torch._inductor.codegen.cpp import TilingSelect
    except ImportError:  # another torch
        yield
        return
    stock = TilingSelect.__dict__["select_tiling"]
    if not getattr(stock, "hoad_safe", False):
        TilingSelect.select_tiling = _select_tiling(stock)
    try:
        with torch._inductor.config.patch({"post_grad_custom_pre_pass": SafeTiling()}):
            yield
    finally:
        TilingSelect.select_tiling = stock


# ------------------------------------------------------------------------------ ISA probes
@contextlib.contextmanager
def remembered_isa_probes():
    """Inductor's first CPU compile in a process checks each vector ISA the CPU has by building a
    tiny library once (cached, under a name keyed by compiler, flags and torch version) and then,
    in every process, loading it in a child Python: six children, 1.3 s of a warm-cache first call
    (an order-3 MLP's program loaded from the cache in 2.4 s, 1.3 of it these probes). A load
    that succeeded is remembered beside the library, per machine, and not tried again; a failed
    one is tried every time, as before. The compiled programs and their cache keys are unchanged."""
    from torch._inductor import cpu_vec_isa

    stock = cpu_vec_isa.VecISA._probe_load

    def probe_load(self, output_path: str) -> bool:
        loaded = f"{output_path}.loads-on-{hashlib.sha256(platform.node().encode()).hexdigest()[:12]}"
        if os.path.exists(loaded):
            return True
        ok = stock(self, output_path)
        if ok:
            with contextlib.suppress(OSError):  # (a read-only cache probes again next time)
                open(loaded, "w").close()
        return ok

    cpu_vec_isa.VecISA._probe_load = probe_load
    try:
        yield
    finally:
        cpu_vec_isa.VecISA._probe_load = stock


@contextlib.contextmanager
def hoad_inductor():
    """Inductor as every compile of hoad's runs it: :func:`cephes_tanh`, :func:`safe_tiling` and
    :func:`remembered_isa_probes`."""
    with cephes_tanh(), safe_tiling(), remembered_isa_probes():
        yield
