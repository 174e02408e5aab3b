"""Single-process tests of the distributed core: the registry, bad input, world size 1,
and the building blocks (codec, peer schedule, flat packing, buckets, step hooks, reducer)."""

from __future__ import annotations

import pytest
import torch

from _dist_models import MLP, Branchy, global_batches, loss_fn
from _dist_utils import run_ranks, values
from bagua_integrations import fuse_optimizer
from bagua_integrations._flat import pack_tensors
from bagua_integrations.distributed import (
    BMUF,
    AlgorithmConfigError,
    BaguaModule,
    DistributedAlgorithm,
    DistributedError,
    GradientAlgorithm,
    MinMaxUInt8,
    ModelAlgorithm,
    ModelSwitchWrapper,
    Reducer,
    ReducerStateError,
    StepHooks,
    UnknownAlgorithmError,
    WireMeter,
    allreduce_parameters,
    bagua_init,
    broadcast_parameters,
    get_algorithm,
    list_algorithms,
    register_algorithm,
)
from bagua_integrations.distributed.algorithms.decentralized import shift_one_peer
from bagua_integrations.distributed.bucketing import build_segments, make_buckets
from bagua_integrations.fused_optimizer import fused_layout

BUILTIN = ["bmuf", "bytegrad", "decentralized", "gradient_allreduce"]


# ---------------------------------------------------------------------- registry and bad input
def test_registry_lists_builtin_algorithms_with_their_kind():
    assert set(BUILTIN) <= set(list_algorithms())
    kinds = {name: get_algorithm(name).kind for name in BUILTIN}
    assert kinds == {"bmuf": "model", "bytegrad": "gradient", "decentralized": "model", "gradient_allreduce": "gradient"}
    assert get_algorithm(DistributedAlgorithm.Decentralize).name == "decentralized"
    assert get_algorithm("GRADIENT_ALLREDUCE").name == "gradient_allreduce"


def test_unknown_algorithm_names_the_registered_ones():
    with pytest.raises(UnknownAlgorithmError, match="gradient_allreduce") as info:
        get_algorithm("allreduce_but_faster")
    assert isinstance(info.value, DistributedError) and isinstance(info.value, RuntimeError)
    with pytest.raises(UnknownAlgorithmError):
        get_algorithm(42)


def test_bad_algorithm_arguments_are_named_errors():
    with pytest.raises(AlgorithmConfigError, match="accepts: .*peer_selection_mode"):
        get_algorithm("decentralized", peer_mode="all")
    with pytest.raises(AlgorithmConfigError, match="peer_selection_mode"):
        get_algorithm("decentralized", peer_selection_mode="ring")
    with pytest.raises(AlgorithmConfigError, match="communication_interval"):
        get_algorithm("decentralized", communication_interval=0)
    with pytest.raises(AlgorithmConfigError, match="global_sync_iter"):
        get_algorithm("bmuf", global_sync_iter=0)
    with pytest.raises(AlgorithmConfigError, match="hierarchical"):
        get_algorithm("bmuf", hierarchical=True)
    # (a NaN block momentum turned the weights to NaN at the first block sync)
    for bad in (dict(block_momentum=float("nan")), dict(block_momentum=1.0), dict(block_momentum=-0.1),
                dict(block_lr=float("inf")), dict(block_lr=0.0), dict(block_lr="fast"), dict(block_lr=True)):
        with pytest.raises(AlgorithmConfigError, match=next(iter(bad))):
            get_algorithm("bmuf", **bad)
    assert get_algorithm("bmuf", block_momentum=0.0, block_lr=2.0).block_lr == 2.0
    with pytest.raises(AlgorithmConfigError, match="message_size"):
        get_algorithm("gradient_allreduce", message_size=0)
    with pytest.raises(AlgorithmConfigError, match="extra arguments"):
        get_algorithm(get_algorithm("bytegrad"), hierarchical=False)


def test_register_a_custom_algorithm():
    @register_algorithm("test_sum_only")
    class SumOnly(GradientAlgorithm):
        name = "test_sum_only"

        def average(self, flat, group):
            yield from ()

    assert isinstance(get_algorithm("test_sum_only"), SumOnly)
    with pytest.raises(AlgorithmConfigError, match="already registered"):
        register_algorithm("test_sum_only", lambda: SumOnly())
    register_algorithm("test_sum_only", lambda: SumOnly(), overwrite=True)


