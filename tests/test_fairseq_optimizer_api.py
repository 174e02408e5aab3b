"""The ``FairseqOptimizer`` API of ``bagua_fused``, in process, against the stock optimizers.

Configs come from fairseq's own parser (``parse_args_and_arch`` + ``convert_namespace_to_omegaconf``),
so the base-optimizer flags go through the same path as on the command line.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest

from _fairseq_utils import requires_fairseq

pytestmark = requires_fairseq

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def fs():
    """fairseq, the plugin and a config factory (imported once: fairseq takes seconds to import)."""
    try:
        import fairseq_plugin  # noqa: F401
    except ImportError:  # not installed yet (pip install -e .): use the checkout
        import sys

        from _fairseq_utils import REPO

        sys.path.insert(0, str(REPO))
        import fairseq_plugin  # noqa: F401
    from fairseq import optim, options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    def make_cfg(*args):
        parser = options.get_training_parser()
        namespace = options.parse_args_and_arch(
            parser,
            input_args=["/nonexistent-data", "--task", "language_modeling", "--arch", "transformer_lm", "--cpu",
                        *args],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return convert_namespace_to_omegaconf(namespace)

    class NS:
        pass

    ns = NS()
    ns.make_cfg = make_cfg
    ns.optim = optim
    ns.plugin = fairseq_plugin
    return ns


def tiny_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    )
    return model.to(dtype)


def batch(step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 6, generator=gen).to(dtype), torch.randn(16, 3, generator=gen).to(dtype)


def train(optimizer, model, steps, start=0, clip=0.5, dtype=torch.float32):
    """fairseq's update: zero_grad, backward, multiply_grads, clip_grad_norm, step."""
    norms = []
    for step in range(start, start + steps):
        x, y = batch(step, dtype)
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).sum()
        optimizer.backward(loss)
        optimizer.multiply_grads(1.0 / 16)
        norms.append(float(optimizer.clip_grad_norm(clip)))
        optimizer.step()
    return norms


def params_of(model):
    return [p.detach().float().clone() for p in model.parameters()]


def assert_same_params(a, b, tol=0.0):
    for x, y in zip(params_of(a), params_of(b)):
        assert float((x - y).abs().max()) <= tol


# ----------------------------------------------------------------------------- building
def test_registered_and_fused(fs):
    from bagua_integrations import fusion_report, is_fused_optimizer

    assert "bagua_fused" in fs.optim.OPTIMIZER_REGISTRY
    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--lr", "0.01")
    model = tiny_model()
    opt = fs.optim.build_optimizer(cfg.optimizer, list(model.parameters()))
    assert type(opt).__name__ == "BaguaFusedOptimizer"
    assert opt.base_name == "adam" and type(opt.base_optimizer).__name__ == "FairseqAdam"
    assert opt.optimizer is opt.base_optimizer.optimizer and is_fused_optimizer(opt.optimizer)
    report = fusion_report(opt.optimizer)
    assert report.fused_params == 6 and report.unfused_params == 0 and report.flat_buffers == 1
    train(opt, model, 2)
    assert opt.fusion_report().last_step_fused and opt.fusion_report().flat_runs == 1


