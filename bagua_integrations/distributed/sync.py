"""Making ranks agree: same model everywhere, same starting weights, same weights after a switch."""

from __future__ import annotations

import difflib
import hashlib
import pickle
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from .._flat import pack_tensors
from . import comm
from .errors import ModelMismatchError

__all__ = [
    "broadcast_parameters",
    "allreduce_parameters",
    "allreduce_optimizer_state",
    "check_same_on_all_ranks",
    "gather_states",
    "describe_model",
    "describe_parameters",
]


def _broadcast(flat: torch.Tensor, src: int, group) -> comm.Stages:
    yield comm.broadcast(flat, src, group)


def _run_all(stages: List[comm.Stages], what: str, timeout) -> None:
    pendings = [comm.Pending(s, f"{what} {i + 1}/{len(stages)}", timeout) for i, s in enumerate(stages)]
    for pending in pendings:
        pending.wait()


def _broadcast_tensors(tensors, src: int, group, what: str, timeout) -> None:
    pack = pack_tensors(tensors)
    if not pack.tensors:
        return
    flats = pack.gather()
    _run_all([_broadcast(flat, src, group) for flat in flats], what, timeout)
    pack.scatter()


def broadcast_parameters(
    module: torch.nn.Module, broadcast_buffers: bool = True, *, src: int = 0, group=None, timeout=None
) -> None:
    """Copy rank ``src``'s parameters (and buffers) to every rank, a few flat tensors at a time.

    Run at ``bagua_init`` so that all replicas start identical. No-op without a process group.
    """
    if not comm.is_distributed(group):
        return
    tensors = [p.detach() for p in module.parameters()]
    if broadcast_buffers:
        tensors += [b for b in module.buffers()]
    _broadcast_tensors(tensors, src, group, "parameter broadcast", timeout)


def broadcast_buffers(module: torch.nn.Module, *, src: int = 0, group=None, timeout=None) -> None:
    """Copy rank ``src``'s buffers (BatchNorm statistics, ...) to every rank."""
    if comm.is_distributed(group):
        _broadcast_tensors(list(module.buffers()), src, group, "buffer broadcast", timeout)


