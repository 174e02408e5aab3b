"""Resume == uninterrupted under model algorithms, HF Trainer and Accelerate, 2 gloo ranks (issue 12).

Under ``decentralized`` (``communication_interval=3``) and ``bmuf`` (``global_sync_iter=3``) each
rank's weights and AdamW moments are its own between syncs, and the algorithm carries a counter
(and BMUF its global model and smoothed block gradient). A run that saves at step 4 (in the middle
of an interval / block) and a fresh run that resumes from that checkpoint must end, after step 8
(again not a sync step, so the ranks' weights differ), with every rank's weights **equal**
(``torch.equal``) to the uninterrupted run's on the same rank: the resumed run performs the same
floating point operations on the same values (same data order, per-rank RNG, restored optimizer
state, same collectives), so there is nothing for a tolerance to absorb.

* Trainer (``BaguaTrainer(bagua_algorithm=...)``): ``trainer.train(resume_from_checkpoint=
  "checkpoint-4")``; the callback's ``bagua_rank{r}.pt`` restores each rank's own state. Control:
  the same checkpoint without ``bagua_rank*.pt`` must raise ``CheckpointError`` on every rank.
* Accelerate (``hf_plugin.prepare(..., algorithm=...)``): ``accelerator.save_state`` at step 4,
  a fresh Accelerator ``load_state`` + ``skip_first_batches``.

* Hyperparameter search (issue 29): ``trainer.hyperparameter_search(backend="optuna", n_trials=2)``
  under ``decentralized`` writes each trial's ``bagua_rank{r}.pt`` into that trial's
  ``run-<trial>/checkpoint-N`` (where Trainer writes the trial's checkpoint), none into
  ``output_dir/checkpoint-N``, and ``train(resume_from_checkpoint="run-1/checkpoint-4")`` finds them.
  Under DDP, transformers runs optuna on rank 0 and broadcasts each trial's parameters and number
  to the other ranks (a ``FixedTrial``), so both ranks train, save and name the trial alike.

One ``torchrun --standalone --nproc_per_node 2`` launch runs every case (this file is its own
worker when run as a script); the test reads one JSON per case written by rank 0. The search
has a launch of its own (``SEARCH_CASES``), so that its test runs alone in a few seconds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from _dist_utils import case_result, run_cases_in_worker, run_torchrun_cases

HERE = Path(__file__).resolve().parent
STEPS, SAVE_AT = 8, 4
ALGO_KWARGS = {
    "decentralized": {"peer_selection_mode": "all", "communication_interval": 3},
    "bmuf": {"global_sync_iter": 3, "warmup_iterations": 0, "block_momentum": 0.5},
}
ALGOS = sorted(ALGO_KWARGS)
CASES = [f"{kind}-{name}" for kind in ("trainer", "accelerate") for name in ALGOS] + [
    f"missing-{name}" for name in ALGOS  # last: they leave a half-started Trainer behind
]
SEARCH_CASES = ["search-decentralized"]
SEARCH_TRIALS, SEARCH_STEPS, SEARCH_SAVE_EVERY = 2, 4, 2


# --------------------------------------------------------------------------- worker (torchrun)
def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def _gather(obj):
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def _trainer_run(out_dir, name, seed, resume=None):
    import _hf_utils as U
    import hf_plugin

    U.reset_accelerate_state()
    model = U.tiny_bert(seed=seed)  # the resumed run starts from other weights: the checkpoint must win
    recorder = U.LossRecorder(model)
    args = U.training_args(out_dir, max_steps=STEPS, per_device_train_batch_size=4, save_strategy="steps",
                           save_steps=SAVE_AT, ddp_timeout=60, logging_steps=100)
    trainer = hf_plugin.BaguaTrainer(model=model, args=args, train_dataset=U.make_dataset(64),
                                     bagua_algorithm=name, bagua_algorithm_kwargs=ALGO_KWARGS[name])
    trainer.train(resume_from_checkpoint=resume)
    recorder.remove()
    return {"final": _flat(model), "losses": recorder.losses, "updates": trainer.bagua_callback.attachment.updates}


def run_trainer_case(name, out_dir):
    full = _trainer_run(os.path.join(out_dir, f"trainer-{name}-full"), name, seed=0)
    checkpoint = os.path.join(out_dir, f"trainer-{name}-full", f"checkpoint-{SAVE_AT}")
    resumed = _trainer_run(os.path.join(out_dir, f"trainer-{name}-resumed"), name, seed=7, resume=checkpoint)
    return _compare(full, resumed, files=sorted(os.listdir(checkpoint)))


def run_missing_case(name, out_dir):
    """The checkpoint without this rank's bagua_rank{r}.pt: a named error on every rank, not a silent divergence."""
    import shutil

    import torch.distributed as dist

    source = os.path.join(out_dir, f"trainer-{name}-full", f"checkpoint-{SAVE_AT}")
    stripped = os.path.join(out_dir, f"missing-{name}", f"checkpoint-{SAVE_AT}")
    if dist.get_rank() == 0:
        shutil.copytree(source, stripped, ignore=shutil.ignore_patterns("bagua_rank*.pt"))
    dist.barrier()
    try:
        _trainer_run(os.path.join(out_dir, f"missing-{name}-run"), name, seed=7, resume=stripped)
    except Exception as error:  # noqa: BLE001 - the test wants every rank's error and message
        outcome = {"error": type(error).__name__, "message": str(error)[:600]}
    else:
        outcome = {"error": None}
    return {"ranks": _gather(outcome)}


