"""The torch version matrix: the core suites on every supported torch, each in its own venv.

    python -m pip install nox
    python -m nox -s core                    # every version in TORCH_VERSIONS (~5 GB of wheels each)
    python -m nox -s "core(torch='2.5.1')"   # one version
    python -m nox -t ci                      # the oldest, the GPU machines' and the newest, as CI runs them
    python -m nox -s core -- -k lamb         # extra pytest arguments after --

Each session installs ``torch==<version>`` first (PyPI's default wheel for that version; a CUDA build
on Linux, which runs on the CPU too), then the project with its ``[test]`` extra, then runs the
suites that need neither fairseq nor transformers. pip's cache is reused across sessions and runs,
except under CI (see ``core``).

``TORCH_VERSIONS`` is the one list of tested versions: ``setup.cfg``'s ``torch>=``, the README's
"Tested with torch" line and ``bagua_integrations/_torch_compat.py`` are checked against it by
``tests/test_torch_versions.py``.
"""

import os
import shutil

import nox

# Oldest first. Compiled steps need 2.6 (segmented ones 2.11, per-tensor ones 2.10); older releases
# run the exact eager step with one warning where compiling was asked (_torch_compat.compiled_steps_unsupported).
TORCH_VERSIONS = ["2.5.1", "2.6.0", "2.10.0", "2.11.0", "2.13.0", "2.14.1"]
PINNED = "2.13.0"  # scripts/install.sh: the version the full suite runs on
GPU_MACHINES = "2.11.0"  # the torch of the lent GPU machines
# CI runs these besides the full suite: the oldest and the GPU machines' torch (Dynamo 2.11 could not
# trace a step that 2.13 and 2.14 compiled, which switched compiled steps off on every GPU run until a
# lent H200 showed it). The newest (2.14.1) is left to `nox -s core` before a release: on the slower
# 2-core CI machines CI took about 125 minutes with it (2026-11-30, an AVX2-only AMD EPYC VM: full suite
# 43 min, 2.5.1 12 min, 2.11.0 35 min, 2.14.1 about as long again), over the 90-minute limit; the
# pinned 2.13 next to it runs everything.
CI_VERSIONS = (TORCH_VERSIONS[0], GPU_MACHINES)

# The suites that need only torch (and pytorch-optimizer for the third-party sweep).
CORE_TESTS = [
    "tests/test_fused_optimizer.py",
    "tests/test_compiled_step.py",
    "tests/test_segmented_fusion.py",
    "tests/test_per_tensor_compiled.py",
    "tests/test_scalar_prologue.py",
    "tests/test_fusion_reliability.py",
    "tests/test_fusion_guards.py",
    "tests/test_flat_memory.py",
    "tests/test_fuse_order.py",
    "tests/test_fused_state_dict.py",
    "tests/test_fsdp2_fused.py",
    "tests/test_torch_compat.py",
    "tests/test_bert_adam_reference.py",
    "tests/test_torch_versions.py",
    "tests/test_third_party_optimizers.py",
    "tests/test_distributed_api.py",
    "tests/test_join.py",
    "tests/test_codec.py",
    "tests/test_async_model_average.py",
    "tests/test_ddp_comm_hook.py",
]

# CPU communication over gloo. In CI the GPU machines' torch skips them (about 5 of its 35 minutes on a slow
# CI machine): those machines talk NCCL, and the oldest and the pinned torch run them in CI.
GLOO_TESTS = [
    "tests/test_distributed_api.py",
    "tests/test_join.py",
    "tests/test_async_model_average.py",
    "tests/test_ddp_comm_hook.py",
]

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["core"]


@nox.session
@nox.parametrize(
    "torch",
    [nox.param(v, tags=["ci"] if v in CI_VERSIONS else []) for v in TORCH_VERSIONS],
)
def core(session, torch):
    """The core suites on one torch version.

    Under CI (``CI`` set) each venv is removed once its suite has run and pip keeps no cache: a CUDA
    build of torch is ~5 GB in the venv and as much again in pip's cache, and a CI machine's disk is
    shared (a full disk failed a run with ``No space left on device``).
    """
    in_ci = bool(os.environ.get("CI"))
    tests = [t for t in CORE_TESTS if not (in_ci and torch == GPU_MACHINES and t in GLOO_TESTS)]
    pip_args = ["--no-cache-dir"] if in_ci else []
    try:
        session.install(*pip_args, f"torch=={torch}")
        session.install(*pip_args, "-e", ".[test]")
        session.run("python", "-c", "import torch; print('torch', torch.__version__)")
        # as scripts/test.sh: the files marked parallel on two workers, then the rest (exit 5: none selected)
        for selection, workers in (("parallel", ["-n", "2", "--dist", "loadfile"]), ("not parallel", [])):
            session.run("python", "-m", "pytest", "-q", "-m", f"not slow and {selection}", *workers, "-p", "no:cacheprovider",
                        "--durations=30", *tests, *session.posargs, env={"BAGUA_EXPECT_TORCH": torch},
                        success_codes=[0, 5])
    finally:
        if in_ci:
            shutil.rmtree(session.virtualenv.location, ignore_errors=True)