def allreduce_parameters(module: torch.nn.Module, *, group=None, timeout=None) -> None:
    """Average parameters and floating-point buffers over ranks (integer buffers come from rank 0).

    Used when switching algorithms, so that ranks whose weights drifted apart (decentralized,
    bmuf) restart from one consistent model.
    """
    if not comm.is_distributed(group):
        return
    floating = [p.detach() for p in module.parameters()] + [b for b in module.buffers() if b.is_floating_point()]
    pack = pack_tensors(floating)
    if pack.tensors:
        flats = pack.gather()
        _run_all([comm.average(flat, group) for flat in flats], "parameter averaging", timeout)
        pack.scatter()
    integers = [b for b in module.buffers() if not b.is_floating_point()]
    if integers:
        _broadcast_tensors(integers, comm.group_ranks(group)[0], group, "integer buffer broadcast", timeout)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every parameter-shaped floating state tensor (Adam's moments, SGD's momentum), not step counts."""
    return [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.is_floating_point()
    ]


def allreduce_optimizer_state(optimizer: torch.optim.Optimizer, *, group=None, timeout=None, join=None) -> None:
    """Average the optimizer's parameter-shaped state over ranks (each divided first, then summed).

    ``join`` (a :class:`~bagua_integrations.distributed.join.JoinState`, under ``Join``):
    average over the ranks that still have data; a joined rank receives that average.
    """
    if not comm.is_distributed(group):
        return
    pack = pack_tensors(optimizer_state_tensors(optimizer))
    if pack.tensors:
        flats = pack.gather()
        if join is not None:
            for flat in flats:
                join.contribute(flat)
        _run_all([comm.average(flat, group) for flat in flats], "optimizer state averaging", timeout)
        pack.scatter()


def describe_model(module: torch.nn.Module) -> List[str]:
    """One line per parameter and buffer: what must be identical on every rank."""
    lines = [
        f"param {name} {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}"
        for name, p in module.named_parameters()
    ]
    lines += [f"buffer {name} {tuple(b.shape)} {b.dtype}" for name, b in module.named_buffers()]
    return lines


def describe_parameters(params) -> List[str]:
    """One line per tensor, for callers that have parameters but no module (fairseq's optimizer)."""
    return [f"param {i} {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}" for i, p in enumerate(params)]


def _digest(lines: List[str]) -> int:
    raw = hashlib.sha256("\n".join(lines).encode()).digest()[:8]
    return int.from_bytes(raw, "little", signed=True)


def check_same_on_all_ranks(lines: List[str], what: str, *, group=None, timeout=None) -> None:
    """Raise :class:`ModelMismatchError` on every rank unless all ranks pass the same ``lines``.

    A fixed-size digest is compared first (so ranks with different models still run the
    same collective); only on a mismatch are the descriptions gathered to say what differs.
    """
    if not comm.is_distributed(group):
        return
    digests = _all_gather_int(_digest(lines), group, timeout, f"{what} consistency check")
    if all(d == digests[0] for d in digests):
        return
    blobs = _all_gather_bytes(pickle.dumps(lines), group, timeout, f"{what} descriptions")
    everyone: List[List[str]] = [pickle.loads(blob) for blob in blobs]
    ranks = comm.group_ranks(group)
    details = []
    for index, other in enumerate(everyone):
        if digests[index] != digests[0]:
            unified = difflib.unified_diff(everyone[0], other, f"rank {ranks[0]}", f"rank {ranks[index]}", lineterm="", n=0)
            diff = [line for line in unified if not line.startswith("@@")]
            details.append("\n".join(diff[:12]) + ("\n..." if len(diff) > 12 else ""))
    raise ModelMismatchError(
        f"the {what} differs between ranks (rank {comm.rank()} stops here, and so does every other rank):\n"
        + "\n".join(details)
        + "\nBuild the same model, optimizer (fused or not, same parameter groups) and algorithm with the "
        "same arguments on every rank before calling bagua_init / switch_to."
    )


# ---------------------------------------------------------------------- every rank's state on one rank
@dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor was in a state: its index in the flat list, its shape and dtype."""

    index: int
    shape: tuple
    dtype: torch.dtype


def _without_tensors(obj: Any, tensors: List[torch.Tensor]) -> Any:
    """``obj`` (dicts, lists, tuples of anything) with each tensor replaced by a :class:`_TensorSlot`."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {key: _without_tensors(value, tensors) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_without_tensors(value, tensors) for value in obj)
    return obj


def _with_tensors(obj: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {key: _with_tensors(value, tensors) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_with_tensors(value, tensors) for value in obj)
    return obj


def _slots(obj: Any) -> List[_TensorSlot]:
    """The :class:`_TensorSlot` s of a layout, in tensor order."""
    if isinstance(obj, _TensorSlot):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    found = [slot for value in values for slot in _slots(value)]
    return sorted(found, key=lambda slot: slot.index)


def _all_gather_int(value: int, group, timeout, what: str) -> List[int]:
    """Every rank's ``value`` (one int64 each), with the package's timeout and stall warning."""
    device = comm.small_tensor_device(group)
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    gathered = torch.empty(comm.world_size(group), dtype=torch.int64, device=device)

    def stages():
        yield comm.all_gather(gathered, mine, group)

    comm.run(stages(), what, timeout)
    return [int(v) for v in gathered.tolist()]


def _all_gather_bytes(blob: bytes, group, timeout, what: str) -> List[bytes]:
    """Every rank's ``blob`` (of any length), with the package's timeout and stall warning."""
    size = comm.world_size(group)
    device = comm.small_tensor_device(group)
    counts = _all_gather_int(len(blob), group, timeout, f"{what} (sizes)")
    longest = max(counts)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if blob:
        mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    mine = mine.to(device)
    everyone = torch.empty(size * longest, dtype=torch.uint8, device=device)

    def blobs():
        yield comm.all_gather(everyone, mine, group)

    comm.run(blobs(), f"{what} (bytes)", timeout)
    raw = everyone.cpu().numpy().tobytes()
    return [raw[i * longest : i * longest + counts[i]] for i in range(size)]


def gather_states(state: Any, *, dst: int = 0, group=None, timeout=None, what: str = "state gather") -> Optional[List[Any]]:
    """Every rank's ``state`` (nested dicts / lists / tuples holding tensors) on rank ``dst`` of ``group``.

    Returns the list of states by group rank on ``dst`` (its own entry is ``state`` itself) and
    None on the other ranks; ``[state]`` without a process group. A collective: call it on every
    rank. Ranks may hold different structures and tensor sizes. The layouts (small, pickled) go to
    every rank; the tensors travel as one flat tensor per dtype, gathered on ``dst`` only, so only
    ``dst`` needs memory for everyone's tensors. Received tensors are views of those flat
    tensors, on the backend's device (CPU for gloo). Every collective has the ``timeout`` and
    the stall warning of the rest of the package (no ``all_gather_object`` that could wait forever).
    """
    if not comm.is_distributed(group):
        return [state]
    tensors: List[torch.Tensor] = []
    layout = _without_tensors(state, tensors)
    layouts = [pickle.loads(b) for b in _all_gather_bytes(pickle.dumps(layout), group, timeout, what)]
    rank_slots = [_slots(other) for other in layouts]
    dtypes = sorted({slot.dtype for slots in rank_slots for slot in slots}, key=str)
    device = comm.small_tensor_device(group)
    me = comm.rank(group)
    root = comm.group_ranks(group)[dst]
    size = comm.world_size(group)
    received: Dict[torch.dtype, List[torch.Tensor]] = {}
    for dtype in dtypes:
        numels = [sum(_numel(s.shape) for s in slots if s.dtype == dtype) for slots in rank_slots]
        longest = max(numels)
        if longest == 0:
            continue
        flat = torch.zeros(longest, dtype=dtype, device=device)
        mine = [t.reshape(-1) for t in tensors if t.dtype == dtype]
        if mine:
            torch.cat([t.to(device) for t in mine], out=flat[: numels[me]])
        outputs = [torch.empty(longest, dtype=dtype, device=device) for _ in range(size)] if me == dst else None

        def stages(flat=flat, outputs=outputs):
            yield comm.gather(flat, outputs, root, group)

        comm.run(stages(), f"{what} ({dtype})", timeout)
        if outputs is not None:
            received[dtype] = outputs
    if me != dst:
        return None
    states: List[Any] = []
    for rank, (other, slots) in enumerate(zip(layouts, rank_slots)):
        if rank == me:
            states.append(state)
            continue
        offsets = {dtype: 0 for dtype in dtypes}
        values: List[Optional[torch.Tensor]] = [None] * len(slots)
        for slot in slots:
            n = _numel(slot.shape)
            start = offsets[slot.dtype]
            values[slot.index] = received[slot.dtype][rank][start : start + n].view(slot.shape) if n else torch.empty(
                slot.shape, dtype=slot.dtype, device=device)
            offsets[slot.dtype] = start + n
        states.append(_with_tensors(other, values))
    return states


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
