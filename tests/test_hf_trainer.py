"""HF Trainer with a fused optimizer: same numbers as Trainer's own AdamW, fusion active to the end.

Tiny BERT from BertConfig, generated data, CPU. Every comparison is against an unfused reference
run with fp32 tolerance, and checks that training moved the weights far more than that tolerance.
"""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_utils import (  # noqa: E402
    TOL,
    assert_matches_unfused,
    fresh_accelerate_state,  # noqa: F401 - autouse fixture
    make_dataset,
    reset_accelerate_state,
    run_trainer,
    tiny_bert,
    training_args,
)
import hf_plugin  # noqa: E402
from bagua_integrations import FusionFallbackWarning, LayoutChangedError, NotElementwiseError, fuse_optimizer  # noqa: E402

STEPS = 20


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    reset_accelerate_state()
    return run_trainer(tmp_path_factory.mktemp("default"), "default", max_steps=STEPS)


def test_param_groups_match_trainer(tmp_path):
    """create_fused_optimizer builds Trainer.create_optimizer's groups, class and hyper-parameters."""
    from transformers import Trainer

    args = training_args(tmp_path, weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7)
    model = tiny_bert()
    reference = Trainer(model=model, args=args, train_dataset=make_dataset(8)).create_optimizer()
    fused = hf_plugin.create_fused_optimizer(tiny_bert(), args)
    assert type(fused) is type(reference) is torch.optim.AdamW
    assert len(fused.param_groups) == len(reference.param_groups) == 2
    names = {id(p): n for n, p in model.named_parameters()}
    for ours, theirs in zip(fused.param_groups, reference.param_groups):
        assert [tuple(p.shape) for p in ours["params"]] == [tuple(p.shape) for p in theirs["params"]]
        for key, value in theirs.items():
            if key != "params":
                assert ours[key] == value, key
    # no-decay group = biases and LayerNorm weights, exactly as Trainer decides
    no_decay = {names[id(p)] for p in reference.param_groups[1]["params"]}
    assert no_decay and all("bias" in n or "LayerNorm" in n for n in no_decay)
    assert reference.param_groups[0]["weight_decay"] == 0.05 and reference.param_groups[1]["weight_decay"] == 0.0
    assert hf_plugin.step_is_fused(fused) and not hf_plugin.is_fused(reference)


@pytest.mark.parametrize("how", ["optimizers", "cls_and_kwargs", "bagua_trainer"])
def test_trainer_matches_default_adamw(default_run, tmp_path, how):
    """20 Trainer steps: fused (three ways of plugging it in) == Trainer's default AdamW."""
    got = run_trainer(tmp_path, how, max_steps=STEPS)
    assert_matches_unfused(default_run, got, STEPS)


def test_gradient_accumulation(tmp_path):
    """gradient_accumulation_steps=2: grads of two micro-batches, set to None in between steps."""
    ref = run_trainer(tmp_path / "ref", "default", max_steps=8, gradient_accumulation_steps=2)
    reset_accelerate_state()
    got = run_trainer(tmp_path / "fused", "optimizers", max_steps=8, gradient_accumulation_steps=2)
    assert len(got["losses"]) == 16
    assert_matches_unfused(ref, got, 8)


@pytest.mark.slow
def test_bf16_autocast(tmp_path):
    """bf16=True (CPU autocast through Accelerate): fp32 master weights, fused == unfused."""
    ref = run_trainer(tmp_path / "ref", "default", max_steps=8, bf16=True)
    reset_accelerate_state()
    got = run_trainer(tmp_path / "fused", "bagua_trainer", max_steps=8, bf16=True)
    assert_matches_unfused(ref, got, 8)


def test_any_optimizer_class(tmp_path):
    """An explicit class (SGD with momentum) gets Trainer's groups and lr; compared with Trainer building it."""
    sgd = {"lr": 0.05, "momentum": 0.9}
    ref = run_trainer(
        tmp_path / "ref", "default", max_steps=8, learning_rate=0.05,
        trainer_kwargs={"optimizer_cls_and_kwargs": (torch.optim.SGD, sgd)},
    )
    reset_accelerate_state()
    got = run_trainer(
        tmp_path / "fused", "optimizers", max_steps=8, learning_rate=0.05,
        fused_kwargs={"optimizer_cls": torch.optim.SGD, "momentum": 0.9},
    )
    optimizer = hf_plugin.unwrap_optimizer(got["trainer"].optimizer)
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["lr"] == 0.05
    assert "betas" not in optimizer.defaults  # betas/eps only go to classes that take them
    assert_matches_unfused(ref, got, 8)


