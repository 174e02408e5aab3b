"""Flat memory as communication sees it (``_flat.py``'s packs) and the reducer's segments.

Each test compares against a reference computed here the plain way (``torch.cat``, explicit
offsets), so a pack that copies when it should view, forgets padding, or writes back to the
wrong place fails with the values side by side.
"""

from __future__ import annotations

import pytest
import torch

from bagua_integrations import fuse_optimizer
from bagua_integrations._flat import ALIGN_BYTES, PackedTensors, align_elements, pack_tensors, shared_flat_view
from bagua_integrations.distributed.bucketing import build_segments, make_buckets
from bagua_integrations.fused_optimizer import flat_grad_segments


def _model() -> torch.nn.Module:
    # 40 + 5 + 15 + 3 float32 elements: the fused buffer pads slots to 16-element boundaries
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Linear(5, 3))


def _fused_with_grads():
    model = _model()
    optimizer = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(4, 8)).square().sum().backward()
    return model, optimizer


def _padded(sizes, per):
    """Tensors laid out like a fused buffer's slots, by hand: (storage, tensors, starts)."""
    starts, offset = [], 0
    for size in sizes:
        offset = (offset + per - 1) // per * per
        starts.append(offset)
        offset += size
    storage = torch.zeros(offset)
    return storage, [storage[s : s + n] for s, n in zip(starts, sizes)], starts


def test_alignment_is_one_number_for_both_sides():
    assert ALIGN_BYTES == 64
    assert align_elements(4) == 16 and align_elements(2) == 32 and align_elements(128) == 1
    model, optimizer = _fused_with_grads()
    (segment,) = flat_grad_segments(optimizer)
    assert all(start % align_elements(4) == 0 for start in segment.starts)


# ----------------------------------------------------------------------------- view path
def test_pack_of_fused_grads_is_the_fused_flat_grad_buffer():
    model, optimizer = _fused_with_grads()
    (segment,) = flat_grad_segments(optimizer)
    grads = [p.grad for p in model.parameters()]
    pack = PackedTensors(list(reversed(grads)))  # order does not matter for a view
    assert not pack.copied
    flat = pack.gather()
    assert flat.data_ptr() == segment.flat.data_ptr()
    last = segment.starts[-1] + segment.params[-1].numel()
    assert flat.numel() == last  # exactly up to the last tensor, no trailing padding
    flat.mul_(3.0)  # changing the flat changes the gradients: it is their memory
    reference = [g.clone() for g in grads]
    pack.scatter()
    assert all(torch.equal(g, r) for g, r in zip(grads, reference))
    params = pack_tensors(model.parameters())
    assert params.zero_copy and len(params) == 1


def test_gaps_are_the_padding_between_tensors_and_are_rezeroed():
    per = align_elements(4)
    storage, tensors, starts = _padded([10, 5, 15, 1], per)
    ends = [s + t.numel() for s, t in zip(starts, tensors)]
    expected_gaps = [(e, s) for e, s in zip(ends, starts[1:]) if s > e]
    pack = PackedTensors([tensors[2], tensors[0], tensors[3], tensors[1]])
    assert not pack.copied and pack.gaps == expected_gaps == [(10, 16), (21, 32), (47, 48)]
    flat = pack.gather()
    assert flat.data_ptr() == storage.data_ptr() and flat.numel() == storage.numel()
    flat.fill_(7.0)  # what a lossy reduction may leave in the padding
    pack.scatter()
    for start, end in expected_gaps:
        assert (storage[start:end] == 0).all()
    assert all((t == 7.0).all() for t in tensors)
    # one gap only: the cheap path
    storage, (a, b), _ = _padded([3, 4], per)
    single = PackedTensors([a, b])
    assert single.gaps == [(3, 16)]
    single.gather().fill_(1.0)
    single.scatter()
    assert storage[3:16].abs().sum() == 0 and (a == 1).all() and (b == 1).all()


