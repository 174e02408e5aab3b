"""2-rank gloo benchmark of the distributed core on CPU.

Measures, on one MLP and one bucket size:
  * step time of bagua's ``gradient_allreduce`` (own flat buffers, and with a fused optimizer)
    against ``torch.nn.parallel.DistributedDataParallel`` with the same bucket size;
  * the same comparison over a sweep of bucket sizes;
  * bytes each rank writes to its sockets per step, for every algorithm (Linux /proc/self/io);
  * Bagua's autotuner searching the bucket size, and the tuned setting against the default and DDP;
  * one rank slowed 2x: how much of its speed the fast rank keeps under DDP, gradient_allreduce and async;
  * the uint8 codec of bytegrad / qadam / low_precision_decentralized (one process, one thread, as
    in each rank): GB/s of fp32 gradient encoded and decoded, eager and compiled, against a plain
    copy of the same bytes measured in the same rounds (``--codec-only`` for just this table).

Variants run interleaved in rounds inside the same two processes so that background load
hits them alike; the reported time is the median step time of rank 0.

    python benchmarks/bench_distributed.py                 # defaults: ~1-2 minutes on 2 cores
    python benchmarks/bench_distributed.py --json out.json --rounds 8
    python benchmarks/bench_distributed.py --codec-only --codec-device cuda --codec-elements 64000000   # on a GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# Benchmark this checkout, whatever an editable install elsewhere points at.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bagua_integrations import fuse_optimizer  # noqa: E402
from bagua_integrations.distributed import WireMeter, bagua_init  # noqa: E402
from bagua_integrations.optim import QAdam  # noqa: E402

MB = 1 << 20


def build_model(width: int, depth: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


class Variant:
    """One way of training the model: a wrapped model, its optimizer and its step function."""

    def __init__(self, name, args, algorithm=None, ddp=False, fused=False, message_size=None, make_optimizer=None,
                 **kwargs):
        self.name = name
        self.model = build_model(args.width, args.depth)
        make_optimizer = make_optimizer or (lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9))
        optimizer = make_optimizer(self.model.parameters())
        message_size = message_size or args.message_size
        if fused:
            fuse_optimizer(optimizer)
        if ddp:
            self.wrapped = DDP(self.model, bucket_cap_mb=message_size / MB, **kwargs)
        else:
            self.wrapped, optimizer = bagua_init(self.model, optimizer, algorithm, message_size=message_size, **kwargs)
        self.optimizer = optimizer
        self.step_fn = optimizer.fuse_step if fused else optimizer.step
        self.times = []
        # CPU seconds of the whole process (every thread: gloo's too) per timed step: a step that
        # uses about as much CPU as wall time is bound by compute, not by the link
        self.cpu_times = []

    def step(self, x, y) -> float:
        start, cpu = time.perf_counter(), time.process_time()
        self.optimizer.zero_grad(set_to_none=True)
        F.mse_loss(self.wrapped(x), y).backward()
        self.step_fn()
        self.last_cpu = time.process_time() - cpu
        return time.perf_counter() - start


def _median_ms(times) -> float:
    return 1000 * statistics.median(times)


def _interleaved(variants, args, rank, peers=None):
    """Time ``variants`` round by round; ratios against the first one in the same round, and with
    ``peers`` ({variant: other variant}) also ``peer_ratios``: each against its peer in the same round."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    for variant in variants:  # warm-up: first steps allocate buffers and open connections
        for _ in range(2):
            variant.step(x, y)
    per_round = {v.name: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            dist.barrier()
            times = []
            for _ in range(args.steps):
                times.append(variant.step(x, y))
                variant.cpu_times.append(variant.last_cpu)
            variant.times += times
            per_round[variant.name].append(statistics.median(times))
    # Background load drifts; comparing variants within each round cancels most of it.
    base = per_round[variants[0].name]
    ratios = {
        name: _quartiles([t / b for t, b in zip(rounds, base)]) for name, rounds in per_round.items()
    }
    timings = {v.name: _median_ms(v.times) for v in variants} | {"ratios": ratios}
    timings["cpu_ms"] = {v.name: _median_ms(v.cpu_times) for v in variants}
    if peers:
        timings["peer_ratios"] = {
            name: (peer, _quartiles([t / b for t, b in zip(per_round[name], per_round[peer])]))
            for name, peer in peers.items() if name in per_round and peer in per_round
        }
    return timings


def _quartiles(values):
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return [q[0], statistics.median(values), q[2]]


def _bucket_count(variant) -> int:
    if isinstance(variant.wrapped, DDP):
        return int(variant.wrapped._get_ddp_logging_data().get("num_buckets_reduced", -1))
    return len(variant.wrapped.reducer.buckets)


def _bytes_per_step(variant, args, rank, steps: int) -> float:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    variant.step(x, y)
    dist.barrier()
    with WireMeter() as meter:
        for _ in range(steps):
            variant.step(x, y)
    return None if meter.bytes is None else meter.bytes / steps


def _autotuned(args, rank):
    """Bagua's autotuner on gradient_allreduce's bucket size (the sweep's sizes and the default), then
    the tuned setting interleaved with the default and DDP."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    tuned = Variant("gradient_allreduce (autotuned)", args, "gradient_allreduce")
    tuner = tuned.wrapped.enable_autotune(max_trials=args.autotune_trials,
                                          message_sizes=sorted(set(args.sweep) | {args.message_size}), seed=0)
    started, steps = time.perf_counter(), 0
    while not tuner.done:
        tuned.step(x, y)  # the first step after a change builds buckets: not measured
        times = [tuned.step(x, y) for _ in range(max(3, args.steps))]
        steps += 1 + len(times)
        tuned.wrapped.report_metrics(1.0 / statistics.median(times))
        tuned.wrapped.ask_and_update_hyperparameters()
    search = {"seconds": time.perf_counter() - started, "steps": steps, "report": tuned.wrapped.autotune_report()}
    compared = _interleaved([Variant("ddp", args, ddp=True), Variant("gradient_allreduce (default)", args, "gradient_allreduce"),
                             tuned], args, rank)
    return {"compare": compared, "search": search}


def _straggler(args, rank):
    """Rank 1 made 2x slower (it sleeps its own step time after each step): rank 0's steps/s
    against the same variant with no one slowed. Synchronous algorithms wait for the straggler
    at every step; async averaging does not."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    out = {}
    for name, kwargs in (("ddp", dict(ddp=True)), ("gradient_allreduce", dict(algorithm="gradient_allreduce")),
                         ("async", dict(algorithm="async", sync_interval_ms=0))):
        variant = Variant(name, args, **kwargs)
        for _ in range(3):
            variant.step(x, y)
        rates = {}
        for slowed in (False, True):
            dist.barrier()
            own = [variant.step(x, y) for _ in range(3)]
            pause = statistics.median(own) if slowed and rank == 1 else 0.0
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.straggler_steps):
                variant.step(x, y)
                if pause:
                    time.sleep(pause)
            rates[slowed] = args.straggler_steps / (time.perf_counter() - start)
            if name == "async":
                variant.wrapped.algorithm.abort()  # every rank the same rounds, then one synchronous average
                variant.wrapped.algorithm.resume()
        out[name] = {"steps_per_s": rates[False], "slowed_steps_per_s": rates[True], "kept": rates[True] / rates[False]}
        if name == "async":
            variant.wrapped.algorithm.abort()
    return out


