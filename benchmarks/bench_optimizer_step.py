"""Time one optimizer step on BERT-base parameter shapes: per-tensor vs fused (eager, compiled) vs torch.

Rows are timed round-robin in one process, so their ratios share the machine's noise.
Compile time is measured separately and kept out of the step times.

    python benchmarks/bench_optimizer_step.py                 # BERT-base shapes (201 tensors, 109.5 M)
    python benchmarks/bench_optimizer_step.py --model small   # a quick look (~11 M parameters)
    python benchmarks/bench_optimizer_step.py --model tiny --repeats 200   # host overhead: 201 tensors, ~8k elements
    python benchmarks/bench_optimizer_step.py --device cuda --dtype bf16   # on the GPU, bf16 params

    python benchmarks/bench_optimizer_step.py --rows elementwise        # BertAdam unclipped, torch AdamW variants
    python benchmarks/bench_optimizer_step.py --rows unfusable          # Adafactor: eager vs compiled per parameter
    python benchmarks/bench_optimizer_step.py --rows traffic            # memory traffic alone, per step pattern
    python benchmarks/bench_optimizer_step.py --rows verify             # the cost of a step checked by verify=N
    python benchmarks/bench_optimizer_step.py --rows late-check         # the cost of the late-reduction check
    python benchmarks/bench_optimizer_step.py --rows LAMB,fused=True   # rows whose name contains one of these

On CUDA each step is timed with CUDA events (median of --repeats, default 50), the host time of
issuing a step is reported too ("host ms": the Python/launch cost, measured without
synchronizing), and the bandwidth reference is a device-to-device copy.

BertAdam with the seed's defaults (per-parameter clipping, max_grad_norm=1.0) and LAMB (two
per-parameter norms) are fused on segmented runs; each is shown beside its per-tensor step and
``torch.compile(opt.step)``, whose warm-up (the first three steps) includes its compile time.
"first 3 steps s" is that warm-up: building the optimizer (for fused rows ``fuse_optimizer``: probes,
flattening), state creation, compilation and one warm step; creating the random parameters is not
counted. Every row stays alive to be timed round-robin, so the row sets are sized to fit 24 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from importlib import metadata

import torch

from bagua_integrations import _compile  # (private: only to time a row without block loops)
from bagua_integrations import fuse_optimizer, fusion_report
from bagua_integrations._torch_compat import inductor_checked_cpu_vector_isas  # (private: a GPU start's cost)
from bagua_integrations.optim import BertAdam, Lamb

BYTES_PER_PARAM_ADAM = 28  # read p, g, m, v (16 B) + write p, m, v (12 B), fp32
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CUDA_COPY_MIB = 512  # each of the two buffers of the device-to-device copy
BASELINE = "BertAdam per-tensor (Bagua's baseline: max_grad_norm=1.0)"
TORCH_FUSED = "torch AdamW fused=True"
TRAFFIC = "traffic only"


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
    # BERT-base's 201 tensors with a few elements each: a step is its host overhead (Python, launches)
    "tiny": bert_shapes(vocab=64, hidden=8, intermediate=16, positions=8),
}


def make_params(shapes, seed=0, device="cpu", dtype=torch.float32):
    """Seeded random parameters and gradients (drawn on CPU in fp32, then moved to ``device``/``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device, dtype)) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(device, dtype)
    return params


