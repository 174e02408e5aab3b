"""The uint8 codec of ``bytegrad``, ``qadam`` and ``low_precision_decentralized``, compiled.

Each bucket-level operation (encode with padding, the per-rank average re-encoded, decode into
the bucket) runs as Inductor kernels. References: the eager codec (the same bytes and values, so a
rank that compiled and one that did not still agree) and a min-max code written here in plain
torch, against which ``ByteGrad`` on 2 and 3 gloo ranks must match bit for bit, compiled.
"""

from __future__ import annotations

import pytest
import torch

from _dist_utils import run_ranks, values
from bagua_integrations._compile import compile_unavailable_reason
from bagua_integrations._torch_compat import compiled_kernels_may_fuse_multiply_add
from bagua_integrations.distributed.algorithms import bytegrad
from bagua_integrations.distributed.algorithms.bytegrad import BLOCK, MinMaxUInt8

needs_compiler = pytest.mark.skipif(compile_unavailable_reason() is not None,
                                    reason=f"no compiled codec here: {compile_unavailable_reason()}")


def _buckets():
    g = torch.Generator().manual_seed(0)
    mixed = torch.randn(5000, generator=g)
    mixed[:1500] = 0  # whole blocks of zeros
    mixed[2048:3072] = 0.25  # a constant block
    mixed[3072:4096] *= 1e-6  # tiny values beside large ones
    return {"mixed": mixed, "short": torch.randn(700, generator=g) * 3, "negative": -torch.rand(3 * BLOCK + 5, generator=g)}


def _codecs(zero_exact):
    return MinMaxUInt8(zero_exact=zero_exact, block=BLOCK, compile=False), MinMaxUInt8(zero_exact=zero_exact, block=BLOCK, compile=True)