@pytest.mark.parametrize("saved_by", ["fused", pytest.param("default", marks=pytest.mark.slow)])
def test_resume_from_checkpoint(tmp_path, saved_by):
    """Stop at step 10, resume from checkpoint-10 (optimizer.pt): same losses and weights as one run.

    saved_by="default": the checkpoint comes from Trainer's unfused AdamW, resumed with the fused
    one (the state_dict formats are the same).
    """
    how = "optimizers" if saved_by == "fused" else "default"
    full = run_trainer(tmp_path / "full", how, max_steps=STEPS, save_strategy="steps", save_steps=10)
    checkpoint = tmp_path / "full" / "checkpoint-10"
    assert (checkpoint / "optimizer.pt").is_file()
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    plain = torch.optim.AdamW(hf_plugin.trainer_param_groups(tiny_bert(), 0.01))
    plain.load_state_dict(saved)  # a fused run's optimizer.pt loads into the unfused class and back
    reset_accelerate_state()
    resumed = run_trainer(
        tmp_path / "resumed", "optimizers", max_steps=STEPS, save_strategy="steps", save_steps=10,
        train_kwargs={"resume_from_checkpoint": str(checkpoint)},
    )
    assert len(resumed["losses"]) == STEPS - 10
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][10:]), **TOL)
    torch.testing.assert_close(resumed["final"], full["final"], **TOL)
    report = hf_plugin.fusion_report(resumed["trainer"].optimizer)
    assert report.last_step_fused and report.fused_steps == STEPS - 10
    if saved_by == "fused":
        # The restored Adam state really is used: without optimizer.pt the same resume ends elsewhere.
        stripped = tmp_path / "stripped"
        shutil.copytree(checkpoint, stripped)
        (stripped / "optimizer.pt").unlink()
        reset_accelerate_state()
        cold = run_trainer(
            tmp_path / "cold", "optimizers", max_steps=STEPS, train_kwargs={"resume_from_checkpoint": str(stripped)}
        )
        assert (cold["final"] - full["final"]).abs().max().item() > 1e-4


def test_tied_weights_masked_lm(tmp_path):
    """BertForMaskedLM ties its decoder to the word embeddings: the tie survives fusion and a checkpoint."""
    from transformers import BertConfig, BertForMaskedLM

    def model_init():
        config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                            vocab_size=100, max_position_embeddings=64, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        torch.manual_seed(0)
        return BertForMaskedLM(config)

    data = [{"input_ids": d["input_ids"], "attention_mask": d["attention_mask"], "labels": d["input_ids"]}
            for d in make_dataset(32)]
    runs = {}
    for how in ("default", "bagua_trainer"):
        reset_accelerate_state()
        model = model_init()
        args = training_args(tmp_path / how, max_steps=4, save_strategy="steps", save_steps=4)
        cls = hf_plugin.BaguaTrainer if how == "bagua_trainer" else __import__("transformers").Trainer
        trainer = cls(model=model, args=args, train_dataset=data)
        trainer.train()
        runs[how] = (model, trainer)
    fused_model, fused_trainer = runs["bagua_trainer"]
    assert fused_model.cls.predictions.decoder.weight is fused_model.bert.embeddings.word_embeddings.weight
    torch.testing.assert_close(
        torch.cat([p.detach().reshape(-1) for p in fused_model.parameters()]),
        torch.cat([p.detach().reshape(-1) for p in runs["default"][0].parameters()]), **TOL,
    )
    report = hf_plugin.fusion_report(fused_trainer.optimizer)
    assert report.last_step_fused and report.fused_steps == 4
    reloaded = type(fused_model).from_pretrained(str(tmp_path / "bagua_trainer" / "checkpoint-4"))
    torch.testing.assert_close(reloaded.bert.embeddings.word_embeddings.weight,
                               fused_model.bert.embeddings.word_embeddings.weight)


