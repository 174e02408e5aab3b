"""``bytegrad``: gradients travel as uint8, min-max quantized per chunk (about 1/4 of fp32 bytes)."""

from __future__ import annotations

import os
import sys
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


# The layout of an encoded row of n elements (n a multiple of 4): an 8-byte header (two float32), then
# n / 4 32-bit words, word i holding the codes of elements i, i + n/4, i + n/2 and i + 3n/4 in its
# bytes 0-3 (rows of other lengths, only from encode() without blocks: a byte per element, in order).
# So a row's elements, seen as (4, n / 4), are its codes' quarters: kernels read and write whole
# words, and read them as float32 bit patterns. Inductor's CPU kernels load 8-bit and 32-bit
# integers through a buffer on the stack where the CPU lacks AVX-512 (float32 loads are direct),
# which made decoding 2.4x slower there; moving a quarter's codes to or from its words is a shift
# and a mask.
WORD_BYTES = 4
_QUARTER_SHIFTS = (0, 8, 16, 24)
# eager code moves a word's bytes, which are its quarters' codes in order where words are little-endian
_EAGER_BYTE_SHUFFLE = sys.byteorder == "little"


def _in_words(n: int) -> bool:
    """Whether rows of ``n`` elements are encoded in 32-bit words (see above)."""
    return n % WORD_BYTES == 0


