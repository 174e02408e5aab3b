"""HF Trainer under FSDP2 with a fused optimizer: what can be checked without an accelerator.

Accelerate turns FSDP on only for accelerator devices (``AcceleratorState`` ignores ``fsdp=...`` on
``MULTI_CPU``), so on CPU Trainer runs such a configuration as DDP and a multi-process test here would
prove nothing. What the plugin does under FSDP2 is what the core does on shards (tests/test_fsdp2_fused.py:
Trainer builds the optimizer over the DTensor parameters, the plugin fuses it); here, that the plugin
accepts FSDP2 where Trainer builds the optimizer, and names the ways that work where it does not.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason="pip install 'bagua-integrations[hf]'")


def _args(version):
    from _hf_utils import training_args

    return training_args("/tmp/unused", fsdp="full_shard", fsdp_config={"fsdp_version": version})


def test_trainer_builds_the_fused_optimizer_under_fsdp2():
    import hf_plugin

    cls, kwargs = hf_plugin.fused_optimizer_cls_and_kwargs(_args(2))
    assert cls is hf_plugin.FusedOptimizer and kwargs["lr"] == 1e-3


def test_a_fused_optimizer_passed_to_trainer_under_fsdp_names_the_ways_that_work():
    import hf_plugin
    from _hf_utils import tiny_bert

    with pytest.raises(hf_plugin.UnsupportedSetupError, match="optimizer_cls_and_kwargs"):
        hf_plugin.create_fused_optimizer(tiny_bert(), _args(2))
    with pytest.raises(hf_plugin.UnsupportedSetupError, match="FSDP1"):
        hf_plugin.fused_optimizer_cls_and_kwargs(_args(1))