def rows(shapes, device="cpu", dtype=torch.float32):
    """(name, builder) pairs; a builder takes fresh parameters (with gradients) and returns a
    zero-argument step function and the optimizer."""

    def build_with(make, on_unsupported="raise"):
        def rows_for(fuse=None, torch_compile=False, verify=0, late_check=True):
            def build(params):
                opt = make(params)
                if torch_compile:
                    return torch.compile(opt.step), opt  # compiles on the first call (in the warm-up)
                if fuse is None:
                    return opt.step, opt
                fuse_optimizer(opt, compile=fuse, on_unsupported=on_unsupported, verify=verify)
                if not late_check:
                    late_reduction_check_off(opt)
                return opt.fuse_step, opt
            return build
        return rows_for

    bert_adam = build_with(lambda ps: BertAdam(ps, lr=1e-4, weight_decay=0.01))  # seed defaults: max_grad_norm=1.0
    bert_adam_no_clip = build_with(lambda ps: BertAdam(ps, lr=1e-4, weight_decay=0.01, max_grad_norm=-1.0))
    lamb = build_with(lambda ps: Lamb(ps, lr=1e-4, weight_decay=0.01))
    # factored second moments: cannot be fused; its exact step runs compiled per parameter
    adafactor = build_with(lambda ps: torch.optim.Adafactor(ps, lr=1e-2), on_unsupported="fallback")

    def pytorch_optimizer_lamb(fuse=None, torch_compile=False):
        import pytorch_optimizer  # pip install pytorch-optimizer (in the [test] extra)

        return build_with(lambda ps: pytorch_optimizer.Lamb(ps, lr=1e-4, weight_decay=0.01))(fuse, torch_compile)

    def without_block_loops(rows_for):
        """The row compiled as before block loops and early stores (its own graphs; the A/B in one run)."""
        def build(params):
            step, opt = rows_for(params)

            def step_without():
                kept, _compile.BLOCK_LOOPS = _compile.BLOCK_LOOPS, False  # read when a graph is compiled
                try:
                    step()
                finally:
                    _compile.BLOCK_LOOPS = kept
            return step_without, opt
        return build

    def adamw(fuse=None, torch_compile=False, **kwargs):
        return build_with(lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, **kwargs))(fuse, torch_compile)

    return [
        (BASELINE, bert_adam()),
        ("BertAdam fused (segmented), eager", bert_adam(fuse=False)),
        ("BertAdam fused (segmented), compiled", bert_adam(fuse=True)),
        # verification mode: every step also runs the unfused step and compares (the cost of one checked step)
        ("BertAdam compiled with verify=1 (every step checked)", bert_adam(fuse=True, verify=1)),
        ("torch.compile(BertAdam.step)", bert_adam(torch_compile=True)),
        ("LAMB per-tensor", lamb()),
        ("LAMB fused (segmented), compiled", lamb(fuse=True)),
        (f"LAMB fused (segmented), compiled, {NO_BLOCK_LOOPS}", without_block_loops(lamb(fuse=True))),
        ("torch.compile(Lamb.step)", lamb(torch_compile=True)),
        ("pytorch-optimizer Lamb (foreach) per-tensor", pytorch_optimizer_lamb()),
        ("pytorch-optimizer Lamb fused (segmented), eager", pytorch_optimizer_lamb(fuse=False)),
        ("pytorch-optimizer Lamb fused (segmented), compiled", pytorch_optimizer_lamb(fuse=True)),
        (f"pytorch-optimizer Lamb fused (segmented), compiled, {NO_BLOCK_LOOPS}",
         without_block_loops(pytorch_optimizer_lamb(fuse=True))),
        ("BertAdam max_grad_norm=-1 per-tensor", bert_adam_no_clip()),
        ("BertAdam max_grad_norm=-1 fused, eager", bert_adam_no_clip(fuse=False)),
        # the check for reductions that begin after the probes' window (the eager step's dry run), off
        (f"BertAdam max_grad_norm=-1 fused, eager, {CHECK_OFF}", bert_adam_no_clip(fuse=False, late_check=False)),
        ("BertAdam max_grad_norm=-1 fused, compiled", bert_adam_no_clip(fuse=True)),
        (f"BertAdam max_grad_norm=-1 fused, compiled, {CHECK_OFF}", bert_adam_no_clip(fuse=True, late_check=False)),
        ("torch AdamW foreach=False", adamw(foreach=False)),
        ("torch AdamW foreach=True", adamw(foreach=True)),
        (TORCH_FUSED, adamw(fused=True)),
        ("torch AdamW fused by bagua, compiled", adamw(fuse=True)),
        ("torch.compile(AdamW.step)", adamw(torch_compile=True)),
        *traffic_rows(),
        ("Adafactor per-tensor", adafactor()),
        ("Adafactor fallback (per-tensor), compiled per parameter", adafactor(fuse=True)),
        ("torch.compile(Adafactor.step)", adafactor(torch_compile=True)),
    ]