# ------------------------------------------------------------------------------- bad input
def test_bad_input_is_named(tmp_path):
    args = training_args(tmp_path)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        hf_plugin.create_fused_optimizer("bert", args)
    with pytest.raises(hf_plugin.UnsupportedSetupError, match="already wrapped"):
        hf_plugin.create_fused_optimizer(torch.nn.DataParallel(tiny_bert()), args)
    with pytest.raises(TypeError, match="TrainingArguments"):
        hf_plugin.create_fused_optimizer(tiny_bert(), {"learning_rate": 1e-3})
    from bagua_integrations import NotAnOptimizerError

    with pytest.raises(NotAnOptimizerError):
        hf_plugin.create_fused_optimizer(tiny_bert(), args, optimizer_cls=dict)
    # a non-elementwise optimizer chosen through args.optim keeps its exact step, or is refused by name on request
    with pytest.warns(FusionFallbackWarning, match="Adafactor"):
        hf_plugin.create_fused_optimizer(tiny_bert(), training_args(tmp_path, optim="adafactor"))
    with pytest.raises(NotElementwiseError):
        hf_plugin.create_fused_optimizer(tiny_bert(), training_args(tmp_path, optim="adafactor"), on_unsupported="raise")
    frozen = tiny_bert()
    frozen.requires_grad_(False)
    with pytest.raises(hf_plugin.UnsupportedSetupError, match="no trainable"):
        hf_plugin.create_fused_optimizer(frozen, args)


@pytest.mark.parametrize("fixed", ["replace_step", "do_flatten"])
def test_fuse_arguments_the_adapters_fix_are_refused_where_they_are_passed(tmp_path, fixed):
    """Not later, as an unknown argument of the optimizer's constructor inside Trainer."""
    args = training_args(tmp_path)
    with pytest.raises(ValueError, match=fixed):
        hf_plugin.fused_optimizer_cls_and_kwargs(args, **{fixed: False})
    with pytest.raises(ValueError, match=fixed):
        hf_plugin.create_fused_optimizer(tiny_bert(), args, **{fixed: False})
    with pytest.raises(ValueError, match=fixed):
        hf_plugin.FusedOptimizer(tiny_bert().parameters(), **{fixed: False})


def test_compile_setting_reaches_the_optimizer_trainer_builds(tmp_path):
    from transformers import Trainer

    # compile=True: the tiny model is below the size "auto" compiles from; AdamW without fused=True
    # (Trainer's default optim is adamw_torch_fused, whose flat step is torch's own fused kernel)
    cls, kwargs = hf_plugin.fused_optimizer_cls_and_kwargs(training_args(tmp_path), torch.optim.AdamW, compile=True)
    trainer = Trainer(model=tiny_bert(), args=training_args(tmp_path, max_steps=2), train_dataset=make_dataset(8),
                      optimizer_cls_and_kwargs=(cls, kwargs))
    trainer.train()
    report = hf_plugin.fusion_report(trainer.optimizer)
    assert report.last_step_fused and report.compiled, report


def test_optim_that_builds_its_own_params_is_refused(tmp_path, monkeypatch):
    from transformers import Trainer

    def galore_like(args, model=None):
        return torch.optim.AdamW, {"lr": 1e-3, "params": [{"params": []}]}

    monkeypatch.setattr(Trainer, "get_optimizer_cls_and_kwargs", staticmethod(galore_like))
    with pytest.raises(hf_plugin.UnsupportedOptimizerError, match="optimizer_cls="):
        hf_plugin.create_fused_optimizer(tiny_bert(), training_args(tmp_path))


def test_fused_without_replace_step_is_refused(tmp_path):
    model = tiny_bert()
    optimizer = fuse_optimizer(torch.optim.AdamW(model.parameters()))  # replace_step=False
    trainer = hf_plugin.BaguaTrainer(
        model=model, args=training_args(tmp_path, max_steps=2), train_dataset=make_dataset(16),
        optimizers=(optimizer, None),
    )
    with pytest.raises(hf_plugin.UnsupportedSetupError, match="replace_step"):
        trainer.train()


def test_model_moved_after_fusing_raises_named_error(tmp_path):
    """Casting the model after building the fused optimizer is caught at the first step, not trained through."""
    from transformers import Trainer

    args = training_args(tmp_path, max_steps=2)
    model = tiny_bert()
    optimizer = hf_plugin.create_fused_optimizer(model, args)
    model.double()
    trainer = Trainer(
        model=model, args=args, train_dataset=make_dataset(16), optimizers=(optimizer, None)
    )
    with pytest.raises(LayoutChangedError):
        trainer.train()


