"""fairseq front end: every row is one ``fairseq-train`` subprocess on the same binarized data and seed.

Data: the recipe's TSV files, tokenized into words exactly as for the HF front end, are written
as fairseq raw text (``input0``/``label``) and binarized with ``fairseq-preprocess`` against the
recipe's own word dictionary (the same vocabulary, so the embedding is as wide as the HF model's).

Model: fairseq's ``roberta`` architecture shrunk to the preset (layers, width, heads, FFN), with
``--task sentence_prediction``'s classification head -- a BERT/RoBERTa-style sentence classifier.

Rows: the recipe's user dir (``fairseq_user_dir/bert_recipe_fairseq``) registers ``bert_adam``
(Bagua's per-tensor BertAdam), ``torch_adamw`` (torch AdamW, foreach / fused / single) and
``timed_sentence_prediction`` (the task, logging optimizer-step and epoch times); it imports
``fairseq_plugin``, so ``--optimizer bagua_fused --bagua-base-optimizer bert_adam`` is the fused
BertAdam. For the rows of BertAdam with its defaults (``row.bertadam_defaults``, Bagua's rows)
BertAdam clips each parameter's gradient (``--bert-adam-max-grad-norm 1.0``) and schedules its own
learning rate (``--bert-adam-warmup``, ``--bert-adam-t-total``), and fairseq does neither
(``--clip-norm 0``, ``--lr-scheduler fixed``); for every other row fairseq clips gradients globally
(``--clip-norm``) and schedules the learning rate (``polynomial_decay`` with warmup, i.e. linear).

Results come from fairseq's own JSON log (``--log-format json``): the per-epoch ``train`` record
(``train_epoch_s``, ``train_opt_ms``, ``train_compile_s``, ``train_compiled``) and the ``valid``
record (``valid_accuracy``, in percent).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from typing import Dict, List, Optional, Sequence

from .data import Example, WordTokenizer, words_of
from .presets import Preset
from .results import RowResult, median
from .rows import Row

__all__ = ["FairseqPlan", "run_fairseq", "fairseq_available", "optimizer_args"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
USER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fairseq_user_dir", "bert_recipe_fairseq")
_PLUGIN_LINE = re.compile(r"first step updated (\d+) parameter\(s\) through (\d+) flat run\(s\); (\d+) unfused")
# logged by the recipe's task (fairseq_user_dir) whenever the fused layout it reports changes
_PATHS_LINE = re.compile(r"bert_recipe_fairseq: fused group paths (\[.*?\]); (\d+) parameter\(s\) through (\d+) flat")


@contextlib.contextmanager
def _quiet_root_logger():
    """Importing fairseq reconfigures the root logger (level DEBUG, a stderr handler), which would flood
    this process's output (matplotlib, transformers); restore it afterwards."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    disabled = logging.root.manager.disable
    logging.disable(logging.INFO)  # and its import-time notes ("Please install tensorboardX")
    try:
        yield
    finally:
        logging.disable(disabled)
        root.setLevel(level)
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)


def fairseq_available() -> Optional[str]:
    """None when fairseq-train / fairseq-preprocess and fairseq_plugin are usable, else why not."""
    if importlib.util.find_spec("fairseq") is None:
        return "fairseq is not installed (pip install 'bagua-integrations[fairseq]')"
    try:
        with _quiet_root_logger():
            import fairseq_plugin  # noqa: F401  (imports fairseq)
    except ImportError as exc:
        return f"fairseq_plugin cannot be imported ({exc})"
    return None


def plugin_compile_flag() -> Optional[str]:
    """The flag of ``bagua_fused`` that chooses compiled / eager, if the installed plugin has one."""
    try:
        with _quiet_root_logger():
            from fairseq_plugin.optimizer import BaguaFusedConfig
    except ImportError:
        return None
    fields = getattr(BaguaFusedConfig, "__dataclass_fields__", {})
    return "--bagua-compile" if "bagua_compile" in fields else None


