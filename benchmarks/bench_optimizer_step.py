"""Time one optimizer step on BERT-base parameter shapes: per-tensor vs fused (eager, compiled) vs torch.

Rows are timed round-robin in one process, so their ratios share the machine's noise.
Compile time is measured separately and kept out of the step times.

    python benchmarks/bench_optimizer_step.py                 # BERT-base shapes (201 tensors, 109.5 M)
    python benchmarks/bench_optimizer_step.py --model small   # a quick look (~11 M parameters)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch

from bagua_integrations import fuse_optimizer, fusion_report
from bagua_integrations.optim import BertAdam
from recipes.bert_benchmark.results import hardware

BYTES_PER_PARAM_ADAM = 28  # read p, g, m, v (16 B) + write p, m, v (12 B), fp32


def bert_shapes(vocab=30522, hidden=768, layers=12, intermediate=3072, positions=512, labels=2):
    """Parameter shapes of BertForSequenceClassification(BertConfig()), in module order."""
    shapes = [(vocab, hidden), (positions, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        for _ in range(4):  # query, key, value, attention output
            shapes += [(hidden, hidden), (hidden,)]
        shapes += [(hidden,), (hidden,), (intermediate, hidden), (intermediate,), (hidden, intermediate), (hidden,), (hidden,), (hidden,)]
    shapes += [(hidden, hidden), (hidden,), (labels, hidden), (labels,)]
    return shapes


MODELS = {
    "bert-base": bert_shapes(),
    "small": bert_shapes(vocab=8192, hidden=256, layers=4, intermediate=1024),
}


def make_params(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    return params


def rows(shapes):
    """(name, builder) pairs; each builder returns a zero-argument step function and the optimizer."""

    def bert_adam(fuse=None):
        def build():
            opt = BertAdam(make_params(shapes), lr=1e-4, max_grad_norm=-1.0, weight_decay=0.01)
            if fuse is None:
                return opt.step, opt
            fuse_optimizer(opt, compile=fuse)
            return opt.fuse_step, opt
        return build

    def adamw(fuse=None, **kwargs):
        def build():
            opt = torch.optim.AdamW(make_params(shapes), lr=1e-4, weight_decay=0.01, **kwargs)
            if fuse is None:
                return opt.step, opt
            fuse_optimizer(opt, compile=fuse)
            return opt.fuse_step, opt
        return build

    return [
        ("BertAdam per-tensor (seed baseline)", bert_adam()),
        ("BertAdam fused, eager", bert_adam(fuse=False)),
        ("BertAdam fused, compiled", bert_adam(fuse=True)),
        ("torch AdamW foreach=False", adamw(foreach=False)),
        ("torch AdamW foreach=True", adamw(foreach=True)),
        ("torch AdamW fused=True", adamw(fused=True)),
        ("torch AdamW fused, compiled", adamw(fuse=True)),
    ]


def copy_bandwidth(numel: int, repeats: int = 5) -> float:
    """Bytes per second of the faster of a large copy (8 B/elem) and a triad c = a + s*b (12 B/elem)."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    c.copy_(a)
    copy = min(_timed(lambda: c.copy_(a)) for _ in range(repeats))
    triad = min(_timed(lambda: torch.add(a, b, alpha=0.5, out=c)) for _ in range(repeats))
    return max(8 * numel / copy, 12 * numel / triad)


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def hardware_line() -> str:
    hw = hardware()
    return f"{hw['cpu']}, {hw['cpu_cores']} cores, {hw['torch_threads']} torch threads, torch {hw['torch']}, Python {hw['python']}, load average {hw.get('load_average_1m', '?')}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="bert-base")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per row (median reported)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    shapes = MODELS[args.model]
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(f"# One optimizer step, {args.model} shapes: {len(shapes)} tensors, {numel / 1e6:.1f} M parameters, fp32")
    print(f"# hardware: {hardware_line()}")
    built = []
    for name, build in rows(shapes):
        step, opt = build()
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):  # state creation, compilation, one warm step
                step()
        setup = time.perf_counter() - started
        report = fusion_report(opt) if hasattr(opt, "fuse_step") else None
        built.append((name, step, report, setup))
        print(f"#   warmed up {name} in {setup:.1f} s" + (f" (compile {report.compile_seconds:.1f} s)" if report and report.compiled else ""), flush=True)
    times = {name: [] for name, *_ in built}
    for _ in range(args.repeats):
        for name, step, _, _ in built:
            times[name].append(_timed(step))
    bandwidth = copy_bandwidth(min(numel, 50_000_000))
    bound_ms = BYTES_PER_PARAM_ADAM * numel / bandwidth * 1e3

    median = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    base, fused_torch = median[built[0][0]], median["torch AdamW fused=True"]
    print()
    print("| optimizer step | ms / step | vs BertAdam per-tensor | vs torch AdamW fused=True | effective GB/s (28 B/param) | fused tensors / flat runs |")
    print("|---|---:|---:|---:|---:|---|")
    results = []
    for name, _, report, setup in built:
        fused = f"{report.fused_params} / {report.flat_runs}" + (" (compiled)" if report.compiled else "") if report else "-"
        gbps = BYTES_PER_PARAM_ADAM * numel / median[name] / 1e6
        print(f"| {name} | {median[name]:.1f} | {base / median[name]:.2f}x faster | {median[name] / fused_torch:.2f}x time | {gbps:.1f} | {fused} |")
        results.append(dict(row=name, ms=median[name], speedup_vs_per_tensor=base / median[name], time_vs_torch_fused=median[name] / fused_torch, warmup_s=setup))
    print(f"| memory-bound estimate (28 B/param at {bandwidth / 1e9:.1f} GB/s, best of copy/triad) | {bound_ms:.1f} | | {bound_ms / fused_torch:.2f}x time | {bandwidth / 1e9:.1f} | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, params=numel, tensors=len(shapes), hardware=hardware(), bound_ms=bound_ms, rows=results), f, indent=2)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
