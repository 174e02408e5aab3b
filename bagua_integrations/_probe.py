"""The elementwise probe: can an optimizer's step run on a flat concatenation of tensors?

An allowlist cannot cover third-party optimizers, so we ask the optimizer itself: run its
own ``step`` on a few small synthetic tensors of very different scales and shapes, once
per tensor and once on their concatenation, and compare parameters and state. Per-tensor
norms (LAMB, LARS), per-parameter clipping (BertAdam), shape-dependent math (Adafactor)
and closures (LBFGS) all show up as a mismatch or an exception.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref
from collections import defaultdict
from contextlib import contextmanager
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from ._late_reductions import _SIZE_READS, watched
from ._nested_state import leaf_at, structure, tensor_leaves, with_leaves
from ._optimizer_copy import optimizer_like
from ._segmented import (_PYTHON_VALUES, _SCALAR_READS, SizesDisagree, StepNotes, Segmentation, SegmentedMode,
                         run_shape, segment_views, size_key, state_kind)
from ._torch_compat import tensor_version
from .errors import FusionError

# Shapes mix 1-D and N-D tensors (to catch "no weight decay on biases"-style rules);
# parameter and gradient scales span many decades (to catch norms, clipping and eps effects).
# Grouped by rank (the segmented probe's runs) they give runs of distinct lengths and counts.
# 4-D tensors catch conv-weight rules (``p.dim() == 4``). The segmented probe's runs (one per
# rank) must differ in segment count (3, 2, 1, 4) and length, as the runs of one segmented call do.
_PROBE_SHAPES = [(4, 6), (9,), (2, 3, 5), (1,), (7, 3), (5,), (2, 1, 3, 2), (1, 2, 2, 1), (3, 1, 1, 2), (1, 1, 2, 2)]
_PARAM_SCALES = [1e-3, 1.0, 1e2, 1e-1, 30.0, 3e-2, 3.0, 1e-2, 0.5, 10.0]
_GRAD_SCALES = [1e-4, 10.0, 1e-2, 1e3, 0.3, 2.0, 5e-2, 1e2, 3e-3, 1.0]
# Elements of alignment padding after each parameter in the probes' flat tensors and runs, as the
# fused step lays them out: a step that reduces over a whole flat tensor (a mean, a count) sees them.
_PADDING = 3
_PROBE_STEPS = 3
_RTOL = 1e-5


class _SizeReads(TorchFunctionMode):
    """Notes whether the step reads the size of a tensor with ``numel`` elements (the flat one,
    its gradient or its state): a threshold such as ``p.numel() >= 4096`` takes the same branch
    for every small probe tensor, and another one for a flat buffer of real parameters."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.read = numel, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SIZE_READS and args and isinstance(args[0], torch.Tensor):
            with torch._C.DisableTorchFunction():
                self.read = self.read or args[0].numel() == self.numel
        return func(*args, **(kwargs or {}))


_PREDICATES = _PYTHON_VALUES  # torch.equal, allclose, is_nonzero: a Python value from whole tensors
_READS = _SCALAR_READS | {torch.Tensor.tolist}


class _ReducedValueReads(TorchFunctionMode):
    """Counts the values a step reads into Python that it reduced from parameter-sized tensors
    (``if grad.abs().sum() == 0: continue``, ``torch.equal(p, zeros)``).

    Read once per parameter by the per-tensor step and once on the flat tensor, such a value is a
    per-parameter predicate that the flat step evaluates over every parameter at once: the
    probes' tensors take the same way either way (no gradient of theirs is all zero), real ones
    need not. A value reduced from the whole group (D-Adaptation's sums, read once a step) is read
    as often either way. "Reduced from": the result of a call with a tensor of one of ``sizes``
    elements among its inputs and fewer elements in its output, or of any call on such a result."""

    def __init__(self):
        super().__init__()
        self.sizes: frozenset = frozenset()
        self.reads = 0
        self._reduced: Dict[int, Any] = {}  # id -> weakref of tensors reduced from parameter-sized ones

    def counting(self, sizes):
        self.sizes = frozenset(sizes)
        return self

    def _is_reduced(self, t) -> bool:
        ref = self._reduced.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + [
            v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        if not tensors:
            return out
        with torch._C.DisableTorchFunction():
            reduced = any(self._is_reduced(t) for t in tensors)
            largest = max((t.numel() for t in tensors if t.numel() in self.sizes), default=0)
            if func in _READS or func in _PREDICATES:
                if reduced or (func in _PREDICATES and largest):
                    self.reads += 1
                return out
            results = [out] if isinstance(out, torch.Tensor) else [
                o for o in out if isinstance(o, torch.Tensor)] if isinstance(out, (tuple, list)) else []
            for r in results:
                if reduced or (largest and r.numel() < largest):
                    self._reduced[id(r)] = weakref.ref(r)
        return out


def _keeps_rng(probe):
    """Run ``probe`` with the random number generators forked: an optimizer that draws random
    numbers (Gravity's initial state, Kron's preconditioner updates) must see the same stream
    after fusing as without it, and so must the model's dropout."""

    @functools.wraps(probe)
    def wrapped(optimizer, group, device, *args, **kwargs):
        cuda = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            return probe(optimizer, group, device, *args, **kwargs)

    return wrapped


def _replayed_rng(device: torch.device):
    """Random numbers drawn inside are drawn again after it: the per-tensor step and the fused
    one of a probe see one stream, as the unfused and the fused optimizer do in training (Gravity
    draws its initial state from it)."""
    return torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [])


