"""``bytegrad``: gradients travel as uint8, min-max quantized per chunk (about 1/4 of fp32 bytes)."""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from ..._compile import AUTO_MIN_ELEMENTS, CompiledFunction
from ..._torch_compat import compiled_kernels_may_fuse_multiply_add
from .. import comm
from ..errors import AlgorithmConfigError
from .base import GradientAlgorithm
from .registry import register_algorithm

__all__ = ["ByteGrad", "MinMaxUInt8", "BLOCK"]

BLOCK = 1024  # elements that share one min/max pair (8 bytes of header: 0.8 % more on the wire)


def _encode_parts(rows: torch.Tensor, zero_exact: bool, levels: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(r, n) float32 -> each row's header as two float32 ``(r, 2)``, a byte per element ``(r, n)``,
    and each row's scale ``(r, 1)``: returned from a compiled encoder, it is kept in a buffer, so the
    quantizing loop reads it instead of dividing again for every 16 codes (7 % faster on CPU)."""
    lo = rows.amin(dim=1, keepdim=True)
    hi = rows.amax(dim=1, keepdim=True)
    if zero_exact:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    span = hi - lo
    scale = torch.where(span > 0, levels / span, torch.zeros_like(span))
    if zero_exact:
        zero = (-lo * scale).round()
        # never below 0 (rounding is odd, so round(x * scale) >= round(lo * scale) == -zero); above
        # ``levels`` where both halves of the range round up: clamped as whole numbers (cheaper than
        # a float clamp, whose NaN handling costs three instructions a vector)
        codes = (rows * scale).round().add(zero).to(torch.int32).clamp(max=levels)
        header = torch.cat([span / levels, zero], dim=1)
    else:
        # within [0, levels] already: rows - lo lies in [0, span], and span * scale is at most
        # levels * (1 + 3 ulp), which rounds to levels (a clamp here cost 40% of the encode's time)
        codes = ((rows - lo) * scale).round()
        header = torch.cat([lo, hi], dim=1)
    return header, codes.to(torch.uint8), scale


def _encode_rows(rows: torch.Tensor, zero_exact: bool, levels: int) -> torch.Tensor:
    """(r, n) float32 -> (r, 8 + n) uint8: each row's 8-byte header, then a byte per element."""
    header, codes, _ = _encode_parts(rows, zero_exact, levels)
    return torch.cat([header.view(torch.uint8), codes], dim=1)


def _decode_rows(packed: torch.Tensor, zero_exact: bool, levels: int) -> torch.Tensor:
    """The inverse of :func:`_encode_rows`: (..., 8 + n) uint8 -> (..., n) float32."""
    header = packed[..., :8].contiguous().view(torch.float32)
    codes = packed[..., 8:].to(torch.float32)
    if zero_exact:
        return (codes - header[..., 1:2]) * header[..., :1]  # no multiply-add: the same bits compiled or not
    lo, hi = header[..., :1], header[..., 1:2]
    return codes * ((hi - lo) / levels) + lo


# The codec's work on a whole bucket, each one pass over the data when compiled (CompiledFunction):
# pure functions of tensors and Python constants, so the eager and the compiled forms give the same bits.

# Encoders write the codes into the packed rows (``codes_out``: the rows past their headers) and
# return the headers, which the caller writes (8 bytes a block): both written in one graph, Inductor
# fused them into one masked loop over whole rows, 6x slower than the codes alone.

def _encode_blocks_into(values: torch.Tensor, codes_out: torch.Tensor, zero_exact: bool, levels: int):
    """``codes_out`` (blocks, block) <- the codes of ``values`` (blocks, block); returns their headers
    (and their scales, see :func:`_encode_parts`)."""
    header, codes, scale = _encode_parts(values, zero_exact, levels)
    codes_out.copy_(codes)
    return header, scale


def _fold_momentum(grads: torch.Tensor, momentum: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    """``beta1 * m + (1 - beta1) * g`` (``rate``: ``1 - beta1``, a float32 scalar tensor) as
    ``m - (m - g) * rate``: one subtraction, one product, one subtraction, each rounded on its
    own in every form (eager, compiled on CPU, in place), so they all give the same bits."""
    return momentum - (momentum - grads) * rate


def _fold_encode_blocks_into(values: torch.Tensor, momentum: torch.Tensor, codes_out: torch.Tensor,
                             rate: torch.Tensor, zero_exact: bool, levels: int):
    """:func:`_encode_blocks_into` of the momentum that ``values`` (gradients) make with
    ``momentum`` (:func:`_fold_momentum`), computed as it is read: the folded momentum is never
    stored (one pass over the data fewer than folding first, then encoding)."""
    return _encode_blocks_into(_fold_momentum(values, momentum, rate), codes_out, zero_exact, levels)


def _average_chunks(received: torch.Tensor, codes_out: torch.Tensor, block: int, zero_exact: bool, levels: int):
    """The mean of the decoded rows of ``received`` (one per rank), encoded again: the codes into
    ``codes_out`` (blocks, block), the headers (and scales) returned."""
    ranks = received.shape[0]
    # (ranks, blocks, 8 + block): each element's block and rank are indices of their own, so a graph
    # made dynamic by a second bucket size still runs vectorized loops (indexed as one flat run with
    # symbolic offsets, it ran 10-47x slower than the static graph)
    decoded = _decode_rows(received.view(ranks, -1, 8 + block), zero_exact, levels)
    mean = decoded.sum(dim=0).div(ranks)
    return _encode_blocks_into(mean, codes_out, zero_exact, levels)


def _decode_into(packed: torch.Tensor, out: torch.Tensor, block: int, zero_exact: bool, levels: int):
    """``out`` <- the first ``out.numel()`` decoded elements of ``packed``."""
    decoded = _decode_rows(packed.reshape(-1, 8 + block), zero_exact, levels).view(-1)
    out.copy_(decoded[: out.numel()].view(out.shape))


_KERNELS = {}
COMPILE_ENV = "BAGUA_COMPILE_CODECS"
_COMPILE_SETTINGS = {"auto": "auto", "1": True, "0": False}


# Inputs a codec kernel may read to recompute the ranks' decoded mean in both of the encoder's
# loops (3 a rank: its codes and its two header values) rather than store it: 1.5x faster on 2
# ranks (one read of uint8 codes instead of a write and two reads of fp32), bit for bit the same.
_MEAN_RECOMPUTE_READS = 24


def _kernel(fn, compile, zero_exact):
    """One shared :class:`CompiledFunction` per codec function, compile setting and code (each
    its own graph cache: a few graphs per function, as shapes become dynamic after the second)."""
    key = (fn, compile, zero_exact)
    if key not in _KERNELS:
        min_elements = {"auto": AUTO_MIN_ELEMENTS, True: 0, False: None}[compile]
        reads = _MEAN_RECOMPUTE_READS if fn is _average_chunks else 0
        _KERNELS[key] = CompiledFunction(fn, min_elements=min_elements, recompute_reads=reads)
    return _KERNELS[key]


class MinMaxUInt8:
    """Each row becomes its min and max (two fp32, 8 bytes) and one byte per element.

    An element is rounded to the nearest of 256 evenly spaced levels between the row's min
    and max, so the error is at most ``(max - min) / 510`` (plus float rounding). With
    ``block`` every ``block`` elements of a row have their own min and max (8 bytes per block):
    one range for millions of gradients would round all but the largest to 0.

    ``zero_exact=True`` widens the range to include 0 and shifts the levels so that 0 is one
    of them: zeros decode to exactly 0 (the header then holds the level spacing and the code
    of 0). Momentum needs it: an element that never had a gradient has momentum 0 and second
    moment 0, and any rounding noise there would be divided by Adam's ``eps``.

    The bucket-level operations (:meth:`encode_chunks`, :meth:`average_chunks`,
    :meth:`decode_into`) run as Inductor kernels, one read of the input and one write of the
    output each (an encoder's per-block headers, 8 bytes a block, are written after it), with ``compile="auto"`` on buckets of at least 2**20 elements where
    ``torch.compile`` works (``True``: every bucket; ``False``: never; default: the environment
    variable ``BAGUA_COMPILE_CODECS``, ``auto``, ``1`` or ``0``, else ``"auto"``). They give the same bytes
    and values as the eager codec (:meth:`encode` / :meth:`decode`, the reference), so ranks
    that compiled and ranks that did not still agree.
    """

    header_bytes = 8
    levels = 255

    def __init__(self, zero_exact: bool = False, block: Optional[int] = None, compile=None):
        if block is not None and block < 1:
            raise ValueError(f"block must be a positive number of elements or None, got {block!r}")
        if compile is None:
            compile = _COMPILE_SETTINGS.get(os.environ.get(COMPILE_ENV, "auto").strip().lower())
            if compile is None:
                raise ValueError(f"{COMPILE_ENV} must be 'auto', '1' or '0', got {os.environ[COMPILE_ENV]!r}")
        if compile not in ("auto", True, False):
            raise ValueError(f"compile must be 'auto', True or False, got {compile!r}")
        self.zero_exact = zero_exact
        self.block = block
        self.compile = compile

    def padded_length(self, n: int) -> int:
        """The row length ``encode`` takes: ``n`` rounded up to whole blocks."""
        return n if self.block is None else -(-n // self.block) * self.block

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (r, n) float32 -> (r, 8 + n) uint8; with ``block``, each run of ``block``
        elements of a row has its own header: (r, n / block * (8 + block))."""
        if self.block is not None:
            r, n = rows.shape
            if n % self.block:
                raise ValueError(f"rows of {n} elements are not whole blocks of {self.block}; pad to padded_length(n)")
            return _encode_rows(rows.reshape(-1, self.block), self.zero_exact, self.levels).reshape(r, -1)
        return _encode_rows(rows, self.zero_exact, self.levels)

    def decode(self, packed: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`encode`: (r, m) uint8 -> (r, n) float32."""
        if self.block is not None:
            r = packed.shape[0]
            return _decode_rows(packed.reshape(-1, self.header_bytes + self.block), self.zero_exact,
                                self.levels).reshape(r, -1)
        return _decode_rows(packed, self.zero_exact, self.levels)

    # ------------------------------------------------------------------ whole buckets, one pass each
    def _block_for(self, chunk: int) -> int:
        return self.block if self.block is not None else chunk

    def encode_chunks(self, flat: torch.Tensor, chunks: int,
                      momentum: Optional[Tuple[torch.Tensor, float]] = None) -> torch.Tensor:
        """The 1-D ``flat`` cut into ``chunks`` equal rows (zero-padded to whole blocks), each
        encoded: ``(chunks, bytes per row)`` uint8, the layout :meth:`encode` gives.

        ``momentum=(m, beta1)``: encode the momentum ``beta1 * m + (1 - beta1) * flat`` instead
        (``m`` shaped like ``flat``), computed as ``m - (m - flat) * (1 - beta1)`` while it is
        read (see :meth:`folds_momentum`); ``flat`` is left as it was.
        """
        chunk = self.padded_length(-(-flat.numel() // chunks))
        block = self._block_for(chunk)
        packed = torch.empty(chunks * chunk // block, self.header_bytes + block, dtype=torch.uint8, device=flat.device)
        values = flat.reshape(-1).to(torch.float32)
        if momentum is not None:
            if momentum[0].shape != flat.shape:
                raise ValueError(f"momentum of shape {tuple(momentum[0].shape)} for gradients of shape {tuple(flat.shape)}")
            folded = momentum[0].reshape(-1).to(torch.float32)
            # float32, as eager torch turns a Python number multiplying a float32 tensor into one
            rate = torch.tensor(1.0 - momentum[1], dtype=torch.float32, device=flat.device)
        full = values.numel() // block  # whole blocks straight from the bucket (no padded copy of it)
        if full:
            codes_out = packed[:full, self.header_bytes:]
            if momentum is None:
                header, _ = _kernel(_encode_blocks_into, self.compile, self.zero_exact)(
                    values[: full * block].view(full, block), codes_out, self.zero_exact, self.levels)
            else:
                header, _ = _kernel(_fold_encode_blocks_into, self.compile, self.zero_exact)(
                    values[: full * block].view(full, block), folded[: full * block].view(full, block), codes_out,
                    rate, self.zero_exact, self.levels)
            packed[:full, : self.header_bytes].copy_(header.view(torch.uint8))
        if full < packed.shape[0]:  # the last partial block and the padding: a few blocks, eagerly
            rest = values[full * block:]
            if momentum is not None:
                rest = _fold_momentum(rest, folded[full * block:], rate)
            tail = torch.zeros((packed.shape[0] - full) * block, dtype=torch.float32, device=flat.device)
            tail[: rest.numel()] = rest
            packed[full:] = _encode_rows(tail.view(-1, block), self.zero_exact, self.levels)
        return packed.view(chunks, -1)

    def folds_momentum(self, flat: torch.Tensor) -> bool:
        """Whether :meth:`encode_chunks` of ``flat`` with ``momentum=`` folds it in a compiled kernel.

        Only then does folding there pay (eagerly it costs more than folding in place first),
        and only where compiled kernels keep ``a * b + c`` as two roundings (CPU): the encoder's
        min/max loop and its quantizing loop each compute the fold, and must get the same bits.
        """
        return (not compiled_kernels_may_fuse_multiply_add(flat.device.type)
                and _kernel(_fold_encode_blocks_into, self.compile, self.zero_exact).wants_compiled(flat))

    def average_chunks(self, received: torch.Tensor, chunk: int) -> torch.Tensor:
        """``received`` (ranks, bytes) holds one encoded row of ``chunk`` elements per rank:
        their mean, encoded: ``(1, bytes)``."""
        block = self._block_for(chunk)
        out = torch.empty(1, received.shape[1], dtype=torch.uint8, device=received.device)
        rows = out.view(-1, self.header_bytes + block)
        header, _ = _kernel(_average_chunks, self.compile, self.zero_exact)(
            received, rows[:, self.header_bytes:], block, self.zero_exact, self.levels)
        rows[:, : self.header_bytes].copy_(header.view(torch.uint8))
        return out

    def decode_into(self, packed: torch.Tensor, out: torch.Tensor, chunk: int) -> torch.Tensor:
        """Decode rows of ``chunk`` elements and write the first ``out.numel()`` values into ``out``."""
        _kernel(_decode_into, self.decode_compile(packed.device), self.zero_exact)(
            packed, out, self._block_for(chunk), self.zero_exact, self.levels)
        return out

    def decode_compile(self, device: torch.device):
        """The compile setting for decoding on ``device``. Every rank decodes the same bytes and must
        get the same values, compiled or not: the min-max form (``codes * step + lo``) runs eagerly
        where the compiler could fuse it into one multiply-add (one rounding instead of two)."""
        if not self.zero_exact and compiled_kernels_may_fuse_multiply_add(device.type):
            return False
        return self.compile


@register_algorithm("bytegrad")
class ByteGrad(GradientAlgorithm):
    """Compressed average in two collectives, each moving uint8 codes instead of floats.

    The bucket is cut into one chunk per rank. Each rank quantizes every chunk and sends
    chunk ``j`` to rank ``j`` (all-to-all, the reduce-scatter step); rank ``j`` decodes and
    averages what it got for its chunk, quantizes the average and all-gathers it, so every
    rank decodes the same result. On the wire that is about 2 bytes per element against 8
    for a ring allreduce of fp32.

    The code (``MinMaxUInt8(zero_exact=True, block=1024)``) keeps one min/max pair per 1024
    elements, not one per chunk: with a single range over a rank's chunk of a 25 MB bucket, all
    gradients but the largest rounded to 0, and BERT fine-tuning stayed at chance accuracy
    (0.51 against 0.84 exact on the recipe's CPU preset). Its levels include 0 exactly, so a
    gradient that is 0 on every rank (an embedding row no batch used) arrives as 0, not as
    rounding noise that Adam-type optimizers would scale up to ``lr``-sized steps.

    Args:
        hierarchical: average in full precision inside each node and quantize only between
            node leaders. Default True (as in Bagua); flat on a single node.
        message_size, timeout: as for :class:`GradientAllReduce`.
        codec: the quantizer (default ``MinMaxUInt8(zero_exact=True, block=BLOCK)``).
    """

    name = "bytegrad"
    hierarchical_default = True
    exact = False
    single_collective = False

    def __init__(self, hierarchical=None, timeout=None, message_size: int = 10_000_000, codec=None):
        super().__init__(hierarchical, timeout, message_size)
        self.codec = codec if codec is not None else MinMaxUInt8(zero_exact=True, block=BLOCK)
        missing = [m for m in ("padded_length", "encode_chunks", "average_chunks", "decode_into")
                   if not callable(getattr(self.codec, m, None))]
        if missing:
            raise AlgorithmConfigError(f"codec must be a quantizer like MinMaxUInt8(zero_exact=True) (it lacks "
                                       f"{', '.join(missing)}), got {type(self.codec).__name__}")

    def average(self, flat: torch.Tensor, group, momentum: Optional[Tuple[torch.Tensor, float]] = None) -> comm.Stages:
        """``momentum=(m, beta1)``: average the momentum ``flat`` makes, folded by the encoder
        (:meth:`MinMaxUInt8.encode_chunks`; ``qadam`` passes it), into ``flat``."""
        size = comm.world_size(group)
        chunk = self.codec.padded_length(-(-flat.numel() // size))
        sent = (self.codec.encode_chunks(flat, size) if momentum is None
                else self.codec.encode_chunks(flat, size, momentum=momentum))
        received = torch.empty_like(sent)
        yield comm.all_to_all(received, sent, group)

        packed_mine = self.codec.average_chunks(received, chunk).view(-1)
        gathered = torch.empty(size * packed_mine.numel(), dtype=torch.uint8, device=flat.device)
        yield comm.all_gather(gathered, packed_mine, group)

        self.codec.decode_into(gathered.view(size, -1), flat, chunk)
