"""The programs a compiled function keeps: one entry per call signature (its program, the free
tensors and Python values it read, how its outputs become a result), the families of calls that
differ only in their number of samples, and the call keys."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Hashable, Sequence

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from hoad.binding import aliases_of, find_sources, untouched
from hoad.derivatives import Derivatives, ResultSpec
from hoad.distributed import Split, note_outputs, quiet_hooks, record_nested, synchronized
from hoad.errors import ExecutionError, HoadError, InvalidArgumentError, first_line
from hoad.guards import find_guards
from hoad.pipeline import Build, Sized, name_of, smaller_programs
from hoad.rules import has_autograd
from hoad.training import Trainable

log = logging.getLogger(__name__)


class Family:
    """Calls of one function that differ only in their number of samples (under batch_dim)."""

    def __init__(self, rows: list[int]):
        self.rows = rows   # the call's leaves that hold the samples in dim 0
        self.first: Sized | None = None   # the first build's program
        self.tried: str | None = None     # how a second build showed the structure depends on the count
        self.entry: Entry | None = None  # the program for every number of samples

    def samples(self, leaves: list) -> int:
        return leaves[self.rows[0]].shape[0]


def _resolves_to(src, roots: dict, t: torch.Tensor) -> bool:
    try:
        return src.resolve(roots) is t
    except (AttributeError, KeyError, IndexError, ValueError, TypeError):
        return False


class Entry:
    """One compiled signature: the program, the free tensors it reads, how to wrap its outputs."""

    def __init__(self, b: Build, wrt: tuple, aliases: dict, roots: dict):
        self.build = b
        self.program = p = b.program
        self.run = b.run
        self.spec = ResultSpec(p.keys, p.zeros, wrt, aliases, p.slot_shapes, p.order, p.diagonal,
                               Split(b.config.split_blocks, p.owners, p.rank) if p.owners else None,
                               b.captured.out_tree)
        # an Inductor program records no autograd graph: calls that need one go through Trainable
        self.n_user = b.n_user
        self.written = b.written  # inputs the program writes into (in place)
        # user ops: results through one autograd cannot see through do not train (hoad.extend._give_autograd)
        self.user_ops = b.user_ops
        # (its hoisted part folded back in: under autograd it runs at every call anyway)
        self.trainable = Trainable(p.gm, f"the order-{p.order} {p.direction} program", p.prefix, p.prefix_reads,
                                   self.n_user, b.samples) if b.config.backend == "inductor" else None
        free = b.captured.free
        # free tensors that were the module's differentiated parameters, read as them (passes.capture._read_as_inputs)
        self.aliases, self.joinable = b.captured.aliases, b.captured.joinable
        self.roots = roots
        self.guards = find_guards(roots)
        self.values = self.values_now()
        # why read_free last found the program stale, and whether that is a routine change (a
        # tensor's new shape, a train/eval switch) rather than a Python value worth a warning
        self.why, self.expected = "", True
        self.trace = None  # the trace a nested program was built in (its held values are that trace's)
        # DistributedDataParallel modules whose forward protocol runs around every call (hoad.distributed):
        # those the function calls, always; the wrapper of a decorated method's module, while gradients are on
        self.ddp = [(d, True) for d in b.captured.ddp]
        self.sources = list(b.sources)
        # the other places each free tensor was found in: it is one tensor while they all hold it
        self.also = list(b.also) if b.also else [()] * len(b.sources)
        self.metas = [_meta(t) for t in free]
        # numbers the program keeps from .item() of free tensors (narrow's start): where they are
        # read from now, and the number (the program is built again when it changes)
        reads = b.captured.values
        self.value_reads = [(src, t if src is None else None, v)
                            for src, (t, v) in zip(find_sources(roots, [t for t, _ in reads]), reads)]
        # tensors whose source was not found are held by identity (in-place updates still seen)
        self.held = [t if s is None else None for t, s in zip(free, self.sources)]
        lost = [f"{tuple(t.shape)} {t.dtype}" for t, s in zip(free, self.sources) if s is None]
        if lost:
            log.warning("hoad: %s reads tensors (%s) reached through objects hoad does not follow; each call reads "
                        "the same tensor objects, so in-place updates are seen but rebinding them to new tensors "
                        "is not. Pass them as arguments to be safe.", name_of(b.fn),
                        ", ".join(lost))

    def check_samples(self, count: int) -> None:
        """A program for every number of samples: refuse a count whose estimated peak (the plan
        scaled from the count it was built for) exceeds the budget."""
        if self.build.budget is not None:
            self.build.budget.check_count(count, smaller_programs(self.build.config))

    def values_now(self) -> tuple | None:
        """The Python values :attr:`guards` watch, as they are now (None if one is gone)."""
        return tuple(guard.now(self.roots) for guard in self.guards)

    def read_free(self, tensors: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        """The free tensors as they are now, or None if one changed shape, dtype or device (or
        its source is gone), or a Python value the function reaches changed (:class:`Guard`), or
        one is now, or is no longer, one of the module's parameters it differentiates among the
        call's ``tensors`` (its arguments' tensors, the module's state first): then the program must
        be traced again, and ``why`` says why."""
        for guard in self.guards:
            changed = guard.changed(self.roots)
            if changed is not None:
                step, self.why = changed
                self.expected = step == ("attr", "training")
                return None
        for src, held, value in self.value_reads:
            try:
                t = held if src is None else src.resolve(self.roots)
                same = isinstance(t, torch.Tensor) and (
                    t.tolist() == value if isinstance(value, list) else t.numel() == 1 and t.item() == value)
            except (AttributeError, KeyError, IndexError, ValueError, TypeError):
                same = False
            if not same:
                self.why = "a tensor whose values it reads (.item(), float(), int(), .tolist()) changed"
                self.expected = False
                return None
        if not self.metas:
            return []
        out = []
        for src, meta, held, also in zip(self.sources, self.metas, self.held, self.also):
            if isinstance(held, FakeTensor) and get_proxy_mode() is not self.trace:
                # a value of the trace that built this program (an operator called inside a
                # traced loss, reading it through an object hoad does not follow): it belongs to
                # that trace alone, so a call in another trace builds again
                self.why, self.expected = "it held a value of an earlier trace", True
                return None
            if held is not None:
                t = held
            else:
                try:
                    t = src.resolve(self.roots)
                except (AttributeError, KeyError, IndexError, ValueError, TypeError):
                    t = None
            if not isinstance(t, torch.Tensor) or _meta(t) != meta:
                self.why = "a tensor it reads changed its shape, dtype, device or layout (or is gone)"
                self.expected = True
                return None
            if also and not all(_resolves_to(other, self.roots, t) for other in also):
                self.why = (f"a tensor it reads, held both at {src.name} and at {also[0].name}, is now two tensors "
                            "(one of those places was given another)")
                self.expected = True
                return None
            out.append(t)
        if tensors is not None and aliases_of(out, tensors, self.joinable) != self.aliases:
            self.why = ("a tensor it reaches another way than through its arguments (a list, a closure, an operator "
                        "holding it) is now another tensor than an input it differentiates, or the same one")
            self.expected = True
            return None
        return out

    def result(self, tensors, free) -> Derivatives:
        if self.written and get_proxy_mode() is None:
            _check_written_aliases(list(tensors) + list(free or ()), self.written,
                                   list(self.build.layout.names) + [f"c{i}" for i in range(len(free or ()))])
        if not all(t.is_contiguous() for t in tensors):
            # the program was traced on dense copies of the call's tensors (free ones keep their
            # strides: read_free), and it relies on them: a reshape traced as a view, an Inductor
            # program's stride assertions. A transposed, step-sliced, expanded or channels_last
            # argument is copied dense first (it was torch's "view size is not compatible" under eager)
            tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        tensors = list(tensors) + list(free) if free else tensors
        if self.build.captured.strided:
            _check_own_storage(tensors, list(self.build.layout.names) + [f"c{i}" for i in range(len(free or ()))])
        try:
            if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
                # the trace recorded autocast's casts (its signature says so): the program runs as recorded
                with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
                    outs = self._synchronized(tensors)
            else:
                outs = self._synchronized(tensors)
        except HoadError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure leaves hoad as a HoadError
            own = self._own_failure(tensors)
            if own is not None:
                raise ExecutionError(
                    f"{name_of(self.build.fn)} itself fails on these inputs ({type(own).__name__}: {first_line(own)}), "
                    f"so its derivative program does too ({type(e).__name__}: {first_line(e)}). Fix the inputs (an "
                    "index out of range, say) or the function; the program needs nothing else") from e
            raise ExecutionError(
                f"the derivative program of {name_of(self.build.fn)} failed while running ({type(e).__name__}: {e}), "
                "although the function itself runs on these inputs: this is a bug in hoad, please report it with "
                "the function") from e
        return self.spec.result(outs)

    def _synchronized(self, tensors) -> tuple:
        """The program's outputs, run inside the forward protocol of the DDP modules it reads
        (inside another trace, the outer program takes them over), noted for FSDP's."""
        if get_proxy_mode() is not None:
            if self.ddp:
                record_nested([d for d, _always in self.ddp])
            return self._run(tensors)
        active = [d for d, always in self.ddp if always or torch.is_grad_enabled()]
        outs = synchronized(active, lambda: self._run(tensors)) if active else self._run(tensors)
        note_outputs(outs)  # (for FSDP's post-forward, when the call runs its protocol)
        return outs

    def _own_failure(self, tensors) -> Exception | None:
        """What the traced function raises on these inputs (run eagerly, without gradients, its
        small buffers restored), or None when it runs: tells a failure of the user's own code
        from one of hoad's program."""
        if get_proxy_mode() is not None:
            return None
        try:
            with torch.no_grad(), untouched(self.roots), quiet_hooks():
                self.build.layout.flat(self.build.fn)(*tensors[:self.n_user])
        except HoadError:
            return None
        except Exception as e:  # noqa: BLE001 - the user's own error, reported with hoad's
            return e
        return None

    def _run(self, tensors) -> tuple:
        if get_proxy_mode() is not None:  # called inside another trace: its ops join that program
            return self._traced(tensors)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        blind = [op for op in self.user_ops if not has_autograd(op)] if training else []
        if blind:
            raise InvalidArgumentError(
                f"a tensor the results depend on requires grad, but {blind[0]} has no autograd formula hoad can "
                "give it (hoad.register_rule gives none), and hoad's program runs it: gradients through the results "
                "would be wrong. Register one with torch.library.register_autograd, or call under torch.no_grad() "
                "when no gradient is wanted")
        if self.trainable is not None and training:
            return self.trainable(*tensors)
        return self.run(*tensors)

    def _traced(self, tensors) -> tuple:
        """The eager program on traced values, its prefix recomputed (cached prefix values would
        be constants of the outer program, stale once the weights change)."""
        b = self.build
        if b.prefix is None:
            return b.main(*tensors)
        return b.main(*tensors, *b.prefix.run(*[tensors[b.prefix.first_free + i] for i in b.prefix.reads]))