@pytest.mark.parametrize(
    "base, flags, expected",
    [
        ("adam", ["--adam-betas", "(0.8, 0.9)", "--adam-eps", "1e-6", "--weight-decay", "0.1"],
         {"betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1}),
        ("sgd", ["--momentum", "0.7", "--wd", "0.2"], {"momentum": 0.7, "weight_decay": 0.2}),
        ("nag", ["--momentum", "0.5"], {"momentum": 0.5}),
        ("adagrad", ["--weight-decay", "0.3"], {"weight_decay": 0.3}),
        ("adamax", ["--adamax-betas", "(0.5, 0.6)"], {"betas": (0.5, 0.6)}),
        ("adadelta", ["--adadelta-rho", "0.8"], {"rho": 0.8}),
    ],
)
def test_base_flags_reach_the_base(fs, base, flags, expected):
    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--bagua-base-optimizer", base, "--lr", "0.25", *flags)
    reference_cfg = fs.make_cfg("--optimizer", base, "--lr", "0.25", *flags)
    opt = fs.optim.build_optimizer(cfg.optimizer, list(tiny_model().parameters()))
    reference = fs.optim.build_optimizer(reference_cfg.optimizer, list(tiny_model().parameters()))
    assert opt.optimizer_config == reference.optimizer_config
    group = opt.optimizer.param_groups[0]
    assert group["lr"] == 0.25
    for key, value in expected.items():
        assert tuple(group[key]) == value if isinstance(value, tuple) else group[key] == value


def test_config_records_base_options(fs):
    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--bagua-base-optimizer", "sgd", "--momentum", "0.9")
    assert cfg.optimizer.bagua_base_optimizer == "sgd"
    assert json.loads(cfg.optimizer.bagua_base_args) == {"momentum": 0.9, "weight_decay": 0.0}


def test_unknown_base_is_a_parser_error(fs, capsys):
    with pytest.raises(SystemExit) as exit_info:
        fs.make_cfg("--optimizer", "bagua_fused", "--bagua-base-optimizer", "adamw")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --bagua-base-optimizer: invalid choice: 'adamw' (choose from 'adadelta', 'adafactor'" in err


def test_flag_of_another_optimizer_is_rejected(fs, capsys):
    # --momentum belongs to sgd/nag, not to the adam base: rejected as `--optimizer adam --momentum` is
    with pytest.raises(SystemExit):
        fs.make_cfg("--optimizer", "bagua_fused", "--bagua-base-optimizer", "adam", "--momentum", "0.9")
    assert "unrecognized arguments: --momentum 0.9" in capsys.readouterr().err


def test_unknown_algorithm_is_a_parser_error(fs, capsys):
    with pytest.raises(SystemExit):
        fs.make_cfg("--optimizer", "bagua_fused", "--bagua-algorithm", "allreduce")
    err = capsys.readouterr().err
    assert "argument --bagua-algorithm: invalid choice: 'allreduce' (choose from" in err
    for name in ("'bmuf'", "'bytegrad'", "'decentralized'", "'gradient_allreduce'"):
        assert name in err


def test_hydra_style_config(fs):
    """A config written by hand (fairseq-hydra-train): base options as JSON in bagua_base_args."""
    from omegaconf import open_dict

    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--lr", "0.1")
    with open_dict(cfg.optimizer):
        cfg.optimizer.bagua_base_optimizer = "nag"
        cfg.optimizer.bagua_base_args = json.dumps({"momentum": 0.8})
    opt = fs.optim.build_optimizer(cfg.optimizer, list(tiny_model().parameters()))
    assert type(opt.base_optimizer).__name__ == "FairseqNAG" and opt.optimizer_config["momentum"] == 0.8

    with open_dict(cfg.optimizer):
        cfg.optimizer.bagua_base_args = json.dumps({"momentun": 0.8})
    with pytest.raises(ValueError, match=r"option\(s\) \['momentun'\] that --bagua-base-optimizer nag does not take"):
        fs.optim.build_optimizer(cfg.optimizer, list(tiny_model().parameters()))
    with open_dict(cfg.optimizer):
        cfg.optimizer.bagua_base_args = "{momentum: 0.8"
    with pytest.raises(ValueError, match="must be a JSON object"):
        fs.optim.build_optimizer(cfg.optimizer, list(tiny_model().parameters()))
    with open_dict(cfg.optimizer):
        cfg.optimizer.bagua_base_optimizer = "rmsprop"
        cfg.optimizer.bagua_base_args = None
    with pytest.raises(ValueError, match=r"invalid choice: 'rmsprop' \(choose from 'adadelta'"):
        fs.optim.build_optimizer(cfg.optimizer, list(tiny_model().parameters()))


def test_non_elementwise_base(fs):
    from bagua_integrations import FusionFallbackWarning, NotElementwiseError

    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--bagua-base-optimizer", "adafactor", "--lr", "0.01",
                      "--bagua-on-unsupported", "raise")
    with pytest.raises(NotElementwiseError, match="--bagua-on-unsupported fallback"):
        fs.optim.build_optimizer(cfg.optimizer, list(tiny_model().parameters()))

    cfg = fs.make_cfg(
        "--optimizer", "bagua_fused", "--bagua-base-optimizer", "adafactor", "--lr", "0.01",
        "--bagua-on-unsupported", "fallback",
    )
    model, reference_model = tiny_model(), tiny_model()
    with pytest.warns(FusionFallbackWarning):
        opt = fs.optim.build_optimizer(cfg.optimizer, list(model.parameters()))
    reference = fs.optim.build_optimizer(fs.make_cfg("--optimizer", "adafactor", "--lr", "0.01").optimizer,
                                         list(reference_model.parameters()))
    assert train(opt, model, 4) == train(reference, reference_model, 4)
    assert_same_params(model, reference_model)
    assert opt.fusion_report().unfused_params == 6


# ----------------------------------------------------------------------------- the API
@pytest.mark.parametrize("base, flags", [("adam", ["--weight-decay", "0.01"]), ("sgd", ["--momentum", "0.9"]),
                                         ("nag", []), ("adamax", []), ("adagrad", []), ("adadelta", [])])
def test_training_matches_the_base(fs, base, flags):
    model, reference_model = tiny_model(), tiny_model()
    opt = fs.optim.build_optimizer(
        fs.make_cfg("--optimizer", "bagua_fused", "--bagua-base-optimizer", base, "--lr", "0.05", *flags).optimizer,
        list(model.parameters()),
    )
    reference = fs.optim.build_optimizer(
        fs.make_cfg("--optimizer", base, "--lr", "0.05", *flags).optimizer, list(reference_model.parameters())
    )
    assert train(opt, model, 5) == train(reference, reference_model, 5)
    assert_same_params(model, reference_model)
    assert opt.fusion_report().fused_steps == 5 and opt.fusion_report().unfused_params == 0
    before = params_of(model)
    train(opt, model, 1, start=5)
    assert any(float((a - b).abs().max()) > 0 for a, b in zip(before, params_of(model)))


def test_lr_get_set(fs):
    opt = fs.optim.build_optimizer(fs.make_cfg("--optimizer", "bagua_fused", "--lr", "0.01").optimizer,
                                   list(tiny_model().parameters()))
    assert opt.get_lr() == 0.01
    opt.set_lr(0.125)
    assert opt.get_lr() == 0.125
    assert all(group["lr"] == 0.125 for group in opt.optimizer.param_groups)


def test_multiply_and_clip_grads(fs):
    model, reference_model = tiny_model(), tiny_model()
    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--lr", "0.01").optimizer
    opt = fs.optim.build_optimizer(cfg, list(model.parameters()))
    reference = fs.optim.build_optimizer(fs.make_cfg("--optimizer", "adam", "--lr", "0.01").optimizer,
                                         list(reference_model.parameters()))
    for o, m in ((opt, model), (reference, reference_model)):
        x, y = batch(0)
        o.zero_grad()
        o.backward(((m(x) - y) ** 2).sum())
        o.multiply_grads(0.5)
        o.multiply_grads(torch.tensor(0.25))
    norm = opt.clip_grad_norm(0.1)
    reference_norm = reference.clip_grad_norm(0.1)
    assert float(norm) == float(reference_norm) and float(norm) > 0.1
    for p, q in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(p.grad, q.grad)
    total = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
    assert abs(float(total) - 0.1) < 1e-5
    # aggregate_norm_fn (FSDP / sharded) is honoured
    assert float(opt.clip_grad_norm(0, aggregate_norm_fn=lambda n: n * 2)) == pytest.approx(0.2, rel=1e-5)


def test_supports_flags(fs):
    def build(base):
        cfg = fs.make_cfg("--optimizer", "bagua_fused", "--bagua-base-optimizer", base, "--lr", "0.1")
        return fs.optim.build_optimizer(cfg.optimizer, list(tiny_model().parameters()))

    adam, sgd = build("adam"), build("sgd")
    assert adam.supports_memory_efficient_fp16 is True and sgd.supports_memory_efficient_fp16 is False
    assert adam.supports_flat_params is True and sgd.supports_flat_params is True
    for opt in (adam, sgd):
        assert opt.supports_step_with_scale is False and opt.supports_groups is False
    with pytest.raises(ValueError, match="param groups"):
        adam.step(groups={"default"})
    with pytest.raises(ValueError, match="unfused SGD"):
        sgd.optimizer = torch.optim.SGD(tiny_model().parameters(), lr=0.1)


def test_step_with_scale_divides_the_gradients(fs):
    model, reference_model = tiny_model(), tiny_model()
    opt = fs.optim.build_optimizer(fs.make_cfg("--optimizer", "bagua_fused", "--bagua-base-optimizer", "sgd",
                                               "--lr", "0.1").optimizer, list(model.parameters()))
    reference = fs.optim.build_optimizer(fs.make_cfg("--optimizer", "sgd", "--lr", "0.1").optimizer,
                                         list(reference_model.parameters()))
    for o, m in ((opt, model), (reference, reference_model)):
        x, y = batch(0)
        o.zero_grad()
        o.backward(((m(x) - y) ** 2).sum())
        o.step(scale=4.0)
    assert_same_params(model, reference_model)


def test_state_dict_resume_and_overrides(fs):
    """Save after 3 steps, load into a fresh optimizer (with an lr override), continue: same as never stopping."""
    args = ("--optimizer", "bagua_fused", "--lr", "0.01", "--weight-decay", "0.01")
    model = tiny_model()
    opt = fs.optim.build_optimizer(fs.make_cfg(*args).optimizer, list(model.parameters()))
    train(opt, model, 3)
    state = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(model.state_dict())
    assert state["bagua_base_optimizer"] == "adam"
    reference_model = tiny_model()
    reference = fs.optim.build_optimizer(fs.make_cfg("--optimizer", "adam", "--lr", "0.01",
                                                     "--weight-decay", "0.01").optimizer,
                                         list(reference_model.parameters()))
    train(reference, reference_model, 3)
    # the saved state is the base optimizer's own format, same numbers
    ref_state = reference.state_dict()
    assert ref_state["param_groups"][0].keys() == state["param_groups"][0].keys()
    for key, value in ref_state["state"].items():
        for name, tensor in value.items():
            other = state["state"][key][name]
            assert torch.equal(torch.as_tensor(tensor), torch.as_tensor(other)), name

    opt.set_lr(0.02)
    train(opt, model, 3, start=3)

    resumed_model = tiny_model(seed=5)
    resumed_model.load_state_dict(weights)
    resumed = fs.optim.build_optimizer(fs.make_cfg(*args).optimizer, list(resumed_model.parameters()))
    resumed.load_state_dict(state, optimizer_overrides={"lr": 0.02})
    assert resumed.get_lr() == 0.02
    train(resumed, resumed_model, 3, start=3)
    assert_same_params(model, resumed_model)

    other = fs.optim.build_optimizer(
        fs.make_cfg("--optimizer", "bagua_fused", "--bagua-base-optimizer", "sgd", "--lr", "0.1").optimizer,
        list(tiny_model().parameters()),
    )
    with pytest.raises(ValueError, match="--bagua-base-optimizer adam, not sgd.*--reset-optimizer"):
        other.load_state_dict(state)


# ----------------------------------------------------------------------------- mixed precision
def _mixed(fs, wrapper, precision, base_args):
    from fairseq.optim import FP16Optimizer, MemoryEfficientFP16Optimizer

    dtype = torch.bfloat16 if "bf16" in precision else torch.float16
    cls = {"fp16": FP16Optimizer, "memory_efficient": MemoryEfficientFP16Optimizer}[wrapper]
    models = []
    norms = []
    for optimizer_args in (("--optimizer", "bagua_fused"), ("--optimizer", "adam")):
        cfg = fs.make_cfg(*optimizer_args, "--lr", "0.01", *base_args, precision,
                          *(["--fp16-no-flatten-grads"] if precision == "--fp16" else []))
        model = tiny_model(dtype=dtype)
        opt = cls.build_optimizer(cfg, list(model.parameters()))
        norms.append(train(opt, model, 4, dtype=dtype))
        models.append((model, opt))
    assert norms[0] == norms[1]
    assert_same_params(models[0][0], models[1][0])
    fused = models[0][1]
    inner = fused.fp32_optimizer if wrapper == "fp16" else fused.wrapped_optimizer
    assert type(inner).__name__ == "BaguaFusedOptimizer"
    assert inner.fusion_report().last_step_fused and inner.fusion_report().unfused_params == 0
    return models


@pytest.mark.parametrize("wrapper", ["fp16", "memory_efficient"])
@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_mixed_precision_wrappers(fs, wrapper, precision):
    """FP16Optimizer (fp32 master copies) and MemoryEfficientFP16Optimizer around bagua_fused,
    in bf16 and fp16 (on CPU; fairseq-train itself needs CUDA/TPU for --bf16 and flat --fp16)."""
    models = _mixed(fs, wrapper, precision, ["--weight-decay", "0.01"])
    fused_wrapper = models[0][1]
    if precision == "--fp16":
        assert fused_wrapper.scaler is not None
    state = fused_wrapper.state_dict()
    assert state["bagua_base_optimizer"] == "adam"
    if precision == "--fp16":
        assert "loss_scale" in state


# ----------------------------------------------------------------------------- algorithm options
def test_algorithm_options_are_checked(fs):
    from fairseq_plugin import _algorithms

    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--bagua-block-lr", "0.5")
    with pytest.raises(ValueError, match="--bagua-block-lr only apply with --bagua-algorithm"):
        fs.optim.build_optimizer(cfg.optimizer, list(tiny_model().parameters()))
    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--bagua-algorithm", "decentralized", "--bagua-block-lr", "0.5")
    with pytest.raises(ValueError, match="decentralized does not take --bagua-block-lr; its options are: .*"
                                         "--bagua-communication-interval"):
        fs.optim.build_optimizer(cfg.optimizer, list(tiny_model().parameters()))
    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--bagua-algorithm", "bmuf", "--bagua-global-sync-iter", "7",
                      "--bagua-use-nbm", "--bagua-hierarchical", "false")
    assert _algorithms.algorithm_kwargs(cfg.optimizer, "bmuf") == {
        "global_sync_iter": 7, "use_nbm": True, "hierarchical": False}
    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--bagua-algorithm", "decentralized", "--bagua-timeout", "30",
                      "--bagua-peer-selection-mode", "shift_one", "--bagua-communication-interval", "4")
    assert _algorithms.algorithm_kwargs(cfg.optimizer, "decentralized") == {
        "timeout": 30.0, "peer_selection_mode": "shift_one", "communication_interval": 4}
    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--bagua-algorithm", "bytegrad", "--bagua-message-size", "4096")
    assert _algorithms.algorithm_kwargs(cfg.optimizer, "bytegrad") == {"message_size": 4096}