def worker(rank, world, port, args, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    results = {}
    head = [
        Variant("ddp", args, ddp=True),
        Variant("gradient_allreduce", args, "gradient_allreduce"),
        Variant("gradient_allreduce+fused", args, "gradient_allreduce", fused=True),
        Variant("gradient_allreduce (find_unused_parameters=False)", args, "gradient_allreduce", find_unused_parameters=False),
        Variant("gradient_allreduce (delay_reduce)", args, "gradient_allreduce", delay_reduce=True),
        Variant("ddp (gradient_as_bucket_view)", args, ddp=True, gradient_as_bucket_view=True),
    ]
    results["head_to_head"] = _interleaved(head, args, rank)
    del head

    sweep = {}
    for size in args.sweep:
        pair = [Variant("ddp", args, ddp=True, message_size=size), Variant("gradient_allreduce", args, "gradient_allreduce", message_size=size)]
        sweep[size] = _interleaved(pair, argparse.Namespace(**{**vars(args), "rounds": max(2, args.rounds // 2)}), rank)
        sweep[size]["buckets"] = [_bucket_count(v) for v in pair]
    results["sweep"] = sweep
    if args.autotune_trials:
        results["autotune"] = _autotuned(args, rank)

    traffic = {}
    algorithms = [
        ("ddp", dict(ddp=True)),
        ("gradient_allreduce", dict(algorithm="gradient_allreduce")),
        ("bytegrad", dict(algorithm="bytegrad")),
        ("decentralized all", dict(algorithm="decentralized", peer_selection_mode="all")),
        ("decentralized shift_one", dict(algorithm="decentralized", peer_selection_mode="shift_one")),
        ("low_precision_decentralized", dict(algorithm="low_precision_decentralized")),
        ("bmuf (global_sync_iter=1)", dict(algorithm="bmuf", warmup_iterations=0, global_sync_iter=1)),
        ("bmuf (global_sync_iter=10)", dict(algorithm="bmuf", warmup_iterations=0, global_sync_iter=10)),
        # after its 1 warm-up step (the one _bytes_per_step leaves out): uint8 momentum
        ("qadam (after warm-up)", dict(algorithm="qadam", make_optimizer=lambda params: QAdam(params, lr=1e-3, warmup_steps=1))),
        ("async (sync_interval_ms=0)", dict(algorithm="async", sync_interval_ms=0)),
    ]
    for name, kwargs in algorithms:
        variant = Variant(name, args, **kwargs)
        traffic[name] = _bytes_per_step(variant, args, rank, steps=10)
        if kwargs.get("algorithm") == "async":
            variant.wrapped.algorithm.abort()
    results["bytes_per_step"] = traffic
    if args.straggler_steps:
        results["straggler"] = _straggler(args, rank)
    results["param_bytes"] = sum(p.numel() * p.element_size() for p in build_model(args.width, args.depth).parameters())
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(results, handle)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


EVICT_BYTES = 256 * MB  # written before each timed codec call on a CPU: more than this VM's caches hold


def codec_rows(elements: int, rounds: int, ranks: int = 2, device: str = "cpu", warm: bool = False) -> dict:
    """Median seconds per call of each codec operation on one bucket of ``elements`` fp32
    values, eager and compiled, and of a plain copy of the same bytes, interleaved in rounds.
    On CUDA each call is timed with CUDA events (the compiled forms are Triton kernels).

    On a CPU every call starts with its data out of the caches (``EVICT_BYTES`` written before it),
    as a bucket that backward wrote a while ago is: otherwise a row's time depends on which rows ran
    just before it (the eager rows evict the bucket, the copy after a copy finds it in cache), and
    the same encode measured 0.36x-0.51x of a copy from run to run. ``warm=True`` skips that."""
    from bagua_integrations.distributed.algorithms.bytegrad import BLOCK, MinMaxUInt8

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(elements, generator=g).to(device)
    copy_target = torch.empty_like(flat)
    rows = {"plain copy (fp32 -> fp32)": lambda: copy_target.copy_(flat),
            # the encoders allocate their output each call (the copy above writes into one it has):
            # this row shows what a fresh buffer's page faults cost on this machine in this run
            "plain copy into a new buffer (clone)": lambda: flat.clone()}
    for label, compiled in (("eager", False), ("compiled", True)):
        codec = MinMaxUInt8(zero_exact=True, block=BLOCK, compile=compiled)
        chunk = codec.padded_length(-(-elements // ranks))
        sent = codec.encode_chunks(flat, ranks)
        received = sent.clone()
        gathered = torch.cat([codec.average_chunks(received, chunk)] * ranks)
        out = torch.empty_like(flat)
        rows[f"encode, {label}"] = lambda codec=codec: codec.encode_chunks(flat, ranks)
        rows[f"average {ranks} ranks' chunks + encode, {label}"] = lambda codec=codec, r=received, c=chunk: codec.average_chunks(r, c)
        rows[f"decode into the bucket, {label}"] = lambda codec=codec, gd=gathered, o=out, c=chunk: codec.decode_into(gd, o, c)
        if compiled and codec.folds_momentum(flat):
            # qadam's first pass on a fused QAdam's bucket: the momentum its gradients make, encoded
            # (folded in place first where the encoder cannot fold, e.g. an unfused QAdam)
            grads, momentum = flat.clone(), torch.randn(elements, generator=g).to(device)
            rows["qadam: fold the momentum in place (lerp_), then encode, compiled"] = (
                lambda codec=codec, gr=grads, m=momentum: codec.encode_chunks(gr.lerp_(m, 0.9), ranks))
            rows["qadam: encode the momentum folded as it is read, compiled"] = (
                lambda codec=codec, gr=grads, m=momentum: codec.encode_chunks(gr, ranks, momentum=(m, 0.9)))
        if compiled:  # a bucket of another size first: the shape-general graphs a model's uneven buckets run
            other = torch.randn(elements + 3 * BLOCK * ranks, generator=g).to(device)
            other_chunk = codec.padded_length(-(-other.numel() // ranks))
            other_sent = codec.encode_chunks(other, ranks)
            if codec.folds_momentum(other):
                codec.encode_chunks(other, ranks, momentum=(other.clone(), 0.9))
            codec.decode_into(torch.cat([codec.average_chunks(other_sent, other_chunk)] * ranks), other, other_chunk)
    for fn in rows.values():  # warm-up: compile, first-touch pages
        fn()
        fn()
    evict = torch.empty(EVICT_BYTES // 4) if device != "cuda" and not warm else None
    times = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            if evict is not None:
                evict.fill_(1.0)
            times[name].append(_timed_call(fn, device))
    medians = {name: statistics.median(values) for name, values in times.items()}
    # each row processes the bucket's fp32 values once (average: one chunk from each rank = one bucket)
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {os.cpu_count()} cores"
    return {"elements": elements, "ranks": ranks, "seconds": medians, "device": device, "hardware": where,
            "compiled graphs": "shape-general (a bucket of another size ran first)",
            "torch": torch.__version__, "caches": "warm" if evict is None else "evicted before each call"}


def _timed_call(fn, device: str) -> float:
    """Seconds of one call: CUDA events around it on a GPU (after a synchronize), else the host clock."""
    if device != "cuda":
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def codec_report(codec: dict) -> str:
    gigabytes = codec["elements"] * 4 / 1e9
    copy = codec["seconds"]["plain copy (fp32 -> fp32)"]
    where = codec.get("hardware", "CPU")
    conditions = f"compiled graphs {codec['compiled graphs']}; " if "compiled graphs" in codec else ""
    if codec.get("device") != "cuda":
        conditions += f"1 thread; caches {codec.get('caches', 'warm')}; "
    lines = [f"## uint8 codec, one bucket of {codec['elements'] * 4 / MB:.0f} MB fp32 on {where}, torch {codec.get('torch', '?')} "
             f"({codec['ranks']} ranks' chunks; {conditions}GB/s of fp32 values processed; vs a plain copy of the same bytes in the same rounds)", "",
             "| operation | ms | GB/s | vs plain copy |", "|---|---:|---:|---:|"]
    for name, seconds in codec["seconds"].items():
        lines.append(f"| {name} | {seconds * 1e3:.2f} | {gigabytes / seconds:.2f} | {copy / seconds:.2f}x |")
    return "\n".join(lines)


def report(results, args) -> str:
    lines = [
        f"# bench_distributed: 2 ranks, gloo, CPU ({os.cpu_count()} cores, 1 thread per rank), "
        f"MLP {args.depth}x{args.width} ({results['param_bytes'] / MB:.1f} MB fp32), batch {args.batch}/rank, "
        f"SGD momentum, bucket {args.message_size / MB:g} MB, median of {args.rounds}x{args.steps} steps",
        "",
        "## step time (ms, rank 0)",
        "vs DDP: median over rounds of (variant / DDP in the same round), [quartiles]",
        "",
        "| variant | ms/step | vs DDP |",
        "|---|---:|---:|",
    ]
    head = results["head_to_head"]
    for name, (low, mid, high) in head["ratios"].items():
        lines.append(f"| {name} | {head[name]:.1f} | {mid:.3f}x [{low:.2f}-{high:.2f}] |")
    lines += ["", "## bucket-size sweep (ms/step)", "| bucket | buckets (DDP / ours) | DDP | gradient_allreduce | vs DDP |",
              "|---:|---:|---:|---:|---:|"]
    for size, pair in results["sweep"].items():
        ddp_buckets, our_buckets = pair["buckets"]
        low, mid, high = pair["ratios"]["gradient_allreduce"]
        lines.append(f"| {int(size) / MB:g} MB | {ddp_buckets} / {our_buckets} | {pair['ddp']:.1f} | "
                     f"{pair['gradient_allreduce']:.1f} | {mid:.3f}x [{low:.2f}-{high:.2f}] |")
    if "autotune" in results:
        tuned = results["autotune"]
        search = tuned["search"]
        best = search["report"]["best"]
        lines += ["", f"## autotune (Optuna TPE over bucket sizes {sorted(set(args.sweep) | {args.message_size})}, "
                  f"{search['report']['max_trials']} trials)",
                  f"search: {len(search['report']['history'])} trials, {search['steps']} steps, {search['seconds']:.1f} s; "
                  f"chosen message_size {best['settings']['message_size'] / MB:g} MB",
                  "", "| variant | ms/step | vs DDP |", "|---|---:|---:|"]
        compare = tuned["compare"]
        for name, (low, mid, high) in compare["ratios"].items():
            lines.append(f"| {name} | {compare[name]:.1f} | {mid:.3f}x [{low:.2f}-{high:.2f}] |")
    lines += ["", "## bytes written to sockets per step (rank 0)", "| algorithm | MB/step | vs gradient_allreduce |", "|---|---:|---:|"]
    traffic = results["bytes_per_step"]
    base = traffic.get("gradient_allreduce")
    for name, value in traffic.items():
        if value is None:
            lines.append(f"| {name} | n/a | n/a |")
        else:
            lines.append(f"| {name} | {value / MB:.2f} | {value / base:.3f} |")
    if "straggler" in results:
        lines += ["", f"## one rank slowed 2x ({args.straggler_steps} steps; rank 1 sleeps its own step time after each step)",
                  "rank 0's steps/s, with no rank slowed and with rank 1 slowed, and the share it keeps", "",
                  "| variant | steps/s | steps/s, rank 1 slowed | kept |", "|---|---:|---:|---:|"]
        for name, row in results["straggler"].items():
            lines.append(f"| {name} | {row['steps_per_s']:.1f} | {row['slowed_steps_per_s']:.1f} | {row['kept']:.0%} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--message-size", type=int, default=4 * MB, help="bucket bytes (bagua message_size, DDP bucket_cap_mb)")
    parser.add_argument("--sweep", type=int, nargs="*", default=[MB // 4, MB, 4 * MB, 16 * MB])
    parser.add_argument("--autotune-trials", type=int, default=8, help="autotuner trials (0: skip the autotune rows)")
    parser.add_argument("--straggler-steps", type=int, default=40, help="steps per straggler measurement (0: skip)")
    parser.add_argument("--json", help="also write the raw numbers here")
    parser.add_argument("--codec-elements", type=int, default=6_000_000, help="fp32 elements in the codec table's bucket")
    parser.add_argument("--codec-only", action="store_true", help="only the codec table (one process)")
    parser.add_argument("--codec-warm", action="store_true",
                        help="CPU codec table: do not evict the caches before each call (see codec_rows)")
    parser.add_argument("--codec-device", choices=["cpu", "cuda"], default="cpu",
                        help="where the codec table runs (cuda: CUDA-event timing, Triton kernels when compiled)")
    args = parser.parse_args(argv)
    if args.codec_device == "cuda" and not torch.cuda.is_available():
        parser.error("--codec-device cuda: no CUDA device is available")
    codec = codec_rows(args.codec_elements, max(args.rounds, 5), device=args.codec_device, warm=args.codec_warm)
    torch.set_num_threads(os.cpu_count() or 1)
    if args.codec_only:
        print(codec_report(codec))
        return 0
    out_path = args.json or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench_distributed_{os.getpid()}.json")
    mp.start_processes(worker, args=(2, _free_port(), args, out_path), nprocs=2, start_method="spawn")
    with open(out_path) as handle:
        results = json.load(handle)
    results["codec"] = codec
    print(report(results, args) + "\n\n" + codec_report(codec))
    if args.json:
        with open(out_path, "w") as handle:
            json.dump(results, handle)
    else:
        os.remove(out_path)


if __name__ == "__main__":
    sys.exit(main())
