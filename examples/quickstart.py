"""hoad quickstart: every derivative of a tanh MLP up to order 3, in one generated program.

Prints the derivative program hoad generated, checks each order against nested torch.func in
float64, and times both (one thread).
"""

import time

import torch
from torch.func import hessian, jacfwd, jacrev

import hoad

torch.set_num_threads(1)
torch.manual_seed(0)
dt = torch.float64

# a small energy: tanh MLP 16 -> 64 -> 64 -> 1 with a scalar output
W1, b1 = torch.randn(16, 64, dtype=dt) / 4, torch.randn(64, dtype=dt)
W2, b2 = torch.randn(64, 64, dtype=dt) / 8, torch.randn(64, dtype=dt)
W3 = torch.randn(64, 1, dtype=dt) / 8


def energy(x):
    h = torch.tanh(x @ W1 + b1)
    h = torch.tanh(h @ W2 + b2)
    return (h @ W3).squeeze(-1)


x = torch.randn(16, dtype=dt)

# 1. compile: order 3 means value, gradient, Hessian and the third-order tensor
cf = hoad.compile(energy, order=3)
res = cf(x)
print(f"value {res.value.item():.6f}; blocks: " + ", ".join(f"{k}: {tuple(res[k].shape)}" for k in res))

# 2. the generated program (read it: every line is one ATen call, blocks are named d<k>_<node>_<wrt>)
print()
print(cf.graph)
print()

# 3. check against nested torch.func
checks = {
    "gradient": (res[0], jacrev(energy)(x)),
    "Hessian": (res[0, 0], hessian(energy)(x)),
    "3rd order": (res[0, 0, 0], jacfwd(hessian(energy))(x)),
}
for name, (got, ref) in checks.items():
    err = (got - ref).abs().max().item()
    assert err < 1e-10, f"{name} differs from torch.func by {err}"
    print(f"{name:>9}: matches torch.func (max abs diff {err:.1e})")


# 4. time it (median of repeated calls, one thread)
def median_ms(fn, repeat=30):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


third = jacfwd(hessian(energy))
t_hoad = median_ms(lambda: cf(x))
t_func = median_ms(lambda: (jacrev(energy)(x), hessian(energy)(x), third(x)))
print(f"\nall orders 1..3: hoad {t_hoad:.2f} ms, torch.func {t_func:.2f} ms (ratio {t_hoad / t_func:.2f})")
print(f"hoad program: {cf.graph.nodes} ATen calls, backend={cf.config.backend}, mode={cf.config.mode}")