@needs_compiler
@pytest.mark.parametrize("zero_exact", [True, False])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_compiled_codec_gives_the_eager_codecs_bytes_and_values(zero_exact, chunks):
    eager, compiled = _codecs(zero_exact)
    for name, flat in _buckets().items():
        sent = eager.encode_chunks(flat, chunks)
        assert torch.equal(compiled.encode_chunks(flat, chunks), sent), name
        chunk = eager.padded_length(-(-flat.numel() // chunks))
        # what the eager codec's encode of the zero-padded rows gives: the same layout
        rows = torch.zeros(chunks, chunk)
        rows.view(-1)[: flat.numel()] = flat
        assert torch.equal(eager.encode(rows), sent), name
        received = torch.stack([sent[0], sent[-1], sent[0]])  # three "ranks"
        averaged = eager.average_chunks(received, chunk)
        assert torch.equal(compiled.average_chunks(received, chunk), averaged), name
        expected, got = torch.empty_like(flat), torch.empty_like(flat)
        eager.decode_into(sent, expected, chunk)
        compiled.decode_into(sent, got, chunk)
        assert torch.equal(got, expected), name
        assert torch.equal(expected, eager.decode(sent).view(-1)[: flat.numel()]), name


@needs_compiler
def test_compiled_codec_is_what_runs():
    """The encoder's kernel, and the one call that makes the headers (with the codes of a bucket's
    last, partial block) after it: compiled where the encoder ran compiled (whatever the headers'
    size), eager where it did not."""
    _, compiled = _codecs(True)
    flat = torch.randn(3000)
    compiled.encode_chunks(flat, 2)
    kernel = bytegrad._kernel(bytegrad._encode_blocks_into, True, True)
    assert kernel.disabled_reason is None and kernel.compiled_calls >= 1 and 1 <= kernel.graphs <= kernel.max_graphs
    headers = bytegrad._kernel(bytegrad._headers_into, True, True)
    calls = headers.compiled_calls
    sent = compiled.encode_chunks(flat, 2)
    assert headers.compiled_calls == calls + 1 and headers.disabled_reason is None
    eager = MinMaxUInt8(zero_exact=True, block=BLOCK, compile="auto")  # buckets below 2**20 elements: eager
    eager_headers = bytegrad._kernel(bytegrad._headers_into, "auto", True)
    calls = eager_headers.compiled_calls
    assert torch.equal(eager.encode_chunks(flat, 2), sent)
    assert eager_headers.compiled_calls == calls and not eager_headers.last_ran_compiled


@needs_compiler
@pytest.mark.skipif(compiled_kernels_may_fuse_multiply_add("cpu"), reason="the encoder folds only where compiled CPU "
                    "kernels keep a * b + c as two roundings")
@pytest.mark.parametrize("chunks", [1, 2])
def test_the_encoder_folds_momentum_as_the_formula_says_compiled_or_not(chunks):
    """``encode_chunks(g, momentum=(m, beta1))`` (QAdam's algorithm on fused buckets) encodes
    ``m - (m - g) * (1 - beta1)`` bit for bit, compiled, eager, and on the partial last block.
    The fold that ``lerp_`` computes differs in the last bit, which moves some codes: a fold with
    another rounding fails this."""
    gen = torch.Generator().manual_seed(3)
    g = torch.randn((1 << 18) + 777, generator=gen) * 1e-3
    m = torch.randn(g.numel(), generator=gen) * 1e-3
    g[:BLOCK] = 0  # a block with no gradient and no momentum: codes of 0 only
    m[:BLOCK] = 0
    eager, compiled = _codecs(True)
    assert compiled.folds_momentum(g) and not eager.folds_momentum(g)
    kernel = bytegrad._kernel(bytegrad._fold_encode_blocks_into, True, True)
    calls = kernel.compiled_calls
    folded = compiled.encode_chunks(g, chunks, momentum=(m, 0.9))
    assert kernel.compiled_calls == calls + 1 and kernel.disabled_reason is None
    assert torch.equal(folded, eager.encode_chunks(m - (m - g) * (1 - 0.9), chunks))
    assert torch.equal(folded, eager.encode_chunks(g, chunks, momentum=(m, 0.9)))
    assert not torch.equal(folded, eager.encode_chunks(g.clone().lerp_(m, 0.9), chunks))
    with pytest.raises(ValueError, match="momentum of shape"):
        compiled.encode_chunks(g, chunks, momentum=(m[:-1], 0.9))


@needs_compiler
@pytest.mark.parametrize("zero_exact", [True, False])
def test_the_encoder_subtracts_as_it_reads_compiled_or_not(zero_exact):
    """``encode_chunks(x, minus=b)`` (low_precision_decentralized's ``weights - public copy``) gives
    the bytes of ``encode_chunks(x - b)``, compiled and eager, on the partial last block too; an
    encoder that scaled ``b`` by 1.001 fails this."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5 * BLOCK + 300, generator=gen)
    b = x + torch.randn(x.numel(), generator=gen) * 1e-3  # a public copy close to the weights
    b[:BLOCK] = x[:BLOCK]  # a block without difference: codes of 0 only
    eager, compiled = _codecs(zero_exact)
    kernel = bytegrad._kernel(bytegrad._difference_encode_blocks_into, True, zero_exact)
    calls = kernel.compiled_calls
    sent = compiled.encode_chunks(x, 1, minus=b)
    assert kernel.compiled_calls == calls + 1 and kernel.disabled_reason is None
    assert torch.equal(sent, eager.encode_chunks(x - b, 1))
    assert torch.equal(sent, eager.encode_chunks(x, 1, minus=b))
    assert not torch.equal(sent, eager.encode_chunks(x - b * 1.001, 1))
    with pytest.raises(ValueError, match="minus= of shape"):
        compiled.encode_chunks(x, 1, minus=b[:-1])
    with pytest.raises(ValueError, match="not both"):
        compiled.encode_chunks(x, 1, momentum=(b, 0.9), minus=b)


def test_small_buckets_stay_eager_by_default_and_the_setting_is_checked(monkeypatch):
    assert MinMaxUInt8().compile == "auto"
    monkeypatch.setenv(bytegrad.COMPILE_ENV, "0")
    assert MinMaxUInt8().compile is False
    monkeypatch.setenv(bytegrad.COMPILE_ENV, "yes")
    with pytest.raises(ValueError, match="BAGUA_COMPILE_CODECS"):
        MinMaxUInt8()
    with pytest.raises(ValueError, match="compile must be"):
        MinMaxUInt8(compile="always")
    with pytest.raises(ValueError, match="multiple of 4"):
        MinMaxUInt8(block=1001)
    assert MinMaxUInt8(compile=False).padded_length(1001) == 1004 and MinMaxUInt8(block=8, compile=False).padded_length(9) == 16


def _codes_in_order(body):
    """The codes of encoded rows (their bytes after the header) in element order: in a row of n
    codes, byte k of 32-bit word i holds element i + k * n / 4 (MinMaxUInt8's layout)."""
    r, n = body.shape
    return body.reshape(r, n // 4, 4).transpose(1, 2).reshape(r, n)


@pytest.mark.parametrize("zero_exact", [True, False])
def test_codes_stay_within_the_levels_without_a_clamp(zero_exact):
    """The min-max code needs no clamp to [0, 255] (its rows - lo is within [0, span]); the zero-exact
    one needs its upper clamp where both halves of a range round up. Against a clamped code."""
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(4096, 64, generator=g) * torch.logspace(-30, 30, 4096).unsqueeze(1),
            torch.rand(512, 64, generator=g).round() * 3 - 1.5,  # two values per row
            torch.full((8, 64), 7.0), torch.tensor([[-1.0, 1.0] * 32])]  # both halves of the range at .5
    for r in rows:
        lo, hi = r.amin(1, keepdim=True), r.amax(1, keepdim=True)
        if zero_exact:
            lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scale = torch.where(hi - lo > 0, 255 / (hi - lo), torch.zeros_like(lo))
        if zero_exact:
            expected = ((r * scale).round() + (-lo * scale).round()).clamp(0, 255)
        else:
            expected = ((r - lo) * scale).round().clamp(0, 255)
        assert torch.equal(_codes_in_order(bytegrad._encode_rows(r, zero_exact, 255)[:, 8:]), expected.to(torch.uint8))


# ---------------------------------------------------------------------- ByteGrad against plain torch, 2 and 3 ranks
def _reference_quantize(values):
    """Min-max uint8 over blocks of BLOCK elements, 0 exact: (codes, step, zero) per block."""
    blocks = values.reshape(-1, BLOCK)
    lo = blocks.amin(1, keepdim=True).clamp(max=0)
    hi = blocks.amax(1, keepdim=True).clamp(min=0)
    span = hi - lo
    scale = torch.where(span > 0, 255 / span, torch.zeros_like(span))
    zero = (-lo * scale).round()
    codes = ((blocks * scale).round() + zero).clamp(0, 255)
    return codes, span / 255, zero


def _reference_round_trip(values):
    codes, step, zero = _reference_quantize(values)
    return ((codes - zero) * step).reshape(-1)


def _reference_bytegrad(flats, size):
    """Every rank's bucket quantized per chunk, the chunks averaged, the average quantized again."""
    n = flats[0].numel()
    chunk = -(-(-(-n // size)) // BLOCK) * BLOCK
    rows = [torch.nn.functional.pad(flat, (0, size * chunk - n)).view(size, chunk) for flat in flats]
    result = []
    for j in range(size):
        decoded = torch.stack([_reference_round_trip(r[j]) for r in rows])
        result.append(_reference_round_trip(decoded.sum(dim=0).div(size)))
    return torch.cat(result)[:n]


def _broken_codes(rows, scale, offset, zero_exact, levels):
    """The codec with a wrong rounding (floor): the reference comparison must catch it."""
    return (rows * scale).floor().add(offset).clamp(0, levels).to(torch.int32)


def _bytegrad_vs_reference(rank, world, broken):
    import torch.distributed as dist

    from bagua_integrations import get_algorithm
    from bagua_integrations.distributed import comm

    if broken:
        bytegrad._codes = _broken_codes
    codec = MinMaxUInt8(zero_exact=True, block=BLOCK, compile=True)
    algorithm = get_algorithm("bytegrad", hierarchical=False, codec=codec)
    g = torch.Generator().manual_seed(rank)
    flat = torch.randn(5 * BLOCK + 333, generator=g) * (rank + 1)
    flat[:BLOCK] = 0
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    comm.run(algorithm.average(flat, None), "bytegrad average")
    kernel = bytegrad._kernel(bytegrad._average_chunks, True, True)
    return {"same": torch.equal(flat, _reference_bytegrad(everyone, world)), "result": flat,
            "compiled": kernel.compiled_calls > 0 and kernel.disabled_reason is None}


@needs_compiler
@pytest.mark.parametrize("world", [2, 3])
def test_compiled_bytegrad_matches_plain_torch_bit_for_bit(world):
    results = values(run_ranks(_bytegrad_vs_reference, world, args=(False,), timeout=240))
    for rank, result in enumerate(results):
        assert result["compiled"], f"rank {rank} ran the eager codec"
        assert result["same"], f"rank {rank} differs from the reference"
        assert torch.equal(result["result"], results[0]["result"])


@needs_compiler
def test_a_wrong_rounding_fails_the_reference():
    results = values(run_ranks(_bytegrad_vs_reference, 2, args=(True,), timeout=240))
    assert not any(result["same"] for result in results)
