"""fairseq_plugin/_fairseq_compat.py on the installed fairseq, OmegaConf and argparse.

Each test exercises one compat function the way the plugin uses it. When a release moves the
private API underneath, the failure names the function, so the fix starts in that one module.
"""

from __future__ import annotations

import argparse
import json

import pytest

from _fairseq_utils import requires_fairseq

pytestmark = requires_fairseq

torch = pytest.importorskip("torch")


WHERE = "fairseq_plugin/_fairseq_compat.py"


def changed(name: str, what: str, detail: str = "") -> str:
    """The failure message: which function, which private API, what was seen."""
    return f"{name}: {what} changed ({WHERE}; {versions()})" + (f": {detail}" if detail else "")


def versions() -> str:
    from importlib import metadata

    import omegaconf

    try:
        fairseq = f"fairseq-fixed {metadata.version('fairseq-fixed')}"
    except metadata.PackageNotFoundError:
        fairseq = f"fairseq {metadata.version('fairseq')}"
    return f"{fairseq}, omegaconf {omegaconf.__version__}"


@pytest.fixture
def private_api(private_api_guard):
    """``with private_api(name, what):`` -- any error inside fails with :func:`changed`'s message."""
    return lambda name, what: private_api_guard(lambda detail: changed(name, what, detail))


@pytest.fixture(scope="module")
def compat():
    from fairseq_plugin import _fairseq_compat

    return _fairseq_compat


def _root(lr=0.25):
    from omegaconf import OmegaConf

    return OmegaConf.create({"common": {"tpu": False}, "optimization": {"lr": [lr]}, "optimizer": {"_name": "x"}})


def test_build_registered_optimizer_builds_dataclass_and_legacy_optimizers_over_the_given_params(compat, private_api):
    from omegaconf import OmegaConf

    name, what = "build_registered_optimizer", "fairseq.optim._build_optimizer"
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    params = [torch.nn.Parameter(torch.ones(4)), frozen]
    with private_api(name, what):
        import fairseq.optim

        assert callable(getattr(fairseq.optim, "_build_optimizer", None)), changed(name, what, "it is gone")
        node = OmegaConf.create({"_name": "adam", "lr": [0.25]}, parent=_root())
        adam = compat.build_registered_optimizer(node, params)
        assert type(adam).__name__ == "FairseqAdam", changed(name, what, f"built {type(adam).__name__}, not FairseqAdam")
        assert adam.get_lr() == 0.25, changed(name, what, f"lr {adam.get_lr()}")
        # unlike the public build_optimizer, the raw builder keeps every parameter it is given
        built = [p for group in adam.optimizer.param_groups for p in group["params"]]
        assert len(built) == 2 and built[1] is frozen, changed(name, what, "did not keep the given parameters")

        legacy = argparse.Namespace(optimizer="sgd", lr=[0.5], momentum=0.9, weight_decay=0.0)
        sgd = compat.build_registered_optimizer(legacy, [torch.nn.Parameter(torch.ones(2))])
        assert isinstance(sgd.optimizer, torch.optim.SGD), changed(name, what, f"built {type(sgd.optimizer).__name__}")
        assert sgd.optimizer.param_groups[0]["momentum"] == 0.9, changed(name, what, "the namespace's momentum was lost")


def test_set_legacy_defaults_fills_missing_options_only(compat, private_api):
    from fairseq.optim import OPTIMIZER_REGISTRY

    name, what = "set_legacy_defaults", "fairseq.dataclass.utils._set_legacy_defaults"
    with private_api(name, what):
        import fairseq.dataclass.utils as utils

        assert callable(getattr(utils, "_set_legacy_defaults", None)), changed(name, what, "it is gone")
        namespace = argparse.Namespace(momentum=0.7)
        compat.set_legacy_defaults(namespace, OPTIMIZER_REGISTRY["sgd"])
        assert namespace.momentum == 0.7, changed(name, what, "overwrote an option that was set")
        assert namespace.weight_decay == 0.0, changed(name, what, "did not fill sgd's --weight-decay default")
        empty = argparse.Namespace()
        compat.set_legacy_defaults(empty, object)  # a class without add_args: nothing to do
        assert vars(empty) == {}, changed(name, what, "changed the namespace of a class without add_args")


def test_config_parent_walks_up_from_an_optimizer_node(compat, private_api):
    from omegaconf import DictConfig, OmegaConf

    name, what = "config_parent", "OmegaConf's Node._get_parent()"
    with private_api(name, what):
        assert hasattr(DictConfig, "_get_parent"), changed(name, what, "it is gone")
        root = _root()
        assert compat.config_parent(root.optimizer) is root, changed(name, what, "did not return the config's root")
        assert compat.config_parent(root) is None, changed(name, what, "a root has no DictConfig parent")
        assert compat.config_parent(argparse.Namespace(lr=[1.0])) is None, changed(name, what, "a namespace has no parent")
        # how the plugin uses it: a base optimizer's node created under that root resolves ${...} there
        node = OmegaConf.create({"_name": "adam", "lr": "${optimization.lr}"}, parent=compat.config_parent(root.optimizer))
        assert list(node.lr) == [0.25], changed(name, what, f"interpolation against the parent gave {node.lr}")