class ProbeCopyError(Exception):
    """The optimizer cannot be copied for probing (see :func:`_probe_clone`)."""


def _probe_clone(optimizer: torch.optim.Optimizer, group: Dict[str, Any], params: List[torch.Tensor]):
    """A throw-away copy of ``optimizer`` holding one group (same hyper-parameters) over ``params``.

    Everything else the optimizer refers to is deep-copied, so the probe cannot touch a user
    tensor even through an attribute: a wrapper optimizer (Lookahead-style) steps a *copy*
    of its inner optimizer and of that one's parameters. Ordinary optimizers hold nothing
    but small settings outside ``param_groups``/``state``, so the copy is cheap.
    """
    state = defaultdict(dict)
    # optimizer-level state (``self.state["k"]``, not keyed by a parameter) is copied as it is: a step
    # count kept there decides, like the group's and the parameters', what the step does next
    try:
        state.update(copy.deepcopy({k: v for k, v in optimizer.state.items() if not isinstance(k, torch.Tensor)}))
    except Exception as exc:
        raise ProbeCopyError(f"its optimizer-level state cannot be copied ({type(exc).__name__}: {exc})") from exc
    # the group's own values are copied too: after a first step some optimizers keep tensors there
    # (D-Adaptation's running sums), which the probe's steps would otherwise update in place
    try:
        settings = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
    except Exception as exc:
        raise ProbeCopyError(f"its param group cannot be copied ({type(exc).__name__}: {exc})") from exc

    def deep(rest):
        try:
            return copy.deepcopy(rest)
        except Exception as exc:
            raise ProbeCopyError(f"{type(exc).__name__}: {exc}") from exc

    try:
        return optimizer_like(optimizer, [dict(settings, params=params)], state, deep, skip=("grad_scale", "found_inf"))
    except AttributeError as exc:  # e.g. param_groups a read-only property of a wrapper optimizer
        raise ProbeCopyError(f"{type(exc).__name__}: {exc}") from exc


