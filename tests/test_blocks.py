"""The compact block algebra against dense reference computations."""

import itertools
import random

import pytest
import torch

from hoad.algebra import (
    Block,
    add,
    contract,
    expand_out,
    map_out,
    permute_out,
    reshape_out,
    squeeze_out,
    sum_out,
    unsqueeze_out,
)


def dense_of(blk: Block) -> torch.Tensor:
    """Reference densification by explicit indexing (independent of Block.materialize)."""
    out = torch.zeros(blk.shape, dtype=blk.data.dtype)
    for idx in itertools.product(*[range(n) for n in blk.shape]):
        cls = {}
        ok = True
        for a, i in enumerate(idx):
            c = blk.dims[a]
            if cls.setdefault(c, i) != i:
                ok = False
                break
        if ok:
            didx = tuple(0 if blk.data.shape[c] == 1 else cls[c] for c in range(blk.data.ndim))
            out[idx] = blk.data[didx]
    return out


def random_block(rng: random.Random, shape, ties=True, broadcast=True) -> Block:
    dims, sizes = [], []
    for n in shape:
        same = [c for c in range(len(sizes)) if sizes[c] == n]
        if ties and same and rng.random() < 0.4:
            dims.append(rng.choice(same))
        else:
            dims.append(len(sizes))
            sizes.append(n)
    data_shape = [1 if broadcast and rng.random() < 0.25 else n for n in sizes]
    data = torch.randn(data_shape, dtype=torch.float64, generator=torch.Generator().manual_seed(rng.randrange(10**6)))
    from hoad.algebra.block import _canonical
    return _canonical(data, dims, shape)


@pytest.mark.parametrize("seed", range(40))
def test_contract_matches_dense_einsum(seed):
    rng = random.Random(seed)
    letters = "abcd"
    sizes = {l: rng.choice([1, 2, 3]) for l in letters}
    ops = []
    for _ in range(rng.choice([1, 2, 3])):
        labels = rng.sample(letters, rng.choice([1, 2, 3]))
        ops.append((random_block(rng, [sizes[l] for l in labels]), labels))
    used = sorted({l for _b, ls in ops for l in ls})
    out = rng.sample(used, rng.randrange(len(used) + 1))
    got = contract(ops, out)
    ref = torch.einsum(",".join("".join(ls) for _b, ls in ops) + "->" + "".join(out), *[dense_of(b) for b, _ in ops])
    assert got.shape == tuple(ref.shape)
    torch.testing.assert_close(dense_of(got), ref)
    torch.testing.assert_close(got.materialize(), ref)


def test_contract_keeps_diagonals_compact():
    x = torch.randn(5, dtype=torch.float64)
    seed = Block.identity(x, (5,))
    coeff = Block.dense(torch.cos(x))
    d1 = contract([(coeff, ["o"]), (seed, ["o", "s0"])], ["o", "s0"])
    d2 = contract([(coeff, ["o"]), (seed, ["o", "s0"]), (seed, ["o", "s1"])], ["o", "s0", "s1"])
    assert d1.data.shape == (5,) and d2.data.shape == (5,)
    assert d2.dims == (0, 0, 0)
    hess = sum_out(d2, 1, [0])
    torch.testing.assert_close(hess.materialize(), torch.diag(torch.cos(x)))


def test_repeated_output_label_builds_a_diagonal():
    v = Block.dense(torch.randn(3, dtype=torch.float64))
    got = contract([(v, ["i"])], ["i", "i"])
    torch.testing.assert_close(got.materialize(), torch.diag(v.data))


def test_broadcast_sum_scales_by_size():
    ones = Block.identity(torch.zeros(()), (4,))  # dense eye(4), stored as one entry
    got = contract([(ones, ["i", "j"])], [])
    assert float(got.data) == 4.0
    torch.testing.assert_close(dense_of(ones), torch.eye(4))


@pytest.mark.parametrize("seed", range(30))
def test_add_of_different_structures(seed):
    rng = random.Random(seed)
    shape = [rng.choice([1, 2, 3]) for _ in range(rng.choice([2, 3, 4]))]
    blocks = [random_block(rng, shape) for _ in range(rng.choice([2, 3]))]
    got = add(blocks)
    torch.testing.assert_close(dense_of(got), sum(dense_of(b) for b in blocks))


