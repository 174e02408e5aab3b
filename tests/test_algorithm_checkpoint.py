"""Checkpoint and resume under every algorithm (issue 12 items 1-2): 2 gloo ranks, new processes.

Phase 1 trains ``TOTAL`` steps without interruption and, at step ``K``, saves each rank's own
checkpoint (model, optimizer, ``wrapped.algorithm_state_dict()``). Phase 2 runs in new
processes, starts from different random weights, loads the checkpoint either before
``bagua_init`` (``algorithm_state=``), model and optimizer before it and the algorithm's state
after it (the natural order), or everything after it (``wrapped.module.load_state_dict`` ...,
the DDP order), trains the remaining steps and must end bit-identical to phase 1 on every rank.
A control resumes without the algorithm state (what was possible before) and must differ, so
the comparison can see a divergence.
"""

from __future__ import annotations

import os

import pytest
import torch

from _dist_utils import run_ranks, values

K, TOTAL = 4, 9
ALGORITHMS = {
    "gradient_allreduce": ("gradient_allreduce", {}),
    "bytegrad": ("bytegrad", {"hierarchical": False}),
    "decentralized_all": ("decentralized", {"peer_selection_mode": "all", "communication_interval": 3}),
    "decentralized_shift_one": ("decentralized", {"peer_selection_mode": "shift_one", "hierarchical": False}),
    "bmuf": ("bmuf", {"block_momentum": 0.875, "global_sync_iter": 3, "warmup_iterations": 2}),
    # checkpoint taken before warmup ends: the recorded initial optimizer state must survive
    "bmuf_in_warmup": ("bmuf", {"block_momentum": 0.5, "global_sync_iter": 2, "warmup_iterations": 6}),
    # per-rank public copies of its own and its neighbours' weights
    "low_precision_decentralized": ("low_precision_decentralized", {"communication_interval": 2}),
    # state lives in its QAdam optimizer; the checkpoint falls after warm-up (compressed momentum)
    "qadam": ("qadam", {"hierarchical": False}),
}
# resuming without the algorithm state goes wrong for these (counters, global model, rank 0's weights)
# (shift_one on 2 ranks always pairs the two, whose averages are equal, so no round or weight is lost)
DIVERGE_WITHOUT_STATE = ("decentralized_all", "bmuf", "bmuf_in_warmup", "low_precision_decentralized")


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _train(wrapped, optimizer, rank, first, last):
    for step in range(first, last):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        optimizer.step()


def _build(key, seed, **init_kwargs):
    from bagua_integrations.distributed import bagua_init

    name, kwargs = ALGORITHMS[key]
    model = _model(seed)
    if name == "qadam":
        from bagua_integrations.optim import QAdam

        optimizer = QAdam(model.parameters(), lr=0.05, warmup_steps=2)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    return model, optimizer, (lambda **more: bagua_init(model, optimizer, name, **kwargs, **init_kwargs, **more))


def _uninterrupted(rank, world, folder, keys):
    out = {}
    for key in keys:
        model, optimizer, init = _build(key, seed=0)
        wrapped, _ = init()
        _train(wrapped, optimizer, rank, 0, K)
        torch.save({"model": wrapped.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "algorithm": wrapped.algorithm_state_dict()}, os.path.join(folder, f"{key}.rank{rank}.pt"))
        # what the HF / Accelerate integrations write per rank next to the framework's rank-0 checkpoint
        torch.save(wrapped.session.rank_state_dict(wrapped.module), os.path.join(folder, f"{key}.own{rank}.pt"))
        # what fairseq's adapter writes: every rank's state (weights as a parameter list) in rank 0's file
        everyone = wrapped.session.gather_rank_state_dicts(params=list(model.parameters()))
        assert (everyone is None) == (rank != 0)
        if everyone is not None:
            torch.save(everyone, os.path.join(folder, f"{key}.everyone.pt"))
        _train(wrapped, optimizer, rank, K, TOTAL)
        out[key] = [p.detach().clone() for p in model.parameters()]
        wrapped.close()
    return out


