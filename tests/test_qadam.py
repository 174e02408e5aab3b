"""Issue 14 item 1: QAdam (optimizer + ``qadam`` algorithm) against plain ``torch.distributed`` code here.

The reference averages gradients with ``all_reduce`` and steps ``torch.optim.Adam`` during
warm-up; after it, every rank folds its gradient into its momentum, quantizes the momenta with
its own min-max uint8 code (one chunk per rank, as a reduce-scatter), averages its chunk,
quantizes that again and all-gathers it; then it steps with the frozen second moment. Weights
and moments must match bit for bit on 2 and 3 ranks, and every rank must hold the same ones.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from _dist_utils import run_ranks, values
from bagua_integrations._torch_compat import compiled_kernels_may_fuse_multiply_add

WARMUP, STEPS, LR, WD = 3, 8, 0.02, 0.01
BETAS = [(0.9, 0.999), (0.8, 0.99)]  # two param groups with their own betas


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))
    model.unused = torch.nn.Linear(3, 3)  # never gets a gradient on any rank
    return model


def _groups(model):
    first = list(model[0].parameters())
    rest = list(model[2].parameters()) + list(model.unused.parameters())
    return [{"params": first, "betas": BETAS[0]}, {"params": rest, "betas": BETAS[1]}]


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 20, generator=g), torch.randn(8, 5, generator=g)


def _encode(rows):
    """Min-max uint8 whose levels include 0 exactly: (codes, spacing, code of zero) per row."""
    lo, hi = rows.amin(1, keepdim=True).clamp(max=0), rows.amax(1, keepdim=True).clamp(min=0)
    span = hi - lo
    scale = torch.where(span > 0, 255 / span, torch.zeros_like(span))
    zero = (-lo * scale).round_()
    return (rows * scale).round_().add_(zero).clamp_(0, 255).to(torch.uint8), span / 255, zero


def _decode(codes, step, zero):
    return (codes.to(torch.float32) - zero) * step


def _compressed_average(flat, rank, world, block=1024):
    """Reduce-scatter then all-gather, each moving uint8 codes with a min/max per ``block`` elements
    (written with all_gather only)."""
    import torch.distributed as dist

    chunk = -(-flat.numel() // world)
    chunk = -(-chunk // block) * block
    rows = torch.zeros(world, chunk)
    rows.view(-1)[: flat.numel()] = flat
    codes, step, zero = _encode(rows.view(-1, block))  # (world * blocks, block), (world * blocks, 1) x 2
    everyone = [[torch.empty_like(t) for _ in range(world)] for t in (codes, step, zero)]
    for out, t in zip(everyone, (codes, step, zero)):
        dist.all_gather(out, t)
    blocks = chunk // block
    mine = slice(rank * blocks, (rank + 1) * blocks)
    received = torch.stack([_decode(everyone[0][r][mine], everyone[1][r][mine], everyone[2][r][mine]).reshape(-1)
                            for r in range(world)])
    mean = received.sum(dim=0, keepdim=True).div_(world)
    codes, step, zero = _encode(mean.view(-1, block))
    parts = [[torch.empty_like(t) for _ in range(world)] for t in (codes, step, zero)]
    for out, t in zip(parts, (codes, step, zero)):
        dist.all_gather(out, t)
    return torch.cat([_decode(c, st, z).reshape(-1) for c, st, z in zip(*parts)])[: flat.numel()]


def _lerp_fold(grad, momentum, beta1):
    return grad.clone().lerp_(momentum, beta1)


def _reference(rank, world, steps=STEPS, model_fn=_model, groups_fn=_groups, fold=_lerp_fold, align=1):
    """``fold(grad, m, beta1)``: the momentum a gradient makes. ``align``: the compressed bucket
    pads each gradient but the last to a multiple of that many elements, with zeros (a fused
    optimizer's flat buffer starts each parameter on 64 bytes)."""
    import torch.distributed as dist

    model = model_fn()
    optimizer = torch.optim.Adam(groups_fn(model), lr=LR, weight_decay=WD, foreach=False)
    beta1_of = {id(p): g["betas"][0] for g in optimizer.param_groups for p in g["params"]}
    params = [p for p in model.parameters()]
    unused = {id(p) for p in model.unused.parameters()} if hasattr(model, "unused") else set()
    used = [p for p in params if id(p) not in unused]
    padding = [(-p.numel()) % align if i < len(params) - 1 else 0 for i, p in enumerate(params)]
    for step in range(1, steps + 1):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model[2](model[1](model[0](x))), y).backward()
        if step <= WARMUP:  # one bucket of every gradient, zeros for the never-used layer (gloo's
            # ring cuts the sum by size, so the reference sends the same length as the bucket)
            flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in params])
            flat.div_(world)
            dist.all_reduce(flat)
            offset = 0
            for p in params:
                offset += p.numel()
                if p.grad is not None:
                    p.grad.copy_(flat[offset - p.numel() : offset].view_as(p))
            optimizer.step()
            continue
        # the bucket holds every parameter's gradient, zeros for the never-used layer
        moments = torch.cat([torch.cat([fold(p.grad, optimizer.state[p]["exp_avg"], beta1_of[id(p)]).reshape(-1)
                                        if p.grad is not None else torch.zeros(p.numel()), torch.zeros(pad)])
                             for p, pad in zip(params, padding)])
        averaged = _compressed_average(moments, rank, world)
        offset = 0
        with torch.no_grad():
            for p, pad in zip(params, padding):
                offset += p.numel() + pad
                if p.grad is None:
                    continue
                state, beta1 = optimizer.state[p], beta1_of[id(p)]
                mine = averaged[offset - pad - p.numel() : offset - pad].view_as(p)
                state["exp_avg"].copy_(mine).add_(p, alpha=(1 - beta1) * WD)
                beta2 = next(g["betas"][1] for g in optimizer.param_groups if any(q is p for q in g["params"]))
                denom = state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**WARMUP)  # frozen v, and |update| <= lr
                denom = torch.maximum(denom, state["exp_avg"].abs() / (1 - beta1**step)).add_(1e-8)
                p.addcdiv_(state["exp_avg"], denom, value=-LR / (1 - beta1**step))
    return [p.detach().clone() for p in params], [optimizer.state[p]["exp_avg"].clone() for p in used]