def _check_written_aliases(tensors, written: set, names) -> None:
    """The program traced each input on storage of its own: a function that writes into one
    input, called with another input sharing its memory (f(x, x) with y.mul_(2)), reads the
    other as it was, where torch reads the write. Refused rather than answered wrongly."""
    def span(t):  # (storage, first byte, byte past the last) of a tensor's entries
        if not isinstance(t, torch.Tensor) or not t.numel():
            return None
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
        lo = t.storage_offset() * t.element_size()
        return t.untyped_storage().data_ptr(), lo, lo + (last + 1) * t.element_size()

    spans = [span(t) for t in tensors]
    for i in written:
        for j, other in enumerate(spans):
            if j != i and other is not None and spans[i] is not None and other[0] == spans[i][0] \
                    and other[1] < spans[i][2] and spans[i][1] < other[2]:
                raise InvalidArgumentError(
                    f"the function writes into input {names[i]!r} in place, and input {names[j]!r} shares its memory "
                    "(the same tensor, or a view of it); hoad's program reads each input as a tensor of its own, so "
                    f"{names[j]!r} would not see the write. Pass a copy (x.clone()) for one of them")


def _check_own_storage(tensors, names) -> None:
    """A function that calls as_strided reads storage: its program assumes every input is a
    contiguous tensor owning its storage (as traced). A view into a larger storage would be read
    differently by torch, so it is refused rather than answered wrongly."""
    for t, name in zip(tensors, names):
        if get_proxy_mode() is None and isinstance(t, torch.Tensor) and (
                t.storage_offset() != 0 or not t.is_contiguous()
                or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            raise InvalidArgumentError(
                f"the function calls as_strided, which reads a tensor's storage, and input {name!r} is a view into a "
                f"larger storage (offset {t.storage_offset()}, strides {tuple(t.stride())}); hoad's program reads its "
                "inputs as tensors of their own. Pass a copy (x.clone() or x.contiguous()), or avoid as_strided")


def is_nested(key) -> bool:
    return isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and key[0] == "nested"


def _meta(t: torch.Tensor) -> tuple:
    """What a program assumes of a free tensor, its layout too: traced views and strided reads of
    it rely on it (and an Inductor program asserts its strides)."""
    return t.shape, t.dtype, t.device, t.stride(), t.storage_offset()


def what_changed(key, keys: list) -> str:
    """What sets ``key`` apart from the nearest cached key with the same arguments (a module's
    train/eval switch, its trainable parameters, the default dtype or autocast), or "" where no
    cached key has them."""
    def full(k) -> bool:  # (treedef, leaves, extra, ambient); a call of plain tensors keys by them alone
        return isinstance(k, tuple) and len(k) == 4 and isinstance(k[0], pytree.TreeSpec)

    if not full(key):
        return ""
    alike = [k for k in keys if full(k) and same_key(k[:2], key[:2])]
    n = sum(isinstance(v, bool) for v in key[2])  # (the training flags, then wrt's names)
    if any(k[3] == key[3] and k[2][:n] == key[2][:n] for k in alike) and len(key[2]) > n:
        return "a change of which parameters require grad (wrt=hoad.parameters)"
    if any(k[3] == key[3] and k[2] != key[2] for k in alike):
        return "a switch of the module between train() and eval()"
    return "a change of the default dtype or of autocast" if any(k[3] != key[3] for k in alike) else ""


def shown_leaf(leaf_key) -> str:
    """A leaf's key (:func:`leaf_key`) as a user reads it: ``0.5``, ``tensor (3, 4) float32``."""
    if leaf_key[0] == "T":
        _, shape, dtype, device = leaf_key
        where = f" on {device}" if device.type != "cpu" else ""
        return f"tensor {tuple(shape)} {str(dtype).removeprefix('torch.')}{where}"
    return repr(leaf_key[2]) if leaf_key[2] != "nan" else "nan"


def same_key(a, b) -> bool:
    """Equal keys; False where comparing them raises (a frozen dataclass of tensors, say)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - what a user's __eq__ raises: not the same
        return False


def ambient() -> tuple:
    """Process-wide settings that change what a traced function computes, so part of a call's
    signature: the default dtype (``torch.zeros(3)``) and autocast (which the trace bakes in)."""
    return (torch.get_default_dtype(), torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
            torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"))


def stand_in(t: torch.Tensor) -> torch.Tensor:
    """A concrete tensor like a traced one (a program is traced in fake mode: values never matter)."""
    return torch.zeros(tuple(t.shape), dtype=t.dtype, device=t.device)


def leaf_key(leaf) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return ("T", tuple(leaf.shape), leaf.dtype, leaf.device)
    try:
        hash(leaf)
    except TypeError:
        raise InvalidArgumentError(
            f"a non-tensor argument of type {type(leaf).__name__} is not hashable; hoad caches programs by "
            "the values of non-tensor arguments, so pass it as a tensor or as a hashable value") from None
    if isinstance(leaf, float) and leaf != leaf:  # (NaN equals no NaN: each call built a new program)
        return ("S", float, "nan")
    return ("S", type(leaf), leaf)


# first builds by distinct compiled objects of one function, with the same options and call
# signature: a hoad.compile or an operator made anew at every step traces and compiles anew at
# every step (0.4-0.6 s a step, against 0.9 ms for the operator built once)
REMADE_AFTER = 3
_FIRST_BUILDS: dict[tuple, int] = {}
_REMADE_SAID: set = set()


def note_a_new_object(cf, key, entry: Entry) -> None:
    """Count the first build of a new compiled object ``cf`` (a :class:`hoad.compiled.Compiled`);
    warn once where the same function was built so by REMADE_AFTER objects."""
    user = inspect.unwrap(cf.fn)
    code = getattr(user, "__code__", None)
    if code is None or cf.module is not None:  # (a module's method: each instance is its own)
        return
    # the objects the function reaches decide which function it is: an ensemble's lambdas over
    # different nets are different functions, a lambda remade each step over the same net is not
    owner = id(getattr(user, "__self__", None))
    cells = tuple(id(c.cell_contents) for c in (getattr(user, "__closure__", None) or ()) if _filled(c))
    try:
        ident = (code, owner, cells, cf.order, repr(cf.wrt), repr(sorted(cf._options.items())), key)
        hash(ident)
    except Exception:  # noqa: BLE001 - an unhashable key: nothing to count
        return
    count = _FIRST_BUILDS[ident] = _FIRST_BUILDS.get(ident, 0) + 1
    if count >= REMADE_AFTER and ident not in _REMADE_SAID:
        _REMADE_SAID.add(ident)
        seconds = sum(v["seconds"] for v in entry.build.stats.values() if isinstance(v, dict) and "seconds" in v)
        log.warning("hoad: %s was traced and compiled by %d separate hoad.compile or operator objects with the same "
                    "options and arguments (this build: %.2f s); each new object builds its program anew. Build it "
                    "once, outside the loop, and call it: an operator reads directions=, weights= and factor= at "
                    "every call, so resample by writing into them (V.copy_(torch.randn_like(V))), or let it draw "
                    "(randomization=(kind, S))",
                    name_of(cf.fn), count, seconds)


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # (an empty cell)
        return False
    return True


def floats_changed(keys: list, key, constants: set[int]) -> list[int]:
    """The leaf positions at which ``key`` differs from one of ``keys`` (a call of the same
    structure, with the same settings) in the values of float arguments alone, none of them one
    that stays a constant (``constants``): the floats to trace as program inputs (hoad.numbers).
    [] where no cached call differs so."""
    if not (isinstance(key, tuple) and len(key) == 4 and isinstance(key[0], pytree.TreeSpec)):
        return []
    for k in keys:
        if not (isinstance(k, tuple) and len(k) == 4 and k[0] == key[0] and k[2:] == key[2:]
                and len(k[1]) == len(key[1])):
            continue
        differing = [i for i, (a, b) in enumerate(zip(k[1], key[1])) if not same_key(a, b)]
        floats = [i for i in differing if k[1][i][:2] == key[1][i][:2] == ("S", float) and i not in constants]
        if differing and floats == differing:
            return differing
    return []


def arguments_changed(cf, key, args: tuple, kwargs: dict, advice: bool = True) -> str:
    """The arguments that set this call of the compiled callable ``cf`` apart from the cached call
    nearest to it (the fewest leaves differing, in the same structure), as ``k=0.7 (was 0.5)``, or
    "" where none is near; with ``advice``, what keeps a changed Python number in the program."""
    if not (isinstance(key, tuple) and len(key) == 4 and isinstance(key[0], pytree.TreeSpec)):
        return ""
    full = [k for k in cf._cache if isinstance(k, tuple) and len(k) == 4 and isinstance(k[0], pytree.TreeSpec)
            and k[2:] == key[2:]]
    alike = [k for k in full if k[0] == key[0] and len(k[1]) == len(key[1])]
    if not alike:  # the arguments are arranged otherwise: both calls, as written
        return (f"({_written(cf, key)}), where it was called with ({_written(cf, full[-1])})"
                if full else "")
    differing = lambda k: [i for i, (a, b) in enumerate(zip(k[1], key[1])) if not same_key(a, b)]  # noqa: E731
    nearest = min(alike, key=lambda k: len(differing(k)))
    paths = [path for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]]
    state = cf.module is not None  # (args[0] is then the module's state)
    changes = [f"{_leaf_name(cf, paths[i], state)}={shown_leaf(key[1][i])} (was {shown_leaf(nearest[1][i])})"
               for i in differing(nearest)]
    if not changes:
        return ""
    said = ", ".join(changes[:3]) + (f" and {len(changes) - 3} more" if len(changes) > 3 else "")
    scalars = [i for i in differing(nearest) if key[1][i][0] == "S"]
    if not advice or not scalars:
        return said
    # (a float argument is traced as a program input at its second value, hoad.numbers, unless the
    # function needs the value in Python: then the trace said why)
    reasons = [(_leaf_name(cf, paths[i], state), cf._constants[(key[0], i)]) for i in scalars
               if (key[0], i) in getattr(cf, "_constants", {})]
    if reasons:
        name, reason = reasons[0]
        return (f"{said} ({name} stays part of the program: {getattr(cf.fn, '__name__', 'the function')} {reason}; "
                f"each value compiles a "
                f"program of its own. Pass it as a tensor, or keep its value out of Python conditions and "
                f"conversions, to keep one program)")
    return (f"{said} (a Python number is part of the program it is traced into; a float argument whose value "
            "alone changes becomes a program input, other numbers stay constants: pass one that changes between "
            "calls as a tensor, read afresh at every call, to keep one program)")


def _written(cf, key) -> str:
    """The call a cache key stands for: ``x=tensor (3,) float64, k=0.5; by keyword scale=2.0``."""
    args, kwargs = pytree.tree_unflatten(list(key[1]), key[0])
    state = cf.module is not None
    shown = lambda v: shown_leaf(v) if isinstance(v, tuple) and v and v[0] in ("T", "S") else "…"  # noqa: E731
    parts = [f"{_leaf_name(cf, (pytree.SequenceKey(0), pytree.SequenceKey(i)), state)}={shown(a)}"
             for i, a in enumerate(args) if i >= state]
    keywords = ", ".join(f"{name}={shown(v)}" for name, v in kwargs.items())
    return ", ".join(parts) + (f"; by keyword {keywords}" if keywords else "")


def _leaf_name(cf, path: tuple, state: bool) -> str:
    """A leaf of (args, kwargs) as the user wrote it: ``k``, ``x``, ``batch['u']``."""
    where, rest = path[0].idx, path[2:]
    if where == 1:  # a keyword
        return f"{path[1].key}{pytree.keystr(rest)}"
    i = path[1].idx - state
    if i < 0:
        return f"the module state{pytree.keystr(rest)}"
    name = cf._positional[i] if i < len(cf._positional) else f"argument {i}"
    return f"{name}{pytree.keystr(rest)}"