def optimizer_args(row: Row, preset: Preset, compile_flag: Optional[str], total_updates: int = -1) -> List[str]:
    """fairseq-train flags of one row; raises ValueError when fairseq cannot express it.

    ``total_updates`` is BertAdam's ``t_total`` for the rows of BertAdam with its defaults.
    """
    betas = f"({preset.adam_betas[0]}, {preset.adam_betas[1]})"
    if row.optimizer == "bertadam":
        base = ["--bert-adam-betas", betas, "--bert-adam-eps", str(preset.adam_eps)]
        if row.bertadam_defaults:
            if total_updates <= 0:
                raise ValueError(f"row {row.key!r} needs total_updates (BertAdam's t_total)")
            # BertAdam's defaults, spelled out: per-parameter clipping, its own warmup_linear schedule
            base += ["--bert-adam-max-grad-norm", "1.0", "--bert-adam-warmup", str(preset.warmup_ratio),
                     "--bert-adam-t-total", str(total_updates), "--bert-adam-schedule", "warmup_linear"]
        else:
            base += ["--bert-adam-max-grad-norm", "-1", "--bert-adam-t-total", "-1"]  # fairseq clips and schedules
        name = "bert_adam"
    elif row.optimizer == "qadam":
        warmup = max(1, int(preset.warmup_ratio * total_updates)) if total_updates > 0 else 1
        base = ["--qadam-betas", betas, "--qadam-eps", str(preset.adam_eps), "--qadam-warmup-steps", str(warmup),
                "--qadam-decoupled-weight-decay"]
        name = "qadam"
    else:
        base = [
            "--torch-adamw-impl", row.impl or "foreach",
            "--torch-adamw-betas", betas,
            "--torch-adamw-eps", str(preset.adam_eps),
        ]
        name = "torch_adamw"
    base += ["--weight-decay", str(preset.weight_decay)]
    if row.fuse is None:
        return ["--optimizer", name] + base
    fused = ["--optimizer", "bagua_fused", "--bagua-base-optimizer", name]
    if compile_flag is not None:
        fused += [compile_flag, "true" if row.compile else "false"]
    elif row.fuse == "eager":
        raise ValueError(
            "fairseq_plugin's bagua_fused has no switch for an eager (uncompiled) fused step; it compiles "
            "automatically when the flat buffers hold >= 2**20 elements"
        )
    return fused + base