def run_search_case(name, out_dir):
    """``hyperparameter_search(backend="optuna")`` under a model algorithm, saving every 2 steps.

    Returns, from rank 0's view of the disk, where every ``bagua_rank*.pt`` and every
    ``trainer_state.json`` (Trainer's own checkpoint) landed, relative to ``output_dir``; then
    every rank's outcome of resuming from the last trial's last checkpoint.
    """
    import _hf_utils as U
    import hf_plugin
    import torch.distributed as dist

    U.reset_accelerate_state()
    root = os.path.join(out_dir, f"search-{name}")
    args = U.training_args(root, max_steps=SEARCH_STEPS, per_device_train_batch_size=4, save_strategy="steps",
                           save_steps=SEARCH_SAVE_EVERY, ddp_timeout=60, logging_steps=100)
    trainer = hf_plugin.BaguaTrainer(model_init=lambda: U.tiny_bert(), args=args, train_dataset=U.make_dataset(32),
                                     eval_dataset=U.make_dataset(8, seed=5), bagua_algorithm=name,
                                     bagua_algorithm_kwargs=ALGO_KWARGS[name])
    trainer.hyperparameter_search(
        hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-3, log=True)},
        backend="optuna", n_trials=SEARCH_TRIALS, direction="minimize",
    )
    dist.barrier()  # every rank has written its files
    written = sorted(
        os.path.relpath(os.path.join(folder, file), root)
        for folder, _, files in os.walk(root)
        for file in files
        if file.startswith("bagua_rank") or file == "trainer_state.json"
    )
    last = os.path.join(root, f"run-{SEARCH_TRIALS - 1}", f"checkpoint-{SEARCH_STEPS}")
    try:
        trainer.train(resume_from_checkpoint=last)
    except Exception as error:  # noqa: BLE001 - the test wants every rank's error and message
        resumed = {"error": type(error).__name__, "message": str(error)[:600]}
    else:
        resumed = {"error": None, "updates": trainer.bagua_callback.attachment.updates}
    return {"written": written, "resumed": _gather(resumed)}


def _accelerate_run(out_dir, name, seed, save_dir=None, load_dir=None):
    import _hf_utils as U
    import hf_plugin
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    U.reset_accelerate_state()
    accelerator = Accelerator(cpu=True)
    model = U.tiny_bert(seed=seed)
    optimizer = torch.optim.AdamW(hf_plugin.trainer_param_groups(model, 0.01), lr=1e-3)
    loader = DataLoader(U.make_dataset(64), batch_size=4, collate_fn=U.collate)
    # Accelerate steps a prepared scheduler once per process per step (split_batches=False)
    schedule = get_linear_schedule_with_warmup(optimizer, 2, STEPS * accelerator.num_processes)
    model, optimizer, loader, schedule = hf_plugin.prepare(
        accelerator, model, optimizer, loader, schedule, algorithm=name, algorithm_kwargs=ALGO_KWARGS[name])
    step, losses = 0, []
    if load_dir is not None:
        accelerator.load_state(load_dir)
        step = SAVE_AT
        loader = accelerator.skip_first_batches(loader, SAVE_AT)
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        losses.append(loss.detach().double().item())
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        step += 1
        if save_dir is not None and step == SAVE_AT:
            accelerator.save_state(save_dir)
        if step >= STEPS:
            break
    return {"final": _flat(accelerator.unwrap_model(model)), "losses": losses, "updates": model.bagua_attachment.updates}


def run_accelerate_case(name, out_dir):
    state_dir = os.path.join(out_dir, f"accelerate-{name}-state")
    full = _accelerate_run(out_dir, name, seed=0, save_dir=state_dir)
    resumed = _accelerate_run(out_dir, name, seed=7, load_dir=state_dir)
    return _compare(full, resumed, files=sorted(os.listdir(state_dir)))


