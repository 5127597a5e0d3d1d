"""``chunk_size=n``: a call split into calls of n samples each, the last padded, and the
results joined as each chunk finishes."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from hoad.binding import Keyword, Positional, holder_of
from hoad.cache import Entry
from hoad.derivatives import Derivatives
from hoad.errors import InvalidArgumentError
from hoad.pipeline import count_dependence, smaller_programs


def split(cf, n: int, args: tuple, kwargs: dict) -> list | None:
    """``cf``'s call split into calls of n samples each (the last padded with copies of its first
    sample, so one program serves every chunk): [(args, kwargs, samples kept)], or None when
    the call has at most n samples."""
    places = []
    for w in cf._expanded_wrt():
        if isinstance(w, int) and w < len(args):
            places.append(Positional(w))
        elif isinstance(w, int) and w < len(cf._positional) and cf._positional[w] in kwargs:
            places.append(Keyword(cf._positional[w]))
        elif isinstance(w, str) and w in kwargs:
            places.append(Keyword(w))
        elif isinstance(w, str) and w in cf._positional and cf._positional.index(w) < len(args):
            places.append(Positional(cf._positional.index(w)))
    state = {n for n, _ in cf.module.named_parameters()} | {n for n, _ in cf.module.named_buffers()} \
        if cf.module is not None else set()
    inside = [w for w in cf._expanded_wrt() if isinstance(w, str) and w not in state and w not in kwargs
              and w not in cf._positional and holder_of(w, list(cf._positional) + list(kwargs))]
    if inside:
        raise InvalidArgumentError(
            f"chunk_size splits tensor arguments along dim 0, and wrt names {inside[0]!r}, inside a container "
            "argument: pass the tensors that hold the samples as arguments of their own, or drop chunk_size")
    if cf.sample_places is not None:  # (an operator's points and seeds beside the input it differentiates)
        places += [p for p in cf.sample_places(args, kwargs) if p not in places]
    values = [args[p.index] if isinstance(p, Positional) else kwargs[p.name] for p in places]
    if not places and any(isinstance(w, str) for w in cf._expanded_wrt()):
        raise InvalidArgumentError(
            f"chunk_size={n} splits the wrt inputs that hold the samples, and wrt={cf.wrt!r} names none of this "
            "call's arguments (module parameters are shared by every sample, so they are not split). Add the input "
            "that holds the samples to wrt, or drop chunk_size")
    if not values or not all(isinstance(v, torch.Tensor) and v.ndim > 0 for v in values):
        return None  # the unchunked call names what is wrong
    samples = values[0].shape[0]
    if any(v.shape[0] != samples for v in values):
        raise InvalidArgumentError(f"batch_dim=0 with chunk_size: the wrt inputs have different numbers of samples "
                                   f"{[v.shape[0] for v in values]} along dim 0")
    if samples <= n:
        return None
    wrt_ids = {id(v) for v in values}
    others = [(f"argument {i}", a) for i, a in enumerate(args)] + [
        (repr(k), v) for k, v in kwargs.items() if not k.startswith("hoad_")]  # (an operator's own: shared)
    others = [(name + pytree.keystr(path), t) for name, a in others  # (and the tensors inside containers)
              for path, t in pytree.tree_flatten_with_path(a)[0]]
    for name, t in others:
        if isinstance(t, torch.Tensor) and id(t) not in wrt_ids and t.ndim > 0 and t.shape[0] == samples:
            # which of them hold samples, chunk_size cannot tell: a shared (B, ...) tensor split
            # would be silently wrong, a per-sample one kept whole fails to broadcast
            raise InvalidArgumentError(
                f"chunk_size={n} splits the wrt inputs along dim 0, and the tensor {name} (shape "
                f"{tuple(t.shape)}) also has {samples} rows: hoad cannot tell whether it holds samples. Split the "
                f"call into chunks yourself, or drop chunk_size")
    chunks = []
    for start in range(0, samples, n):
        kept = min(n, samples - start)
        a, k = list(args), dict(kwargs)
        for place, v in zip(places, values):
            piece = v[start:start + kept]
            if kept < n:
                piece = torch.cat([piece, piece[:1].expand(n - kept, *piece.shape[1:])])
            if isinstance(place, Positional):
                a[place.index] = piece
            else:
                k[place.name] = piece
        chunks.append((tuple(a), k, kept))
    return chunks


def joined(cf, chunks: list) -> Derivatives:
    """The chunks' results written into the joined ones as each chunk finishes: the call holds
    the joined results and one chunk's program, not every chunk's results besides."""
    total = sum(kept for _a, _k, kept in chunks)
    value = blocks = first = None
    at = 0
    for i, (a, k, kept) in enumerate(chunks):
        r, entry = cf._call_entry(*a, **k)
        if i == 0:  # (this call's program: another thread's calls move _last)
            _check_count_free(cf, entry)
            _check_joined_size(cf, entry, len(chunks), total)
            first = r
            value = r.value.new_empty((total, *r.value.shape[1:]))
            blocks = {K: b.new_empty((total, *b.shape[1:])) for K, b in r._blocks.items()}
        value[at:at + kept] = r.value[:kept]
        for K, b in r._blocks.items():
            blocks[K][at:at + kept] = b[:kept]
        at += kept
    return Derivatives(value, blocks, first._spec)


def _check_count_free(cf, entry: Entry) -> None:
    """Chunks change what the function sees as its number of samples: refuse one that computes
    with it (a per-sample loss divided by X.shape[0] was off by the samples over chunk_size)."""
    b = entry.build
    if "count_free" not in b.stats:
        b.stats["count_free"] = count_dependence(b, b.captured.out_shape[0] + 1) is None
    if not b.stats["count_free"]:
        raise InvalidArgumentError(
            f"chunk_size={cf.config.chunk_size} runs the function on {cf.config.chunk_size} samples at a time, "
            "and the function uses its number of samples as a value (X.shape[0] in a mean, say), so chunks would "
            "change its results. Divide by the total outside the function, pass the count as an argument, or "
            "drop chunk_size")


def _check_joined_size(cf, entry: Entry, chunks: int, samples: int) -> None:
    """The joined results must fit, whatever the size of one chunk's program."""
    if entry.build.budget is not None:
        entry.build.budget.check_joined(chunks, cf.config.chunk_size, samples, smaller_programs(cf.config))
