"""hf_plugin.prepare in plain Accelerate loops: fp32, GradScaler (fp16 simulation on CPU), bf16, accumulation.

Each fused run is compared with the same loop through ``accelerator.prepare`` and the unfused
optimizer, with fp32 tolerance.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_utils import (  # noqa: E402
    TOL,
    accelerate_loop,
    assert_matches_unfused,
    fresh_accelerate_state,  # noqa: F401 - autouse fixture
    reset_accelerate_state,
    tiny_bert,
)
import hf_plugin  # noqa: E402
from bagua_integrations import fuse_optimizer  # noqa: E402

def compare(ref, got, steps_taken):
    assert got["skipped"] == ref["skipped"]
    assert_matches_unfused(ref, got, steps_taken)


def both(**kwargs):
    ref = accelerate_loop(False, **kwargs)
    reset_accelerate_state()
    got = accelerate_loop(True, **kwargs)
    return ref, got


def test_fp32_loop_matches_accelerator_prepare():
    ref = accelerate_loop(False, steps=12)
    reset_accelerate_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = accelerate_loop(True, steps=12)
    compare(ref, got, 12)
    assert type(got["optimizer"]).__name__ == "AcceleratedOptimizer"
    # The LR scheduler was built before prepare() fused the optimizer: it must not think its
    # step tracking was overridden (torch warns "optimizer.step() has been overridden ...").
    assert not [w for w in caught if "overridden" in str(w.message)], [str(w.message) for w in caught]


def test_split_flat_views_keeps_aliases_and_whole_tensors():
    from hf_plugin.accelerator import split_flat_views

    flat = torch.arange(10.0)
    whole = torch.ones(3)
    state = {"a": flat[:4].view(2, 2), "b": flat[4:10], "tied1": whole, "tied2": whole, "alias_a": flat[:4].view(2, 2)}
    split_flat_views(state)
    assert state["tied1"] is whole and state["tied2"] is whole  # whole storage: left alone
    assert state["a"].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    assert state["a"].untyped_storage().data_ptr() != state["b"].untyped_storage().data_ptr()
    assert state["alias_a"] is state["a"]  # two names of the same view stay one tensor
    torch.testing.assert_close(state["b"], torch.arange(4.0, 10.0))
    flat.zero_()
    assert state["b"].sum() > 0  # copies: the model's buffer is not what gets written


@pytest.mark.parametrize("fused_kernel", [False, True], ids=["adamw", "adamw-fused-kernel"])
def test_gradscaler_fp16_simulation_skips_overflow_steps(fused_kernel):
    """fp16 autocast + a GradScaler on the AcceleratedOptimizer (its step is swapped under the scaler).

    Steps 3 and 7 get an inf gradient. Plain AdamW: the scaler skips exactly those steps, fused or
    not. AdamW(fused=True) (Trainer's default ``adamw_torch_fused``) handles scaling itself: the
    scaler hands it ``grad_scale`` / ``found_inf`` and the kernel skips the update internally --
    through the flat buffers too. Either way the fused path stays active for every step taken.
    """
    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=3)

    options = dict(steps=12, fp16_autocast=True, poison_steps=(3, 7), optimizer_kwargs={"fused": fused_kernel})
    ref = accelerate_loop(False, scaler=scaler(), **options)
    reset_accelerate_state()
    got = accelerate_loop(True, scaler=scaler(), **options)
    skipped = [] if fused_kernel else [3, 7]
    assert [i for i, s in enumerate(got["skipped"]) if s] == skipped
    compare(ref, got, 12 - len(skipped))
    assert got["accelerator"].scaler.get_scale() == ref["accelerator"].scaler.get_scale()
    # the scaler really scaled: its scale grew and shrank with the poisoned steps
    assert got["accelerator"].scaler.get_scale() != 2.0**14


def test_bf16_mixed_precision():
    ref, got = both(steps=8, mixed_precision="bf16")
    compare(ref, got, 8)


def test_gradient_accumulation():
    """accelerator.accumulate with 2 micro-batches: step() is a no-op in between, grads set to None after."""
    ref, got = both(steps=6, accumulation=2)
    assert len(got["losses"]) == 12
    compare(ref, got, 6)


def test_save_and_load_state_round_trip(tmp_path):
    """accelerator.save_state / load_state: the fused optimizer's state survives and keeps training exactly."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from _hf_utils import collate, flat_params, make_dataset

    data = make_dataset(48)

    def build():
        reset_accelerate_state()
        accelerator = Accelerator(cpu=True)
        model = tiny_bert()
        optimizer = torch.optim.AdamW(hf_plugin.trainer_param_groups(model, 0.01), lr=1e-3)
        loader = DataLoader(data, batch_size=8, collate_fn=collate)
        model, optimizer, loader = hf_plugin.prepare(accelerator, model, optimizer, loader)
        return accelerator, model, optimizer, list(loader)

    def train(model, optimizer, batches):
        for batch in batches:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    accelerator, model, optimizer, batches = build()
    train(model, optimizer, batches[:3])
    accelerator.save_state(str(tmp_path / "state"))
    train(model, optimizer, batches[3:])
    expected = flat_params(model)

    accelerator, model, optimizer, batches = build()
    accelerator.load_state(str(tmp_path / "state"))
    train(model, optimizer, batches[3:])
    torch.testing.assert_close(flat_params(model), expected, **TOL)
    report = hf_plugin.fusion_report(optimizer)
    assert report.last_step_fused and report.fused_steps == 3


# ------------------------------------------------------------------------------- bad input
def test_prepare_refuses_bad_input():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="Accelerator"):
        hf_plugin.prepare(object(), model, optimizer)
    with pytest.raises(TypeError, match="optimizer"):
        hf_plugin.prepare(accelerator, model, "adamw")
    prepared = accelerator.prepare(optimizer)  # already an AcceleratedOptimizer: its step was captured
    with pytest.raises(hf_plugin.UnsupportedSetupError, match="already wrapped"):
        hf_plugin.prepare(accelerator, model, prepared)
    fused_wrong = fuse_optimizer(torch.optim.AdamW(tiny_bert().parameters()))  # replace_step=False
    with pytest.raises(hf_plugin.UnsupportedSetupError, match="replace_step"):
        hf_plugin.prepare(accelerator, tiny_bert(), fused_wrong)
    with pytest.raises(ValueError, match="replace_step"):
        hf_plugin.prepare(accelerator, model, torch.optim.AdamW(model.parameters()), replace_step=False)


def test_algorithm_in_single_process_warns_and_trains():
    """One process: nothing to communicate, the run is the plain fused run (and says so once)."""
    try:
        names = hf_plugin.available_algorithms()
    except hf_plugin.DistributedCoreMissingError:
        pytest.skip("bagua_integrations.distributed is not available")
    assert "gradient_allreduce" in names
    with pytest.warns(hf_plugin.BaguaAlgorithmWarning):
        got = accelerate_loop(True, steps=3, algorithm="gradient_allreduce")
    assert hf_plugin.fusion_report(got["optimizer"]).fused_steps == 3
