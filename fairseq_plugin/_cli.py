"""Command-line glue: the base optimizer's own flags under ``--optimizer bagua_fused``.

fairseq adds the flags of the *selected* optimizer only (``--optimizer bagua_fused``), so
``--adam-betas`` would be rejected. :func:`install_base_flags` makes the training parser
look up ``--bagua-base-optimizer`` right before its final parse, add that optimizer's own
flags (exactly as ``--optimizer <base>`` would) and, after parsing, store their values in
``args.bagua_base_args`` (JSON). That field is part of the ``bagua_fused`` dataclass, so the
values reach ``cfg.optimizer`` and the checkpoint like any other optimizer option, and they
survive fairseq's process spawning (which passes the config, not the command line).
"""

from __future__ import annotations

import argparse
import json
from typing import Dict, List, Optional, Sequence

from ._fairseq_compat import parser_option_dests, wrap_parse_known_args

DEFAULT_BASE = "adam"
# Registered optimizers that cannot be the base: ourselves, and the composite optimizer
# (a container of several FairseqOptimizers with per-group schedulers, not one torch optimizer).
EXCLUDED_BASES = {"bagua_fused": "it is this optimizer", "composite": "it combines several optimizers"}

_HOOK_ATTR = "_bagua_fused_hooked"


def base_choices() -> List[str]:
    from fairseq.optim import OPTIMIZER_REGISTRY

    return sorted(name for name in OPTIMIZER_REGISTRY if name not in EXCLUDED_BASES)


def invalid_choice_message(flag: str, value, choices: Sequence[str]) -> str:
    """argparse's own wording for a bad choice, so the error reads like any fairseq flag's."""
    listed = ", ".join(repr(c) for c in choices)
    return f"argument {flag}: invalid choice: {value!r} (choose from {listed})"


def check_base(name) -> str:
    choices = base_choices()
    if name not in choices:
        raise ValueError(invalid_choice_message("--bagua-base-optimizer", name, choices))
    return name


def base_option_names(base: str) -> Optional[List[str]]:
    """Names of the options a base optimizer takes (None: it reads fairseq's whole namespace)."""
    from fairseq.optim import OPTIMIZER_DATACLASS_REGISTRY, OPTIMIZER_REGISTRY

    dc = OPTIMIZER_DATACLASS_REGISTRY.get(base)
    if dc is not None:
        return [name for name in dc.__dataclass_fields__ if not name.startswith("_")]
    cls = OPTIMIZER_REGISTRY[base]
    if not hasattr(cls, "add_args"):
        return []
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    cls.add_args(parser)
    return parser_option_dests(parser)


def _interpolated(base: str) -> set:
    """Dataclass fields filled from elsewhere in the config (``lr``, ``tpu``): not base flags."""
    from fairseq.optim import OPTIMIZER_DATACLASS_REGISTRY

    dc = OPTIMIZER_DATACLASS_REGISTRY.get(base)
    if dc is None:
        return {"lr"}
    out = set()
    for name, field in dc.__dataclass_fields__.items():
        default = field.default
        if isinstance(default, str) and default.startswith("${"):
            out.add(name)
    return out | {"lr"}


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def collect_base_args(base: str, namespace) -> Dict[str, object]:
    """The base optimizer's option values found in a parsed fairseq namespace."""
    names = base_option_names(base) or []
    skip = _interpolated(base)
    return {
        name: _jsonable(getattr(namespace, name))
        for name in names
        if name not in skip and hasattr(namespace, name)
    }


def install_base_flags(parser: argparse.ArgumentParser) -> None:
    """Teach ``parser`` (fairseq's training parser) the base optimizer's flags; idempotent.

    Every parse of ``parser`` goes through the function below (see
    :func:`fairseq_plugin._fairseq_compat.wrap_parse_known_args` for why fairseq forces that).
    """
    if getattr(parser, _HOOK_ATTR, False):
        return
    setattr(parser, _HOOK_ATTR, True)
    added: Dict[str, bool] = {}

    def parse_known_args(original, args=None, namespace=None):
        probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        probe.add_argument("--optimizer", default=None)
        probe.add_argument("--bagua-base-optimizer", default=DEFAULT_BASE)
        probe.add_argument("--bagua-algorithm", default=None)
        known, _ = probe.parse_known_args(args)
        if known.optimizer != "bagua_fused":
            return original(args, namespace)
        base = known.bagua_base_optimizer
        choices = base_choices()
        if base not in choices:
            parser.error(invalid_choice_message("--bagua-base-optimizer", base, choices))
        if known.bagua_algorithm is not None:
            from ._algorithms import check_name

            try:
                check_name(known.bagua_algorithm)  # a registered name, or Bagua's (GradientAllReduce, ...)
            except ValueError as error:
                parser.error(str(error))
        if base not in added:
            from fairseq.optim import OPTIMIZER_REGISTRY

            group = parser.add_argument_group(f"bagua_fused base optimizer ({base})")
            cls = OPTIMIZER_REGISTRY[base]
            if hasattr(cls, "add_args"):
                try:
                    cls.add_args(group)
                except argparse.ArgumentError:
                    pass  # an option of that name already exists; argparse keeps the first
            added[base] = True
        parsed, extra = original(args, namespace)
        parsed.bagua_base_args = json.dumps(collect_base_args(base, parsed), sort_keys=True)
        return parsed, extra

    wrap_parse_known_args(parser, parse_known_args)