@pytest.mark.parametrize("seed", range(30))
def test_output_maps(seed):
    rng = random.Random(seed)
    r = rng.choice([1, 2, 3])
    shape = [rng.choice([1, 2, 3]) for _ in range(r + rng.choice([0, 1, 2]))]
    blk = random_block(rng, shape)
    dense = dense_of(blk)
    out = shape[:r]
    # permute
    perm = list(range(r))
    rng.shuffle(perm)
    torch.testing.assert_close(dense_of(permute_out(blk, r, perm)), dense.permute(perm + list(range(r, len(shape)))))
    # sum
    axes = rng.sample(range(r), rng.randrange(r + 1))
    for keepdim in (False, True):
        got = sum_out(blk, r, axes, keepdim)
        ref = dense.sum(axes, keepdim=keepdim) if axes else dense
        torch.testing.assert_close(dense_of(got), ref)
    # unsqueeze / squeeze
    d = rng.randrange(r + 1)
    torch.testing.assert_close(dense_of(unsqueeze_out(blk, r, d)), dense.unsqueeze(d))
    ones = [a for a in range(r) if shape[a] == 1]
    torch.testing.assert_close(dense_of(squeeze_out(blk, r, ones)),
                               dense.reshape([n for a, n in enumerate(shape) if a not in ones]))
    # expand (with a new leading axis)
    new_out = [2] + [n if n != 1 else rng.choice([1, 3]) for n in out]
    ref = dense.reshape([1] + shape).expand(new_out + shape[r:])
    torch.testing.assert_close(dense_of(expand_out(blk, r, new_out)), ref)
    # reshape: flatten and a split that keeps the first axis
    n = 1
    for s in out:
        n *= s
    torch.testing.assert_close(dense_of(reshape_out(blk, r, [n])), dense.reshape([n] + shape[r:]))
    new = [out[0], n // out[0]] if r > 1 else [1, n]
    torch.testing.assert_close(dense_of(reshape_out(blk, r, new)), dense.reshape(new + shape[r:]))
    # a generic map: flip along the first output axis
    got = map_out(blk, r, lambda t: t.flip(0), out)
    torch.testing.assert_close(dense_of(got), dense.flip(0))


@pytest.mark.parametrize("seed", range(10))
def test_materialize_keep_ties(seed):
    x = torch.randn(3, 2, dtype=torch.float64)
    seed_blk = Block.identity(x, (3, 2))
    # keep axis 0 tied to slot axis 0: per-row Jacobian, i.e. the diagonal over rows
    got = seed_blk.materialize([[0, 2]])
    torch.testing.assert_close(got, torch.eye(2, dtype=torch.float64).expand(3, 2, 2))


@pytest.mark.parametrize("seed", range(30))
def test_map_out_keeps_ties_of_untouched_axes(seed):
    from hoad.algebra import along

    rng = random.Random(seed)
    r = rng.choice([2, 3])
    shape = [rng.choice([1, 2, 3]) for _ in range(r)] + [rng.choice([1, 2, 3]) for _ in range(rng.choice([1, 2]))]
    # tie each output axis to a slot axis of the same size where possible (per-sample structure)
    blk = random_block(rng, shape)
    dense = dense_of(blk)
    d = rng.randrange(r)
    got = map_out(blk, r, lambda t: t.flip(d), shape[:r], along(r, [d]))
    torch.testing.assert_close(dense_of(got), dense.flip(d))
    got = map_out(blk, r, lambda t: t.select(d, 0), shape[:d] + shape[d + 1:r], along(r, [d], removed=True))
    torch.testing.assert_close(dense_of(got), dense.select(d, 0))
    got = map_out(blk, r, lambda t: t.cumsum(d), shape[:r], along(r, [d]))
    torch.testing.assert_close(dense_of(got), dense.cumsum(d))


def test_slicing_features_keeps_samples_diagonal():
    x = torch.randn(4, 3, dtype=torch.float64)
    seed_blk = Block.identity(x, (4, 3))
    got = map_out(seed_blk, 2, lambda t: t[:, 1:], [4, 2], {0: 0})
    assert got.dims[0] == got.dims[2], "the sample axis must stay tied to its slot"
    assert got.data.numel() == 4 * 2 * 3


def test_dense_identity_of_256_and_more():
    """torch.eye's decomposition counts in uint16 from n = 256, which has no CPU arange."""
    import hoad

    for n in (255, 256, 300):
        x = torch.randn(n, dtype=torch.float64)
        res = hoad.compile(lambda x: x.sin().sum(), order=2, backend="eager")(x)
        torch.testing.assert_close(res[0, 0], torch.diag(-x.sin()))


def test_a_weight_broadcast_over_a_batch_makes_one_matrix_product():
    """Under a fused lowering, an operand that only broadcasts along a label it shares with the
    other (stride 0: a weight expanded over samples) drops it: one mm with the batch folded into
    the columns instead of a bmm over copies of the weight. The value is the bmm's."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hoad.algebra import Target
    from hoad.algebra.einsum import _einsum
    from hoad.lowering.inductor import InductorLowering

    w, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(5, 3, 6, dtype=torch.float64)

    def product(w, y, lowering):
        terms = [(w.expand(5, 4, 3), ["b", "i", "k"]), (y, ["b", "k", "j"])]
        return _einsum(terms, ["b", "i", "j"], {"b": 5, "i": 4, "k": 3, "j": 6}, lowering=lowering)

    for lowering, op in ((InductorLowering(), torch.ops.aten.mm.default),
                         (Target().lowering, torch.ops.aten.bmm.default)):
        gm = make_fx(lambda w, y: product(w, y, lowering))(w, y)
        assert [n.target for n in gm.graph.nodes
                if n.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)] == [op]
        torch.testing.assert_close(gm(w, y), torch.bmm(w.expand(5, 4, 3), y))


# an order-4 Taylor jet's contraction at a tanh layer of the torch-jet paper's MLP: 14 operands,
# the sample axis a broadcast (size 1) in the seeds
_JET_EXPR = "ab,ab,ac,ad,ade,ade,dc,cb,af,ag,age,age,gf,fb->ae"


def _jet_shapes(sizes: dict, seeds=(4, 5, 10, 11)) -> tuple:
    return tuple(tuple(1 if (label == "a" and k in seeds) else sizes[label] for label in term)
                 for k, term in enumerate(_JET_EXPR.split("->")[0].split(",")))


def test_many_operand_contractions_take_a_cheap_path():
    """Beyond 5 operands the path is opt_einsum's dynamic programming over the sizes each label
    really has (a broadcast axis counted at its full size): its default search formed per-sample
    [768, 768] matrices there, 4.9e10 FLOPs against 2.5e8. The contraction's value is unchanged."""
    import opt_einsum

    from hoad.algebra.einsum import _einsum, _path_of

    big = {"a": 16, "b": 512, "c": 768, "d": 768, "e": 4, "f": 768, "g": 768}
    shapes = _jet_shapes(big)
    full = [tuple(big[label] for label in term) for term in _JET_EXPR.split("->")[0].split(",")]
    path = [tuple(step) for step in _path_of(_JET_EXPR, shapes)]
    _, info = opt_einsum.contract_path(_JET_EXPR, *full, shapes=True, optimize=path)
    assert info.opt_cost < 3e8 and info.largest_intermediate <= 16 * 768 * 4, (info.opt_cost, path)

    small = {"a": 3, "b": 5, "c": 4, "d": 6, "e": 2, "f": 4, "g": 6}
    gen = torch.Generator().manual_seed(5)
    operands = [torch.randn(s, generator=gen, dtype=torch.float64) for s in _jet_shapes(small)]
    terms = [(t, list(term)) for t, term in zip(operands, _JET_EXPR.split("->")[0].split(","))]
    got = _einsum(terms, ["a", "e"], small)
    torch.testing.assert_close(got, torch.einsum(_JET_EXPR, *operands))
