"""Cubic and quartic force constants of a Lennard-Jones cluster, from one order-4 program.

A chemist's anharmonic analysis starts from the Taylor expansion of the potential energy at a
minimum: the Hessian gives the normal modes and harmonic frequencies, and the cubic and quartic
force constants (third and fourth derivatives) give the anharmonic corrections. Here:

1. A cluster of ``N`` atoms (reduced units, ε = σ = m = 1) is relaxed to a minimum with Newton's
   method on hoad's order-2 program.
2. ``hoad.compile(energy, order=4)`` computes the energy, gradient, Hessian, cubic and quartic
   force constants in one program; only the canonical blocks are computed (Schwarz symmetry).
3. The force constants are checked against finite differences of hoad's own Hessians along the
   normal modes (central differences: the cubic ones from first differences, the quartic ones
   from second differences).
4. Along the normal mode with the largest cubic constant, the Taylor models of order 2, 3 and 4 are compared with the
   true energy: each order's error falls one power of the displacement faster, which is what
   the anharmonic terms buy.

Run: ``python examples/force_constants.py`` (about 10 s on 2 CPU cores, Inductor compile aside).
"""

from __future__ import annotations

import math

import torch

import hoad

torch.set_default_dtype(torch.float64)


def energy(x: torch.Tensor) -> torch.Tensor:
    """The Lennard-Jones energy Σ_{i<j} 4 (r⁻¹² − r⁻⁶) of atoms at ``x`` (3N coordinates)."""
    p = x.reshape(-1, 3)
    n = p.shape[0]
    i, j = torch.triu_indices(n, n, 1)
    r2 = (p[i] - p[j]).pow(2).sum(-1)
    inv6 = r2.pow(-3)
    return (4 * (inv6 * inv6 - inv6)).sum()


def start(n: int, seed: int = 0) -> torch.Tensor:
    """Atoms on a jittered simple cubic grid near the pair minimum 2^(1/6)."""
    g = torch.Generator().manual_seed(seed)
    side = math.ceil(n ** (1 / 3))
    grid = torch.stack(torch.meshgrid(*[torch.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    return (grid * 2 ** (1 / 6) + 0.05 * torch.randn(n, 3, generator=g)).reshape(-1).to(torch.float64)


def relax(x: torch.Tensor, steps: int = 200) -> torch.Tensor:
    """A minimum by saddle-free Newton steps on hoad's order-2 program: the step divides by |λ|,
    so it goes downhill along negative curvature too, and is capped at 0.1; the 6 zero modes
    (translations and rotations) are left out."""
    newton = hoad.compile(energy, order=2)
    x = x.clone()
    for _ in range(steps):
        res = newton(x)
        g, H = res[(0,)], res[0, 0]
        lam, Q = torch.linalg.eigh(H)
        if g.norm() < 1e-10 and lam[6:].min() > 0:
            break
        keep = lam.abs() > 1e-8 * lam.abs().max()
        step = Q[:, keep] @ ((Q[:, keep].T @ g) / lam[keep].abs())
        x = x - step * min(1.0, 0.1 / step.norm().item())
    return x


def analyse(n: int = 8, verbose: bool = True) -> dict:
    x0 = relax(start(n))
    cf = hoad.compile(energy, order=4)
    res = cf(x0)
    g, H, F3, F4 = res[(0,)], res[0, 0], res[0, 0, 0], res[0, 0, 0, 0]
    lam, Q = torch.linalg.eigh(H)
    modes, omega = Q[:, 6:], lam[6:].sqrt()  # (the 6 zero modes: translations and rotations)
    assert lam[6:].min() > 0 and g.norm() < 1e-8, "not at a minimum"
    # the force constants in normal coordinates (unit masses)
    phi3 = torch.einsum("abc,ai,bj,ck->ijk", F3, modes, modes, modes)
    phi4 = torch.einsum("abcd,ai,bj,ck,dl->ijkl", F4, modes, modes, modes, modes)

    # checks by central differences of hoad's own Hessians along each normal mode
    hessian = hoad.compile(energy, order=2)
    h = 2e-4

    def modal_hessian(dx):
        return modes.T @ hessian(x0 + dx)[0, 0] @ modes

    d3 = torch.stack([(modal_hessian(h * q) - modal_hessian(-h * q)) / (2 * h) for q in modes.T], -1)
    d4 = torch.stack([(modal_hessian(h * q) - 2 * modes.T @ H @ modes + modal_hessian(-h * q)) / h ** 2
                      for q in modes.T], -1)
    cubic_error = ((d3 - phi3).abs().max() / phi3.abs().max()).item()
    quartic_error = ((d4 - torch.einsum("ijkk->ijk", phi4)).abs().max() / phi4.abs().max()).item()

    # the Taylor models along the mode with the largest cubic constant, against the true energy
    k = int(torch.einsum("iii->i", phi3).abs().argmax())
    q = modes[:, k]
    points = [(s, energy(x0 + s * q).item()) for s in (0.02, 0.04, 0.08, 0.16)]
    e0 = res.value.item()
    # dᵏ/dsᵏ E(x0 + s q) at s = 0, k = 1..4, contracted from the blocks: g·q, ω_k², φ_kkk, φ_kkkk
    d = [t.item() for t in res.along(q)]
    taylor = []
    for s, e in points:
        t2 = e0 + s * d[0] + s ** 2 / 2 * d[1]
        t3 = t2 + s ** 3 / 6 * d[2]
        t4 = t3 + s ** 4 / 24 * d[3]
        taylor.append((s, e, abs(t2 - e), abs(t3 - e), abs(t4 - e)))
    if verbose:
        print(f"{n} atoms at a minimum: energy {e0:.6f}, |gradient| {g.norm():.1e}")
        print(f"harmonic frequencies ω: {omega.min():.4f} .. {omega.max():.4f} ({len(omega)} modes)")
        print(f"force constants: {len(res.keys())} canonical blocks; cubic {tuple(F3.shape)}, "
              f"quartic {tuple(F4.shape)}")
        print(f"cubic φ_ijk against differences of Hessians: {cubic_error:.1e} (relative)")
        print(f"quartic φ_ijkk against second differences: {quartic_error:.1e} (relative)")
        print(f"along mode {k} (ω = {omega[k]:.4f}, the largest cubic constant φ_kkk = {phi3[k, k, k]:.2f}): "
              "|Taylor model − energy|")
        print("   step      energy   order 2   order 3   order 4")
        for s, e, e2, e3, e4 in taylor:
            print(f"  {s:5.2f}  {e:10.6f}  {e2:8.1e}  {e3:8.1e}  {e4:8.1e}")
    return {"x0": x0, "mode": k, "gradient": g, "omega": omega, "phi3": phi3, "phi4": phi4, "cubic_error": cubic_error,
            "quartic_error": quartic_error, "taylor": taylor, "along": d}


if __name__ == "__main__":
    analyse()