CHECK_OFF = "late-reduction check off"
# compiled without the block loops and early stores (Inductor's own loops: the norms' loop recomputes
# the moments, the update's loop stores them)
NO_BLOCK_LOOPS = "without block loops"


def late_reduction_check_off(opt) -> None:
    """Switch off, for this fused optimizer, the check that a step planned elementwise does not
    begin to reduce over whole parameters (bagua_integrations/_late_reductions.py): the eager
    step's dry run and the compiled step's graph check. Only to time what the check costs."""
    fusion = opt._bagua_fusion
    fusion._runs_to_check = lambda plan: []


# Memory traffic alone, in the patterns of the steps above: compiled kernels over one flat buffer
# per tensor kind that read and write what a step must, with (almost) no arithmetic. They show
# what a step cannot beat on this machine however good its kernel, measured in the same run.
TRAFFIC_PATTERNS = {
    # AdamW: one pass, read p, g, m, v and write p, m, v
    "AdamW, 1 pass": ["r4w3"],
    # BertAdam with clipping: read g for its norm, then read g, m, v, p and write all four
    "BertAdam clipped, 2 passes": ["r1", "r4w4"],
    # LAMB at its minimum: read g, m, v, p and write m, v (norms on the way), then read m, v, p and write p
    "LAMB minimum, 2 passes": ["r4w2", "r3w1"],
    # LAMB as Inductor compiles it: read all four for the norms, then read all four and write p, m, v
    "LAMB as compiled, 2 passes": ["r4", "r4w3"],
}


def _traffic_kernels():
    def r1(p, g, m, v, c):
        return g.sum()

    def r4(p, g, m, v, c):
        return (p + g + m + v).sum()

    def r4w2(p, g, m, v, c):
        m.add_((g + p) * c)
        v.add_(g * c)

    def r3w1(p, g, m, v, c):
        p.add_((m + v) * c)

    def r4w3(p, g, m, v, c):
        m.add_(g * c)
        v.add_(g * c)
        p.add_((m + v) * c)

    def r4w4(p, g, m, v, c):
        g.mul_(1 + c)
        r4w3(p, g, m, v, c)

    return {f.__name__: torch.compile(f, fullgraph=True) for f in (r1, r4, r4w2, r3w1, r4w3, r4w4)}


def traffic_rows():
    """Rows that time memory traffic only (see ``TRAFFIC_PATTERNS``); they share one set of flat buffers
    (p, g, m, v: what the kernels hold does not matter, only that they are read and written)."""
    kernels, buffers = {}, []

    def row(passes):
        def build(params):
            if not kernels:
                kernels.update(_traffic_kernels())
                p = torch.cat([q.detach().reshape(-1) for q in params])
                g = torch.cat([q.grad.reshape(-1) for q in params])
                c = torch.zeros((), dtype=p.dtype, device=p.device)  # an input: nothing to constant-fold
                buffers.extend([p, g, torch.zeros_like(p), torch.zeros_like(p), c])

            def step():
                for name in passes:
                    kernels[name](*buffers)
            return step, None
        return build

    return [(f"{TRAFFIC}: {name} ({' + '.join(passes)})", row(passes)) for name, passes in TRAFFIC_PATTERNS.items()]


# Row sets that fit in 24 GB on BERT-base shapes; each also gets the baseline and torch's fused AdamW.
ROW_SETS = {
    "bert": ["BertAdam fused (segmented)", "torch.compile(BertAdam.step)", "LAMB", "Lamb", TRAFFIC],
    "elementwise": ["max_grad_norm=-1", "torch AdamW", "torch.compile(AdamW.step)"],
    "unfusable": ["Adafactor"],
    "verify": ["BertAdam fused (segmented), compiled", "verify=1"],
    # the late-reduction check's cost per step: each row beside the same row with the check off
    "late-check": ["BertAdam max_grad_norm=-1 fused, "],
    "traffic": [TRAFFIC],
    # LAMB compiled with and without block loops and early stores, beside its traffic floors
    "block-loops": ["LAMB fused (segmented), compiled", "Lamb fused (segmented), compiled", "LAMB minimum",
                    "LAMB as compiled"],
}