def _ours(rank, world, fused=False, steps=STEPS, message_size=10_000_000, setup="constructor"):
    """``setup``: how the optimizer gets its groups: in the constructor; the second group added
    after attaching (``late_group``); or a checkpoint with the real warm-up loaded after
    attaching an optimizer built with another (``loaded``), as fairseq and Accelerate do."""
    from bagua_integrations import bagua_init, fuse_optimizer
    from bagua_integrations.distributed import collective_log
    from bagua_integrations.optim import QAdam

    model = _model()
    groups = _groups(model)
    if setup == "late_group":
        optimizer = QAdam(groups[:1], lr=LR, warmup_steps=WARMUP, weight_decay=WD)
    elif setup == "loaded":
        optimizer = QAdam(groups, lr=LR, warmup_steps=100 * WARMUP, weight_decay=WD)
        checkpoint = QAdam(_groups(_model()), lr=LR, warmup_steps=WARMUP, weight_decay=WD).state_dict()
    else:
        optimizer = QAdam(groups, lr=LR, warmup_steps=WARMUP, weight_decay=WD)
    if fused:
        fuse_optimizer(optimizer)
    wrapped, optimizer = bagua_init(model, optimizer, "qadam", message_size=message_size)
    if setup == "late_group":
        optimizer.add_param_group(groups[1])
    elif setup == "loaded":
        optimizer.load_state_dict(checkpoint)
    wire = []
    for step in range(1, steps + 1):
        x, y = _batch(rank, step)
        optimizer.zero_grad(set_to_none=True)
        collective_log.reset()
        torch.nn.functional.mse_loss(model[2](model[1](model[0](x))), y).backward()
        wire.append(dict(collective_log.bytes))
        optimizer.step()
    used = [p for p in model.parameters() if p.grad is not None]
    return [p.detach().clone() for p in model.parameters()], [optimizer.state[p]["exp_avg"].clone() for p in used], wire


def _both(rank, world, setup="constructor"):
    return {"reference": _reference(rank, world), "ours": _ours(rank, world, setup=setup)}