def _quarters(t: torch.Tensor) -> torch.Tensor:
    """(..., n) -> (..., 4, n / 4): a row's elements as the quarters its code words hold."""
    return t.view(*t.shape[:-1], WORD_BYTES, t.shape[-1] // WORD_BYTES)


def _range_of(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each row's (min, max) over its elements (all but the first dimension), kept as dimensions."""
    within = tuple(range(1, rows.dim()))
    return rows.amin(dim=within, keepdim=True), rows.amax(dim=within, keepdim=True)


def _scaling(lo: torch.Tensor, hi: torch.Tensor, zero_exact: bool, levels: int):
    """From rows' (min, max): their two header values, the scale that turns a value into levels,
    and the offset the codes are computed with (the code of 0, or the row's min)."""
    if zero_exact:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    span = hi - lo
    scale = torch.where(span > 0, levels / span, torch.zeros_like(span))
    if zero_exact:
        zero = (-lo * scale).round()
        return span / levels, zero, scale, zero
    return lo, hi, scale, lo


def _codes(rows: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, zero_exact: bool, levels: int):
    """Rows -> their int32 codes in ``[0, levels]`` (see :func:`_scaling`)."""
    if zero_exact:
        # never below 0 (rounding is odd, so round(x * scale) >= round(lo * scale) == -zero); above
        # ``levels`` where both halves of the range round up: clamped as whole numbers (cheaper than
        # a float clamp, whose NaN handling costs three instructions a vector)
        return (rows * scale).round().add(offset).to(torch.int32).clamp(max=levels)
    # within [0, levels] already: rows - lo lies in [0, span], and span * scale is at most
    # levels * (1 + 3 ulp), which rounds to levels (a clamp here cost 40% of the encode's time)
    return ((rows - offset) * scale).round().to(torch.int32)


def _header(lo: torch.Tensor, hi: torch.Tensor, zero_exact: bool, levels: int) -> torch.Tensor:
    """Rows' headers ``(r, 2)`` float32 from their (min, max)."""
    first, second, _, _ = _scaling(lo, hi, zero_exact, levels)
    return torch.cat([first, second], dim=1).view(-1, 2)


def _encode_parts(rows: torch.Tensor, zero_exact: bool, levels: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(r, ...) float32 rows -> their headers ``(r, 2)`` and int32 codes (shaped as ``rows``)."""
    lo, hi = _range_of(rows)
    first, second, scale, offset = _scaling(lo, hi, zero_exact, levels)
    return torch.cat([first, second], dim=1).view(-1, 2), _codes(rows, scale, offset, zero_exact, levels)


def _pack_words(quarters: torch.Tensor) -> torch.Tensor:
    """(..., 4, q) int32 codes (each within a byte) -> their (..., q) int32 words."""
    if _EAGER_BYTE_SHUFFLE and not torch.compiler.is_compiling():
        # eagerly, one strided copy of the bytes (the shifts below are seven passes over the words)
        return quarters.to(torch.uint8).transpose(-1, -2).contiguous().view(torch.int32).squeeze(-1)
    words = quarters[..., 0, :]
    for k in range(1, WORD_BYTES):
        words = words | (quarters[..., k, :] << _QUARTER_SHIFTS[k])
    return words


def _unpack_words(words: torch.Tensor) -> torch.Tensor:
    """(..., q) words, as float32 bit patterns -> the (..., 4, q) codes they hold, as float32."""
    if _EAGER_BYTE_SHUFFLE and not torch.compiler.is_compiling():
        return words.view(torch.uint8).unflatten(-1, (-1, WORD_BYTES)).transpose(-1, -2).to(torch.float32)
    bits = words.view(torch.int32).unsqueeze(-2)  # (..., 1, q)
    shifts = torch.tensor(_QUARTER_SHIFTS, dtype=torch.int32, device=words.device).view(WORD_BYTES, 1)
    return ((bits >> shifts) & 255).to(torch.float32)


def _values(codes: torch.Tensor, first: torch.Tensor, second: torch.Tensor, zero_exact: bool, levels: int):
    """Codes (float32) -> values, given a row's two header floats (level spacing and the code of 0,
    or min and max), each broadcast over the row."""
    if zero_exact:
        return (codes - second) * first  # no multiply-add: the same bits compiled or not
    return codes * ((second - first) / levels) + first


def _decode_blocks(rows: torch.Tensor, zero_exact: bool, levels: int) -> torch.Tensor:
    """(..., 2 + q) float32 views of encoded rows (header, then code words) -> their values (..., 4, q)."""
    first, second = rows[..., 0:1].unsqueeze(-1), rows[..., 1:2].unsqueeze(-1)  # (..., 1, 1)
    return _values(_unpack_words(rows[..., 2:]), first, second, zero_exact, levels)


def _as_words(packed: torch.Tensor) -> torch.Tensor:
    """(..., 4m) uint8 -> the same bytes as (..., m) float32 (how kernels read code words), copied
    only if they do not start on whole words."""
    if packed.stride(-1) != 1 or packed.storage_offset() % WORD_BYTES or any(
            s % WORD_BYTES for s in packed.stride()[:-1]):
        packed = packed.contiguous()
    return packed.view(torch.float32)


def _encode_rows(rows: torch.Tensor, zero_exact: bool, levels: int) -> torch.Tensor:
    """(r, n) float32 -> (r, 8 + n) uint8: each row's 8-byte header, then its codes (see above)."""
    if not _in_words(rows.shape[1]):
        header, codes = _encode_parts(rows, zero_exact, levels)
        return torch.cat([header.view(torch.uint8), codes.to(torch.uint8)], dim=1)
    header, codes = _encode_parts(_quarters(rows), zero_exact, levels)
    return torch.cat([header.view(torch.uint8), _pack_words(codes).view(torch.uint8)], dim=1)


def _decode_rows(packed: torch.Tensor, zero_exact: bool, levels: int) -> torch.Tensor:
    """The inverse of :func:`_encode_rows`: (..., 8 + n) uint8 -> (..., n) float32."""
    if _in_words(packed.shape[-1] - 8):
        return _decode_blocks(_as_words(packed), zero_exact, levels).flatten(-2)
    header = packed[..., :8].contiguous().view(torch.float32)
    return _values(packed[..., 8:].to(torch.float32), header[..., 0:1], header[..., 1:2], zero_exact, levels)


# The codec's work on a whole bucket, each one pass over the data when compiled (CompiledFunction):
# pure functions of tensors and Python constants, so the eager and the compiled forms give the same
# bits. They work on whole blocks: values as (blocks, 4, block / 4) (a block's quarters), encoded
# rows as float32 (read) or int32 (written) views of their bytes, each dimension an index of its own
# (a graph made dynamic by a second bucket size still runs vectorized loops; with the blocks of a
# flat run indexed through symbolic divisions it ran scalar, 10-47x slower).

# Encoders write the code words into the packed rows (``words_out``: the rows past their headers) and
# return the blocks' (min, max), from which :func:`_headers_into` makes and writes the headers (with
# :func:`_header`, the same operations as the kernel's, so the same bits; 8 bytes a block). With no other per-block
# output, Inductor's CPU kernel runs each block's min/max loop and then its quantizing loop, which
# reads the block again from cache: 1.6x faster than two passes over the bucket (when the headers
# were outputs too), 6x faster than headers and codes written in one graph (one masked loop).

def _encode_blocks_into(values: torch.Tensor, words_out: torch.Tensor, zero_exact: bool, levels: int):
    """``words_out`` (blocks, q) int32 <- the code words of ``values`` (blocks, 4, q); returns the
    blocks' (min, max)."""
    lo, hi = _range_of(values)
    _, _, scale, offset = _scaling(lo, hi, zero_exact, levels)
    words_out.copy_(_pack_words(_codes(values, scale, offset, zero_exact, levels)))
    return lo, hi


def _fold_momentum(grads: torch.Tensor, momentum: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    """``beta1 * m + (1 - beta1) * g`` (``rate``: ``1 - beta1``, a float32 scalar tensor) as
    ``m - (m - g) * rate``: one subtraction, one product, one subtraction, each rounded on its
    own in every form (eager, compiled on CPU, in place), so they all give the same bits."""
    return momentum - (momentum - grads) * rate


def _fold_encode_blocks_into(values: torch.Tensor, momentum: torch.Tensor, words_out: torch.Tensor,
                             rate: torch.Tensor, zero_exact: bool, levels: int):
    """:func:`_encode_blocks_into` of the momentum that ``values`` (gradients) make with
    ``momentum`` (:func:`_fold_momentum`), computed as it is read: the folded momentum is never
    stored (one pass over the data fewer than folding first, then encoding)."""
    return _encode_blocks_into(_fold_momentum(values, momentum, rate), words_out, zero_exact, levels)


def _difference_encode_blocks_into(values: torch.Tensor, base: torch.Tensor, words_out: torch.Tensor,
                                   zero_exact: bool, levels: int):
    """:func:`_encode_blocks_into` of ``values - base``, computed as it is read (a subtraction: the
    same bits in every form): the difference is never stored, one write and one read of the data
    fewer than subtracting first (``low_precision_decentralized`` sends ``weights - public copy``)."""
    return _encode_blocks_into(values - base, words_out, zero_exact, levels)


def _average_chunks(received: torch.Tensor, words_out: torch.Tensor, zero_exact: bool, levels: int):
    """The mean of the decoded rows of ``received`` (ranks, blocks, 2 + q), encoded again: the code
    words into ``words_out`` (blocks, q), the blocks' (min, max) returned."""
    mean = _decode_blocks(received, zero_exact, levels).sum(dim=0).div(received.shape[0])
    return _encode_blocks_into(mean, words_out, zero_exact, levels)


def _headers_into(headers_out: torch.Tensor, lo: Optional[torch.Tensor], hi: Optional[torch.Tensor],
                  tail: Optional[torch.Tensor], tail_words_out: Optional[torch.Tensor], zero_exact: bool, levels: int):
    """``headers_out`` (blocks, 2) float32 <- the headers of blocks whose (min, max) an encoder
    returned (``lo``, ``hi``; None: none), followed by those of ``tail`` (a bucket's last few blocks,
    zero-padded, (k, 4, q); None: none), whose code words go into ``tail_words_out``. After an encoder, one
    call, compiled where the encoder was: with a tail, its ~20 small operations cost more eagerly than a
    compiled call (encode_chunks 14% faster on a 4 MB bucket); without one, less (average_chunks)."""
    if tail is not None:
        tail_lo, tail_hi = _encode_blocks_into(tail, tail_words_out, zero_exact, levels)
        lo = tail_lo if lo is None else torch.cat([lo, tail_lo])
        hi = tail_hi if hi is None else torch.cat([hi, tail_hi])
    headers_out.copy_(_header(lo, hi, zero_exact, levels))


def _decode_into(out: torch.Tensor, packed: torch.Tensor, zero_exact: bool, levels: int):
    """``out`` (blocks, 4, q) <- the values of ``packed`` (blocks, 2 + q)."""
    out.copy_(_decode_blocks(packed, zero_exact, levels))


_KERNELS = {}
COMPILE_ENV = "BAGUA_COMPILE_CODECS"
_COMPILE_SETTINGS = {"auto": "auto", "1": True, "0": False}


# Inputs a codec kernel may read to recompute the ranks' decoded mean in both of the encoder's
# loops (3 a rank: its codes and its two header values) rather than store it: 1.5x faster on 2
# ranks (one read of uint8 codes instead of a write and two reads of fp32), bit for bit the same.
_MEAN_RECOMPUTE_READS = 24
# Inputs an encoder may read to compute a block's codes in its packing loop (each quarter's codes read
# once there) rather than store them as int32 and read them back: the momentum-folding encoder reads 5
# (gradients, momentum, rate, min, max), past Inductor's default of 4; it ran 1.9x slower storing them.
_CODES_RECOMPUTE_READS = 8


def _kernel(fn, compile, zero_exact):
    """One shared :class:`CompiledFunction` per codec function, compile setting and code (each
    its own graph cache: a few graphs per function, as shapes become dynamic after the second)."""
    key = (fn, compile, zero_exact)
    if key not in _KERNELS:
        min_elements = {"auto": AUTO_MIN_ELEMENTS, True: 0, False: None}[compile]
        if fn is _average_chunks and min_elements:  # sized by its first tensor: the ranks' code words,
            min_elements //= WORD_BYTES  # a word per 4 elements of the bucket (the others: its values)
        reads = {_average_chunks: _MEAN_RECOMPUTE_READS, _encode_blocks_into: _CODES_RECOMPUTE_READS,
                 _fold_encode_blocks_into: _CODES_RECOMPUTE_READS,
                 _difference_encode_blocks_into: _CODES_RECOMPUTE_READS}.get(fn, 0)
        _KERNELS[key] = CompiledFunction(fn, min_elements=min_elements, recompute_reads=reads)
    return _KERNELS[key]


class MinMaxUInt8:
    """Each row becomes its min and max (two fp32, 8 bytes) and one byte per element.

    The bytes of a row of ``n`` elements, ``n`` a multiple of 4 (always so with ``block``, and in
    the bucket-level operations): the header, then ``n / 4`` 32-bit words, word ``i`` holding in its
    bytes 0 to 3 (little-endian) the codes of elements ``i``, ``i + n/4``, ``i + n/2`` and
    ``i + 3n/4``, so that compiled kernels move whole words (other rows: the codes in order).

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
        if block is not None and (block < 1 or block % WORD_BYTES):
            raise ValueError(f"block must be a positive multiple of {WORD_BYTES} elements (codes travel "
                             f"{WORD_BYTES} to a 32-bit word) or None, got {block!r}")
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
        """The row length the bucket-level operations use: ``n`` rounded up to whole blocks
        (without ``block``: to a multiple of 4, whole 32-bit words of codes)."""
        unit = WORD_BYTES if self.block is None else self.block
        return -(-n // unit) * unit

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
                      momentum: Optional[Tuple[torch.Tensor, float]] = None,
                      minus: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The 1-D ``flat`` cut into ``chunks`` equal rows (zero-padded to whole blocks), each
        encoded: ``(chunks, bytes per row)`` uint8, the layout :meth:`encode` gives.

        ``momentum=(m, beta1)``: encode the momentum ``beta1 * m + (1 - beta1) * flat`` instead
        (``m`` shaped like ``flat``), computed as ``m - (m - flat) * (1 - beta1)`` while it is
        read (see :meth:`folds_momentum`); ``flat`` is left as it was.

        ``minus=b`` (shaped like ``flat``): encode ``flat - b``, computed while it is read (the same
        bytes as encoding ``flat - b`` made first).
        """
        if momentum is not None and minus is not None:
            raise ValueError("encode_chunks takes momentum= or minus=, not both")
        chunk = self.padded_length(-(-flat.numel() // chunks))
        block = self._block_for(chunk)
        packed = torch.empty(chunks * chunk // block, self.header_bytes + block, dtype=torch.uint8, device=flat.device)
        values = flat.reshape(-1).to(torch.float32)
        if minus is not None:
            if minus.shape != flat.shape:
                raise ValueError(f"minus= of shape {tuple(minus.shape)} for values of shape {tuple(flat.shape)}")
            base = minus.reshape(-1).to(torch.float32)
        if momentum is not None:
            if momentum[0].shape != flat.shape:
                raise ValueError(f"momentum of shape {tuple(momentum[0].shape)} for gradients of shape {tuple(flat.shape)}")
            folded = momentum[0].reshape(-1).to(torch.float32)
            # float32, as eager torch turns a Python number multiplying a float32 tensor into one
            rate = torch.tensor(1.0 - momentum[1], dtype=torch.float32, device=flat.device)
        full = values.numel() // block  # whole blocks straight from the bucket (no padded copy of it)
        words_out = packed.view(torch.int32)[:, self.header_bytes // WORD_BYTES:]
        lo = hi = tail = None
        encoder = None
        if full:
            quarters = (full, WORD_BYTES, block // WORD_BYTES)
            if minus is not None:
                encoder = _kernel(_difference_encode_blocks_into, self.compile, self.zero_exact)
                lo, hi = encoder(
                    values[: full * block].view(quarters), base[: full * block].view(quarters), words_out[:full],
                    self.zero_exact, self.levels)
            elif momentum is None:
                encoder = _kernel(_encode_blocks_into, self.compile, self.zero_exact)
                lo, hi = encoder(
                    values[: full * block].view(quarters), words_out[:full], self.zero_exact, self.levels)
            else:
                encoder = _kernel(_fold_encode_blocks_into, self.compile, self.zero_exact)
                lo, hi = encoder(
                    values[: full * block].view(quarters), folded[: full * block].view(quarters), words_out[:full],
                    rate, self.zero_exact, self.levels)
        if full < packed.shape[0]:  # the last partial block and the padding: a few blocks, zero-padded
            rest = values[full * block:]
            if momentum is not None:
                rest = _fold_momentum(rest, folded[full * block:], rate)
            elif minus is not None:
                rest = rest - base[full * block:]
            tail = torch.zeros(packed.shape[0] - full, WORD_BYTES, block // WORD_BYTES, dtype=torch.float32,
                               device=flat.device)
            tail.view(-1)[: rest.numel()] = rest
        _kernel(_headers_into, self.compile, self.zero_exact)(
            self._headers_of(packed), lo, hi, tail, None if tail is None else words_out[full:], self.zero_exact,
            self.levels, like=encoder)
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
        words = (self.header_bytes + block) // WORD_BYTES
        lo, hi = _kernel(_average_chunks, self.compile, self.zero_exact)(
            _as_words(received).view(received.shape[0], -1, words), rows.view(torch.int32)[:, self.header_bytes // WORD_BYTES:],
            self.zero_exact, self.levels)
        # without a tail to encode, the headers' few small operations cost less eagerly than a compiled call
        _headers_into(self._headers_of(rows), lo, hi, None, None, self.zero_exact, self.levels)
        return out

    def _headers_of(self, rows: torch.Tensor) -> torch.Tensor:
        """(blocks, 8 + block) uint8 encoded rows -> their headers, a (blocks, 2) float32 view."""
        return rows.view(torch.float32)[:, : self.header_bytes // WORD_BYTES]

    def decode_into(self, packed: torch.Tensor, out: torch.Tensor, chunk: int) -> torch.Tensor:
        """Decode rows of ``chunk`` elements and write the first ``out.numel()`` values into ``out``."""
        block = self._block_for(chunk)
        rows = _as_words(packed).view(-1, (self.header_bytes + block) // WORD_BYTES)
        n = out.numel()
        flat = out.view(-1) if out.is_contiguous() else torch.empty(n, dtype=out.dtype, device=out.device)
        full = n // block
        if full:
            _kernel(_decode_into, self.decode_compile(packed.device), self.zero_exact)(
                flat[: full * block].view(full, WORD_BYTES, block // WORD_BYTES), rows[:full], self.zero_exact,
                self.levels)
        if full * block < n:  # the last partial block, eagerly (the same operations: the same bits)
            flat[full * block:] = _decode_blocks(rows[full], self.zero_exact, self.levels).reshape(-1)[: n - full * block]
        if not out.is_contiguous():
            out.copy_(flat.view(out.shape))
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