def test_bmuf_needs_its_optimizer_and_an_attach_before_stepping():
    params = list(MLP().parameters())
    with pytest.raises(AlgorithmConfigError, match="resets its state"):
        BMUF(warmup_iterations=5).attach(params)
    with pytest.raises(AlgorithmConfigError, match="averages its state"):
        BMUF(warmup_iterations=0, average_sync=True).attach(params)
    with pytest.raises(AlgorithmConfigError, match="before the first"):
        BMUF(warmup_iterations=0).after_step(params)
    bmuf = BMUF(warmup_iterations=0).attach(params)
    with pytest.raises(AlgorithmConfigError, match="same ones"):
        bmuf.after_step(list(MLP().parameters()))


def test_bagua_init_refuses_bad_input():
    model = MLP()
    with pytest.raises(AlgorithmConfigError, match="torch.optim.Optimizer"):
        bagua_init(model, "sgd")
    wrapped, _ = bagua_init(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(AlgorithmConfigError, match="already wrapped"):
        bagua_init(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(AlgorithmConfigError, match="exactly one optimizer"):
        bagua_init(MLP(), [], "decentralized")
    with pytest.raises(UnknownAlgorithmError):
        bagua_init(MLP(), None, "nope")


def test_reducer_needs_a_gradient_algorithm_and_trainable_parameters():
    with pytest.raises(AlgorithmConfigError, match="gradient algorithm"):
        Reducer(MLP().parameters(), get_algorithm("bmuf"))
    frozen = MLP().requires_grad_(False)
    with pytest.raises(AlgorithmConfigError, match="requires grad"):
        Reducer(frozen.parameters(), get_algorithm("gradient_allreduce"))


# ---------------------------------------------------------------------- world size 1 runs plainly
@pytest.mark.parametrize("name", BUILTIN)
def test_world_size_one_trains_exactly_like_plain_pytorch(name):
    plain, ours = MLP(), MLP()
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    wrapped, opt_ours = bagua_init(ours, opt_ours, name)
    assert isinstance(wrapped, BaguaModule) and wrapped.unwrap() is ours and wrapped.module is ours
    for x, y in global_batches(3, 4, 1):
        for model, opt in ((plain, opt_plain), (wrapped, opt_ours)):
            opt.zero_grad()
            with wrapped.no_sync():
                pass
            loss_fn(model, x, y).backward()
            opt.step()
    for a, b in zip(plain.parameters(), ours.parameters()):
        assert torch.equal(a, b)


def test_framework_entry_points_are_no_ops_without_a_process_group():
    grads = [torch.randn(3, 4), None]
    before = grads[0].clone()
    get_algorithm("bytegrad").allreduce_gradients(grads)
    assert torch.equal(grads[0], before)
    model = MLP()
    params = list(model.parameters())
    snapshot = [p.detach().clone() for p in params]
    assert get_algorithm("decentralized").after_step(params, step=1) is False
    assert BMUF(warmup_iterations=0, global_sync_iter=1).attach(params).after_step(step=1) is False
    broadcast_parameters(model)
    allreduce_parameters(model)
    assert all(torch.equal(p, s) for p, s in zip(params, snapshot))


def test_model_switch_wrapper_single_process():
    model = MLP()
    wrapper = ModelSwitchWrapper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(DistributedError, match="switch_to"):
        wrapper(torch.randn(2, 8))
    assert wrapper.switch_to("gradient_allreduce") is wrapper
    assert wrapper.algorithm.name == "gradient_allreduce"
    wrapper.switch_to(DistributedAlgorithm.BMUF, warmup_iterations=0)
    assert wrapper.algorithm.name == "bmuf"
    assert wrapper(torch.randn(2, 8)).shape == (2, 4)
    assert sorted(wrapper.state_dict()) == sorted(model.state_dict())
    assert [n for n, _ in wrapper.named_parameters()] == ["module." + n for n, _ in model.named_parameters()]
    # a checkpoint saved from a DDP model ("module." keys) loads, as into BaguaModule; with strict=False
    # it loaded nothing before, silently
    other = MLP()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    for strict in (True, False):
        wrapper.load_state_dict({"module." + k: v for k, v in other.state_dict().items()}, strict=strict)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
        with torch.no_grad():
            model.fc1.weight.zero_()
    with pytest.raises(AlgorithmConfigError, match="intra_comm_root_rank"):
        ModelSwitchWrapper(model, None, intra_comm_root_rank=1)


def test_model_switch_wrapper_constructor_kwargs_are_shared_defaults():
    model = MLP()
    wrapper = ModelSwitchWrapper(model, torch.optim.SGD(model.parameters(), lr=0.1), peer_selection_mode="shift_one",
                                 communication_interval=3)
    assert wrapper.switch_to("gradient_allreduce").algorithm.name == "gradient_allreduce"
    algorithm = wrapper.switch_to("decentralized", communication_interval=5).algorithm
    assert (algorithm.peer_selection_mode, algorithm.communication_interval) == ("shift_one", 5)
    with pytest.raises(AlgorithmConfigError, match="does not accept"):
        wrapper.switch_to("bytegrad", peer_selection_mode="all")


def test_bagua_init_settings_reach_the_algorithm():
    wrapped, _ = bagua_init(MLP(), None, "bytegrad", hierarchical_reduce=False, message_size=1234)
    assert (wrapped.algorithm.hierarchical, wrapped.algorithm.message_size) == (False, 1234)
    mine = get_algorithm("gradient_allreduce", message_size=77)
    wrapped, _ = bagua_init(MLP(), None, mine)
    assert wrapped.algorithm is mine and mine.message_size == 77
    with pytest.raises(AlgorithmConfigError, match="hierarchical"):
        bagua_init(MLP(), torch.optim.SGD(MLP().parameters(), lr=0.1), "bmuf", hierarchical_reduce=True)


# ---------------------------------------------------------------------- building blocks
@pytest.mark.parametrize("width", [1000, 999], ids=["codes-in-words", "codes-in-order"])
def test_min_max_uint8_error_bound(width):
    codec = MinMaxUInt8()
    rows = torch.randn(5, width) * torch.arange(1, 6).unsqueeze(1)
    rows[4] = 3.25  # a constant row is exact
    packed = codec.encode(rows)
    assert packed.dtype == torch.uint8 and packed.shape == (5, width + 8)
    decoded = codec.decode(packed)
    bound = (rows.amax(1) - rows.amin(1)) / 510 + 1e-6
    errors = (decoded - rows).abs().amax(1)
    assert (errors <= bound).all(), (errors, bound)
    assert (errors[:4] > bound[:4] / 10).all()  # really quantized
    assert torch.equal(decoded[4], rows[4])
    assert torch.equal(decoded.amin(1)[:4], rows.amin(1)[:4])  # min and max travel exactly


@pytest.mark.parametrize("size", [2, 4, 6, 8])
def test_shift_one_pairs_halves_and_rotates(size):
    half = size // 2
    seen = {rank: set() for rank in range(size)}
    for round_index in range(half):
        peers = [shift_one_peer(rank, size, round_index) for rank in range(size)]
        for rank, peer in enumerate(peers):
            assert peers[peer] == rank and (rank < half) != (peer < half)
            seen[rank].add(peer)
    # within half rounds every rank met every rank of the other half: a new partner each round
    assert all(len(partners) == half for partners in seen.values())


def test_param_pack_is_zero_copy_over_a_fused_buffer_and_copies_otherwise():
    model = MLP()
    optimizer = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    pack = pack_tensors(model.parameters())
    assert pack.zero_copy
    (flat,) = pack.gather()
    assert flat.data_ptr() == fused_layout(optimizer).groups[0].buffers[0].param.data_ptr()
    flat.add_(1.0)
    pack.scatter()
    plain = MLP()
    copied = pack_tensors(plain.parameters())
    assert not copied.zero_copy
    (flat,) = copied.gather()
    flat.mul_(0)
    copied.scatter()
    assert all((p == 0).all() for p in plain.parameters())
    # a fused parameter whose storage was replaced: the pack notices and copies instead
    model.fc1.weight.data = model.fc1.weight.data.clone()
    (flat,) = pack.gather()
    assert not pack.zero_copy and torch.equal(flat[: model.fc1.weight.numel()], model.fc1.weight.detach().reshape(-1))


def test_buckets_hold_at_least_message_size_bytes_in_reverse_order():
    model = MLP()
    params = list(model.parameters())
    segments = build_segments(params, [])
    buckets = make_buckets(segments, 256)
    order = [entry.param for bucket in buckets for entry in bucket.entries]
    assert [id(p) for p in order] == [id(p) for p in reversed(params)]
    assert all(bucket.nbytes >= 256 for bucket in buckets[:-1])
    assert sum(len(b.entries) for b in buckets) == len(params)
    assert len(make_buckets(segments, 10**9)) == 1


def test_fused_segments_keep_alignment_gaps_and_tensor_buckets_reuse_flat_memory():
    model = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Linear(5, 3))
    optimizer = fuse_optimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    segments = build_segments(list(model.parameters()), [optimizer])
    assert len(segments) == 1 and segments[0].shared
    bucket = make_buckets(segments, 10**9)[0]
    assert len(bucket.gaps) == 3  # 40, 5 and 15 elements: slots padded to 16-element boundaries
    bucket.flat.fill_(1.0)
    bucket.zero_gaps()
    assert all((bucket.flat[a:b] == 0).all() for a, b in bucket.gaps)
    grads = [e.view for e in segments[0].entries]
    (tensor_bucket,) = pack_tensors(grads, 10**9)
    assert not tensor_bucket.copied
    separate = [torch.ones(3), torch.ones(2, 2)]
    assert [b.copied for b in pack_tensors(separate, 100)] == [True]  # two storages: one flat copy
    assert [b.copied for b in pack_tensors(separate, 8)] == [False, False]  # one tensor per bucket: itself


def test_reducer_single_process_keeps_unused_grads_none_and_grads_flat():
    model = Branchy()
    reducer = Reducer(model.parameters(), get_algorithm("gradient_allreduce"), message_size=64)
    loss_fn(model, torch.randn(4, 8), torch.randn(4, 4)).backward()
    assert reducer.rounds == 1
    assert model.side.weight.grad is None and model.never.weight.grad is None
    flats = {id(s.flat) for s in reducer.segments}
    assert len(flats) == 1
    flat = reducer.segments[0].flat
    for p in (model.fc1.weight, model.fc2.bias):
        assert flat.data_ptr() <= p.grad.data_ptr() < flat.data_ptr() + flat.numel() * 4
    reducer.detach()
    model.zero_grad()
    loss_fn(model, torch.randn(4, 8), torch.randn(4, 4)).backward()
    assert reducer.rounds == 1


def test_reducer_refuses_an_optimizer_fused_after_it():
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reducer = Reducer(model.parameters(), get_algorithm("gradient_allreduce"), optimizers=[optimizer])
    fuse_optimizer(optimizer)
    with pytest.raises(ReducerStateError, match="fuse_optimizer\\(optimizer\\) first"):
        reducer.before_step()


@pytest.mark.parametrize("mode", ["plain", "fused", "fused_replace_step", "plain_with_scheduler", "fused_replace_with_scheduler"])
def test_step_hooks_run_once_per_step_after_the_update(mode):
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    if mode.startswith("fused"):
        fuse_optimizer(optimizer, replace_step="replace" in mode)
    if mode.endswith("scheduler"):
        torch.optim.lr_scheduler.StepLR(optimizer, 1)
    calls = []

    def after():
        # the update has landed and per-parameter state is back in place
        state = optimizer.state[model.fc1.weight]
        calls.append(("after", torch.equal(model.fc1.weight.detach(), before_w), state["exp_avg"].shape))

    hooks = StepHooks(optimizer, before=lambda: calls.append(("before",)), after=after)
    step = optimizer.fuse_step if mode == "fused" else optimizer.step
    for _ in range(2):
        before_w = model.fc1.weight.detach().clone()
        optimizer.zero_grad()
        loss_fn(model, torch.randn(4, 8), torch.randn(4, 4)).backward()
        step = optimizer.fuse_step if mode == "fused" else optimizer.step
        step()
    assert calls == [("before",), ("after", False, model.fc1.weight.shape)] * 2
    hooks.remove()
    step = optimizer.fuse_step if mode == "fused" else optimizer.step
    step()
    assert len(calls) == 4


def test_wire_meter_counts_written_bytes(tmp_path):
    with WireMeter() as meter:
        (tmp_path / "x.bin").write_bytes(b"\0" * 100_000)
    if meter.bytes is None:
        pytest.skip("/proc/self/io is not available")
    assert 100_000 <= meter.bytes < 200_000


def test_algorithm_interface_kinds():
    assert issubclass(get_algorithm("bmuf").__class__, ModelAlgorithm)
    assert issubclass(get_algorithm("bytegrad").__class__, GradientAlgorithm)
    for name in BUILTIN:
        algorithm = get_algorithm(name)
        entry_points = ("allreduce_gradients", "ddp_comm_hook") if algorithm.kind == "gradient" else ("after_step", "attach")
        assert all(callable(getattr(algorithm, e)) for e in entry_points)


def test_an_interrupted_backward_is_refused_afterwards():
    model = MLP()
    reducer = Reducer(model.parameters(), get_algorithm("gradient_allreduce"))

    def explode(_grad):
        raise RuntimeError("user hook failed")

    handle = model.fc1.weight.register_hook(explode)  # fires after fc3/fc2 gradients were marked
    with pytest.raises(RuntimeError, match="user hook failed"):
        loss_fn(model, torch.randn(4, 8), torch.randn(4, 4)).backward()
    handle.remove()
    with pytest.raises(ReducerStateError, match="interrupted"):
        reducer.before_step()


# ---------------------------------------------------------------------- nothing kept once dropped
def test_a_reducer_the_program_drops_is_freed_and_removes_its_hooks():
    """The hooks hold the reducer weakly (a hook that held it was a cycle the garbage collector
    cannot see), so whoever uses a reducer keeps it, and a dropped one stops averaging cleanly,
    as a dropped ``DistributedDataParallel`` does: no hook is left calling into freed state."""
    import gc
    import weakref

    model = MLP()
    reducer = Reducer(model.parameters(), get_algorithm("gradient_allreduce"))

    def hooks():
        return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())

    assert hooks() == len(list(model.parameters()))
    dropped = weakref.ref(reducer)
    del reducer
    gc.collect()
    assert dropped() is None, "the reducer is kept alive by its own gradient hooks"
    assert hooks() == 0
    loss_fn(model, torch.randn(4, 8), torch.randn(4, 4)).backward()  # plain local gradients
    assert all(p.grad is not None for p in model.parameters())