def _available_memory() -> int:
    """Bytes of memory available (Linux ``MemAvailable``), or 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def copy_bandwidth(numel: int, repeats: int = 5) -> float:
    """Bytes per second of the faster of a large copy (8 B/elem) and a triad c = a + s*b (12 B/elem)."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    c.copy_(a)
    copy = min(_timed(lambda: c.copy_(a)) for _ in range(repeats))
    triad = min(_timed(lambda: torch.add(a, b, alpha=0.5, out=c)) for _ in range(repeats))
    return max(8 * numel / copy, 12 * numel / triad)


def cuda_copy_bandwidth(mib: int = CUDA_COPY_MIB, repeats: int = 20) -> float:
    """Bytes per second of ``dst.copy_(src)`` between two ``mib`` MiB fp32 device buffers
    (bytes read + written), median of ``repeats`` event-timed copies after a warm-up."""
    numel = mib * 2**20 // 4
    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = statistics.median(_timed_cuda(lambda: dst.copy_(src))[0] for _ in range(repeats))
    src = dst = None  # (freed before the cache is emptied)
    torch.cuda.empty_cache()
    return 2 * numel * 4 / seconds


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _timed_cuda(fn):
    """(device seconds, host seconds) of one call: CUDA events around it, after a synchronize.

    The host time is the perf_counter time of issuing the call, without waiting for the GPU.
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    started = time.perf_counter()
    fn()
    host = time.perf_counter() - started
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, host


def adam_bytes_per_param(opt):
    """Bytes one Adam-like step moves per parameter: read p, g, m, v and write p, m, v, from
    the element sizes of an actual parameter, its gradient and its two moment tensors."""
    for group in opt.param_groups:
        for p in group["params"]:
            moments = [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.shape == p.shape]
            if p.grad is not None and len(moments) >= 2:
                m, v = moments[:2]
                return 2 * p.element_size() + p.grad.element_size() + 2 * m.element_size() + 2 * v.element_size()
    return None


def hardware():
    """This machine, for the header and the JSON (benchmarks do not import recipes)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpu": None,
    }
    try:
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        info["cuda"] = torch.version.cuda
    for name, dists in (("transformers", ("transformers",)), ("accelerate", ("accelerate",)),
                        ("fairseq", ("fairseq-fixed", "fairseq")), ("triton", ("triton",))):
        for dist in dists:
            try:
                info[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return info


def hardware_line(device="cpu") -> str:
    hw = hardware()
    if device == "cuda":
        return (f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}, triton {hw.get('triton', 'not installed')}), "
                f"torch {hw['torch']}, Python {hw['python']}; host {hw['cpu']}, {hw['cpu_cores']} cores, "
                f"load average {hw.get('load_average_1m', '?')}")
    return f"{hw['cpu']}, {hw['cpu_cores']} cores, {hw['torch_threads']} torch threads, torch {hw['torch']}, Python {hw['python']}, load average {hw.get('load_average_1m', '?')}"


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="bert-base")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameters, gradients and state")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per row (median reported); default 5 on cpu, 50 on cuda")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--require-compiled", action="store_true",
                        help="exit 1 when a fused ', compiled' row ran eagerly (its compiled step fell back) or a row failed")
    parser.add_argument("--rows", default="bert",
                        help="'bert' (default: BertAdam with per-parameter clipping, LAMB, their torch.compile peers), "
                        "'elementwise' (BertAdam without clipping, torch AdamW variants), 'unfusable' (Adafactor: "
                        "its exact step per parameter, eager and compiled), 'traffic' (the memory traffic of each "
                        "step's pattern alone), 'block-loops' (LAMB and pytorch-optimizer's Lamb compiled with and without "
                        "block loops and early stores, beside LAMB's floors), 'late-check' (BertAdam without clipping, eager and compiled, each with and without "
                        "the check for reductions that begin after the probes' window), 'all' (needs ~35 GB on BERT-base), "
                        "or comma-separated substrings of row names")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run (a lent GPU's time): no row but the references starts its warm-up "
                        "after 70%% of it (those rows are reported as not run, which --require-compiled counts as failed), and "
                        "timing stops at the budget once every row has 3 steps, so the table is always printed")
    args = parser.parse_args(argv)
    run_started = time.perf_counter()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    repeats = args.repeats if args.repeats is not None else (50 if cuda else 5)
    dtype = DTYPES[args.dtype]

    shapes = MODELS[args.model]
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(f"# One optimizer step, {args.model} shapes: {len(shapes)} tensors, {numel / 1e6:.1f} M parameters, {args.dtype}"
          + (", cuda" if cuda else ""))
    print(f"# hardware: {hardware_line(args.device)}")
    if cuda:  # measured first, while the device memory is still free
        bandwidth = cuda_copy_bandwidth()
        print(f"# device copy bandwidth: {bandwidth / 1e9:.0f} GB/s (2 x {CUDA_COPY_MIB} MiB fp32, dst.copy_(src), read + write)")
    built, failed = [], []
    all_rows = rows(shapes, args.device, dtype)
    wanted = ROW_SETS.get(args.rows) or [w.strip() for w in args.rows.split(",") if w.strip()]
    chosen = [(name, build) for name, build in all_rows if args.rows == "all" or name in (BASELINE, TORCH_FUSED)
              or any(w in name for w in wanted)]
    # rows with the late-reduction check off only where asked for (--rows late-check, all, or by name)
    chosen = [(name, build) for name, build in chosen
              if CHECK_OFF not in name or args.rows in ("late-check", "all") or CHECK_OFF in args.rows]
    # and rows without block loops where asked for (--rows block-loops, all, or by name)
    chosen = [(name, build) for name, build in chosen
              if NO_BLOCK_LOOPS not in name or args.rows in ("block-loops", "all") or "LAMB" in args.rows
              or "Lamb" in args.rows]
    # param, grad and two state tensors per row (the traffic-only rows share one set)
    need = (sum(not name.startswith(TRAFFIC) for name, _ in chosen) + any(name.startswith(TRAFFIC) for name, _ in chosen)
            ) * 4 * numel * dtype.itemsize
    have = 0 if cuda else _available_memory()
    if have and need > 0.85 * have:
        parser.error(f"{len(chosen)} rows need about {need / 2**30:.0f} GiB of {have / 2**30:.0f} GiB available "
                     "(every row stays alive to be timed round-robin): choose fewer with --rows")
    for name, build in chosen:
        if (args.budget is not None and time.perf_counter() - run_started > 0.7 * args.budget
                and name not in (BASELINE, TORCH_FUSED)):  # the references: warm in no time, and every ratio needs them
            failed.append((name, f"not run: 70% of --budget {args.budget:.0f} s had passed before its warm-up"))
            print(f"#   {name}: {failed[-1][1]}", flush=True)
            continue
        params = make_params(shapes, device=args.device, dtype=dtype)  # not timed: random numbers take seconds
        started, cpu_checks_before = time.perf_counter(), inductor_checked_cpu_vector_isas()
        try:
            step, opt = build(params)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(3):  # state creation, compilation, one warm step
                    step()
            if cuda:
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a row that cannot run is reported, not fatal
            failed.append((name, _reason(exc)))
            print(f"#   {name} failed in the warm-up: {_reason(exc)}", flush=True)
            continue
        setup = time.perf_counter() - started
        report = fusion_report(opt) if hasattr(opt, "fuse_step") else None
        built.append((name, step, report, setup, opt))
        note = f" (compile {report.compile_seconds:.1f} s)" if report and report.compiled else ""
        if name.startswith("torch.compile("):
            note = " (including torch.compile)"
        if cuda and not cpu_checks_before and inductor_checked_cpu_vector_isas():
            note += "; Inductor checked the host CPU's vector instructions here: the graph holds a CPU kernel"
        print(f"#   warmed up {name} in {setup:.1f} s{note}", flush=True)
    times = {name: [] for name, *_ in built}
    host = {name: [] for name, *_ in built}
    for done in range(repeats):
        if args.budget is not None and done >= 3 and time.perf_counter() - run_started > args.budget:
            print(f"# --budget {args.budget:.0f} s reached: {done} timed steps per row", flush=True)
            break
        for name, step, *_ in built:
            if cuda:
                seconds, issued = _timed_cuda(step)
                times[name].append(seconds)
                host[name].append(issued)
            else:
                times[name].append(_timed(step))
    bytes_per_param = next((b for b in (adam_bytes_per_param(opt) for *_, opt in built if opt is not None) if b),
                           7 * dtype.itemsize)
    if not cuda:
        bandwidth = copy_bandwidth(min(numel, 50_000_000))
    bound_ms = bytes_per_param * numel / bandwidth * 1e3

    median = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    host_ms = {name: statistics.median(ts) * 1e3 for name, ts in host.items() if ts}
    base = median.get(BASELINE)
    fused_torch = median.get(TORCH_FUSED)
    print()
    if cuda:
        print(f"| optimizer step | ms / step | host ms | vs BertAdam per-tensor | vs torch AdamW fused=True | first 3 steps s | effective GB/s ({bytes_per_param} B/param) | % of copy bandwidth | fused tensors / flat runs |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    else:
        print(f"| optimizer step | ms / step | vs BertAdam per-tensor | vs torch AdamW fused=True | first 3 steps s | effective GB/s ({bytes_per_param} B/param) | fused tensors / flat runs |")
        print("|---|---:|---:|---:|---:|---:|---|")
    results = []
    for name, _, report, setup, _ in built:
        fused = f"{report.fused_params} / {report.flat_runs}" + (" (compiled)" if report.compiled else "") if report else "-"
        ms = median[name]
        gbps = bytes_per_param * numel / ms / 1e6
        vs_base = f"{base / ms:.2f}x faster" if base else "-"
        vs_torch = f"{ms / fused_torch:.2f}x time" if fused_torch else "-"
        row = dict(row=name, ms=ms, speedup_vs_per_tensor=base / ms if base else None,
                   time_vs_torch_fused=ms / fused_torch if fused_torch else None, warmup_s=setup)
        if cuda:
            share = gbps * 1e9 / bandwidth * 100
            print(f"| {name} | {ms:.2f} | {host_ms[name]:.2f} | {vs_base} | {vs_torch} | {setup:.1f} | {gbps:.1f} | {share:.0f}% | {fused} |")
            row.update(host_ms=host_ms[name], effective_gbps=gbps, pct_of_copy_bandwidth=share,
                       compile_s=report.compile_seconds if report else None)
        else:
            print(f"| {name} | {ms:.1f} | {vs_base} | {vs_torch} | {setup:.1f} | {gbps:.1f} | {fused} |")
        results.append(row)
    for name, reason in failed:
        print(f"| {name} | failed: {reason} |" + " |" * (7 if cuda else 5))
        results.append(dict(row=name, failed=reason))
    vs_bound = f"{bound_ms / fused_torch:.2f}x time" if fused_torch else ""
    if cuda:
        print(f"| memory-bound estimate ({bytes_per_param} B/param at {bandwidth / 1e9:.0f} GB/s, device copy) | {bound_ms:.2f} | | | {vs_bound} | | {bandwidth / 1e9:.0f} | 100% | |")
    else:
        print(f"| memory-bound estimate ({bytes_per_param} B/param at {bandwidth / 1e9:.1f} GB/s, best of copy/triad) | {bound_ms:.1f} | | {vs_bound} | | {bandwidth / 1e9:.1f} | |")
    fell_back = [(name, report.compile_disabled_reason or "the last step ran eagerly") for name, _, report, _, _ in built
                 if name.endswith(", compiled") and report is not None and not (report.compiled or report.per_tensor_compiled)]
    for name, reason in fell_back:
        print(f"# COMPILED PATH NOT USED: {name}: {reason}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, params=numel, tensors=len(shapes), hardware=hardware(), bound_ms=bound_ms, rows=results,
                           device=args.device, dtype=args.dtype, repeats=repeats, bytes_per_param=bytes_per_param,
                           bandwidth_gbps=bandwidth / 1e9, compiled_rows_fell_back=fell_back), f, indent=2)
    if args.require_compiled and (fell_back or failed):
        print(f"# --require-compiled: {len(fell_back)} compiled row(s) fell back, {len(failed)} row(s) failed", file=sys.stderr)
        return None
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
