"""Every script in examples/ runs as written (one process, and under torchrun where it says so),
so the examples the README points to cannot rot."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _dist_utils import free_port, fsdp2_runs_on_cpu

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _run(script, *args, nproc=1, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    result = subprocess.run([*launcher, str(EXAMPLES / script), *args], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"{script} {args} exited with {result.returncode}:\n{result.stderr[-4000:]}"
    return result.stdout


def test_every_example_is_tested_here():
    tested = {"fused_optimizer.py", "distributed_torchrun.py", "fsdp2_fused.py", "hf_trainer.py",
              "accelerate_example.py", "fairseq_language_model.sh"}
    assert {p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh")} == tested


def test_fused_optimizer_example():
    out = _run("fused_optimizer.py")
    assert "AdamW: path elementwise" in out and "BertAdam: path segmented" in out


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "bmuf"])
def test_distributed_example_under_torchrun(algorithm):
    out = _run("distributed_torchrun.py", algorithm, nproc=2)
    assert f"{algorithm} on 2 ranks" in out
    if algorithm == "gradient_allreduce":
        assert "between ranks 0.0e+00" in out


@pytest.mark.skipif(not fsdp2_runs_on_cpu(), reason="FSDP2 does not run on CPU with this torch")
@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_fsdp2_example_under_torchrun(optimizer):
    out = _run("fsdp2_fused.py", optimizer, nproc=2)
    assert "last step: fused" in out and "param groups: " + ("segmented" if optimizer == "lamb" else "elementwise") in out
    difference = float(out.rsplit("largest difference to unfused ", 1)[1].split()[0])
    assert difference < 1e-5, out


needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                              or importlib.util.find_spec("accelerate") is None,
                              reason="transformers/accelerate are not installed (pip install 'bagua-integrations[hf]')")


@needs_hf
@pytest.mark.parametrize("nproc, algorithm", [(1, None), (2, "bytegrad")])
def test_hf_trainer_example(nproc, algorithm):
    out = _run("hf_trainer.py", *([algorithm] if algorithm else []), nproc=nproc)
    assert "optimizer paths ['elementwise', 'elementwise']" in out


@needs_hf
@pytest.mark.parametrize("nproc", [1, 2])
def test_accelerate_example(nproc):
    out = _run("accelerate_example.py", nproc=nproc)
    assert "4 tensors fused" in out


@pytest.mark.skipif(importlib.util.find_spec("fairseq") is None, reason="fairseq is not installed")
def test_fairseq_example_prepares_data_and_trains(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(["bash", str(EXAMPLES / "fairseq_language_model.sh"), str(tmp_path / "work")], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "num_updates 20" in result.stdout + result.stderr
    assert (tmp_path / "work" / "checkpoints" / "checkpoint_last.pt").exists()
