"""``AlgorithmSession``, the one driver of a distributed algorithm (bagua_init, fairseq, HF).

Single process: update counting, the model algorithm after plain and fused steps, checkpoints,
parameter selection. Two gloo ranks: weights averaged after plain and fused steps, the mean
gradient norm, and fairseq's ``--bagua-algorithm`` refusing ranks with different models.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from _dist_models import MLP, local_batches, loss_fn
from _dist_utils import run_ranks, run_scenarios, scenario_value
from _fairseq_utils import fairseq_available
from bagua_integrations import fuse_optimizer
from bagua_integrations.distributed import (
    AlgorithmConfigError,
    AlgorithmSession,
    ModelAlgorithm,
    collective_log,
    get_algorithm,
)

STEP_MODES = ["plain", "fused", "fused_replace_step"]


class Spy(ModelAlgorithm):
    """A model algorithm that records when it runs and whether the update had landed by then."""

    name = "spy"

    def __init__(self):
        super().__init__()
        self.calls = []
        self.reference = None  # the weight tensor to compare against

    def update(self, step, group):
        self.calls.append((step, self.reference is not None and not torch.equal(self.reference[0], self.reference[1])))
        return True


def _model_and_optimizer(mode, seed=0):
    model = MLP(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if mode != "plain":
        fuse_optimizer(optimizer, replace_step=mode == "fused_replace_step")
    return model, optimizer


def _step(mode, model, optimizer, x, y):
    optimizer.zero_grad()
    loss_fn(model, x, y).backward()
    (optimizer.fuse_step if mode == "fused" else optimizer.step)()


# ---------------------------------------------------------------------- single process
def test_after_update_counts_every_update_and_only_model_algorithms_act():
    model, optimizer = _model_and_optimizer("plain")
    session = AlgorithmSession(get_algorithm("gradient_allreduce"), optimizer=optimizer, model=model)
    assert session.kind == "gradient" and not session.distributed and not session.acts_after_step
    assert [session.after_update() for _ in range(3)] == [False] * 3
    assert session.num_updates == 3
    session.after_update(step=10)  # a framework's global step (a resumed run)
    assert session.num_updates == 10

    spy = Spy()
    session = AlgorithmSession(spy, optimizer=optimizer)
    assert session.acts_after_step
    assert [session.after_update() for _ in range(2)] == [True, True]
    session.after_update(step=7)
    assert [step for step, _ in spy.calls] == [1, 2, 7] and spy.num_updates == 7


@pytest.mark.parametrize("mode", STEP_MODES)
def test_model_algorithm_runs_after_every_plain_and_fused_step(mode):
    model, optimizer = _model_and_optimizer(mode)
    spy = Spy()
    session = AlgorithmSession(spy, optimizer=optimizer, model=model)
    handle = session.install_step_hook(optimizer)
    for x, y in local_batches(3, 4, rank=0):
        spy.reference = (model.fc1.weight.detach().clone(), model.fc1.weight.detach())
        _step(mode, model, optimizer, x, y)
    # once per step, numbered from 1, and after the update had landed
    assert spy.calls == [(1, True), (2, True), (3, True)]
    assert session.num_updates == 3
    handle.remove()
    _step(mode, model, optimizer, *local_batches(1, 4, rank=0)[0])
    assert len(spy.calls) == 3


def test_close_removes_the_step_hooks_and_detaches():
    model, optimizer = _model_and_optimizer("fused")
    spy = Spy()
    session = AlgorithmSession(spy, optimizer=optimizer)
    session.install_step_hook(optimizer)
    session.close()
    _step("fused", model, optimizer, *local_batches(1, 4, rank=0)[0])
    assert spy.calls == [] and spy.pack is None


def test_state_dict_round_trip():
    model, optimizer = _model_and_optimizer("plain")
    session = AlgorithmSession(get_algorithm("decentralized", communication_interval=3), optimizer=optimizer)
    for _ in range(4):
        session.after_update()
    state = session.state_dict()
    single = {"rank": 0, "world_size": 1, "weights_differ": False, "replicas_differ": False}
    assert state == {"name": "decentralized", "num_updates": 4, "algorithm": {"num_updates": 4, "rounds": 0}, **single}

    again = AlgorithmSession(get_algorithm("decentralized", communication_interval=3), optimizer=optimizer)
    assert again.load_state_dict(state)
    assert again.num_updates == 4 and again.algorithm.num_updates == 4
    again.after_update()
    assert again.num_updates == 5 and again.algorithm.num_updates == 5
    # a gradient algorithm has no state of its own but the counter travels
    grad = AlgorithmSession(get_algorithm("bytegrad"), optimizer=optimizer)
    grad.after_update()
    assert grad.state_dict() == {"name": "bytegrad", "num_updates": 1, "algorithm": {}, **single}


def test_a_checkpoint_of_another_algorithm_is_not_restored(caplog):
    model, optimizer = _model_and_optimizer("plain")
    session = AlgorithmSession(get_algorithm("decentralized"), optimizer=optimizer)
    with caplog.at_level(logging.WARNING):
        assert not session.load_state_dict({"name": "bmuf", "num_updates": 9, "algorithm": {"num_updates": 9}})
    assert session.num_updates == 0 and session.algorithm.num_updates == 0
    assert "bmuf" in caplog.text and "not restored" in caplog.text


def test_parameter_selection_and_single_process_helpers():
    model, optimizer = _model_and_optimizer("plain")
    model.fc3.weight.requires_grad_(False)
    half = torch.optim.SGD([model.fc1.weight], lr=0.1)
    assert AlgorithmSession(get_algorithm("decentralized"), optimizer=half, model=model).params == [model.fc1.weight]
    by_model = AlgorithmSession(get_algorithm("decentralized"), model=model).params
    assert len(by_model) == 5 and all(p.requires_grad for p in by_model)
    assert AlgorithmSession(get_algorithm("decentralized"), params=[model.fc2.bias]).params == [model.fc2.bias]
    with pytest.raises(AlgorithmConfigError, match="needs the parameters"):
        AlgorithmSession(get_algorithm("decentralized"))
    with pytest.raises(AlgorithmConfigError, match="one optimizer"):
        AlgorithmSession(get_algorithm("decentralized"), optimizer=[optimizer, half])
    norm = torch.tensor(2.5)
    assert AlgorithmSession(get_algorithm("decentralized"), model=model).aggregate_norm(norm) is norm


def test_session_sets_the_algorithm_timeout_when_it_has_none():
    model, optimizer = _model_and_optimizer("plain")
    algorithm = get_algorithm("decentralized")
    AlgorithmSession(algorithm, optimizer=optimizer, timeout=12)
    assert algorithm.timeout.total_seconds() == 12
    algorithm = get_algorithm("decentralized", timeout=5)
    session = AlgorithmSession(algorithm, optimizer=optimizer)
    assert session.timeout.total_seconds() == 5


# ---------------------------------------------------------------------- two ranks
def _gather(tensor):
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, tensor)
    return parts


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def sc_weights_averaged_after_each_step(rank, world):
    out = {}
    for mode in STEP_MODES:
        model, optimizer = _model_and_optimizer(mode)
        session = AlgorithmSession(get_algorithm("decentralized", hierarchical=False, timeout=60),
                                   optimizer=optimizer, model=model)
        session.install_step_hook(optimizer)
        spreads = []
        for x, y in local_batches(3, 4, rank):  # different data per rank: only the averaging aligns them
            collective_log.reset()
            _step(mode, model, optimizer, x, y)
            averaged = collective_log.calls["all_reduce"]
            parts = _gather(_flat(model))
            spreads.append((averaged, float((parts[0] - parts[1]).abs().max())))
        out[mode] = (session.num_updates, spreads)
        session.close()
    return out


def sc_mean_gradient_norm(rank, world):
    model, optimizer = _model_and_optimizer("plain")
    model_session = AlgorithmSession(get_algorithm("bmuf", warmup_iterations=0), optimizer=optimizer, model=model)
    grad_session = AlgorithmSession(get_algorithm("gradient_allreduce"), optimizer=optimizer, model=model)
    norm = torch.tensor(float(rank + 1), dtype=torch.float32)
    return float(model_session.aggregate_norm(norm)), float(grad_session.aggregate_norm(norm))


def sc_mismatched_models_refused(rank, world):
    model = MLP() if rank == 0 else torch.nn.Sequential(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        AlgorithmSession(get_algorithm("decentralized", timeout=60), optimizer=optimizer, model=model)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return type(error).__name__, str(error)
    return None, ""


def sc_fairseq_refuses_mismatched_ranks(rank, world):
    if not fairseq_available():
        return "skipped"
    import fairseq_plugin  # noqa: F401 - registers bagua_fused
    from fairseq import optim, options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    namespace = options.parse_args_and_arch(
        options.get_training_parser(),
        input_args=["/nonexistent-data", "--task", "language_modeling", "--arch", "transformer_lm", "--cpu",
                    "--optimizer", "bagua_fused", "--bagua-algorithm", "decentralized", "--bagua-timeout", "60"],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = convert_namespace_to_omegaconf(namespace)
    model = MLP() if rank == 0 else torch.nn.Sequential(torch.nn.Linear(8, 4))
    try:
        optim.build_optimizer(cfg.optimizer, list(model.parameters()))
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, str(error)
    return None, ""


SCENARIOS = {
    "weights_averaged": sc_weights_averaged_after_each_step,
    "mean_gradient_norm": sc_mean_gradient_norm,
    "mismatched_models": sc_mismatched_models_refused,
    "fairseq_mismatch": sc_fairseq_refuses_mismatched_ranks,
}


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(run_scenarios, 2, (SCENARIOS, list(SCENARIOS)), timeout=300)


def test_model_algorithm_averages_after_plain_and_fused_steps(two_ranks):
    for per_rank in scenario_value(two_ranks, "weights_averaged"):
        for mode in STEP_MODES:
            updates, spreads = per_rank[mode]
            assert updates == 3, mode
            for averaged, spread in spreads:
                assert averaged >= 1 and spread == 0.0, (mode, spreads)


def test_mean_gradient_norm_under_a_model_algorithm(two_ranks):
    # model algorithm: the ranks' mean; gradient algorithm: gradients are already averaged, norm as is
    assert scenario_value(two_ranks, "mean_gradient_norm") == [(1.5, 1.0), (1.5, 2.0)]


def test_mismatched_ranks_raise_on_every_rank(two_ranks):
    for error, message in scenario_value(two_ranks, "mismatched_models"):
        assert error == "ModelMismatchError" and "fc1.weight" in message


def test_fairseq_refuses_mismatched_ranks(two_ranks):
    results = scenario_value(two_ranks, "fairseq_mismatch")
    if results[0] == "skipped":
        pytest.skip("fairseq is not installed")
    for error, message in results:
        assert error == "ModelMismatchError", message
        assert "differs between ranks" in message and "param 0 (16, 8)" in message


def test_a_sessions_checkpoint_keeps_the_settings_its_autotuner_chose():
    """fairseq and HF tune through the session: its state holds what the autotuner chose, and a
    resumed session applies it (a resume went back to the configured settings, silently)."""
    pytest.importorskip("optuna")
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = AlgorithmSession(get_algorithm("decentralized", communication_interval=1), optimizer=optimizer,
                               model=model)
    session.enable_autotune(max_trials=2, intervals=[1, 4], seed=0)
    session.apply_communication_settings(communication_interval=4)  # (what the tuner broadcasts)
    state = session.state_dict()
    assert state["autotuned"] == {"communication_interval": 4}
    resumed = AlgorithmSession(get_algorithm("decentralized", communication_interval=1), optimizer=optimizer,
                               model=model)
    assert resumed.load_state_dict(state)
    assert resumed.communication_setting("communication_interval") == 4
