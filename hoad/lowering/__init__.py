"""The machine: how programs are laid out and run where they will run.

- :mod:`~hoad.lowering.inductor`: layouts for Inductor programs (a :class:`~hoad.algebra.Lowering`),
  Inductor's options and hoad's cache directory;
- :mod:`~hoad.lowering.kernels`: the AVX-512 float64 kernels ``hoad::mm`` and ``hoad::gram``;
- :mod:`~hoad.lowering.malloc`: glibc malloc tuning for programs that allocate per call.

Imports flow one way: algebra ← lowering ← passes.
"""