def _resumed(rank, world, folder, keys, order):
    from bagua_integrations.distributed import BMUF

    out = {}
    for key in keys:
        checkpoint = torch.load(os.path.join(folder, f"{key}.rank{rank}.pt"), weights_only=False)
        model, optimizer, init = _build(key, seed=1 + rank)  # other weights than the checkpoint's
        if order == "before":
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            wrapped, _ = init(algorithm_state=checkpoint["algorithm"])
        elif order == "natural":  # everything loaded first, the algorithm's state after bagua_init
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            wrapped, _ = init()
            wrapped.load_algorithm_state_dict(checkpoint["algorithm"])
        elif order == "after":
            wrapped, _ = init()
            wrapped.module.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            wrapped.load_algorithm_state_dict(checkpoint["algorithm"])
        elif order in ("framework", "gathered"):  # rank 0's weights and optimizer everywhere, then this rank's own
            shared = torch.load(os.path.join(folder, f"{key}.rank0.pt"), weights_only=False)
            wrapped, _ = init()
            wrapped.module.load_state_dict(shared["model"])
            optimizer.load_state_dict(shared["optimizer"])
            if order == "framework":  # its own file (HF / Accelerate)
                own = torch.load(os.path.join(folder, f"{key}.own{rank}.pt"), weights_only=False)
                wrapped.session.load_rank_state_dict(own, wrapped.module)
            else:  # its entry of rank 0's file (fairseq)
                everyone = torch.load(os.path.join(folder, f"{key}.everyone.pt"), weights_only=False)
                wrapped.session.load_rank_state_dict(everyone[rank], params=list(model.parameters()))
        elif order == "without_algorithm_state":  # the old way: weights and optimizer only
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            wrapped, _ = init()
        elif order == "weights_after_init":  # BMUF's global model must follow weights loaded after bagua_init
            wrapped, _ = init()
            wrapped.module.load_state_dict(checkpoint["model"])
            assert isinstance(wrapped.algorithm, BMUF)
            globals_ = wrapped.algorithm._per_tensor(wrapped.algorithm.global_params)
            out[key] = all(torch.equal(g, p) for g, p in zip(globals_, model.parameters()))
            wrapped.close()
            continue
        _train(wrapped, optimizer, rank, K, TOTAL)
        out[key] = [p.detach().clone() for p in model.parameters()]
        wrapped.close()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ckpt"))
    return folder, values(run_ranks(_uninterrupted, 2, (folder, list(ALGORITHMS)), timeout=240))


@pytest.mark.parametrize("order", ["before", "natural", "after", "framework", "gathered"])
def test_resume_equals_uninterrupted(reference, order):
    folder, expected = reference
    got = values(run_ranks(_resumed, 2, (folder, list(ALGORITHMS), order), timeout=240))
    for rank in range(2):
        for key in ALGORITHMS:
            same = [torch.equal(a, b) for a, b in zip(got[rank][key], expected[rank][key])]
            assert all(same), f"{key}, loaded {order} bagua_init, rank {rank}: differs from the uninterrupted run"


def test_resume_without_algorithm_state_diverges(reference):
    """The control: the comparison above sees what an incomplete resume does."""
    folder, expected = reference
    got = values(run_ranks(_resumed, 2, (folder, list(DIVERGE_WITHOUT_STATE), "without_algorithm_state"), timeout=240))
    for key in DIVERGE_WITHOUT_STATE:
        assert any(not torch.equal(a, b) for rank in range(2) for a, b in zip(got[rank][key], expected[rank][key])), key


def test_bmuf_global_model_follows_weights_loaded_after_init(reference):
    folder, _ = reference
    got = values(run_ranks(_resumed, 2, (folder, ["bmuf"], "weights_after_init"), timeout=120))
    assert got[0]["bmuf"] and got[1]["bmuf"]


