"""Every use of fairseq's, OmegaConf's and argparse's private API by the plugin, in one place.

Each function here reaches into something its library does not promise to keep. They are
collected so that a new release breaks *this* module, loudly, instead of silently changing
how ``--optimizer bagua_fused`` builds or parses its base optimizer elsewhere:
``tests/test_fairseq_compat.py`` exercises each one on the installed libraries and fails with
the function's name if the private API moved.

Checked on fairseq-fixed 0.12.3.1 (fairseq 0.12.2's API), omegaconf 2.3.0 and the argparse
of Python 3.11.7; ``CHECKED_ON`` lists the versions the tests last ran on.

fairseq and omegaconf are imported inside the functions: ``fairseq_plugin._cli`` (which uses
this module) stays importable without them.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, List, Optional, Tuple

CHECKED_ON = {"fairseq-fixed": "0.12.3.1", "omegaconf": "2.3.0", "python": "3.11.7"}

__all__ = [
    "CHECKED_ON",
    "build_registered_optimizer",
    "set_legacy_defaults",
    "config_parent",
    "parser_option_dests",
    "wrap_parse_known_args",
    "call_before_each_save",
    "forget_global_group",
]

# (args, namespace) -> (parsed namespace, unrecognised strings): argparse's parse_known_args
ParseKnownArgs = Callable[..., Tuple[argparse.Namespace, List[str]]]


def build_registered_optimizer(cfg, params):
    """Build the registered fairseq optimizer that ``cfg`` names, over exactly ``params``.

    Private: ``fairseq.optim._build_optimizer`` (the registry's raw builder that
    ``fairseq.optim.build_optimizer`` wraps). The public ``build_optimizer`` also flattens
    dicts of parameters and drops the ones without ``requires_grad``; the base optimizer must
    receive the parameter list that ``bagua_fused`` itself was given, unchanged. ``cfg`` is a
    ``DictConfig`` with ``_name`` (dataclass optimizers) or an ``argparse.Namespace`` with
    ``optimizer`` (legacy ``add_args`` optimizers). Checked on fairseq-fixed 0.12.3.1.
    """
    from fairseq.optim import _build_optimizer

    return _build_optimizer(cfg, params)


def set_legacy_defaults(namespace: argparse.Namespace, cls) -> None:
    """Fill ``namespace`` with the defaults of a legacy (``add_args``) optimizer class.

    Private: ``fairseq.dataclass.utils._set_legacy_defaults``, which is what fairseq itself
    does for such optimizers when it converts a namespace into a config. A no-op for classes
    without ``add_args``. Checked on fairseq-fixed 0.12.3.1.
    """
    from fairseq.dataclass.utils import _set_legacy_defaults

    _set_legacy_defaults(namespace, cls)


def config_parent(cfg) -> Optional[Any]:
    """The ``DictConfig`` that holds ``cfg`` (fairseq's whole training config), else None.

    Private: OmegaConf's ``Node._get_parent()``; OmegaConf has no public way to walk up from
    a node. fairseq hands an optimizer only its own ``cfg.optimizer`` node, but a base
    optimizer built from it needs the ``common``/``optimization`` sections (and the node's
    ``${optimization.lr}`` interpolations resolve against the root). None when ``cfg`` is not
    a ``DictConfig`` (a legacy namespace) or has no ``DictConfig`` parent. Checked on
    omegaconf 2.3.0.
    """
    from omegaconf import DictConfig

    if not isinstance(cfg, DictConfig):
        return None
    parent = cfg._get_parent()
    return parent if isinstance(parent, DictConfig) else None


def parser_option_dests(parser: argparse.ArgumentParser) -> List[str]:
    """The ``dest`` of every argument ``parser`` defines, except those whose dest is ``SUPPRESS``.

    Private: argparse's ``ArgumentParser._actions``; argparse has no public list of a parser's
    options. Used to learn which options a legacy fairseq optimizer's ``add_args`` defines.
    Checked on the argparse of Python 3.11.7.
    """
    return [action.dest for action in parser._actions if action.dest != argparse.SUPPRESS]


def wrap_parse_known_args(
    parser: argparse.ArgumentParser, wrapper: Callable[[ParseKnownArgs, Any, Any], Tuple[argparse.Namespace, List[str]]]
) -> None:
    """Route every parse of ``parser`` through ``wrapper(original, args, namespace)``.

    Why fairseq forces it: fairseq (``fairseq.options.parse_args_and_arch``) adds the flags of
    the *selected* optimizer only (``--optimizer bagua_fused``), then parses the final
    command line; a flag of the base optimizer (``--adam-betas`` for ``--bagua-base-optimizer
    adam``) would be rejected, and fairseq offers no hook between "optimizer chosen" and "final
    parse". So the parser's ``parse_known_args`` is replaced, on this one parser instance, by
    ``wrapper``, which may add arguments before calling ``original(args, namespace)`` and
    post-process what it returns.

    Private: relies on argparse's ``parse_args`` calling ``self.parse_known_args(args,
    namespace)`` (an implementation detail; checked on Python 3.11.7), and on fairseq parsing
    with the same parser object whose optimizer ``add_args`` it called (fairseq-fixed 0.12.3.1).
    """
    original = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        return wrapper(original, args, namespace)

    parser.parse_known_args = parse_known_args


def call_before_each_save(torch_optimizer, callback: Callable[[], None]) -> None:
    """Make fairseq call ``callback()`` on every rank right before it writes a checkpoint.

    Private: fairseq's ``Trainer.consolidate_optimizer`` (called on all data-parallel ranks by
    ``checkpoint_utils.save_checkpoint`` before rank 0 alone builds the checkpoint) calls
    ``trainer.optimizer.optimizer.consolidate_state_dict()`` when that attribute exists; it
    is how fairscale's sharded optimizer collects its shards. Setting it on the torch optimizer
    (``trainer.optimizer.optimizer`` is that object with and without fairseq's fp16 wrappers)
    is the only all-ranks point before a save. fairseq also calls it on a rank that crashed,
    before writing ``crash.pt``. Checked on fairseq-fixed 0.12.3.1.
    """
    torch_optimizer.consolidate_state_dict = callback


def forget_global_group() -> None:
    """Drop fairseq's cached data-parallel process group (at exit, before the groups are destroyed).

    Why: destroying a process group joins gloo's worker threads only when it drops the last
    reference to it, and fairseq keeps one for the whole run: a gloo thread still running when
    the interpreter tears down can abort the rank after training finished (see
    ``bagua_integrations.distributed.comm.destroy_process_groups_at_exit``).

    Private: ``fairseq.distributed.utils.get_global_group._global_group``, where fairseq caches the
    group it makes with ``dist.new_group()`` (its data-parallel group without model parallelism).
    Checked on fairseq-fixed 0.12.3.1.
    """
    import sys

    utils = sys.modules.get("fairseq.distributed.utils")
    getter = getattr(utils, "get_global_group", None)
    if getter is not None and hasattr(getter, "_global_group"):
        del getter._global_group
