"""Shared helpers for the fairseq plugin tests: a generated corpus, fairseq-train runs, log parsing.

Every run is a subprocess with a timeout, on CPU, one thread (the machine is shared), with a
tiny model. The corpus is generated from a seeded RNG and binarized with fairseq-preprocess
once per test session (:func:`shared_corpus`).

Runs write nothing into the repository: each runs in its own temporary working directory, and
a ``--no-save`` run still gets a ``--save-dir`` there (fairseq-train creates its save dir and
writes a probe file into it even with ``--no-save``; the default is ``./checkpoints``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from _dist_utils import free_port

REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIR = REPO / "fairseq_plugin"
PROBE_DIR = Path(__file__).resolve().parent / "_fairseq_probe"

TIMEOUT = 240  # seconds for one fairseq-train run (they take 5-15 s on two idle cores)
WORDS = [f"w{i}" for i in range(60)]

# transformer_lm small enough to train 30 updates in a second or two
LM_ARGS = [
    "--task", "language_modeling",
    "--arch", "transformer_lm",
    "--decoder-layers", "1",
    "--decoder-embed-dim", "16",
    "--decoder-ffn-embed-dim", "32",
    "--decoder-attention-heads", "2",
    "--tokens-per-sample", "32",
    "--max-tokens", "256",
]
# the BERT recipe's model family: RoBERTa masked LM, tiny
ROBERTA_ARGS = [
    "--task", "masked_lm",
    "--criterion", "masked_lm",
    "--arch", "roberta",
    "--encoder-layers", "1",
    "--encoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2",
    "--max-positions", "32",
    "--tokens-per-sample", "32",
    "--max-tokens", "256",
]
COMMON_ARGS = [
    "--cpu",
    "--seed", "1",
    "--log-format", "json",
    "--log-interval", "1",
    "--disable-validation",
    "--num-workers", "0",
    "--no-epoch-checkpoints",
]


# fairseq's tools run with this Python (``-m fairseq_cli.*``), not whatever ``fairseq-train`` is on
# PATH: a venv's python without the venv activated has no console scripts on PATH, and a pyenv shim
# may point at another interpreter.
FAIRSEQ_TRAIN = [sys.executable, "-m", "fairseq_cli.train"]
FAIRSEQ_PREPROCESS = [sys.executable, "-m", "fairseq_cli.preprocess"]


def fairseq_available() -> bool:
    """Whether fairseq is installed. Installed but broken is not a skip: the tests that need it fail
    (importing it, or running its tools), so a broken install never turns the fairseq tests quiet."""
    return importlib.util.find_spec("fairseq") is not None


requires_fairseq = pytest.mark.skipif(not fairseq_available(), reason="fairseq is not installed (pip install "
                                      "'bagua-integrations[fairseq]')")


def env() -> Dict[str, str]:
    out = dict(os.environ)
    out["OMP_NUM_THREADS"] = "1"  # deterministic and polite on a shared machine
    out["MKL_NUM_THREADS"] = "1"
    out["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p])
    out.pop("RANK", None)
    out.pop("WORLD_SIZE", None)
    out.pop("LOCAL_RANK", None)
    return out


# ----------------------------------------------------------------------------- corpus
def write_corpus(directory: Path, seed: int = 0) -> None:
    rng = random.Random(seed)
    # a little structure (a word tends to follow its predecessor) so the loss goes down
    for name, lines in (("train", 400), ("valid", 40)):
        with open(directory / f"{name}.txt", "w") as handle:
            for _ in range(lines):
                word = rng.randrange(len(WORDS))
                tokens = []
                for _ in range(rng.randint(5, 20)):
                    tokens.append(WORDS[word])
                    word = (word + rng.choice((1, 1, 2, 7))) % len(WORDS)
                handle.write(" ".join(tokens) + "\n")


def make_corpus(directory: Path) -> Path:
    """Write and binarize the corpus under ``directory``; return the data-bin path."""
    directory.mkdir(parents=True, exist_ok=True)
    write_corpus(directory)
    destdir = directory / "data-bin"
    cmd = [
        *FAIRSEQ_PREPROCESS,
        "--only-source",
        "--trainpref", str(directory / "train.txt"),
        "--validpref", str(directory / "valid.txt"),
        "--destdir", str(destdir),
        "--workers", "1",
    ]
    result = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=TIMEOUT)
    if result.returncode != 0:
        raise RuntimeError(f"fairseq-preprocess failed:\n{result.stdout}\n{result.stderr}")
    return destdir


_CORPUS: Dict[str, Path] = {}


def shared_corpus(tmp_path_factory) -> Path:
    """One binarized corpus per test session, whichever module asks first."""
    if "path" not in _CORPUS:
        _CORPUS["path"] = make_corpus(tmp_path_factory.mktemp("fairseq_corpus"))
    return _CORPUS["path"]


# ----------------------------------------------------------------------------- runs
@dataclass
class Run:
    cmd: List[str]
    returncode: int
    stdout: str
    stderr: str
    save_dir: Optional[Path] = None
    records: List[dict] = field(default_factory=list)

    @property
    def log(self) -> str:
        return self.stdout + self.stderr

    def losses(self) -> Dict[int, float]:
        return {int(r["num_updates"]): float(r["loss"]) for r in self.records}

    def column(self, key: str) -> Dict[int, float]:
        return {int(r["num_updates"]): float(r[key]) for r in self.records if key in r}

    def check(self) -> "Run":
        if self.returncode != 0:
            race = (f"\nthe gloo exit abort ({_GLOO_ABORT!r}): a gloo thread still ran at the interpreter's "
                    "teardown; see bagua_integrations.distributed.comm.destroy_process_groups_at_exit"
                    if _GLOO_ABORT in self.stderr else "")
            raise AssertionError(
                f"fairseq-train exited with {self.returncode}{race}\ncommand: {' '.join(self.cmd)}\n"
                f"--- stderr (tail) ---\n{self.stderr[-6000:]}"
            )
        return self


def parse_records(text: str) -> List[dict]:
    """The per-update ``train_inner`` records of a ``--log-format json --log-interval 1`` log."""
    out = []
    for line in text.splitlines():
        marker = "| train_inner | "
        if marker in line:
            out.append(json.loads(line.split(marker, 1)[1]))
    return out


def _command(data, save_dir, args, model, nproc, workdir: Path) -> List[str]:
    if nproc > 1:
        # `-m fairseq_cli.train`: the fairseq-train on PATH may be a shell shim (pyenv).
        # On CPU fairseq cannot infer the torchrun setup (it divides by the GPU count), so
        # the rendezvous is spelled out; --distributed-rank -1 makes torch read RANK from env.
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nproc_per_node", str(nproc),
            "--master_port", str(free_port()),
            "-m", "fairseq_cli.train",
        ]
    else:
        cmd = list(FAIRSEQ_TRAIN)
    cmd += [str(data), *model, *COMMON_ARGS]
    # --no-save still creates and probes the save dir (default ./checkpoints): keep it in the run's workdir
    cmd += ["--no-save", "--save-dir", str(workdir / "checkpoints")] if save_dir is None else ["--save-dir", str(save_dir)]
    if nproc > 1:
        cmd += [
            "--distributed-backend", "gloo",
            "--distributed-world-size", str(nproc),
            "--distributed-init-method", "env://",
            "--distributed-no-spawn",
            "--distributed-rank", "-1",
        ]
    return cmd + [str(a) for a in args]


# A torchrun rank of a 2-process gloo run used to die with this C++ abort now and then, after
# training (gdb on a core dump): while Python finalized, a gloo worker thread destroyed a finished
# collective that held the last reference to a Python-backed tensor; taking the GIL during
# finalization ended the thread and the unwind hit a noexcept frame (std::terminate). bagua's exit
# handler (comm.destroy_process_groups_at_exit, which fairseq_plugin installs) now joins every gloo
# thread before the teardown; the probe user dir records the threads left, and the distributed tests
# assert there are none. Such an abort is a failure, named as such; it is not relaunched.
_GLOO_ABORT = "terminate called without an active exception"


class _Started:
    def __init__(self, cmd, save_dir, timeout, extra_env, workdir: Path):
        self.cmd, self.save_dir, self.timeout = cmd, save_dir, timeout
        self.extra_env, self.workdir = extra_env, workdir
        run_env = env()
        run_env.update(extra_env or {})
        # files, not pipes: two runs side by side must never block on a full pipe
        self.out = tempfile.TemporaryFile(mode="w+")
        self.err = tempfile.TemporaryFile(mode="w+")
        # own session: on a timeout the whole torchrun tree is killed, not just the launcher;
        # own working directory: whatever fairseq writes relative to it stays out of the repository
        self.proc = subprocess.Popen(
            cmd, env=run_env, stdout=self.out, stderr=self.err, text=True, start_new_session=True,
            cwd=str(workdir),
        )

    def _read(self):
        texts = []
        for handle in (self.out, self.err):
            handle.seek(0)
            texts.append(handle.read())
            handle.close()
        return texts

    def finish(self) -> Run:
        try:
            try:
                self.proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
                _, err = self._read()
                raise AssertionError(
                    f"fairseq-train did not finish in {self.timeout}s: {' '.join(self.cmd)}\n{err[-4000:]}"
                ) from None
            out, err = self._read()
            run = Run(self.cmd, self.proc.returncode, out, err, self.save_dir)
            run.records = parse_records(run.log)
            return run
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start_train(
    data: Path,
    save_dir: Optional[Path],
    args: Sequence[str],
    *,
    model: Sequence[str] = LM_ARGS,
    nproc: int = 1,
    timeout: int = TIMEOUT,
    extra_env: Optional[Dict[str, str]] = None,
) -> _Started:
    """Launch fairseq-train (under torchrun when ``nproc > 1``); ``.finish()`` waits and parses.

    The run's working directory is a fresh temporary one, removed by ``.finish()``.
    """
    workdir = Path(tempfile.mkdtemp(prefix="fairseq_run_"))
    return _Started(_command(data, save_dir, args, model, nproc, workdir), save_dir, timeout, extra_env, workdir)


def fairseq_train(data: Path, save_dir: Optional[Path], args: Sequence[str], **kwargs) -> Run:
    """Run fairseq-train to completion and parse its log."""
    return start_train(data, save_dir, args, **kwargs).finish()


def train_pair(data: Path, root: Path, reference_args: Sequence[str], fused_args: Sequence[str], **kwargs):
    """The reference and the bagua_fused run side by side (two cores); save dirs root/ref, root/fused."""
    first = start_train(data, root / "ref", reference_args, **kwargs)
    second = start_train(data, root / "fused", fused_args, **kwargs)
    return first.finish().check(), second.finish().check()


def plugin_args(base: Optional[str] = "adam", *extra: str) -> List[str]:
    args = ["--user-dir", str(PLUGIN_DIR), "--optimizer", "bagua_fused"]
    if base is not None:
        args += ["--bagua-base-optimizer", base]
    return args + list(extra)


# ----------------------------------------------------------------------------- comparisons
def load_model(checkpoint: Path) -> Dict[str, "object"]:
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    return {k: v.float().clone() for k, v in state["model"].items()}


def max_param_diff(a: Dict[str, "object"], b: Dict[str, "object"]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_same_losses(reference: Run, other: Run, updates: int, tol: float = 0.0) -> None:
    ref, got = reference.losses(), other.losses()
    assert sorted(ref) == list(range(1, updates + 1)), f"reference logged updates {sorted(ref)}"
    assert sorted(got) == sorted(ref), f"logged updates {sorted(got)} != {sorted(ref)}"
    worst = max(abs(ref[u] - got[u]) for u in ref)
    assert worst <= tol, f"losses differ by up to {worst}: {ref} vs {got}"


def fused_counts(run: Run) -> Dict[str, int]:
    """Parse the plugin's 'first step updated N parameter(s) through R flat run(s); U unfused' line."""
    import re

    match = re.search(r"first step updated (\d+) parameter\(s\) through (\d+) flat run\(s\); (\d+) unfused", run.log)
    assert match, "the bagua_fused first-step line is missing from the log"
    fused, runs, unfused = map(int, match.groups())
    return {"fused": fused, "runs": runs, "unfused": unfused}