def _another_algorithms_state(rank, world, folder, order):
    """Each rank's own weights, then bagua_init under ``decentralized`` with a ``gradient_allreduce``
    checkpoint's algorithm state: the weights right after (whose replicas then differ or not)."""
    checkpoint = torch.load(os.path.join(folder, f"gradient_allreduce.rank{rank}.pt"), weights_only=False)
    model, optimizer, init = _build("decentralized_all", seed=1 + rank)  # the ranks' weights differ
    if order == "before":
        wrapped, _ = init(algorithm_state=checkpoint["algorithm"])
    else:
        wrapped, _ = init()
        wrapped.load_algorithm_state_dict(checkpoint["algorithm"])
    weights = [p.detach().clone() for p in model.parameters()]
    wrapped.close()
    return weights


@pytest.mark.parametrize("order", ["before", "natural"])
def test_another_algorithms_state_is_a_fresh_start_with_the_first_ranks_weights(reference, order):
    """A checkpoint of another algorithm is not restored (one warning, a fresh schedule), so the
    replicas start from the first rank's weights as at any fresh start, whichever order it is
    given in. (Given to bagua_init, it once kept each rank's own weights, as a resume of this
    algorithm does: replicas that differed from the first step.)"""
    folder, _ = reference
    got = values(run_ranks(_another_algorithms_state, 2, (folder, order), timeout=120))
    assert all(torch.equal(a, b) for a, b in zip(got[0], got[1])), f"loaded {order} bagua_init: the replicas differ"


def _shared_resume(rank, world, folder, key):
    """Rank 0's checkpoint loaded on every rank (what fairseq and HF Trainer save): a named error everywhere."""
    from bagua_integrations.distributed import CheckpointError

    checkpoint = torch.load(os.path.join(folder, f"{key}.rank0.pt"), weights_only=False)
    model, optimizer, init = _build(key, seed=0)
    wrapped, _ = init()
    try:
        wrapped.session.load_state_dict(checkpoint["algorithm"], shared=True, optimizer_state=checkpoint["optimizer"])
    except CheckpointError as error:
        return str(error)
    finally:
        wrapped.close()
    return None


@pytest.mark.parametrize("key", ["decentralized_shift_one", "bmuf"])
def test_one_ranks_checkpoint_on_every_rank_is_refused(reference, key):
    folder, _ = reference
    messages = values(run_ranks(_shared_resume, 2, (folder, key), timeout=120))
    assert all(m and "every rank" in m for m in messages), messages


def test_algorithm_state_contents():
    from bagua_integrations.distributed import get_algorithm

    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    bmuf = get_algorithm("bmuf", warmup_iterations=0)
    bmuf.attach(params, optimizer)
    state = bmuf.state_dict()
    assert [tuple(t.shape) for t in state["global_params"]] == [(3, 2), (4,)]
    assert all(torch.equal(a, b) for a, b in zip(state["global_params"], params))
    assert get_algorithm("decentralized").state_dict() == {"num_updates": 0, "rounds": 0}
    assert get_algorithm("bytegrad").state_dict() == {} and not get_algorithm("bytegrad").replicas_differ
    assert get_algorithm("decentralized").replicas_differ and not get_algorithm("decentralized").weights_differ
    assert get_algorithm("decentralized", peer_selection_mode="shift_one").weights_differ
    # pending: loaded before attach, applied at attach
    other = get_algorithm("bmuf", warmup_iterations=0)
    state["global_params"] = [t + 1 for t in state["global_params"]]
    state["num_updates"] = 7
    other.load_state_dict(state)
    assert other.has_pending_state
    other.attach(params, optimizer)
    assert other.num_updates == 7 and not other.has_pending_state
    assert torch.equal(other._per_tensor(other.global_params)[0], params[0] + 1)