def _user_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The parameters, gradients, state tensors (those in containers too: AggMo's {beta: buffer})
    and tensors in param groups of ``optimizer``, as it holds them now."""
    out = []
    for group in optimizer.param_groups:
        out.extend(v for k, v in group.items() if k != "params" and isinstance(v, torch.Tensor))
        for p in group["params"]:
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
    for per_param in optimizer.state.values():
        if isinstance(per_param, dict):
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    out.append(value)
                elif (leaves := tensor_leaves(value)) is not None:
                    out.extend(leaf for _, leaf in leaves)
    return out


def _synthetic(device, dtype, generator):
    """Initial parameters and one gradient list per probe step, on ``device``."""
    grads = [
        [
            torch.randn(shape, generator=generator, dtype=dtype).to(device) * scale
            for shape, scale in zip(_PROBE_SHAPES, _GRAD_SCALES)
        ]
        for _ in range(_PROBE_STEPS)
    ]
    params = [
        torch.randn(shape, generator=generator, dtype=dtype).to(device) * scale
        for shape, scale in zip(_PROBE_SHAPES, _PARAM_SCALES)
    ]
    return params, grads


class _Closure:
    """The closure the probes pass to the step: a fixed loss, and a count of the calls.

    A fused step calls the user's closure once and replays its loss to the optimizer's own
    step (EmoNavi-style optimizers scale their update by it). A step that calls its closure
    more than once re-evaluates the model between calls (SAM, line searches): replaying one loss
    would change its math, so such a step is never fused."""

    def __init__(self):
        self.calls = 0
        self.given = 0  # steps given this closure
        self.in_step = 0  # calls within the step being taken

    def __call__(self):
        # a loss that changes with each call of one step, as re-evaluating a model that moved does:
        # a step that iterates until its loss settles (L-BFGS) then calls its closure more than once
        self.calls += 1
        self.in_step += 1
        return torch.tensor(0.75 / self.in_step)

    def step(self, step, optimizer, n: int) -> None:
        """The probe's ``n``-th step: the first one without a closure (a step that cannot run
        without one evaluates the model itself: L-BFGS, SAM, line searches), the others with this
        one where the step takes a closure. A first step that fails without one is given it too:
        a step that reads the loss from its closure (AliG: ``step(lambda: float(loss))``) runs
        fused, and one that calls it more than once a step still shows (:meth:`reevaluates`)."""
        self.in_step = 0
        if n > 0 and _takes_closure(step, optimizer):
            self.given += 1
            step(optimizer, self)
            return
        try:
            step(optimizer)
        except Exception:
            if not _takes_closure(step, optimizer):
                raise
            self.given += 1
            self.in_step = 0
            step(optimizer, self)

    def reevaluates(self) -> Optional[str]:
        if self.calls > self.given:
            return ("its step calls the closure more than once per step (it re-evaluates the model), so it "
                    "runs unfused with the closure")
        return None


def _takes_closure(step, optimizer) -> bool:
    try:
        inspect.signature(step).bind(optimizer, None)
    except (TypeError, ValueError):
        return False
    return True


def _padded_cat(tensors) -> torch.Tensor:
    """The tensors one after another, each followed by ``_PADDING`` zeros (the elementwise probe's flat tensor)."""
    pieces = []
    for t in tensors:
        pieces += [t.reshape(-1), t.new_zeros(_PADDING)]
    return torch.cat(pieces)


def _unpadded(flat: torch.Tensor, like) -> torch.Tensor:
    """The parameters' elements of a :func:`_padded_cat` tensor, without the padding."""
    pieces, cursor = [], 0
    for t in like:
        pieces.append(flat[cursor : cursor + t.numel()])
        cursor += t.numel() + _PADDING
    return torch.cat(pieces)


def _seed_pieces(optimizer, group, like: List[torch.Tensor], generator, template: Optional[torch.Tensor] = None):
    """State for each of the probe's tensors ``like``, shaped like the real group's, when it already has some.

    Some optimizers create their state in ``__init__`` and never lazily in ``step`` (torch's
    Adagrad before 2.12 creates ``sum`` there), a state loaded before fusing has values the step
    builds on, and a group probed again during training (``Fusion._replan``) has a step count
    past its warm-up. Parameter-shaped entries become synthetic tensors of the probe's shapes (a
    constant stays that constant, anything else gets random values of the same sign and scale);
    other entries (step counts, per-parameter scalars) are copied as they are. Returns the state
    per tensor and the parameter-shaped keys, or ``(None, ())`` where the group has no state yet.
    The state copied is ``template``'s where given (a parameter of the group with state), else that
    of the group's largest parameter with state.
    """
    with_state = [p for p in group["params"] if optimizer.state.get(p)]
    if not with_state:
        return None, ()
    largest = max(with_state, key=lambda p: p.numel())  # its shape tells parameter-shaped state apart
    if template is not None and optimizer.state.get(template):
        largest = template
    template, real_shape, real_dtype = optimizer.state[largest], largest.shape, largest.dtype
    per_param: List[Dict[str, Any]] = [{} for _ in like]
    shaped = []

    def synthetic(value: torch.Tensor) -> List[torch.Tensor]:
        data = value.detach().double()
        out = []
        for p in like:
            if bool((data == data.reshape(-1)[0]).all()):
                piece = torch.full(p.shape, float(data.reshape(-1)[0]), dtype=torch.float64)
            else:
                piece = torch.rand(p.shape, generator=generator, dtype=torch.float64) * float(data.abs().max())
                if bool((data < 0).any()):
                    piece = piece * torch.randn(p.shape, generator=generator, dtype=torch.float64).sign()
            # state in the parameter's dtype follows the probe's (fp32) tensors: torch's foreach
            # steps refuse a bf16 ``sum`` (Adagrad creates it in __init__) beside fp32 parameters
            out.append(piece.to(device=p.device, dtype=p.dtype if value.dtype == real_dtype else value.dtype))
        return out

    for key, value in template.items():
        leaves = tensor_leaves(value)  # a container of parameter-shaped tensors: each one synthetic
        if isinstance(value, torch.Tensor) and value.shape == real_shape:
            shaped.append(key)
            for state, piece in zip(per_param, synthetic(value)):
                state[key] = piece
        elif leaves is not None and all(leaf.shape == real_shape for _, leaf in leaves):
            shaped.append(key)
            pieces = {path: synthetic(leaf) for path, leaf in leaves}
            for i, state in enumerate(per_param):
                state[key] = with_leaves(value, {path: made[i] for path, made in pieces.items()}, copy=True)
        else:
            for state in per_param:
                state[key] = copy.deepcopy(value)
    return per_param, tuple(shaped)


def _seed_state(optimizer, group, opt_a, per_tensor, opt_b, flat, generator, template=None) -> None:
    """:func:`_seed_pieces` for the elementwise probe: ``opt_a``'s tensors get the pieces, its flat
    tensor their padded concatenation (other entries: a copy)."""
    per_param, shaped = _seed_pieces(optimizer, group, per_tensor, generator, template)
    if per_param is None:
        return

    def flat_value(key, value):
        if key not in shaped:
            return copy.deepcopy(value)
        leaves = tensor_leaves(value)
        if leaves is None:
            return _padded_cat([state[key] for state in per_param])
        return with_leaves(value, {path: _padded_cat([leaf_at(state[key], path) for state in per_param])
                                   for path, _ in leaves}, copy=True)

    flat_state = {key: flat_value(key, value) for key, value in per_param[0].items()}
    for p, state in zip(per_tensor, per_param):
        opt_a.state[p] = state
    opt_b.state[flat] = flat_state


def _mismatch(name: str, per_tensor: torch.Tensor, flat: torch.Tensor,
              before: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why ``flat`` is not ``per_tensor`` up to fp32 rounding, or ``None``.

    ``before``: the values both started from (a parameter, or a state before the last step). A
    difference within ``_RTOL`` of how far a value moved is rounding too: MADGRAD's dual averaging
    computes a parameter as the difference of two far larger terms (``x0 - s / rms``), so one
    rounding step of those, which differs with an element's place in a vectorised loop, is a large
    part of a tiny parameter. A momentum buffer is such a difference wherever this step's update
    cancels most of it (``0.999 * m + u``, ``u`` near ``-m``): there a norm summed in another order
    (``torch._foreach_norm`` against one parameter's ``vector_norm`` on a GPU, one or two roundings
    apart) moved LARS's tiny values by 1e-5 of themselves. A step that is not elementwise changes
    the update itself, by much more than that."""
    if per_tensor.shape != flat.shape:
        return f"{name} has shape {tuple(flat.shape)} on the flat tensor, not {tuple(per_tensor.shape)}"
    a, b = per_tensor.double(), flat.double()
    same = (a == b) | ((a - b).abs() <= _RTOL * torch.maximum(a.abs(), b.abs())) | (a.isnan() & b.isnan())
    if before is not None:
        same |= (a - b).abs() <= _RTOL * (a - before.double()).abs()
    if bool(same.all()):
        return None
    relative = torch.where(same, torch.zeros_like(a), (a - b).abs() / a.abs().clamp_min(1e-30))
    at = int(relative.argmax())
    # (where: a value far below the largest of its tensor points at cancellation, a rounding effect)
    return (f"{name} differs between per-tensor and flat updates (relative error {relative[at].item():.2e}, "
            f"at a value of {a[at].item():.2e} where the largest is {a.abs().max().item():.2e})")


@_keeps_rng
def probe_elementwise(
    optimizer: torch.optim.Optimizer, group: Dict[str, Any], device: torch.device, mixing: Optional[Counter] = None,
    template: Optional[torch.Tensor] = None,
) -> Optional[str]:
    """Return ``None`` if ``optimizer``'s step is elementwise under ``group``'s settings, else why not.

    ``mixing``, when given, receives the operations of one flat step that mix the elements of the
    whole flat tensor (a global gradient norm, D-Adaptation's sums; ``_late_reductions``), counted
    per step (the most of any probe step): the step was found exact with them, so checks of the
    real steps accept them and look only for others. ``template``: the parameter whose state seeds
    the probe (see :func:`_seed_pieces`)."""
    generator = torch.Generator().manual_seed(1234)
    dtype = torch.float32
    init, grads = _synthetic(device, dtype, generator)

    per_tensor = [torch.nn.Parameter(t.clone()) for t in init]
    flat = torch.nn.Parameter(_padded_cat(init))
    try:
        opt_a = _probe_clone(optimizer, group, per_tensor)
        opt_b = _probe_clone(optimizer, group, [flat])
    except ProbeCopyError as exc:
        return f"it cannot be copied to be probed on synthetic tensors ({exc})"
    _seed_state(optimizer, group, opt_a, per_tensor, opt_b, flat, generator, template)
    step = type(optimizer).step
    sizes = _SizeReads(flat.numel())
    flat_numel = {flat.numel(): {0}}  # what the flat tensor's operations are watched by
    closure = _Closure()
    reads_per_tensor, reads_flat = _ReducedValueReads(), _ReducedValueReads()
    with _untouched(optimizer):
        try:
            for n, step_grads in enumerate(grads):
                for p, g in zip(per_tensor, step_grads):
                    p.grad = g.clone()
                flat.grad = _padded_cat(step_grads)
                if n == len(grads) - 1:
                    state_before = _state_copy(opt_a, per_tensor)
                with _replayed_rng(device), reads_per_tensor.counting(t.numel() for t in per_tensor if t.numel() > 1):
                    closure.step(step, opt_a, n)
                # (the read counter outermost: its own size reads stay out of the other modes' sight)
                with reads_flat.counting([flat.numel()]), watched(dict(flat_numel)) as watch, sizes:
                    closure.step(step, opt_b, n)
                if mixing is not None:
                    mixing |= watch.findings[0]
        except Exception as exc:  # the probe reports; the caller decides whether to raise
            return f"its step raised {type(exc).__name__} on synthetic tensors ({exc})"
    reason = closure.reevaluates()
    if reason:
        return reason
    if sizes.read:
        return "its step reads a parameter's size (numel, len, size or shape), which a flat tensor changes"
    if reads_per_tensor.reads > reads_flat.reads:
        return (f"its step reads into Python values it reduces from each parameter ({reads_per_tensor.reads} "
                f"per tensor, {reads_flat.reads} flat over {_PROBE_STEPS} steps: `if grad.abs().sum() == 0:`), "
                "which the flat tensor would answer for every parameter at once")
    try:
        return _compare_flat(opt_a, per_tensor, opt_b, flat, init, state_before)
    except Exception as exc:  # state the comparison cannot read (e.g. dicts of tensors)
        return f"its state cannot be compared per tensor and flat ({type(exc).__name__}: {exc})"


@contextmanager
def _untouched(optimizer):
    """A safety net: fail loudly if probing changed any of the optimizer's real tensors."""
    watched = [(t, tensor_version(t)) for t in _user_tensors(optimizer)]
    try:
        yield
    finally:
        touched = [t for t, version in watched if tensor_version(t) != version]
        if touched:  # the deep copy in _probe_clone should make this impossible
            raise FusionError(
                f"probing {type(optimizer).__name__} modified {len(touched)} of its real tensors (its step "
                "reaches them through something the probe could not copy); fuse_optimizer cannot check "
                "it safely. Fuse it with assume_elementwise=True only if you know its update is elementwise."
            )


def _state_copy(opt, params) -> List[Dict[str, Any]]:
    """Each parameter's state as it is now (tensors copied): what a state was before the last probe
    step, for :func:`_mismatch`'s ``before``."""
    copies = []
    for p in params:
        kept = {}
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                kept[key] = value.detach().clone()
            elif tensor_leaves(value) is not None:  # a container of tensors (AggMo's {beta: buffer})
                try:
                    kept[key] = copy.deepcopy(value)
                except Exception:
                    pass  # (compared without leniency)
        copies.append(kept)
    return copies


def _before(state_before: Dict[str, Any], key: str, path: Tuple = (), like: Optional[torch.Tensor] = None):
    """The value at ``key`` (and ``path`` into a container) of a state before the last step, where
    it existed then with ``like``'s number of elements; else ``None`` (no leniency)."""
    value = state_before.get(key)
    if value is not None and path:
        try:
            value = leaf_at(value, path)
        except Exception:
            return None
    if not isinstance(value, torch.Tensor) or (like is not None and value.numel() != like.numel()):
        return None
    return value.reshape(-1)


def _compare_flat_leaf(key, value: torch.Tensor, pieces, flat, per_tensor, befores=None) -> Optional[str]:
    if value.shape != flat.shape:
        return f"its state '{key}' has shape {tuple(value.shape)}, not the parameter's shape"
    if any(not isinstance(v, torch.Tensor) or v.shape != p.shape for v, p in zip(pieces, per_tensor)):
        return f"its state '{key}' is not shaped like each parameter"
    before = torch.cat(befores) if befores and all(b is not None for b in befores) else None
    return _mismatch(f"state '{key}'", torch.cat([v.reshape(-1) for v in pieces]), _unpadded(value, pieces), before)


def _compare_flat(opt_a, per_tensor, opt_b, flat, init, state_before) -> Optional[str]:
    with torch.no_grad():
        reason = _mismatch("the parameter update", torch.cat([p.reshape(-1) for p in per_tensor]),
                           _unpadded(flat, per_tensor), torch.cat([t.reshape(-1) for t in init]))
        if reason:
            return reason
        flat_state = opt_b.state.get(flat, {})
        keys_a = set().union(*(opt_a.state.get(p, {}).keys() for p in per_tensor))
        if keys_a != set(flat_state):
            return f"it keeps different state keys per tensor ({sorted(keys_a)}) and flat ({sorted(flat_state)})"
        for key, value in flat_state.items():
            pieces = [opt_a.state[p][key] for p in per_tensor]
            leaves = tensor_leaves(value)
            if leaves is not None:  # a container of tensors (AggMo's {beta: buffer}): leaf by leaf
                if any(structure(v) != structure(value) for v in pieces):
                    return f"its state '{key}' holds tensors otherwise per tensor and flat"
                for path, leaf in leaves:
                    own = [leaf_at(v, path) for v in pieces]
                    befores = [_before(b, key, path, v) for b, v in zip(state_before, own)]
                    reason = _compare_flat_leaf(f"{key}{list(path)}", leaf, own, flat, per_tensor, befores)
                    if reason:
                        return reason
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                befores = [_before(b, key, like=v) for b, v in zip(state_before, pieces)]
                reason = _compare_flat_leaf(key, value, pieces, flat, per_tensor, befores)
                if reason:
                    return reason
            else:
                scalar = value.item() if isinstance(value, torch.Tensor) else value
                others = [v.item() if isinstance(v, torch.Tensor) else v for v in pieces]
                if any(o != scalar for o in others):
                    return f"its scalar state '{key}' differs per tensor ({others}) and flat ({scalar})"
    return None


@_keeps_rng
def probe_segmented(
    optimizer: torch.optim.Optimizer, group: Dict[str, Any], device: torch.device,
    template: Optional[torch.Tensor] = None, known_reductions_only: bool = False, first_step_on_runs: bool = False,
    notes: Optional[StepNotes] = None, lone_lists_over_runs: bool = False, ranks: Optional[Tuple[int, ...]] = None,
    size_dims: Tuple[int, ...] = (),
) -> Optional[str]:
    """Return ``None`` if ``optimizer``'s step is exact on segmented runs (``_segmented.py``), else why not.

    ``known_reductions_only``: every reduction must be one the mode combines from partial values
    (as over FSDP2 shards; ``SegmentedMode``). ``first_step_on_runs``: the first step too runs on
    the runs, creating the state there (over shards a first step per parameter would reduce over
    one rank's part only); only where the group has no state yet.

    The same synthetic tensors as :func:`probe_elementwise`, grouped into one run per rank with
    padding between parameters, as the fused step lays them out. The first step runs per
    parameter on views of the runs (optimizers create their state lazily, per parameter), the
    later ones on the runs under :class:`SegmentedMode`; parameters and state must equal the
    per-tensor optimizer's. Seeded, like :func:`probe_elementwise`, with the group's state where it
    has some (``template``'s where given).

    A step that reads a parameter's size along a dimension (``p.size(1)``) is probed again with
    runs cut where that size changes (``size_dims``), as the layout then cuts them.
    """
    generator = torch.Generator().manual_seed(1234)
    init, grads = _synthetic(device, torch.float32, generator)
    if ranks is not None:
        keep = [i for i, t in enumerate(init) if t.dim() in ranks]
        init, grads = [init[i] for i in keep], [[g[i] for i in keep] for g in grads]
    per_tensor = [torch.nn.Parameter(t.clone()) for t in init]
    runs = []  # (proxy, segmentation, indices into the synthetic tensors)
    lengths, tags = set(), Counter()  # the runs of one call differ in shape and in segment scalar shape
    for rank, sizes in sorted({(t.dim(), size_key(t.shape, size_dims)) for t in init}):
        indices = [i for i, t in enumerate(init) if t.dim() == rank and size_key(t.shape, size_dims) == sizes]
        pieces, cursor = [], 0
        for i in indices:
            pieces.append((cursor, cursor + init[i].numel(), init[i].shape))
            cursor += init[i].numel() + _PADDING
        while (rank, cursor) in lengths:
            cursor += 1
        lengths.add((rank, cursor))
        tags[len(pieces)] += 1
        seg = Segmentation(run_shape(rank, cursor), pieces, tag=tags[len(pieces)] - 1)
        flat = torch.zeros(cursor, device=device)
        for (start, end, _), i in zip(pieces, indices):
            flat[start:end] = init[i].reshape(-1)
        runs.append((torch.nn.Parameter(flat.view(seg.shape)), seg, indices))
    views = [None] * len(init)  # parameters sharing memory with the runs, for the first step
    for proxy, seg, indices in runs:
        for view, i in zip(segment_views(proxy.detach(), seg), indices):
            views[i] = torch.nn.Parameter(view)
    try:
        opt_a = _probe_clone(optimizer, group, per_tensor)
        opt_b = _probe_clone(optimizer, group, [proxy for proxy, _, _ in runs] if first_step_on_runs else views)
    except ProbeCopyError as exc:
        return f"it cannot be copied to be probed on synthetic tensors ({exc})"
    per_param, _ = _seed_pieces(optimizer, group, per_tensor, generator, template)  # the group's state, if any
    if first_step_on_runs and per_param:
        return "the group has state already (its first step is behind it)"
    for p, view, state in zip(per_tensor, views, per_param or ()):
        opt_a.state[p] = state
        opt_b.state[view] = {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}
    step = type(optimizer).step
    closure = _Closure()
    cut_by = None  # a dimension whose size the step reads, which the runs' parameters do not share
    with _untouched(optimizer):
        try:
            for n, step_grads in enumerate(grads):
                for p, g in zip(per_tensor, step_grads):
                    p.grad = g.clone()
                if n == len(grads) - 1:
                    state_before = _state_copy(opt_a, per_tensor)
                with _replayed_rng(device):
                    closure.step(step, opt_a, n)
                if n == 0 and not first_step_on_runs:
                    for v, g in zip(views, step_grads):
                        v.grad = g.clone()
                    closure.step(step, opt_b, n)
                    reason = _pack_runs(opt_b, views, runs)
                    if reason:
                        return reason
                    continue
                for proxy, seg, indices in runs:
                    flat_grad = torch.zeros(seg.length, device=device)
                    for (start, end, _), i in zip(seg.pieces, indices):
                        flat_grad[start:end] = step_grads[i].reshape(-1)
                    proxy.grad = flat_grad.view(seg.shape)
                with SegmentedMode([seg for _, seg, _ in runs], known_reductions_only=known_reductions_only,
                                   lone_lists_over_runs=lone_lists_over_runs, notes=notes):
                    closure.step(step, opt_b, n)
        except SizesDisagree as exc:
            if exc.dim in size_dims:
                return f"its step raised {type(exc).__name__} on segmented synthetic tensors ({exc})"
            cut_by = exc.dim
        except Exception as exc:  # NotSegmentable, or anything else: the probe reports
            return f"its step raised {type(exc).__name__} on segmented synthetic tensors ({exc})"
    if cut_by is not None:  # probed again on runs cut where that size changes
        return probe_segmented(optimizer, group, device, template, known_reductions_only, first_step_on_runs, notes,
                               lone_lists_over_runs, ranks, size_dims + (cut_by,))
    reason = closure.reevaluates()
    if reason:
        return reason
    try:
        return _compare_segmented(opt_a, per_tensor, opt_b, runs, init, state_before)
    except Exception as exc:
        return f"its state cannot be compared per parameter and segmented ({type(exc).__name__}: {exc})"


def _pack_runs(opt, views, runs) -> Optional[str]:
    """Move the per-parameter state the first step created onto the runs (as the planner does)."""
    state = opt.state
    for proxy, seg, indices in runs:
        members = [views[i] for i in indices]
        first = state.get(members[0], {})
        packed: Dict[str, Any] = {}
        for key, value in first.items():
            values = [state.get(m, {}).get(key) for m in members]
            kind = state_kind(value, members[0].shape)
            if kind == "flat":
                flat = torch.zeros(seg.length, dtype=value.dtype, device=value.device)
                for (start, end, _), v in zip(seg.pieces, values):
                    flat[start:end] = v.reshape(-1)
                packed[key] = flat.view(seg.shape)
            elif kind == "scalar":
                packed[key] = torch.stack([v.reshape(()) for v in values]).reshape(seg.scalar_shape)
            elif kind == "other":
                return f"its state '{key}' is neither shaped like the parameter nor one value"
            elif any(v != value for v in values):
                return f"its state '{key}' differs between parameters that are stepped together"
            else:
                packed[key] = value
        for m in members:
            state.pop(m, None)
        state[proxy] = packed
    opt.param_groups[0]["params"] = [proxy for proxy, _, _ in runs]
    return None


def _compare_segmented(opt_a, per_tensor, opt_b, runs, init, state_before) -> Optional[str]:
    with torch.no_grad():
        for proxy, seg, indices in runs:
            got = segment_views(proxy.detach(), seg)
            for view, i in zip(got, indices):
                reason = _mismatch("the parameter update", per_tensor[i].reshape(-1), view.reshape(-1), init[i].reshape(-1))
                if reason:
                    return reason
            run_state = opt_b.state.get(proxy, {})
            for i_pos, i in enumerate(indices):
                expected = opt_a.state.get(per_tensor[i], {})
                if set(expected) != set(run_state):
                    return f"it keeps different state keys per tensor ({sorted(expected)}) and segmented ({sorted(run_state)})"
                for key, value in run_state.items():
                    want = expected[key]
                    if isinstance(value, torch.Tensor) and tuple(value.shape) == seg.shape:
                        have = segment_views(value, seg)[i_pos]
                    elif isinstance(value, torch.Tensor) and tuple(value.shape) == seg.scalar_shape:
                        have = value.reshape(-1)[i_pos]
                    else:
                        have = value
                    if isinstance(want, torch.Tensor) or isinstance(have, torch.Tensor):
                        if not (isinstance(want, torch.Tensor) and isinstance(have, torch.Tensor)):
                            return f"its state '{key}' is a tensor on one side only"
                        if want.numel() != have.numel():
                            return f"its state '{key}' has {have.numel()} values segmented, {want.numel()} per tensor"
                        reason = _mismatch(f"state '{key}'", want.reshape(-1), have.reshape(-1),
                                           _before(state_before[i], key, like=want))
                        if reason:
                            return reason
                    elif want != have:
                        return f"its state '{key}' differs per tensor ({want}) and segmented ({have})"
    return None


@_keeps_rng
def probe_empty_group(optimizer: torch.optim.Optimizer, group: Dict[str, Any], device: torch.device) -> Optional[str]:
    """Return ``None`` if ``optimizer``'s step runs with a group none of whose parameters has a
    gradient, else why not. A fused step split over several calls of the optimizer's step (runs
    that only their place tells apart) hands each call some groups without a parameter; a step
    written with ``torch.stack`` over the group's gradients fails there (as it would unfused on a
    group whose parameters all lack gradients)."""
    try:
        clone = _probe_clone(optimizer, group, [torch.nn.Parameter(torch.ones(3, device=device))])
    except ProbeCopyError as exc:
        return f"it cannot be copied to be probed ({exc})"
    with _untouched(optimizer):
        try:
            _Closure().step(type(optimizer).step, clone, 0)
        except Exception as exc:
            return f"its step fails on a group whose parameters have no gradient ({type(exc).__name__}: {exc})"
    return None


@_keeps_rng
def probe_per_tensor_calls(
    optimizer: torch.optim.Optimizer, group: Dict[str, Any], device: torch.device
) -> Optional[str]:
    """Return ``None`` if calling ``optimizer``'s step once per parameter equals one ordinary call, else why not.

    The compiled per-tensor path (``_per_tensor.py``) runs the step with one parameter in its
    group at a time and puts the group's settings and optimizer-level state back between calls.
    That is exact unless the step adds bookkeeping up over the parameters of a call, or its
    update of one parameter depends on another. Checked here on the synthetic tensors, with
    parameters of every rank, over three steps: parameters, state, group settings and
    optimizer-level state must equal the ordinary step's.
    """
    from ._per_tensor import per_parameter_calls

    generator = torch.Generator().manual_seed(4321)
    init, grads = _synthetic(device, torch.float32, generator)
    whole = [torch.nn.Parameter(t.clone()) for t in init]
    split = [torch.nn.Parameter(t.clone()) for t in init]
    try:
        opt_a = _probe_clone(optimizer, group, whole)
        opt_b = _probe_clone(optimizer, group, split)
    except ProbeCopyError as exc:
        return f"it cannot be copied to be probed on synthetic tensors ({exc})"
    step = type(optimizer).step
    with _untouched(optimizer):
        try:
            for step_grads in grads:
                for a, b, g in zip(whole, split, step_grads):
                    a.grad, b.grad = g.clone(), g.clone()
                step(opt_a)
                per_parameter_calls(opt_b, [split], lambda p, alone: alone(p) or step(opt_b))
        except Exception as exc:
            return f"its step raised {type(exc).__name__} when called per parameter ({exc})"
    try:
        with torch.no_grad():
            for i, (a, b) in enumerate(zip(whole, split)):
                reason = _mismatch(f"parameter {i}'s update", a.reshape(-1), b.reshape(-1), init[i].reshape(-1))
                if reason:
                    return reason + " when stepped alone"
                state_a, state_b = opt_a.state.get(a, {}), opt_b.state.get(b, {})
                if set(state_a) != set(state_b):
                    return f"its state keys differ when a parameter is stepped alone ({sorted(state_b)})"
                for key, value in state_a.items():
                    reason = _same_value(f"state '{key}'", value, state_b[key])
                    if reason:
                        return reason + " when stepped alone"
            settings_a = {k: v for k, v in opt_a.param_groups[0].items() if k != "params"}
            settings_b = {k: v for k, v in opt_b.param_groups[0].items() if k != "params"}
            for key in set(settings_a) | set(settings_b):
                reason = _same_value(f"group setting '{key}'", settings_a.get(key), settings_b.get(key))
                if reason:
                    return reason + " when parameters are stepped one at a time (it counts per parameter)"
            globals_a = {k: v for k, v in opt_a.state.items() if not isinstance(k, torch.Tensor)}
            globals_b = {k: v for k, v in opt_b.state.items() if not isinstance(k, torch.Tensor)}
            for key in set(globals_a) | set(globals_b):
                reason = _same_value(f"optimizer state '{key}'", globals_a.get(key), globals_b.get(key))
                if reason:
                    return reason + " when parameters are stepped one at a time (it counts per parameter)"
    except Exception as exc:
        return f"its state cannot be compared when stepped per parameter ({type(exc).__name__}: {exc})"
    return None


def _same_value(name: str, a: Any, b: Any) -> Optional[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return f"{name} differs in kind or shape"
        return _mismatch(name, a.reshape(-1), b.reshape(-1))
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{name} has different keys"
        for key in a:
            reason = _same_value(f"{name}['{key}']", a[key], b[key])
            if reason:
                return reason
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{name} has different lengths"
        for i, (x, y) in enumerate(zip(a, b)):
            reason = _same_value(f"{name}[{i}]", x, y)
            if reason:
                return reason
        return None
    try:
        return None if a == b else f"{name} is {b!r}, not {a!r}"
    except Exception:  # values that cannot be compared
        return f"{name} cannot be compared"