def test_algorithm_needs_a_manual_ddp_backend(fs):
    from fairseq_plugin import _algorithms

    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--distributed-world-size", "2")
    with pytest.raises(ValueError, match="needs --ddp-backend legacy_ddp.*pytorch_ddp"):
        _algorithms.check_setup("gradient_allreduce", cfg)
    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--distributed-world-size", "2", "--ddp-backend", "legacy_ddp")
    _algorithms.check_setup("gradient_allreduce", cfg)
    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--use-bmuf")
    with pytest.raises(ValueError, match="--use-bmuf"):
        _algorithms.check_setup("bmuf", cfg)


def test_model_algorithm_in_one_process(fs, caplog):
    """A single process has no peers: the algorithm is built and counts updates, nothing else changes."""
    model, reference_model = tiny_model(), tiny_model()
    cfg = fs.make_cfg("--optimizer", "bagua_fused", "--lr", "0.01", "--bagua-algorithm", "bmuf",
                      "--bagua-warmup-iterations", "2", "--bagua-global-sync-iter", "2")
    opt = fs.optim.build_optimizer(cfg.optimizer, list(model.parameters()))
    assert opt.algorithm.kind == "model"
    reference = fs.optim.build_optimizer(fs.make_cfg("--optimizer", "adam", "--lr", "0.01").optimizer,
                                         list(reference_model.parameters()))
    assert train(opt, model, 4) == train(reference, reference_model, 4)
    assert_same_params(model, reference_model)
    state = opt.state_dict()
    assert state["bagua_algorithm"]["num_updates"] == 4
    again = fs.optim.build_optimizer(cfg.optimizer, list(tiny_model().parameters()))
    again.load_state_dict(state)
    assert again.algorithm.num_updates == 4


