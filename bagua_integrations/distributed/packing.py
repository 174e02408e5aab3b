"""Parameters seen as a few flat tensors, so one collective moves many of them.

When the parameters already lie back to back in one storage (a fused optimizer's flat
buffer) the flat tensor is a view of it and nothing is copied; otherwise the values are
gathered into a private flat copy and scattered back after communicating.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch

__all__ = ["ParamPack", "shared_flat_view"]

_ALIGN_BYTES = 64  # the fused optimizer aligns slots to 64 bytes: smaller gaps hold no tensor


def shared_flat_view(tensors: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """A 1-D view covering exactly ``tensors`` (plus alignment padding between them), if they
    lie back to back in one storage, as a fused optimizer's parameters and gradients do."""
    first = tensors[0]
    storage = first.untyped_storage()
    per = max(1, _ALIGN_BYTES // first.element_size())
    ordered = sorted(tensors, key=lambda t: t.storage_offset())
    for t in ordered:
        if (
            t.untyped_storage().data_ptr() != storage.data_ptr()
            or t.dtype != first.dtype
            or t.layout != torch.strided
            or not t.is_contiguous()
        ):
            return None
    for before, after in zip(ordered, ordered[1:]):
        gap = after.storage_offset() - (before.storage_offset() + before.numel())
        if gap < 0 or gap >= per:
            return None
    start = ordered[0].storage_offset()
    length = ordered[-1].storage_offset() + ordered[-1].numel() - start
    flat = torch.empty(0, dtype=first.dtype, device=first.device)
    flat.set_(storage, start, (length,))
    return flat


def _dedup(tensors: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class _Chunk:
    """Same-device, same-dtype tensors and their flat form."""

    def __init__(self, tensors: List[torch.Tensor]):
        self.tensors = tensors
        self.numel = sum(t.numel() for t in tensors)
        self.view = self._shared_view()
        self._copy: Optional[torch.Tensor] = None

    def _shared_view(self) -> Optional[torch.Tensor]:
        flat = shared_flat_view(self.tensors)
        if flat is not None:
            self._expected = [(t, t.data_ptr()) for t in self.tensors]
        return flat

    def _view_still_valid(self) -> bool:
        return self.view is not None and all(t.data_ptr() == ptr for t, ptr in self._expected)

    def gather(self) -> torch.Tensor:
        if self._view_still_valid():
            return self.view
        self.view = None  # someone replaced a tensor's storage: copy from now on
        if self._copy is None:
            first = self.tensors[0]
            self._copy = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        offset = 0
        with torch.no_grad():
            for t in self.tensors:
                self._copy[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
                offset += t.numel()
        return self._copy

    def scatter(self) -> None:
        if self.view is not None:
            return
        offset = 0
        with torch.no_grad():
            for t in self.tensors:
                t.detach().copy_(self._copy[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


class ParamPack:
    """Tensors grouped by (device, dtype) into flat tensors: ``gather`` reads, ``scatter`` writes back.

    ``flats = pack.gather()``; modify ``flats`` in place; ``pack.scatter()``.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]):
        self.tensors = _dedup(t for t in tensors if t.numel() > 0)
        by_key = {}
        for t in self.tensors:
            by_key.setdefault((t.device, t.dtype), []).append(t)
        self.chunks = [_Chunk(members) for members in by_key.values()]

    @property
    def zero_copy(self) -> bool:
        return all(chunk.view is not None for chunk in self.chunks)

    def gather(self) -> List[torch.Tensor]:
        return [chunk.gather() for chunk in self.chunks]

    def scatter(self) -> None:
        for chunk in self.chunks:
            chunk.scatter()

    def same_tensors(self, tensors: Iterable[torch.Tensor]) -> bool:
        return [id(t) for t in _dedup(t for t in tensors if t.numel() > 0)] == [id(t) for t in self.tensors]
