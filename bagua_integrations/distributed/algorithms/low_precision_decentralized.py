"""``low_precision_decentralized``: ring model averaging that sends uint8-quantized weight differences.

Bagua's low-precision decentralized algorithm, in the order of CHOCO-SGD (Koloskova et al. 2019,
"Decentralized Stochastic Optimization and Gossip Algorithms with Compressed Communication"; the
compressed-difference scheme of Tang et al. 2018's DCD-PSGD). The ranks form a ring. Each rank keeps
three *public copies*: its own ``x̂`` (what its neighbours believe its weights are) and those of its
left and right neighbours. After every ``communication_interval`` optimizer steps each rank

1. quantizes the difference between its weights (after the local step) and its public copy,
   ``q = Q(x - x̂)`` (min-max uint8 per chunk of :data:`CHUNK` elements, as ``bytegrad``), sends
   ``q`` to both neighbours and receives theirs;
2. applies every difference to the matching public copy (``x̂ += Q⁻¹(q)``, the same on the sender
   and its two receivers, so public copies agree bit for bit across ranks);
3. moves its weights by the gossip step ``x += (x̂_left + x̂_right - 2 x̂) / 3`` (ring weights 1/3).

Without quantization the public copies equal the weights and step 3 is the ring average of the
weights *after* the local steps, so every local update counts in full. (Mixing the current weights
with the neighbours' copies from the previous round, the earlier form here, counted each rank's
new update at 1/3: on 2 ranks training ran at a third of its learning rate and BERT stayed at
chance.) On the wire: one byte per element plus 8 bytes per chunk, to each of two neighbours,
instead of 4 bytes per element. The public copies are per-rank state: checkpoints carry them. On 2
ranks both neighbours are one rank, and its two copies are kept as one tensor (always equal there).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .. import comm
from ..errors import AlgorithmConfigError, CheckpointError
from .base import ModelAlgorithm
from .bytegrad import WORD_BYTES, MinMaxUInt8, _as_words, _decode_blocks, _kernel
from .registry import register_algorithm

__all__ = ["LowPrecisionDecentralized", "CHUNK"]

CHUNK = 1024  # elements quantized with one min/max pair


def ring_neighbours(rank: int, size: int):
    """(left, right) of ``rank`` in a ring of ``size`` (the same rank twice when ``size == 2``)."""
    return (rank - 1) % size, (rank + 1) % size


def _finish_round(flat, own, left_copy, right_copy, mine, from_left, from_right, levels: int):
    """Each public copy moves by the difference its owner sent, then the gossip step: one pass
    over the weights and the three copies when compiled; the eager form runs the same operations
    in the same order (so ranks that compiled and ranks that did not keep equal copies). Whole
    blocks: the weights and copies as ``(blocks, 4, CHUNK / 4)``, the encoded rows as float32
    views of their bytes ``(blocks, 2 + CHUNK / 4)`` (see :class:`MinMaxUInt8`)."""
    for public_copy, packed in ((own, mine), (left_copy, from_left), (right_copy, from_right)):
        public_copy.add_(_decode_blocks(packed, False, levels).to(public_copy.dtype))
    flat.add_(torch.add(left_copy, right_copy).sub_(own, alpha=2).div_(3))


def _finish_round_with_one_neighbour(flat, own, neighbour_copy, mine, from_neighbour, levels: int):
    """:func:`_finish_round` on 2 ranks, where the left and the right neighbour are one rank and its
    two public copies are one tensor: ``left + right`` is ``neighbour + neighbour``, the same bits,
    with a quarter less data read and written and one decode fewer."""
    for public_copy, packed in ((own, mine), (neighbour_copy, from_neighbour)):
        public_copy.add_(_decode_blocks(packed, False, levels).to(public_copy.dtype))
    flat.add_(torch.add(neighbour_copy, neighbour_copy).sub_(own, alpha=2).div_(3))


def _finish_round_in_blocks(kernel, tensors, encoded, levels: int) -> None:
    """``kernel`` (:func:`_finish_round` or :func:`_finish_round_with_one_neighbour`) over 1-D
    ``tensors`` (weights, then public copies) of any length: the whole blocks through it, the last partial one eagerly, padded with zeros
    (the same operations on each element: the same bits)."""
    n, quarter = tensors[0].numel(), CHUNK // WORD_BYTES
    rows = [_as_words(t).view(-1, 2 + quarter) for t in encoded]
    full = n // CHUNK
    if full:
        kernel(*(t[: full * CHUNK].view(full, WORD_BYTES, quarter) for t in tensors), *(r[:full] for r in rows), levels)
    if full * CHUNK < n:
        padded = [torch.zeros(CHUNK, dtype=t.dtype, device=t.device) for t in tensors]
        for pad, t in zip(padded, tensors):
            pad[: n - full * CHUNK] = t[full * CHUNK:]
        kernel.fn(*(pad.view(1, WORD_BYTES, quarter) for pad in padded), *(r[full:full + 1] for r in rows), levels)
        for pad, t in zip(padded, tensors):
            t[full * CHUNK:] = pad[: n - full * CHUNK]


@register_algorithm("low_precision_decentralized")
class LowPrecisionDecentralized(ModelAlgorithm):
    """Ring averaging with uint8-quantized differences (see the module docstring).

    Args:
        communication_interval: communicate after every this many optimizer steps.
        hierarchical: not supported (the ring runs over all ranks); ``None``/``False`` only.
        timeout: how long to wait for a neighbour before raising ``CommunicationError``.
    """

    name = "low_precision_decentralized"
    #: weights per message (a multiple of :data:`CHUNK`): a round goes out in pieces, each sent and
    #: finished on its own, so that quantizing and applying one piece overlaps the next one's
    #: transfer. One message of the whole model stalled a 1 Gbit/s link (2 ranks, 24 MB of weights:
    #: 0.57x of DDP's step time; 0.40x in pieces of 2**21, 0.36-0.39x of 2**20, which cost ~3 ms
    #: more a step on an unshaped link). The pieces do not change a bit: they split at block edges.
    piece_elements = 2**21

    def __init__(self, communication_interval: int = 1, hierarchical: Optional[bool] = None, timeout=None):
        super().__init__(hierarchical, timeout)
        if (isinstance(communication_interval, bool) or not isinstance(communication_interval, int)
                or communication_interval < 1):
            raise AlgorithmConfigError(f"communication_interval must be an integer >= 1, got {communication_interval!r}")
        self.communication_interval = communication_interval
        self.codec = MinMaxUInt8(block=CHUNK)
        self.public: List[List[torch.Tensor]] = []  # per flat: [own, left, right]
        self._copies_checked_for: Optional[int] = None  # the world size _share_one_neighbours_copies saw

    def hyperparameters(self):
        return dict(super().hyperparameters(), communication_interval=self.communication_interval)

    def validate_hierarchy(self) -> None:
        if self.hierarchical:
            raise AlgorithmConfigError(
                "low_precision_decentralized runs one ring over all ranks; pass hierarchical_reduce=False (or None)")

    def on_attach(self) -> None:
        # bagua_init broadcasts rank 0's weights before attach: every public copy starts equal everywhere
        self.public = [[flat.clone() for _ in range(3)] for flat in self.pack.gather()]
        self._copies_checked_for = None

    def weights_loaded(self) -> None:
        if self.pack is not None and not self.restored:
            self.on_attach()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self):
        """The update counter and the three public copies (own, left, right), per parameter."""
        state = super().state_dict()
        for index, key in enumerate(("public_own", "public_left", "public_right")):
            state[key] = [t.clone() for t in self._per_tensor([copies[index] for copies in self.public])]
        return state

    @torch.no_grad()
    def restore(self, state) -> None:
        super().restore(state)
        self._unshare_neighbour_copies()  # two copies again, as saved (shared again if they are equal)
        for index, key in enumerate(("public_own", "public_left", "public_right")):
            saved = state.get(key)
            if saved is None:
                continue
            tensors = self._per_tensor([copies[index] for copies in self.public])
            if len(saved) != len(tensors) or any(a.shape != b.shape for a, b in zip(saved, tensors)):
                raise CheckpointError(
                    f"{self.name}'s checkpointed {key} do not match the attached parameters: resume with the "
                    "model the checkpoint was saved from")
            for mine, theirs in zip(tensors, saved):
                mine.copy_(theirs)

    # ------------------------------------------------------------------ one round
    def _round(self, flat: torch.Tensor, copies: List[torch.Tensor], group):
        own, left_copy, right_copy = copies
        # one row: blocks of CHUNK elements; fp32 weights: the difference is made as the encoder reads
        # (other dtypes: made in theirs, then encoded, as the reference does)
        mine = (self.codec.encode_chunks(flat, 1, minus=own) if flat.dtype == torch.float32
                else self.codec.encode_chunks(flat - own, 1))
        size, me = comm.world_size(group), comm.group_ranks(group).index(comm.rank())
        left, right = ring_neighbours(me, size)
        ranks = comm.group_ranks(group)
        from_left = torch.empty_like(mine)
        if size == 2:  # the one neighbour is both
            yield comm.exchange(mine, from_left, ranks[left], group)
            if left_copy.data_ptr() == right_copy.data_ptr():  # its copies are one tensor (see update)
                _finish_round_in_blocks(
                    _kernel(_finish_round_with_one_neighbour, self.codec.decode_compile(flat.device), False),
                    (flat, own, left_copy), (mine, from_left), self.codec.levels)
                return
            from_right = from_left
        else:
            from_right = torch.empty_like(mine)
            yield comm.ring_exchange(mine, from_left, from_right, ranks[left], ranks[right], group)
        # decodes: the public copies must get the same bits on every rank, compiled or not
        _finish_round_in_blocks(_kernel(_finish_round, self.codec.decode_compile(flat.device), False),
                                (flat, own, left_copy, right_copy), (mine, from_left, from_right), self.codec.levels)

    def _pieces(self, flat: torch.Tensor, copies: List[torch.Tensor]):
        """``(piece of flat, the same piece of each public copy)``, cut at block edges."""
        length = max(CHUNK, self.piece_elements // CHUNK * CHUNK)
        for start in range(0, flat.numel(), length):
            end = min(start + length, flat.numel())
            yield flat[start:end], [public_copy[start:end] for public_copy in copies]

    @torch.no_grad()
    def _share_one_neighbours_copies(self, group) -> None:
        """On 2 ranks the left and the right neighbour are one rank, and the two public copies of it
        are equal bit for bit (the same start, the same differences): they become one tensor, which
        each round updates once (24 MB less memory for 24 MB of weights, a quarter less traffic).
        Checked once after attaching or restoring (copies restored unequal stay two), and again if
        a round runs over a group of another size (there the copies are two tensors again)."""
        size = comm.world_size(group)
        if size == self._copies_checked_for:
            return
        self._unshare_neighbour_copies()
        self._copies_checked_for = size
        if size == 2:
            for copies in self.public:
                if torch.equal(copies[1], copies[2]):
                    copies[2] = copies[1]

    def _unshare_neighbour_copies(self) -> None:
        for copies in self.public:
            if copies[2] is copies[1]:
                copies[2] = copies[1].clone()
        self._copies_checked_for = None

    def update(self, step: int, group) -> bool:
        if not comm.is_distributed(group) or step % self.communication_interval:
            return False
        flats = self.pack.gather()
        self._share_one_neighbours_copies(group)
        with torch.no_grad():
            self.run([self._round(piece, copies_of_piece, group) for flat, copies in zip(flats, self.public)
                      for piece, copies_of_piece in self._pieces(flat, copies)],
                     "low-precision ring averaging")
        self.pack.scatter()
        return True
