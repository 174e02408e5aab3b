"""Time the fused step's per-step check for edits of the optimizer's state, on BERT-base shapes.

Between two fused steps the planner must notice ``del optimizer.state[p]``, a replaced state
entry or value, and an in-place edit of a step count; it checks that once in ``plan()`` and
records the state again at the end of ``write_back()``. This measures that bookkeeping alone
(not the step), per step, on AdamW over the 201 parameters of BertForSequenceClassification
(``bench_optimizer_step.bert_shapes``), fused with ``compile=False`` and stepped twice:

* "old": the tuple fingerprint the planner built before (kept here as ``old_fingerprint``),
  built twice per step and compared once;
* "new": ``StepPlanner._state_unchanged()`` (in ``plan()``) plus ``_see_state()`` (in
  ``write_back()``) as a usual step runs it: the step wrote no state object (AdamW advances its
  step counts in place), so the write-back only re-reads their versions. Two more rows show the
  write-back's other paths: it compares the whole state when the step wrote a state object, and
  builds a new watch when that changed it (an optimizer whose step counts are Python numbers
  does so every step).

Each row is the median of ``--repeats`` (5) timings of ``--calls`` (200) steps' worth of checks,
reported per step. All rows run in the same process, round-robin.

    python benchmarks/bench_plan_overhead.py
    python benchmarks/bench_plan_overhead.py --hidden 64   # same tensor count, little memory
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_optimizer_step import bert_shapes  # noqa: E402

from bagua_integrations import fuse_optimizer, fusion_report  # noqa: E402


def old_fingerprint(planner):
    """The planner's ``_state_fingerprint()`` before the incremental check (commit a0a95df)."""
    state = planner.optimizer.state
    out = []
    for group in planner.layout.groups.values():
        for slot in group.slots():
            entry = state.get(slot.param)
            if entry is None:
                out.append(None)
                continue
            out.append((id(entry), tuple(
                (key, id(value), value._version if isinstance(value, torch.Tensor) and value.numel() == 1 else None)
                for key, value in entry.items())))
    return tuple(out)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def build(hidden: int):
    torch.manual_seed(0)
    shapes = bert_shapes(hidden=hidden, intermediate=4 * hidden, vocab=30522 if hidden == 768 else 512,
                         positions=512 if hidden == 768 else 64)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    opt = fuse_optimizer(torch.optim.AdamW(params, lr=1e-4), compile=False)
    for _ in range(2):
        opt.zero_grad()
        for p in params:
            p.grad = torch.randn_like(p)
        opt.fuse_step()
    return params, opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768, help="BERT hidden size (768: BERT-base)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    params, opt = build(args.hidden)
    planner = opt._bagua_fusion.planner
    report = fusion_report(opt)
    values = sum(len(opt.state[p]) for p in params)

    # sanity: the new check sees an edit, and sees nothing without one
    assert planner._state_unchanged()
    opt.state[params[3]]["step"].add_(0)
    assert not planner._state_unchanged()
    planner._see_state()
    assert planner._state_unchanged()

    def old_step():
        seen = old_fingerprint(planner)  # write_back() of the previous step
        for _ in range(args.calls):
            _ = seen != old_fingerprint(planner)  # plan()
            seen = old_fingerprint(planner)  # write_back()

    def new_step():
        for _ in range(args.calls):
            planner._state_unchanged()  # plan()
            planner._see_state()  # write_back()

    def new_step_compared():
        for _ in range(args.calls):
            planner._state_unchanged()
            planner._state_written = True  # as after a step that wrote a state object
            planner._see_state()

    def new_step_rebuilt():
        for _ in range(args.calls):
            planner._state_unchanged()
            planner._state_seen.entry_ids = []  # the comparison fails: a new watch is built
            planner._state_written = True
            planner._see_state()

    def old_check():
        seen = old_fingerprint(planner)
        for _ in range(args.calls):
            _ = seen != old_fingerprint(planner)

    def new_check():
        for _ in range(args.calls):
            planner._state_unchanged()

    rows = {"old, per step (2 fingerprints + compare)": old_step, "new, per step (check + see_state)": new_step,
            "new, per step, step wrote state (compared)": new_step_compared,
            "new, per step, step changed state (rebuilt)": new_step_rebuilt,
            "old, one check (fingerprint + compare)": old_check, "new, one check (_state_unchanged)": new_check}
    times = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, fn in rows.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) / args.calls)

    print(f"CPU: {cpu_name()}; Python {platform.python_version()}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")
    print(f"AdamW over {len(params)} tensors ({sum(p.numel() for p in params) / 1e6:.1f} M elements, hidden "
          f"{args.hidden}), {values} state values, {report.fused_params} fused in {report.flat_runs} run(s); "
          f"median of {args.repeats} x {args.calls} calls")
    width = max(map(len, rows))
    print(f"{'':{width}}  {'us':>8}")
    for name in rows:
        print(f"{name:{width}}  {statistics.median(times[name]) * 1e6:8.1f}")


if __name__ == "__main__":
    main()