@pytest.mark.parametrize("world,setup", [(2, "constructor"), (3, "constructor"), (2, "late_group"), (2, "loaded")])
def test_qadam_equals_the_plain_torch_distributed_reference(world, setup):
    """Also when the groups change after attaching: a group added later is folded like the
    others, and a loaded checkpoint's warm-up is the one the algorithm follows."""
    results = values(run_ranks(_both, world, timeout=180, args=(setup,)))
    for rank, result in enumerate(results):
        ref_params, ref_moments = result["reference"]
        params, moments, wire = result["ours"]
        for a, b in zip(ref_params + ref_moments, params + moments):
            assert torch.equal(a, b), f"rank {rank}: max difference {(a - b).abs().max().item():.3g}"
        # warm-up: the fp32 gradients (and the unused-parameter flags, one int32 per parameter);
        # after it: uint8 all-to-all + all-gather, only the flags as an allreduce
        flags, fp32 = 4 * 6, 4 * sum(p.numel() for p in _model().parameters())
        if setup != "constructor":  # the changed groups are checked again on every rank (a small all_gather)
            assert wire[0].pop("all_gather", 0) > 0, wire[0]
        assert all(set(w) == {"all_reduce"} and w["all_reduce"] == fp32 + flags for w in wire[:WARMUP]), wire
        blocks = -(-(-(-fp32 // 4 // world)) // 1024)  # per rank's chunk
        sent = world * blocks * (1024 + 8)  # one byte per element (padded to blocks), 8 per block
        assert all(w["all_reduce"] == flags and w["all_to_all"] == sent and w["all_gather"] == sent // world
                   for w in wire[WARMUP:]), wire
    for other in results[1:]:  # the replicas are the same, moments included
        for a, b in zip(results[0]["ours"][0] + results[0]["ours"][1], other["ours"][0] + other["ours"][1]):
            assert torch.equal(a, b)
    # the warm-up really was Adam and the later steps moved the weights (the comparison can fail)
    first, _ = results[0]["reference"]
    assert not torch.equal(first[0], _model()[0].weight)


def _dead_inputs(rank, world, zero_exact=True):
    """Inputs 0-3 are always 0, so their weight columns never get a gradient: m = v = 0 there."""
    from bagua_integrations import bagua_init
    from bagua_integrations.distributed.algorithms import MinMaxUInt8
    from bagua_integrations.optim import QAdam

    model = _model()
    before = model[0].weight.detach().clone()
    optimizer = QAdam(model.parameters(), lr=LR, warmup_steps=2)
    wrapped, _ = bagua_init(model, optimizer, "qadam")
    wrapped.algorithm._compressed.codec = MinMaxUInt8(zero_exact=zero_exact)
    for step in range(1, 6):
        x, y = _batch(rank, step)
        x[:, :4] = 0
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model[2](model[1](model[0](x))), y).backward()
        optimizer.step()
    return {"dead_moved": (model[0].weight[:, :4] - before[:, :4]).abs().max().item(),
            "live_moved": (model[0].weight[:, 4:] - before[:, 4:]).abs().max().item()}


def test_weights_that_never_had_a_gradient_stay_put_after_warmup():
    """Momentum 0 must decode to exactly 0: with v = 0 any rounding noise is divided by eps
    (min-max levels without 0 moved these weights by ~1e5 in 3 steps)."""
    for result in values(run_ranks(_dead_inputs, 2, timeout=120)):
        assert result["dead_moved"] == 0.0 and result["live_moved"] > 1e-3, result


def _aligned_run(rank, world, fused):
    """One param group whose sizes are multiples of 16 floats: the fused flat buffer has no alignment
    gaps, so its one bucket holds exactly what the unfused reducer's bucket holds."""
    from bagua_integrations import bagua_init, fuse_optimizer, fusion_report
    from bagua_integrations.optim import QAdam

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    optimizer = QAdam(model.parameters(), lr=LR, warmup_steps=WARMUP, weight_decay=WD)
    if fused:
        fuse_optimizer(optimizer)
    wrapped, optimizer = bagua_init(model, optimizer, "qadam")
    if fused:
        assert wrapped.reducer.zero_copy  # the buckets are slices of the fused flat gradients
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        optimizer.fuse_step() if fused else optimizer.step()
    if fused:
        assert fusion_report(optimizer).fused_params == 4 and fusion_report(optimizer).last_step_fused
    return [p.detach().clone() for p in model.parameters()] + [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]


def _fused_and_plain(rank, world):
    return {"plain": _aligned_run(rank, world, fused=False), "fused": _aligned_run(rank, world, fused=True)}


def test_fused_qadam_communicates_slices_of_its_flat_buffers_and_matches():
    """fuse_optimizer(QAdam): the buckets are its flat gradient buffer, the step runs on flat
    buffers, and weights and momenta equal the unfused run's."""
    results = values(run_ranks(_fused_and_plain, 2, timeout=180))
    for result in results:
        for a, b in zip(result["plain"], result["fused"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(results[0]["fused"], results[1]["fused"]):
        assert torch.equal(a, b)


def _every_parameter_used():
    """No parameter a multiple of 16 floats but the first: the fused buffers pad between them."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 61), torch.nn.Tanh(), torch.nn.Linear(61, 5))


def _one_group(model):
    return [{"params": list(model.parameters()), "betas": BETAS[0]}]


def _fill_padding_between(tensors, value):
    """Write ``value`` into the storage between tensors that lie in one flat buffer."""
    ordered = sorted(tensors, key=lambda t: t.storage_offset())
    for before, after in zip(ordered, ordered[1:]):
        start = before.storage_offset() + before.numel()
        if after.storage_offset() > start:
            torch.empty(0).set_(before.untyped_storage(), start, (after.storage_offset() - start,)).fill_(value)


def _fused_compiled_codec(rank, world):
    """A fused QAdam whose codec compiles (``BAGUA_COMPILE_CODECS=1``, as buckets of 2**20
    elements and more do by default): its encoder folds the gradients into the momentum."""
    import os

    from bagua_integrations import bagua_init, fuse_optimizer
    from bagua_integrations.distributed.algorithms import bytegrad
    from bagua_integrations.optim import QAdam

    os.environ["BAGUA_COMPILE_CODECS"] = "1"
    model = _every_parameter_used()
    optimizer = fuse_optimizer(QAdam(_one_group(model), lr=LR, warmup_steps=WARMUP, weight_decay=WD), replace_step=True)
    wrapped, optimizer = bagua_init(model, optimizer, "qadam")
    assert wrapped.reducer.zero_copy
    for step in range(1, STEPS + 1):
        x, y = _batch(rank, step)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        optimizer.step()
        if step == WARMUP:  # the flat momentum's padding belongs to no parameter: it may hold anything
            _fill_padding_between([optimizer.state[p]["exp_avg"] for p in model.parameters()], 1e20)
    folding_encoder = bytegrad._KERNELS.get((bytegrad._fold_encode_blocks_into, True, True))
    ours = [p.detach().clone() for p in model.parameters()], [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    reference = _reference(rank, world, model_fn=_every_parameter_used, groups_fn=_one_group, align=16,
                           fold=lambda grad, m, beta1: m - (m - grad) * (1 - beta1))
    return {"ours": ours, "reference": reference, "compiled folds": folding_encoder and folding_encoder.compiled_calls}


@pytest.mark.skipif(compiled_kernels_may_fuse_multiply_add("cpu"), reason="the compiled encoder folds only where "
                    "compiled CPU kernels keep a * b + c as two roundings (torch 2.13 and later)")
def test_fused_qadam_with_a_compiled_codec_folds_in_the_encoder_and_equals_the_reference():
    """The compiled encoder reads the gradients and the fused optimizer's flat momentum and
    encodes the momentum they make (``m - (m - g) * (1 - beta1)``) without storing it: the
    weights and momenta equal the plain torch.distributed reference's bit for bit, on every rank,
    whatever the padding of the flat momentum holds. (test_codec checks that folding with
    ``lerp_`` instead gives other bytes.)"""
    results = values(run_ranks(_fused_compiled_codec, 2, timeout=300))
    for rank, result in enumerate(results):
        assert result["compiled folds"] == STEPS - WARMUP, result["compiled folds"]
        for a, b in zip(result["reference"][0] + result["reference"][1], result["ours"][0] + result["ours"][1]):
            assert torch.equal(a, b), f"rank {rank}: max difference {(a - b).abs().max().item():.3g}"
    for a, b in zip(results[0]["ours"][0], results[1]["ours"][0]):
        assert torch.equal(a, b)


def _warmup_only(rank, world):
    return {"reference": _reference(rank, world, steps=WARMUP), "ours": _ours(rank, world, fused=True, steps=WARMUP)[:2]}


def test_fused_warmup_is_adam_on_averaged_gradients():
    for result in values(run_ranks(_warmup_only, 2, timeout=120)):
        for a, b in zip(result["reference"][0], result["ours"][0]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------- single process
def test_qadam_alone_is_adam_then_frozen_second_moment():
    from bagua_integrations.optim import QAdam

    torch.manual_seed(1)
    ours = [torch.randn(4, 3, requires_grad=True), torch.randn(5, requires_grad=True)]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    qadam = QAdam(ours, lr=0.01, warmup_steps=2, weight_decay=0.1)
    adam = torch.optim.Adam(ref, lr=0.01, weight_decay=0.1, foreach=False)
    for step in range(1, 6):
        for p, q in zip(ours, ref):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        qadam.step()
        if step <= 2:
            adam.step()
            for p, q in zip(ours, ref):
                assert torch.equal(p, q)
        else:
            frozen = [adam.state[q]["exp_avg_sq"] for q in ref]
            for p, v in zip(ours, frozen):
                assert torch.equal(qadam.state[p]["exp_avg_sq"], v)


def test_qadam_bounds_the_update_where_v_froze_at_zero():
    """An element with no gradient during warm-up (v = 0) that gets one later moves by at most lr
    (Bagua's QAdam divided its momentum by eps there)."""
    from bagua_integrations.optim import QAdam

    p = torch.zeros(4, requires_grad=True)
    optimizer = QAdam([p], lr=0.01, warmup_steps=2, decoupled_weight_decay=True, weight_decay=0.1)
    for step in range(6):
        before = p.detach().clone()
        p.grad = torch.tensor([1.0, 0.0, 0.0, 0.0]) if step < 2 else torch.tensor([1.0, 5.0, 0.0, 0.0])
        optimizer.step()
        assert (p - before).abs().max() <= 0.01 * (1 + 1e-6) + 0.1 * 0.01 * before.abs().max()
    assert p[1] < -0.02 and p[2] == 0.0  # the late element moved, at lr per step; the idle one did not


def test_qadam_refuses_a_warmup_of_zero_steps():
    from bagua_integrations.optim import QAdam

    with pytest.raises(ValueError, match="warmup_steps"):
        QAdam([torch.zeros(2, requires_grad=True)], warmup_steps=0)


def test_qadam_algorithm_refuses_other_optimizers_and_join_and_bare_tensors():
    from bagua_integrations.distributed import AlgorithmConfigError, JoinError, QAdamAlgorithm
    from bagua_integrations.optim import QAdam

    params = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(AlgorithmConfigError, match="QAdam"):
        QAdamAlgorithm().attach(params, torch.optim.Adam(params))
    # given to the constructor (Bagua's QAdamAlgorithm(q_adam_optimizer)), a torch Adam went on to a
    # bare KeyError: 'warmup_steps' inside with_bagua
    for build in (lambda adam: QAdamAlgorithm(adam), lambda adam: QAdamAlgorithm(q_adam_optimizer=adam)):
        with pytest.raises(AlgorithmConfigError, match="QAdam optimizer and got Adam"):
            build(torch.optim.Adam(params))
    qadam = QAdam(params)
    assert QAdamAlgorithm(q_adam_optimizer=qadam).optimizer is qadam
    with pytest.raises(AlgorithmConfigError, match="two optimizers"):
        QAdamAlgorithm(QAdam(params), q_adam_optimizer=qadam)
    algorithm = QAdamAlgorithm()
    optimizer = QAdam(params)
    algorithm.attach(params, [optimizer])
    with pytest.raises(JoinError):
        algorithm.validate_join()
    with pytest.raises(AlgorithmConfigError, match="allreduce_parameter_gradients"):
        algorithm.bucket_stages(torch.zeros(3), None)
    algorithm.detach()
    assert not optimizer.momentum_in_grad  # alone again: it folds its gradients itself


def test_qadam_in_one_process_folds_its_own_momentum():
    """One process communicates nothing, so nothing folds the gradients: the optimizer must
    (fairseq attaches the algorithm even then). A 1-rank DDP calls the hook: it must not fold."""
    from bagua_integrations.distributed import QAdamAlgorithm
    from bagua_integrations.optim import QAdam

    def run(attach):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 3))]
        optimizer = QAdam(params, lr=0.1, warmup_steps=1)
        if attach:
            algorithm = QAdamAlgorithm().attach(params, optimizer)
            assert not optimizer.momentum_in_grad
        for step in range(4):
            params[0].grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
            if attach:
                list(algorithm.bucket_stages(params[0].grad.view(-1), [(params[0], params[0].grad)]))
            optimizer.step()
        return params[0].detach(), optimizer.state[params[0]]["exp_avg"]

    for alone, attached in zip(run(False), run(True)):
        assert torch.equal(alone, attached)


def _accumulate(rank, world, exchange_every_backward):
    from bagua_integrations import bagua_init
    from bagua_integrations.distributed import AlgorithmConfigError
    from bagua_integrations.optim import QAdam

    model = _model()
    wrapped, optimizer = bagua_init(model, QAdam(model.parameters(), lr=LR, warmup_steps=1), "qadam")
    for step in range(1, 4):
        for micro in range(2):
            x, y = _batch(rank, 10 * step + micro)
            context = wrapped.no_sync() if micro == 0 and not exchange_every_backward else contextlib.nullcontext()
            with context:
                try:
                    torch.nn.functional.mse_loss(model[2](model[1](model[0](x))), y).backward()
                except AlgorithmConfigError as error:
                    return f"step {step}: {error}"
        optimizer.step()
        optimizer.zero_grad()
    return "ok"


def test_qadam_refuses_a_second_momentum_exchange_before_the_step():
    """Accumulating gradients without no_sync() would fold the momentum once per backward."""
    assert values(run_ranks(_accumulate, 2, timeout=120, args=(False,))) == ["ok", "ok"]
    for message in values(run_ranks(_accumulate, 2, timeout=120, args=(True,))):
        assert message.startswith("step 2: ") and "no_sync()" in message, message  # step 1 is warm-up


def _last_layer_dropped(rank, world, fused):
    """The last layer is used by every rank through warm-up and one compressed step, then by none."""
    from bagua_integrations import bagua_init, fuse_optimizer
    from bagua_integrations.distributed import AlgorithmConfigError
    from bagua_integrations.optim import QAdam

    model = _model()
    optimizer = QAdam(model.parameters(), lr=LR, warmup_steps=WARMUP)
    if fused:
        fuse_optimizer(optimizer)
    wrapped, optimizer = bagua_init(model, optimizer, "qadam")
    last = model[2]
    for step in range(1, WARMUP + 5):
        x, y = _batch(rank, step)
        optimizer.zero_grad(set_to_none=True)
        hidden = model[1](model[0](x))
        out = last(hidden) if step <= WARMUP + 1 else hidden[:, :5]
        try:
            torch.nn.functional.mse_loss(out, y).backward()
        except AlgorithmConfigError as error:
            return f"step {step}: {error}"
        optimizer.step()
        if step == WARMUP + 1:
            kept = [t.detach().clone() for p in last.parameters() for t in (p, optimizer.state[p]["exp_avg"])]
    now = [t.detach().clone() for p in last.parameters() for t in (p, optimizer.state[p]["exp_avg"])]
    assert all(torch.equal(a, b) for a, b in zip(kept, now)), "the dropped layer moved"
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_a_layer_no_rank_uses_after_warmup_is_not_a_second_exchange(fused):
    """A parameter no rank used this round is folded with its bucket, but the step skips it (grad
    None) and its step count stays: keyed by that count, its next fold was refused as a second
    exchange for the same step ("qadam exchanged a parameter's momentum twice"). A fold now counts
    until the optimizer's next step, whichever parameters that step moves."""
    first, second = values(run_ranks(_last_layer_dropped, 2, timeout=120, args=(fused,)))
    assert not isinstance(first, str), first
    assert all(torch.equal(a, b) for a, b in zip(first, second))  # the ranks agree


def test_qadam_checks_every_group_it_is_given():
    """A group's own settings (add_param_group, load_state_dict) are checked like the constructor's,
    before anything is replaced; a torch Adam checkpoint loads, with QAdam's own keys defaulted."""
    from bagua_integrations.optim import QAdam

    p = torch.nn.Parameter(torch.ones(3))
    for bad in (dict(warmup_steps=0), dict(warmup_steps=2.5), dict(warmup_steps=None), dict(betas=(0.9,)),
                dict(betas=(1.0, 0.9)), dict(lr=-1.0), dict(eps="1e-8")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            QAdam([p], **bad)
        optimizer = QAdam([p], warmup_steps=2)
        with pytest.raises(ValueError, match="group 1"):
            optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], **bad})
        assert len(optimizer.param_groups) == 1
    optimizer = QAdam([p], warmup_steps=2)
    checkpoint = optimizer.state_dict()
    checkpoint["param_groups"][0]["warmup_steps"] = 0
    with pytest.raises(ValueError, match="group 0: invalid warmup_steps 0"):
        optimizer.load_state_dict(checkpoint)
    assert optimizer.param_groups[0]["warmup_steps"] == 2
    adam = torch.optim.Adam([p])
    p.grad = torch.ones(3)
    adam.step()
    optimizer.load_state_dict(adam.state_dict())
    optimizer.step()
    assert optimizer.param_groups[0]["warmup_steps"] == 2 and optimizer.state[p]["step"] == 2