def _freed_once_dropped(rank, world, algorithm):
    import gc
    import weakref

    import torch.distributed as dist

    from bagua_integrations import bagua_init

    def build_and_train():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped, _ = bagua_init(model, optimizer, algorithm, process_group=dist.new_group())
        for step in range(3):
            optimizer.zero_grad()
            wrapped(torch.full((2, 4), float(rank + step))).sum().backward()
            optimizer.step()
        if algorithm == "async":  # the end of training (HF's callback does it): its rounds keep it until then
            wrapped.algorithm.abort()
        return [weakref.ref(o) for o in (model, wrapped, optimizer)]

    refs = build_and_train()
    gc.collect()
    return [ref() is not None for ref in refs]


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "bytegrad", "decentralized", "async"])
def test_a_model_and_its_optimizer_are_freed_once_the_program_drops_them(algorithm):
    """Each parameter's gradient hook held the reducer, which holds the parameter: a cycle through
    autograd's hook storage that Python's garbage collector cannot see. Every model a program built
    (one per trial of a hyperparameter search) stayed in memory with its optimizer state, and its
    process group's gloo threads ran into the interpreter's teardown."""
    for result in run_ranks(_freed_once_dropped, 2, (algorithm,), timeout=120):
        assert result.ok, result.describe()
        assert result.value == [False, False, False], f"still alive (model, wrapper, optimizer): {result.value}"


