"""Test-only fairseq user dir: ``bagua_fused`` plus a per-rank record of the weights.

``--user-dir tests/_fairseq_probe`` registers the plugin (by importing ``fairseq_plugin``) and
wraps ``Trainer.train_step`` so that every rank appends, after each update, a digest of its
model weights to ``$BAGUA_FAIRSEQ_PROBE_DIR/rank<R>.jsonl``. The multi-process tests compare
the ranks' digests: equal where the algorithm synchronises, different where it trains locally.
At exit each rank writes the gloo threads still running at the interpreter's teardown to
``threads<R>.json`` (there must be none: see ``destroy_process_groups_at_exit``).
"""

import atexit
import hashlib
import json
import os

import torch
from fairseq.trainer import Trainer


def _gloo_threads_at_teardown():
    """Write the gloo threads still running when the interpreter's teardown begins (registered
    before the plugin's exit handler, so it runs after it): the exit race's cause, if any."""
    directory, rank = os.environ.get("BAGUA_FAIRSEQ_PROBE_DIR"), os.environ.get("RANK")
    if not directory or rank is None or not os.path.isdir("/proc/self/task"):
        return
    from _dist_utils import gloo_threads  # tests/, on sys.path as the user dir's parent

    with open(os.path.join(directory, f"threads{rank}.json"), "w") as handle:
        json.dump(gloo_threads(), handle)


atexit.register(_gloo_threads_at_teardown)

import fairseq_plugin  # noqa: E402,F401  (registers --optimizer bagua_fused, and its exit handler)

_original_train_step = Trainer.train_step


def _digest(model):
    sha = hashlib.sha1()
    total = 0.0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            data = p.detach().float().contiguous().cpu()
            sha.update(name.encode())
            sha.update(data.numpy().tobytes())
            total += float(data.double().sum())
    return sha.hexdigest(), total


def _train_step(self, samples, raise_oom=False):
    out = _original_train_step(self, samples, raise_oom)
    directory = os.environ.get("BAGUA_FAIRSEQ_PROBE_DIR")
    if directory:
        sha, total = _digest(self.get_model())
        record = {"update": self.get_num_updates(), "sha": sha, "sum": total}
        with open(os.path.join(directory, f"rank{self.data_parallel_rank}.jsonl"), "a") as handle:
            handle.write(json.dumps(record) + "\n")
    return out


Trainer.train_step = _train_step