def test_per_rank_gather_runs_before_a_save_but_not_on_the_crash_path(fs, caplog):
    """fairseq calls consolidate_state_dict on every rank before a save, and on one failing rank
    before crash.pt: only the first may gather (the peers of a crashing rank are not there)."""
    from types import SimpleNamespace

    from fairseq_plugin.optimizer import BaguaFusedOptimizer

    calls = []
    algorithm = SimpleNamespace(
        name="decentralized", num_updates=7,
        gather_rank_state_dicts=lambda params=None: calls.append(params) or [{"algorithm": {"rank": 0}}, {"algorithm": {"rank": 1}}],
    )
    param = torch.nn.Parameter(torch.ones(2))
    adapter = SimpleNamespace(algorithm=algorithm, _gathered=None, _params_are_weights=True, params=[param])
    try:
        raise FloatingPointError("a failing update")
    except FloatingPointError:
        BaguaFusedOptimizer._gather_rank_states(adapter)
    assert calls == [] and adapter._gathered is None
    assert "rank 0's state only" in caplog.text
    BaguaFusedOptimizer._gather_rank_states(adapter)
    assert len(calls) == 1 and calls[0][0] is param
    assert adapter._gathered == (7, [{"algorithm": {"rank": 0}}, {"algorithm": {"rank": 1}}])