def test_config_parent_on_a_real_fairseq_config(compat, private_api):
    import warnings

    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import fairseq_plugin  # noqa: F401  (registers bagua_fused)

    name, what = "config_parent", "OmegaConf's Node._get_parent() on fairseq's config"
    with private_api(name, what):
        namespace = options.parse_args_and_arch(
            options.get_training_parser(),
            input_args=["/nonexistent-data", "--task", "language_modeling", "--arch", "transformer_lm", "--cpu",
                        "--optimizer", "bagua_fused", "--lr", "0.125"],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = convert_namespace_to_omegaconf(namespace)
        root = compat.config_parent(cfg.optimizer)
        assert root is not None, changed(name, what, "fairseq's cfg.optimizer has no DictConfig parent")
        assert list(root.optimization.lr) == [0.125], changed(name, what, "the parent is not fairseq's whole config")


def test_parser_option_dests_lists_a_legacy_optimizers_options(compat, private_api):
    from fairseq.optim import OPTIMIZER_REGISTRY

    name, what = "parser_option_dests", "argparse's ArgumentParser._actions"
    with private_api(name, what):
        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument("--version", action="version", version="1", dest=argparse.SUPPRESS)  # not an option value
        assert isinstance(getattr(parser, "_actions", None), list), changed(name, what, "it is gone")
        parser.add_argument("--alpha-beta", type=float)
        parser.add_argument("--gamma", dest="delta", action="store_true")
        dests = compat.parser_option_dests(parser)
        assert dests == ["alpha_beta", "delta"], changed(name, what, f"got {dests}")
        sgd = argparse.ArgumentParser(add_help=False)
        OPTIMIZER_REGISTRY["sgd"].add_args(sgd)
        dests = compat.parser_option_dests(sgd)
        assert dests == ["momentum", "weight_decay"], changed(name, what, f"got {dests} for sgd's add_args")


def test_wrap_parse_known_args_sees_every_parse(compat, private_api):
    name, what = "wrap_parse_known_args", "argparse's parse_args -> self.parse_known_args routing"
    calls = []

    def wrapper(original, args, namespace):
        calls.append(list(args) if args is not None else None)
        if not any(a.dest == "late" for a in parser._actions):
            parser.add_argument("--late", type=int)  # added right before the real parse, as the plugin does
        parsed, extra = original(args, namespace)
        parsed.seen = True
        return parsed, extra

    with private_api(name, what):
        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument("--early", type=int)
        compat.wrap_parse_known_args(parser, wrapper)
        parsed = parser.parse_args(["--early", "1", "--late", "2"])
        assert (parsed.early, parsed.late, parsed.seen) == (1, 2, True), changed(name, what, f"parse_args gave {parsed}")
        parsed, extra = parser.parse_known_args(["--other", "3"])
        assert parsed.seen and extra == ["--other", "3"], changed(name, what, f"parse_known_args gave {parsed}, {extra}")
        assert len(calls) == 2, changed(name, what, f"the wrapper ran {len(calls)} time(s) for 2 parses")


def test_wrap_parse_known_args_through_fairseqs_parser(compat, private_api):
    """The plugin's use of it: a base optimizer's own flag under ``--optimizer bagua_fused``."""
    from fairseq import options

    import fairseq_plugin  # noqa: F401  (registers bagua_fused)

    name, what = "wrap_parse_known_args", "fairseq's parse_args_and_arch parsing with the optimizer's parser"
    with private_api(name, what):
        namespace = options.parse_args_and_arch(
            options.get_training_parser(),
            input_args=["/nonexistent-data", "--task", "language_modeling", "--arch", "transformer_lm", "--cpu",
                        "--optimizer", "bagua_fused", "--bagua-base-optimizer", "sgd", "--momentum", "0.5"],
        )
        assert json.loads(namespace.bagua_base_args) == {"momentum": 0.5, "weight_decay": 0.0}, (
            changed(name, what, f"bagua_base_args {namespace.bagua_base_args!r}")
        )


def test_call_before_each_save_runs_from_fairseqs_consolidate_optimizer(compat, private_api):
    """fairseq's Trainer.consolidate_optimizer (every rank, before a save) reaches the callback,
    with and without fairseq's fp16 wrapper around the fairseq optimizer."""
    from types import SimpleNamespace

    from fairseq.trainer import Trainer

    name, what = "call_before_each_save", "Trainer.consolidate_optimizer's consolidate_state_dict duck typing"
    calls = []
    torch_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    compat.call_before_each_save(torch_optimizer, lambda: calls.append("saved"))
    fairseq_optimizer = SimpleNamespace(optimizer=torch_optimizer)
    with private_api(name, what):
        for save_optimizer_state in (True, False):
            trainer = SimpleNamespace(
                cfg=SimpleNamespace(checkpoint=SimpleNamespace(no_save_optimizer_state=not save_optimizer_state)),
                optimizer=fairseq_optimizer,
                is_fsdp=False,
            )
            Trainer.consolidate_optimizer(trainer)
        assert calls == ["saved"], changed(name, what, f"callback calls {calls}")


def _forget_global_group(rank, world):
    import gc
    import weakref

    import torch.distributed as dist
    from fairseq.distributed import utils

    from fairseq_plugin import _fairseq_compat

    group = weakref.ref(utils.get_global_group())  # fairseq makes and caches it on first use
    assert utils.get_global_group() is group(), "not cached"
    _fairseq_compat.forget_global_group()
    _fairseq_compat.forget_global_group()  # nothing cached: nothing to do
    dist.destroy_process_group()
    gc.collect()
    return group() is None


def test_forget_global_group_leaves_fairseq_no_reference_to_its_group(compat, private_api):
    """After it, destroying the process groups drops fairseq's cached group for good (the last
    reference: what lets the exit join its gloo threads)."""
    from _dist_utils import run_ranks

    name, what = "forget_global_group", "fairseq.distributed.utils.get_global_group's cache"
    (result,) = run_ranks(_forget_global_group, 1, timeout=120)
    with private_api(name, what):
        assert result.ok, result.describe()
    assert result.value is True, changed(name, what, "the group outlived the destroy")