@pytest.mark.parametrize("call, says", [
    (lambda m, o: get_algorithm("gradient_allreduce", message_size="10"), "message_size must be a whole number"),
    (lambda m, o: get_algorithm("bytegrad", message_size=0.5), "message_size must be a whole number"),
    (lambda m, o: get_algorithm("gradient_allreduce", message_size=float("nan")), "message_size must be a whole"),
    (lambda m, o: bagua_init(m, o, message_size="1M"), "message_size must be a whole number"),
    (lambda m, o: get_algorithm("gradient_allreduce", hierarchical="false"), "hierarchical must be True or False"),
    (lambda m, o: bagua_init(m, o, hierarchical_reduce="no"), "hierarchical_reduce must be True or False"),
    (lambda m, o: get_algorithm("decentralized", communication_interval=True), "communication_interval"),
    (lambda m, o: get_algorithm("bytegrad", codec="uint8"), "codec must be a quantizer"),
    (lambda m, o: bagua_init(o, m), "the optimizer comes second"),
    (lambda m, o: bagua_init(m, m), "the model comes first"),
    (lambda m, o: bagua_init("model", o), "first argument is the model"),
    (lambda m, o: bagua_init(m, o, process_group="world"), "process_group must be a torch.distributed process group"),
    (lambda m, o: get_algorithm("decentralized").load_state_dict("checkpoint.pt"), "must be the dict"),
    (lambda m, o: bagua_init(m, torch.optim.SGD(MLP().parameters(), lr=0.1)), "none of this model's parameters"),
])
def test_arguments_of_the_wrong_kind_are_named_errors(call, says):
    """Each was a bare TypeError/ValueError/AttributeError, or silently taken ("false" as True, 0.5 bytes
    as 0, True as an interval of 1)."""
    from bagua_integrations.distributed import CheckpointError

    model = MLP()
    with pytest.raises((AlgorithmConfigError, CheckpointError), match=says):
        call(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_ranks_started_by_a_launcher_without_a_process_group_are_refused(monkeypatch):
    """torchrun set WORLD_SIZE=2 but the script never called init_process_group: each rank would
    have trained alone, silently (DDP raises there too)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = MLP()
    with pytest.raises(DistributedError, match="WORLD_SIZE=2.*init_process_group"):
        bagua_init(model, torch.optim.SGD(model.parameters(), lr=0.1))
    monkeypatch.setenv("WORLD_SIZE", "1")
    bagua_init(model, torch.optim.SGD(model.parameters(), lr=0.1))[0].close()


def _close_a_switch_wrapper(rank, world):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = ModelSwitchWrapper(model, optimizer).switch_to("gradient_allreduce")
    x = torch.full((2, 8), float(rank + 1))

    def grads(forward):
        optimizer.zero_grad()
        forward(x).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    averaged = grads(wrapper)
    wrapper.close()
    wrapper.close()  # once is enough
    alone = grads(model)  # the plain model trains alone: no hook averages it any more
    try:
        wrapper(x)
        refused = False
    except DistributedError:
        refused = True
    wrapper.switch_to("gradient_allreduce")  # and attaches again
    again = grads(wrapper)
    torch.manual_seed(0)
    plain = MLP()  # the same weights (no step was taken), never wrapped
    plain(x).sum().backward()
    local = [p.grad for p in plain.parameters()]
    expected = [g.clone() for g in local]
    for g in expected:
        torch.distributed.all_reduce(g)
        g /= world
    return dict(refused=refused, local=all(torch.equal(a, b) for a, b in zip(alone, local)),
                averaged=all(torch.allclose(a, b, rtol=1e-6) for a, b in zip(averaged, expected)),
                again=all(torch.allclose(a, b, rtol=1e-6) for a, b in zip(again, expected)))


def test_a_model_switch_wrapper_closes_and_its_model_trains_alone():
    """ModelSwitchWrapper had no close(): its model stayed attached, and a rank meant to go on alone
    (dropping the wrapper does not detach it) kept averaging its gradients with the others."""
    for result in values(run_ranks(_close_a_switch_wrapper, 2, timeout=120)):
        assert result == dict(refused=True, local=True, averaged=True, again=True), result


def test_a_closed_wrapper_refuses_to_train_but_still_evaluates():
    """After close() its training steps would not be averaged (the replicas drifted 0.4 apart in one
    step on 2 ranks, silently)."""
    model = MLP()
    wrapped, _ = bagua_init(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(2, 8)
    wrapped(x)
    wrapped.close()
    with pytest.raises(DistributedError, match="closed"):
        wrapped(x)
    with torch.no_grad():
        wrapped(x)
    wrapped.eval()
    wrapped(x)