def _gather_states(rank, world):
    from bagua_integrations.distributed import gather_states

    # ranks hold different structures, sizes, dtypes, 0-dim and empty tensors, and plain values
    state = {
        "rank": rank,
        "weights": [torch.full((rank + 1, 3), float(rank)), torch.arange(4 * rank, dtype=torch.float64)],
        "step": torch.tensor(10.0 + rank),
        "counts": torch.arange(rank + 2, dtype=torch.int64),
        "nested": ({"empty": torch.empty(0, 2)}, "text", None),
    }
    if rank == 2:
        state["only_here"] = torch.ones(2, 2, dtype=torch.bfloat16)
    got = gather_states(state, dst=1)
    if got is None:
        return None
    return [
        {
            "rank": s["rank"],
            "weights": [w.clone() for w in s["weights"]],
            "step": s["step"].clone(),
            "counts": s["counts"].clone(),
            "nested": (s["nested"][0]["empty"].shape, s["nested"][1], s["nested"][2]),
            "only_here": s.get("only_here"),
        }
        for s in got
    ]


def test_gather_states_brings_every_ranks_state_to_one_rank():
    got = values(run_ranks(_gather_states, 3, timeout=120))
    assert got[0] is None and got[2] is None
    for rank, state in enumerate(got[1]):
        assert state["rank"] == rank
        assert torch.equal(state["weights"][0], torch.full((rank + 1, 3), float(rank)))
        assert torch.equal(state["weights"][1], torch.arange(4 * rank, dtype=torch.float64))
        assert state["weights"][1].dtype == torch.float64
        assert torch.equal(state["step"], torch.tensor(10.0 + rank)) and state["step"].dim() == 0
        assert torch.equal(state["counts"], torch.arange(rank + 2, dtype=torch.int64))
        assert state["nested"] == (torch.Size([0, 2]), "text", None)
        assert (state["only_here"] is not None) == (rank == 2)
    assert torch.equal(got[1][2]["only_here"], torch.ones(2, 2, dtype=torch.bfloat16))


SWITCH_AT, SAVE_AT, SWITCH_END = 3, 7, 11
SWITCHED = {"peer_selection_mode": "all", "communication_interval": 3}


def _switch_wrapper_run(rank, world, folder, how):
    """ModelSwitchWrapper: gradient_allreduce, then decentralized from SWITCH_AT; saved at SAVE_AT."""
    from bagua_integrations.distributed import ModelSwitchWrapper

    path = os.path.join(folder, f"switch.rank{rank}.pt")
    model = _model(0 if how == "uninterrupted" else 1 + rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    wrapper = ModelSwitchWrapper(model, optimizer)
    if how == "uninterrupted":
        wrapper.switch_to("gradient_allreduce")
        _train(wrapper, optimizer, rank, 0, SWITCH_AT)
        wrapper.switch_to("decentralized", **SWITCHED)
        _train(wrapper, optimizer, rank, SWITCH_AT, SAVE_AT)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "algorithm": wrapper.algorithm_state_dict()}, path)
    else:
        checkpoint = torch.load(path, weights_only=False)
        assert checkpoint["algorithm"]["name"] == "decentralized"
        if how == "before":
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            wrapper.switch_to("decentralized", algorithm_state=checkpoint["algorithm"], **SWITCHED)
        elif how == "after":
            wrapper.switch_to("decentralized", **SWITCHED)
            wrapper.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            assert wrapper.load_algorithm_state_dict(checkpoint["algorithm"])
        else:  # the control: weights and optimizer only, the schedule restarts
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            wrapper.switch_to("decentralized", **SWITCHED)
    _train(wrapper, optimizer, rank, SAVE_AT, SWITCH_END)
    wrapper.wrapped.close()
    return [p.detach().clone() for p in model.parameters()]


def test_model_switch_wrapper_resume_equals_uninterrupted(tmp_path):
    folder = str(tmp_path)
    expected = values(run_ranks(_switch_wrapper_run, 2, (folder, "uninterrupted"), timeout=120))
    for how in ("before", "after", "without_state"):
        got = values(run_ranks(_switch_wrapper_run, 2, (folder, how), timeout=120))
        same = all(torch.equal(a, b) for rank in range(2) for a, b in zip(got[rank], expected[rank]))
        assert same == (how != "without_state"), f"resumed {how} switch_to: same as uninterrupted = {same}"