class FairseqPlan:
    """Data and settings shared by the fairseq rows."""

    def __init__(
        self,
        preset: Preset,
        train: Sequence[Example],
        valid: Sequence[Example],
        tokenizer: WordTokenizer,
        out_dir: str,
        *,
        seed: int = 0,
        num_labels: int = 2,
        nproc: int = 1,
        precision: str = "fp32",
        bagua_algorithm: Optional[str] = None,
        bagua_algorithm_args: Optional[dict] = None,
        threads: Optional[int] = None,
        progress: bool = True,
        timeout: Optional[float] = None,
    ):
        self.preset = preset
        self.train_examples, self.valid_examples = list(train), list(valid)
        self.tokenizer = tokenizer
        self.out_dir = os.path.join(out_dir, "fairseq")
        self.seed = seed
        self.num_labels = num_labels
        self.nproc = nproc
        self.precision = precision
        self.bagua_algorithm = bagua_algorithm
        self.bagua_algorithm_args = dict(bagua_algorithm_args or {})
        self.threads = threads
        self.progress = progress
        self.timeout = timeout
        self.data_bin: Optional[str] = None

    # ------------------------------------------------------------------ environment
    def env(self) -> Dict[str, str]:
        env = dict(os.environ)
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            env.pop(key, None)  # the recipe itself may run under torchrun
        paths = [REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
            env["MKL_NUM_THREADS"] = str(self.threads)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env

    # ------------------------------------------------------------------ data
    def prepare(self) -> str:
        """Write raw text, the dictionaries, and binarize both splits; returns the data-bin directory."""
        raw = os.path.join(self.out_dir, "raw")
        data_bin = os.path.join(self.out_dir, "data-bin")
        os.makedirs(raw, exist_ok=True)
        words_per_sentence = self.preset.max_seq_len - 2  # + <s> (init token) and </s>
        for split, examples in (("train", self.train_examples), ("valid", self.valid_examples)):
            with open(os.path.join(raw, f"{split}.input0"), "w") as handle:
                for example in examples:
                    words = words_of(example.sentence)[:words_per_sentence] or ["[UNK]"]
                    handle.write(" ".join(words) + "\n")
            with open(os.path.join(raw, f"{split}.label"), "w") as handle:
                for example in examples:
                    handle.write(f"{example.label}\n")
        with open(os.path.join(raw, "dict.input0.txt"), "w") as handle:
            for word in self.tokenizer.itos[4:]:  # after the recipe's special tokens
                handle.write(f"{word} 1\n")
        with open(os.path.join(raw, "dict.label.txt"), "w") as handle:
            for label in range(self.num_labels):
                handle.write(f"{label} 1\n")
        running = []
        for name in ("input0", "label"):  # the two binarizations run side by side
            cmd = [
                sys.executable, "-m", "fairseq_cli.preprocess", "--only-source",
                "--trainpref", os.path.join(raw, f"train.{name}"),
                "--validpref", os.path.join(raw, f"valid.{name}"),
                "--srcdict", os.path.join(raw, f"dict.{name}.txt"),
                "--destdir", os.path.join(data_bin, name),
                "--workers", "1",
            ]
            running.append((cmd, subprocess.Popen(cmd, env=self.env(), stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT, text=True)))
        for cmd, process in running:
            output, _ = process.communicate()
            if process.returncode != 0:
                raise RuntimeError(f"fairseq-preprocess failed ({' '.join(cmd)}):\n{output[-4000:]}")
        self.data_bin = data_bin
        return data_bin

    # ------------------------------------------------------------------ one row
    def steps_per_epoch(self) -> int:
        # fairseq batches the whole set, then deals the batches out to the workers
        return math.ceil(math.ceil(len(self.train_examples) / self.preset.batch_size) / self.nproc)

    def total_updates(self) -> int:
        return max(1, math.ceil(self.steps_per_epoch() * self.preset.epochs))

    def command(self, row: Row, compile_flag: Optional[str]) -> List[str]:
        import torch

        p = self.preset
        total = self.total_updates()
        cuda = torch.cuda.is_available()
        cmd: List[str] = []
        if self.nproc > 1:
            cmd += [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(self.nproc),
                    "--master_port", str(_free_port()), "-m", "fairseq_cli.train"]
        else:
            cmd += [sys.executable, "-m", "fairseq_cli.train"]  # this Python's fairseq, PATH or not
        cmd += [self.data_bin, "--user-dir", USER_DIR]
        cmd += [
            "--task", "timed_sentence_prediction", "--num-classes", str(self.num_labels),
            "--init-token", "0", "--max-positions", str(p.positions), "--shorten-method", "truncate",
            "--arch", "roberta", "--encoder-layers", str(p.layers), "--encoder-embed-dim", str(p.hidden),
            "--encoder-ffn-embed-dim", str(p.intermediate), "--encoder-attention-heads", str(p.heads),
            "--dropout", str(p.dropout), "--attention-dropout", str(p.dropout),
            "--criterion", "sentence_prediction",
            "--batch-size", str(p.batch_size), "--required-batch-size-multiple", "1",
            "--lr", str(p.lr),
        ]
        if row.frontend_clips_and_schedules:
            cmd += [
                "--lr-scheduler", "polynomial_decay", "--end-learning-rate", "0",
                "--warmup-updates", str(int(p.warmup_ratio * total)), "--total-num-update", str(total),
                "--clip-norm", str(p.max_grad_norm if row.frontend_clips else 0),
            ]
        else:  # BertAdam clips each parameter and schedules itself: fairseq does neither
            cmd += ["--lr-scheduler", "fixed", "--clip-norm", "0"]
        cmd += [
            "--seed", str(self.seed), "--num-workers", "0",
            "--log-format", "json", "--log-interval", str(max(1, total // 50)),
            # fairseq-train probes its --save-dir even with --no-save: keep it out of the working directory
            "--no-save", "--save-dir", os.path.join(self.out_dir, "checkpoints"),
            "--best-checkpoint-metric", "accuracy", "--maximize-best-checkpoint-metric",
        ]
        if p.epochs == math.ceil(p.epochs):
            cmd += ["--max-epoch", str(int(p.epochs))]
        else:
            cmd += ["--max-epoch", str(math.ceil(p.epochs)), "--max-update", str(total)]
        if not cuda:
            cmd += ["--cpu"]
        if self.precision == "fp16":
            cmd += ["--fp16"]
        elif self.precision == "bf16":
            cmd += ["--bf16"]
        if self.nproc > 1:
            cmd += ["--distributed-world-size", str(self.nproc), "--distributed-backend", "nccl" if cuda else "gloo"]
            if not cuda:
                # fairseq infers torchrun's rendezvous by dividing by the GPU count: spell it out on CPU
                cmd += ["--distributed-init-method", "env://", "--distributed-no-spawn", "--distributed-rank", "-1"]
        optimizer = optimizer_args(row, p, compile_flag, total)
        if self.nproc > 1:
            # bagua_fused's algorithms need fairseq's legacy DDP (and fairseq's default DDP backend cannot run
            # on CPU): every row uses it, so all rows communicate the same way
            cmd += ["--ddp-backend", "legacy_ddp"]
            if self.bagua_algorithm and row.fuse is not None:
                optimizer += ["--bagua-algorithm", self.bagua_algorithm]
                for key, value in self.bagua_algorithm_args.items():  # fairseq_plugin's --bagua-<name> flags
                    flag = "--bagua-" + key.replace("_", "-")
                    optimizer += [flag] if value is True else [] if value is False else [flag, str(value)]
        return cmd + optimizer

    def run_row(self, row: Row, compile_flag: Optional[str]) -> RowResult:
        result = RowResult("fairseq", row.key, row.label, fuse=row.fuse,
                           clipping=row.clipping(self.preset.max_grad_norm),
                           schedule=row.schedule(self.preset.warmup_ratio, self.total_updates()))
        try:
            cmd = self.command(row, compile_flag)
        except ValueError as exc:
            result.status, result.reason = "skipped", str(exc)
            return result
        os.makedirs(os.path.join(self.out_dir, "logs"), exist_ok=True)
        log_path = os.path.join(self.out_dir, "logs", f"{row.key}.log")
        epochs, valid, fused, group_paths = [], [], None, None
        bar = _progress_bar(self.total_updates(), f"[fairseq] {row.key}", self.progress)
        with open(log_path, "w") as log:
            log.write(" ".join(cmd) + "\n")
            # own session: a timeout kills the whole torchrun tree, not just the launcher
            timings_path = os.path.join(self.out_dir, "logs", f"{row.key}.timings")
            if os.path.exists(timings_path):
                os.remove(timings_path)
            env = self.env()
            env["BERT_RECIPE_TIMINGS"] = timings_path
            process = subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                start_new_session=True,
            )
            fired: List[bool] = []

            def on_timeout():
                fired.append(True)
                _kill_tree(process)

            timer = threading.Timer(self.timeout, on_timeout) if self.timeout else None
            if timer is not None:
                timer.start()
            try:
                for line in process.stdout:
                    log.write(line)
                    record = _record(line)
                    if record is not None:
                        tag, stats = record
                        if tag == "train_inner" and bar is not None:
                            bar.n = int(float(stats.get("num_updates", bar.n)))
                            bar.refresh()
                        elif tag == "train":
                            epochs.append(stats)
                        elif tag == "valid":
                            valid.append(stats)
                    match = _PLUGIN_LINE.search(line)
                    if match and group_paths is None:  # the plugin's first-step line, unless the recipe's came
                        fused = f"{match.group(1)} / {match.group(2)}"
                    match = _PATHS_LINE.search(line)
                    if match:  # the recipe's own line, logged whenever the fusion changes: the last one holds
                        try:
                            group_paths = json.loads(match.group(1))
                        except json.JSONDecodeError:
                            pass
                        fused = f"{match.group(2)} / {match.group(3)}"
                returncode = process.wait()
            except BaseException:
                _kill_tree(process)
                raise
            finally:
                if timer is not None:
                    timer.cancel()
                if bar is not None:
                    bar.n = bar.total if epochs else bar.n
                    bar.close()
        if returncode != 0 or not epochs:
            tail = _tail(log_path)
            why = f"timed out after {self.timeout:g} s" if fired else f"exit code {returncode}"
            result.status, result.reason = "failed", f"fairseq-train {why}; see {log_path}: {tail}"
            return result
        full = self.steps_per_epoch()
        epoch_times, updates, optimizer_ms, compile_s, compiled, counts = [], 0, 0.0, 0.0, [], []
        previous_updates = 0
        for stats in epochs:
            n = int(float(stats.get("train_num_updates", 0))) - previous_updates
            previous_updates += n
            seconds = float(stats["train_epoch_s"])
            epoch_times.append(seconds * full / max(n, 1))
            updates += n
            optimizer_ms += float(stats["train_opt_ms"]) * n
            compile_s += float(stats.get("train_compile_s", 0.0))
            compiled.append(float(stats.get("train_compiled", 0.0)))
            counts.append(n)
        seconds = sum(float(s["train_epoch_s"]) for s in epochs)
        result.epoch_times_s = [round(t, 3) for t in epoch_times]
        result.epoch_time_s = sum(epoch_times) / len(epoch_times)
        result.steps = updates
        result.epochs_measured = updates / full
        result.extrapolated = updates < full * len(epochs)
        result.step_ms = seconds / updates * 1e3
        result.optimizer_step_ms = optimizer_ms / updates
        result.optimizer_share = optimizer_ms / 1e3 / seconds
        result.accuracy = float(valid[-1]["valid_accuracy"]) / 100.0 if valid else None
        per_update = _read_timings(timings_path)
        if per_update:
            result.median_update_ms = median(u for u, _ in per_update) * 1e3
            result.median_optimizer_ms = median(o for _, o in per_update) * 1e3
        if row.fuse is not None:
            result.compile_s = round(compile_s, 3)
            result.compiled = compiled[-1] > 0.5
            # per-epoch means -> compiled updates; the first update creates the state and never compiles
            compiled_updates = sum(c * n for c, n in zip(compiled, counts))
            result.compiled_share = round(min(1.0, compiled_updates / max(1, updates - 1)), 4)
            result.fused = fused
            result.group_paths = group_paths
        result.extra["train_loss"] = float(epochs[-1].get("train_loss", "nan"))
        result.extra["log"] = log_path
        result.extra["command"] = " ".join(cmd)
        return result


def run_fairseq(plan: FairseqPlan, rows: Sequence[Row], on_result=None) -> List[RowResult]:
    missing = fairseq_available()
    if missing is not None:
        out = [RowResult("fairseq", r.key, r.label, status="skipped", reason=missing) for r in rows]
        for result in out:
            if on_result is not None:
                on_result(result)
        return out
    if plan.data_bin is None:
        try:
            plan.prepare()
        except (OSError, RuntimeError) as exc:  # report it in the table; the HF rows are already measured
            out = [RowResult("fairseq", r.key, r.label, status="failed", reason=f"data preparation: {exc}") for r in rows]
            for result in out:
                if on_result is not None:
                    on_result(result)
            return out
    compile_flag = plugin_compile_flag()
    results = []
    for row in rows:
        print(f"\n[fairseq] {row.label}", flush=True)
        result = plan.run_row(row, compile_flag)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


# ------------------------------------------------------------------------------------ helpers
def _record(line: str):
    """``(tag, stats)`` of a fairseq JSON progress line (``... | train | {...}``), else None."""
    for tag in ("train_inner", "train", "valid"):
        marker = f"| {tag} | "
        if marker in line:
            try:
                return tag, json.loads(line.split(marker, 1)[1])
            except json.JSONDecodeError:
                return None
    return None


_ERROR_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception): .*")


def _tail(path: str, lines: int = 3) -> str:
    """The last error line of a log (``ValueError: ...``), else its last lines."""
    try:
        with open(path) as handle:
            content = [line.rstrip() for line in handle if line.strip()]
    except OSError:
        return ""
    errors = [m.group(0) for m in map(_ERROR_LINE.search, content) if m and "ChildFailedError" not in m.group(0)]
    if errors:
        return errors[-1][-800:]
    return " / ".join(line.strip() for line in content[-lines:])[-800:]


def _progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="update", dynamic_ncols=True)


def _read_timings(path: str):
    try:
        with open(path) as handle:
            return [tuple(map(float, line.split())) for line in handle if len(line.split()) == 2]
    except OSError:
        return []


def _kill_tree(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