def test_a_gap_of_a_whole_alignment_step_or_overlap_means_no_view():
    per = align_elements(4)
    storage = torch.zeros(4 * per)
    assert shared_flat_view([storage[0:3], storage[3 + per - 1 : 3 + per]]) is not None
    assert shared_flat_view([storage[0:3], storage[3 + per : 4 + per]]) is None  # could hide a tensor
    assert shared_flat_view([storage[0:5], storage[4:8]]) is None  # overlapping
    assert shared_flat_view([storage[0:4].view(2, 2).t(), storage[4:8]]) is None  # not contiguous
    assert PackedTensors([storage[0:3], storage[3 + per : 4 + per]]).copied


# ----------------------------------------------------------------------------- copy path
def test_copy_path_round_trips_values_of_scattered_tensors():
    torch.manual_seed(1)
    a = torch.randn(3, 4)
    b = torch.randn(5, 2).t()  # not contiguous
    c = torch.randn(7)
    tensors = [a, b, c]
    pack = PackedTensors(tensors)
    assert pack.copied and pack.gaps == []
    flat = pack.gather()
    reference = torch.cat([t.reshape(-1) for t in tensors])
    assert torch.equal(flat, reference)
    flat.mul_(2).add_(1)
    pack.scatter()
    offset = 0
    for t in tensors:
        assert torch.equal(t, (reference[offset : offset + t.numel()] * 2 + 1).view_as(t))
        offset += t.numel()
    # the private copy is allocated once and re-read on every gather
    a.zero_()
    again = pack.gather()
    assert again.data_ptr() == flat.data_ptr() and (again[: a.numel()] == 0).all()


def test_copy_path_of_parameters_that_require_grad():
    model = _model()
    params = list(model.parameters())
    packs = pack_tensors(params)
    assert not packs.zero_copy
    (flat,) = packs.gather()
    reference = torch.cat([p.detach().reshape(-1) for p in params])
    assert torch.equal(flat, reference) and not flat.requires_grad
    flat.neg_()
    packs.scatter()
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params]), -reference)


def test_scatter_before_gather_on_the_copy_path_is_refused():
    with pytest.raises(RuntimeError, match="before gather"):
        PackedTensors([torch.ones(2), torch.ones(3)]).scatter()


def test_replaced_storage_falls_back_to_copying_and_still_scatters():
    model, optimizer = _fused_with_grads()
    params = list(model.parameters())
    (segment,) = flat_grad_segments(optimizer)
    packs = pack_tensors(params)
    assert packs.zero_copy
    moved = params[0]
    moved.data = moved.data.clone()  # no longer in the fused buffer
    (flat,) = packs.gather()
    assert not packs.zero_copy and packs[0].gaps == []
    assert flat.numel() == sum(p.numel() for p in params)  # a packed copy: no padding
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in params]))
    before = [p.detach().clone() for p in params]
    flat.add_(10.0)
    packs.scatter()
    for p, old in zip(params, before):
        assert torch.equal(p.detach(), old + 10.0)
    # the gradients, which did not move, still live in the fused buffer
    assert params[1].grad.data_ptr() == segment.flat.data_ptr() + segment.starts[1] * 4


# ----------------------------------------------------------------------------- grouping
def test_pack_tensors_groups_by_dtype_dedups_skips_empty_and_honours_max_bytes():
    f32 = [torch.full((n,), float(n)) for n in (4, 8, 2, 16, 1)]
    f64 = [torch.ones(3, dtype=torch.float64), torch.ones(5, dtype=torch.float64)]
    empty = torch.ones(0)
    tensors = [f32[0], f64[0], f32[1], empty, f32[2], f32[0], f64[1], f32[3], f32[4]]
    packs = pack_tensors(tensors, max_bytes=40)
    assert [id(t) for t in packs.tensors] == [id(t) for t in f32[:1] + f64[:1] + f32[1:3] + f64[1:] + f32[3:]]
    for pack in packs:
        assert len({(t.dtype, t.device) for t in pack.tensors}) == 1
    # reference: per dtype in first-seen order, close a pack once it holds >= 40 bytes
    expected, current, size = [], [], 0
    for group in (f32, f64):
        for t in group:
            current.append(id(t))
            size += t.numel() * t.element_size()
            if size >= 40:
                expected.append(current)
                current, size = [], 0
        if current:
            expected.append(current)
            current, size = [], 0
    assert [[id(t) for t in pack.tensors] for pack in packs] == expected
    assert len(pack_tensors(tensors)) == 2  # no limit: one pack per dtype
    assert packs.same_tensors(tensors + [empty, f64[0]]) and not packs.same_tensors(list(reversed(tensors)))
    assert pack_tensors([empty]).tensors == [] and pack_tensors([empty]).gather() == []


