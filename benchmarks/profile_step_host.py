"""Where an optimizer step's host time goes: Python's profiler over the rows of bench_optimizer_step.

A step on a GPU is short (a BERT-base AdamW step is about 1 ms of memory traffic on an H100), so the
Python and launch work around its kernels can be most of it. This script answers *where*: for each
chosen row it times the host side of a step (the call alone, without waiting for the device) and
profiles it with cProfile, in two phases:

* **startup**: building the optimizer (for fused rows ``fuse_optimizer``: probes, flattening) and
  its first 3 steps (state creation, compilation), the cost a user pays once per run;
* **steady**: ``--steps`` steps after a warm-up, the cost paid on every step.

It prints, per row and phase, the wall time and the functions that take the most time of their own
(``--top``), and writes each full profile as text under ``--out``.

    python benchmarks/profile_step_host.py                               # 201 tiny tensors on the CPU
    python benchmarks/profile_step_host.py --device cuda --rows "BertAdam fused (segmented), compiled"
    python benchmarks/profile_step_host.py --model bert-base --no-steady --rows "BertAdam fused (segmented), compiled"

Timings under the profiler are inflated (every Python call is counted); the "host ms" column is
measured without it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_optimizer_step import MODELS, hardware_line, make_params, rows  # noqa: E402

# '|'-separated substrings of row names (the names hold commas)
DEFAULT_ROWS = ("BertAdam fused (segmented), compiled|LAMB fused (segmented), compiled|"
                "pytorch-optimizer Lamb fused (segmented), compiled|torch AdamW fused by bagua, compiled|"
                "torch AdamW fused=True")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _stats_text(profile: cProfile.Profile, sort: str, top: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats(sort).print_stats(top)
    return out.getvalue()


def _callers_text(profile: cProfile.Profile, pattern: str) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_callers(rf"subprocess.py:\d+\(({pattern})\)")
    return out.getvalue()


def _short(text: str, top: int) -> str:
    """The table lines of a pstats report, with long site-packages paths shortened."""
    lines = [line for line in text.splitlines() if re.match(r"\s*[\d/]+\s+\d", line)][:top]
    return "\n".join(re.sub(r"\S*/site-packages/", "", re.sub(r"\S*/bagua_integrations/", "bagua:", line))[:160]
                     for line in lines)


def profile_row(name, build, shapes, args, out_dir):
    params = make_params(shapes, device=args.device, dtype=torch.float32)
    startup = cProfile.Profile()
    started = time.perf_counter()
    startup.enable()
    step, _opt = build(params)
    for _ in range(3):
        step()
    _sync(args.device)
    startup.disable()
    startup_s = time.perf_counter() - started
    report = [f"## {name}: startup (build + first 3 steps) {startup_s:.2f} s under the profiler"]
    text = _stats_text(startup, "cumulative", 120)
    report.append(_short(text, 2 * args.top))  # the wrappers of the first steps come first
    with open(os.path.join(out_dir, _file_name(name, "startup")), "w") as f:
        # who started subprocesses (compilers, Inductor's CPU checks, Triton's launcher builds)
        f.write(text + "\n" + _callers_text(startup, "check_call|check_output|run"))
    host_ms = None
    if args.steady:
        for _ in range(20):
            step()
        _sync(args.device)
        host = []
        for _ in range(args.steps):
            t = time.perf_counter()
            step()
            host.append(time.perf_counter() - t)
        _sync(args.device)
        host_ms = statistics.median(host) * 1e3
        steady = cProfile.Profile()
        steady.enable()
        for _ in range(args.steps):
            step()
        _sync(args.device)
        steady.disable()
        text = _stats_text(steady, "tottime", 80)
        with open(os.path.join(out_dir, _file_name(name, "steady")), "w") as f:
            f.write(text + "\n" + _stats_text(steady, "cumulative", 80))
        report.append(f"## {name}: steady, {host_ms:.3f} host ms a step (median of {args.steps}, no profiler); "
                      f"own time under the profiler, {args.steps} steps:")
        report.append(_short(text, args.top))
    return startup_s, host_ms, "\n".join(report)


def _file_name(name: str, phase: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") + f".{phase}.txt"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="'|'-separated substrings of bench_optimizer_step's row names")
    parser.add_argument("--steps", type=int, default=200, help="steady steps timed, then profiled")
    parser.add_argument("--top", type=int, default=15, help="functions printed per phase")
    parser.add_argument("--no-steady", dest="steady", action="store_false", help="profile the startup only")
    parser.add_argument("--out", default="profile_step_host_out", help="folder for the full profiles")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    os.makedirs(args.out, exist_ok=True)
    wanted = [w.strip() for w in args.rows.split("|") if w.strip()]
    chosen = [(n, b) for n, b in rows(MODELS[args.model], device=args.device) if any(w in n for w in wanted)]
    if not chosen:
        parser.error(f"--rows {args.rows!r} matches no row")
    print(f"# {hardware_line(args.device)}; torch {torch.__version__}; model {args.model}")
    summary = []
    for name, build in chosen:
        startup_s, host_ms, report = profile_row(name, build, MODELS[args.model], args, args.out)
        print(report, flush=True)
        summary.append((name, startup_s, host_ms))
    print("\n| row | startup s (profiled) | host ms / step |\n|---|---:|---:|")
    for name, startup_s, host_ms in summary:
        print(f"| {name} | {startup_s:.2f} | {'' if host_ms is None else f'{host_ms:.3f}'} |")


if __name__ == "__main__":
    main()
