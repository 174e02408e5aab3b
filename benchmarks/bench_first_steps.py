"""What a fused, compiled optimizer costs before its first fast step: building it and its first steps.

Each line runs in a fresh Python process (imports, Dynamo's and Inductor's process-wide state start
empty), by default with an empty Inductor cache directory and an empty temporary directory (where
Inductor keeps the precompiled header its CPU kernels include, whatever its cache directory): what
a user's first run on a machine pays. ``--warm-cache`` keeps one of each for all lines (a second run). The table gives
``fuse_optimizer``'s time ("build", which includes the check that a compiler works), each of the
first steps, their sum with the build, and how many graphs were compiled.

    python benchmarks/bench_first_steps.py                       # BertAdam, LAMB, pytorch-optimizer Lamb
    python benchmarks/bench_first_steps.py --repeats 2 --src ../other-checkout --src .   # before / after
    python benchmarks/bench_first_steps.py --device cuda --optimizers LAMB              # on a GPU

``--src`` (repeatable) names checkouts of this repository whose ``bagua_integrations`` is imported;
their lines alternate, so that both see the same state of the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

OPTIMIZERS = ("BertAdam", "LAMB", "pytorch-optimizer Lamb")


def _child(name: str, steps: int, device: str) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_optimizer_step import MODELS, make_params

    import torch

    from bagua_integrations import fuse_optimizer, fusion_report
    from bagua_integrations.optim import BertAdam, Lamb

    def pytorch_optimizer_lamb(params):
        import pytorch_optimizer

        return pytorch_optimizer.Lamb(params)

    make = {"BertAdam": lambda ps: BertAdam(ps, lr=1e-4), "LAMB": Lamb, "pytorch-optimizer Lamb": pytorch_optimizer_lamb}[name]
    params = make_params(MODELS["bert-base"], device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    started = time.perf_counter()
    optimizer = fuse_optimizer(make(params), compile=True)
    build = time.perf_counter() - started
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        optimizer.fuse_step()
        sync()
        times.append(time.perf_counter() - started)
    report = fusion_report(optimizer)
    return {"build": build, "steps": times, "graphs": report.compile_graphs, "compiled": report.compiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated, of: " + ", ".join(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=4, help="steps timed (the table sums the first 3 with the build)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--src", action="append", help="a checkout of this repository to import (repeatable)")
    parser.add_argument("--warm-cache", action="store_true", help="one Inductor cache directory for every line")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.steps, args.device)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sources = [os.path.abspath(s) for s in (args.src or [here])]
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    print(f"# build + first steps, bert-base shapes (201 tensors, 109.5 M fp32), compile=True, {args.device}; "
          f"{'one warm' if args.warm_cache else 'an empty'} Inductor cache and temporary directory; {os.cpu_count()} CPUs")
    print("| optimizer | checkout | build s | " + " | ".join(f"step {i + 1} s" for i in range(args.steps))
          + " | build + first 3 steps s | graphs |")
    print("|---|---|---:|" + "---:|" * args.steps + "---:|---:|")
    with tempfile.TemporaryDirectory() as warm:
        for _ in range(args.repeats):
            for name in names:
                for src in sources:
                    with tempfile.TemporaryDirectory() as cold:
                        kept = warm if args.warm_cache else cold
                        env = dict(os.environ, PYTHONPATH=src, TORCHINDUCTOR_CACHE_DIR=kept, TMPDIR=kept)
                        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name,
                                              "--steps", str(args.steps), "--device", args.device], env=env, capture_output=True, text=True)
                    if out.returncode != 0:
                        print(f"| {name} | {src} | failed: {out.stderr.strip().splitlines()[-1:]} |", flush=True)
                        continue
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    first = r["build"] + sum(r["steps"][:3])
                    print(f"| {name} | {os.path.basename(src)} | {r['build']:.2f} | "
                          + " | ".join(f"{t:.2f}" for t in r["steps"]) + f" | {first:.2f} | {r['graphs']} |", flush=True)


if __name__ == "__main__":
    main()