def _compare(full, resumed, files):
    finals_full, finals_resumed = _gather(full["final"]), _gather(resumed["final"])
    return {
        "files": files,
        "equal": [torch.equal(a, b) for a, b in zip(finals_full, finals_resumed)],
        "max_diff": [(a - b).abs().max().item() for a, b in zip(finals_full, finals_resumed)],
        "rank_spread": (finals_full[0] - finals_full[1]).abs().max().item(),
        "losses_full": _gather(full["losses"]),
        "losses_resumed": _gather(resumed["losses"]),
        "updates": _gather([full["updates"], resumed["updates"]]),
    }


def main():
    sys.path.insert(0, str(HERE))
    out_dir, cases = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    runners = {"trainer": run_trainer_case, "accelerate": run_accelerate_case, "missing": run_missing_case,
               "search": run_search_case}

    def run_case(case):
        kind, _, name = case.partition("-")
        return runners[kind](name, out_dir)

    run_cases_in_worker(out_dir, cases, run_case)


# --------------------------------------------------------------------------- tests
def _require_two_rank_hf():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("bagua_integrations.distributed")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is required")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    _require_two_rank_hf()
    out = tmp_path_factory.mktemp("hf_resume")
    return run_torchrun_cases(Path(__file__).resolve(), out, CASES, timeout=240)


@pytest.fixture(scope="module")
def search_results(tmp_path_factory):
    _require_two_rank_hf()
    pytest.importorskip("optuna")
    out = tmp_path_factory.mktemp("hf_search")
    return run_torchrun_cases(Path(__file__).resolve(), out, SEARCH_CASES, timeout=240)


def _assert_resume_is_exact(got):
    # the ranks really differ at the end (step 8 is no sync step): per-rank state mattered
    assert got["rank_spread"] > 1e-6, got["rank_spread"]
    assert got["equal"] == [True, True], f"resumed != uninterrupted, max abs diff per rank {got['max_diff']}"
    for full, resumed in zip(got["losses_full"], got["losses_resumed"]):
        assert len(full) == STEPS and resumed == full[SAVE_AT:]
    assert got["updates"] == [[STEPS, STEPS]] * 2  # the update count continued from the checkpoint


# One 2-rank launch (~15 s) serves every case: in the default suite, the only end-to-end resume test.


@pytest.mark.parametrize("name", ALGOS)
def test_trainer_resume_equals_uninterrupted(results, name):
    got = case_result(results, f"trainer-{name}")
    assert {"bagua_rank0.pt", "bagua_rank1.pt"} <= set(got["files"]), got["files"]
    _assert_resume_is_exact(got)


@pytest.mark.parametrize("name", ALGOS)
def test_trainer_resume_without_rank_files_raises_checkpoint_error(results, name):
    got = case_result(results, f"missing-{name}")
    for rank, outcome in enumerate(got["ranks"]):
        assert outcome["error"] == "CheckpointError", (rank, outcome)
        assert f"bagua_rank{rank}.pt" in outcome["message"] and name in outcome["message"]


@pytest.mark.parametrize("name", ALGOS)
def test_accelerate_save_load_state_resume_equals_uninterrupted(results, name):
    got = case_result(results, f"accelerate-{name}")
    assert any(f.startswith("custom_checkpoint_") for f in got["files"]), got["files"]
    _assert_resume_is_exact(got)


def test_hyperparameter_search_writes_rank_files_into_each_trials_checkpoint(search_results):
    """Issue 29: the per-rank files sit beside Trainer's checkpoint of the same trial, and resuming finds them."""
    got = case_result(search_results, "search-decentralized")
    checkpoints = [os.path.join(f"run-{trial}", f"checkpoint-{step}") for trial in range(SEARCH_TRIALS)
                   for step in range(SEARCH_SAVE_EVERY, SEARCH_STEPS + 1, SEARCH_SAVE_EVERY)]
    expected = sorted(os.path.join(folder, file) for folder in checkpoints
                      for file in ("bagua_rank0.pt", "bagua_rank1.pt", "trainer_state.json"))
    outside_trials = [path for path in got["written"] if not path.startswith("run-")]
    assert not outside_trials, f"written outside the trials' run-<trial>/ folders: {outside_trials}"
    assert got["written"] == expected
    for rank, outcome in enumerate(got["resumed"]):
        assert outcome == {"error": None, "updates": SEARCH_STEPS}, (rank, outcome)


if __name__ == "__main__":
    main()