def _mismatched_warmup(rank, world):
    from bagua_integrations import bagua_init
    from bagua_integrations.optim import QAdam

    model = _model()
    bagua_init(model, QAdam(model.parameters(), warmup_steps=3 + rank), "qadam")


def test_ranks_with_different_warmups_fail_by_name_on_every_rank():
    results = run_ranks(_mismatched_warmup, 2, timeout=120, pg_timeout=30)
    for result in results:
        assert result.error_type == "bagua_integrations.distributed.errors.ModelMismatchError", result.describe()
        assert "warmup_steps" in result.error


def _switching(rank, world):
    from bagua_integrations.distributed import ModelSwitchWrapper
    from bagua_integrations.optim import QAdam

    model = _model()
    optimizer = QAdam(model.parameters(), lr=LR, warmup_steps=2)
    switcher = ModelSwitchWrapper(model, optimizer)
    seen = []
    step = 0
    for name in ("gradient_allreduce", "qadam", "async", "QAdam", "gradient_allreduce"):  # Bagua's names work too
        switcher.switch_to(name, **({"sync_interval_ms": 0} if name == "async" else {}))
        seen.append((type(switcher.algorithm).__name__, optimizer.momentum_in_grad))
        for _ in range(4):
            step += 1
            x, y = _batch(rank, step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model[2](model[1](model[0](x))), y).backward()
            optimizer.step()
    return {"seen": seen, "weights": [p.detach().clone() for p in model.parameters()]}