def test_unknown_algorithm_fails_at_construction(tmp_path):
    """A typo fails when the Trainer is built (the core's UnknownAlgorithmError, listing the names)."""
    pytest.importorskip("bagua_integrations.distributed.algorithms")
    with pytest.raises(ValueError, match="no-such-algorithm.*bytegrad"):
        hf_plugin.BaguaTrainer(
            model=tiny_bert(), args=training_args(tmp_path), train_dataset=make_dataset(8),
            bagua_algorithm="no-such-algorithm",
        )


def test_load_best_model_at_end_is_refused_where_ranks_hold_different_weights():
    """Under decentralized, bmuf and async, Trainer would rank checkpoints by rank 0's evaluation
    of its own replica and load rank 0's replica on every rank (found by review: the reloaded
    model did not reproduce the recorded best metric)."""
    from hf_plugin._algorithms import check_model_selection
    from hf_plugin.errors import AlgorithmSetupError

    from bagua_integrations.distributed import get_algorithm

    differ = [get_algorithm("decentralized", communication_interval=3), get_algorithm("bmuf"), get_algorithm("async")]
    for algorithm in differ:
        with pytest.raises(AlgorithmSetupError, match="load_best_model_at_end=False"):
            check_model_selection(algorithm, load_best_model_at_end=True)
        check_model_selection(algorithm, load_best_model_at_end=False)
    for name in ("gradient_allreduce", "bytegrad", "qadam", "decentralized"):  # decentralized "all", every step
        check_model_selection(get_algorithm(name), load_best_model_at_end=True)


def test_trainer_refuses_load_best_model_at_end_under_bmuf(tmp_path):
    """The check above, as a user meets it: ``train()`` stops before the first step."""
    pytest.importorskip("bagua_integrations.distributed.algorithms")
    from hf_plugin.errors import AlgorithmSetupError

    args = training_args(tmp_path, max_steps=2, eval_strategy="steps", save_strategy="steps", eval_steps=1,
                         save_steps=1, load_best_model_at_end=True, max_grad_norm=0.0)
    trainer = hf_plugin.BaguaTrainer(
        model=tiny_bert(), args=args, train_dataset=make_dataset(16), eval_dataset=make_dataset(8),
        bagua_algorithm="bmuf",
    )
    with pytest.raises(AlgorithmSetupError, match="load_best_model_at_end=False"):
        trainer.train()
    assert trainer.state.global_step == 0


def _explicit_classes():
    from transformers.optimization import Adafactor

    classes = [
        # (class, extra kwargs, the defaults it must end with: Trainer's adam_* only for an Adam-like class)
        (torch.optim.AdamW, {}, {"betas": (0.8, 0.99), "eps": 1e-7}),
        (torch.optim.Adagrad, {}, {"eps": 1e-10}),  # its own eps, as Trainer's optim="adagrad" keeps it
        (Adafactor, {"scale_parameter": False, "relative_step": False}, {"eps": (1e-30, 1e-3)}),  # a pair of eps
    ]
    try:
        import pytorch_optimizer

        classes.append((pytorch_optimizer.Adan, {}, {"betas": (0.98, 0.92, 0.99)}))  # three betas
    except ImportError:
        pass
    return classes


@pytest.mark.parametrize("index", range(4))
def test_an_explicit_class_gets_trainers_adam_arguments_only_in_their_form(tmp_path, index):
    """An explicit class gets ``betas``/``eps`` from TrainingArguments only where it is Adam-like (a
    pair of betas, a numeric eps); Adafactor (a pair of eps) and Adan (three betas) failed their first
    step with a bare TypeError/ValueError, and Adagrad lost its own eps."""
    classes = _explicit_classes()
    if index >= len(classes):
        pytest.skip("pytorch-optimizer is not installed")
    cls, extra, expected = classes[index]
    args = training_args(tmp_path, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-7)
    model = tiny_bert()
    optimizer = hf_plugin.create_fused_optimizer(model, args, cls, **extra)
    for key, value in expected.items():
        got = optimizer.defaults[key]
        assert (tuple(got) if isinstance(got, (tuple, list)) else got) == value, (key, got)
    out = model(input_ids=torch.randint(0, 100, (2, 8)), labels=torch.tensor([0, 1]))
    out.loss.backward()
    optimizer.step()  # (the first step is where the wrong forms failed)