def test_packs_cut_from_a_fused_buffer_stay_views_in_memory_order():
    model, optimizer = _fused_with_grads()
    (segment,) = flat_grad_segments(optimizer)
    grads = [p.grad for p in reversed(list(model.parameters()))]  # given out of memory order
    packs = pack_tensors(grads, max_bytes=64)
    assert len(packs) > 1 and packs.zero_copy
    cursor = segment.flat.data_ptr()
    for pack in packs:
        flat = pack.gather()
        assert flat.data_ptr() >= cursor  # ascending, non-overlapping ranges of the buffer
        cursor = flat.data_ptr() + flat.numel() * flat.element_size()


def test_a_pack_refuses_mixed_dtypes():
    with pytest.raises(ValueError, match="one device and dtype"):
        PackedTensors([torch.ones(2), torch.ones(2, dtype=torch.float64)])


# ----------------------------------------------------------------------------- reducer segments
def test_build_segments_over_a_fused_optimizer_is_its_flat_grad_buffer():
    model, optimizer = _fused_with_grads()
    params = list(model.parameters())
    (fused,) = flat_grad_segments(optimizer)
    (segment,) = build_segments(params, [optimizer])
    assert segment.shared and segment.flat is fused.flat
    for entry, param, start in zip(segment.entries, fused.params, fused.starts):
        assert entry.param is param and entry.start == start
        assert entry.view.data_ptr() == param.grad.data_ptr()  # the gradient itself, not a copy
    buckets = make_buckets([segment], 64)
    base, end = fused.flat.data_ptr(), fused.flat.data_ptr() + fused.flat.numel() * 4
    for bucket in buckets:
        assert base <= bucket.flat.data_ptr() and bucket.flat.data_ptr() + bucket.nbytes <= end
        assert not bucket.pack.copied
    # a bucket's gaps are the padding between its entries, measured from its own start
    (whole,) = make_buckets(build_segments(params, [optimizer]), 10**9)
    spans = sorted((e.start, e.end) for e in whole.entries)
    assert whole.gaps == [(e, s) for (_, e), (s, _) in zip(spans, spans[1:]) if s > e]


def test_build_segments_splits_around_parameters_the_reducer_does_not_average():
    model, optimizer = _fused_with_grads()
    params = list(model.parameters())
    averaged = [params[0], params[2], params[3]]  # the first layer's bias is left out
    segments = build_segments(averaged, [optimizer])
    assert all(s.shared for s in segments)
    assert sorted(len(s.entries) for s in segments) == [1, 2]
    assert [max(e.position for e in s.entries) for s in segments] == [2, 0]  # backward order
    for bucket in make_buckets(segments, 10**9):
        covered = {id(e.param) for e in bucket.entries}
        assert id(params[1]) not in covered
        start = bucket.flat.data_ptr()
        bias = params[1].grad.data_ptr()
        assert not (start <= bias < start + bucket.nbytes)  # the bias's gradient is outside every bucket


def test_build_segments_without_a_fused_optimizer_owns_one_flat_buffer_per_dtype():
    model = _model()
    model(torch.randn(2, 8)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    segments = build_segments(list(model.parameters()), [])
    assert len(segments) == 1 and not segments[0].shared
    (segment,) = segments
    assert torch.equal(segment.flat, torch.cat([g.reshape(-1) for g in grads]))
    for entry in segment.entries:
        assert entry.param.grad.data_ptr() == entry.view.data_ptr()