def test_switching_between_qadam_async_and_allreduce():
    """switch_to takes the new algorithms by name; qadam's hold on the optimizer ends with it; ranks agree."""
    results = values(run_ranks(_switching, 2, timeout=180))
    assert [s for s, _ in results[0]["seen"]] == ["GradientAllReduce", "QAdamAlgorithm", "AsyncModelAverage",
                                                  "QAdamAlgorithm", "GradientAllReduce"]
    assert [flag for _, flag in results[0]["seen"]] == [False, True, False, True, False]
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        assert torch.equal(a, b)


def test_hf_refuses_loss_scaling_and_clipping_under_qadam():
    pytest.importorskip("transformers")
    from hf_plugin._algorithms import check_gradient_handling
    from hf_plugin.errors import AlgorithmSetupError

    from bagua_integrations.distributed import get_algorithm

    qadam = get_algorithm("qadam")
    with pytest.raises(AlgorithmSetupError, match="bf16 or fp32"):
        check_gradient_handling(qadam, loss_scaling=True, clipping=False)
    with pytest.raises(AlgorithmSetupError, match="max_grad_norm=0"):
        check_gradient_handling(qadam, loss_scaling=False, clipping=True)
    check_gradient_handling(qadam, loss_scaling=False, clipping=False)
    check_gradient_handling(get_algorithm("bytegrad"), loss_scaling=True, clipping=True)  # others do not care
