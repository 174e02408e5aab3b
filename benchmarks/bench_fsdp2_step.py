"""Time the optimizer step alone under PyTorch FSDP2 (``fully_shard``, DTensor parameters), CPU, gloo.

Why: under FSDP2 every parameter, gradient and state tensor is a DTensor holding this rank's shard,
and each op of a per-tensor or ``foreach`` step goes through DTensor's dispatch. pytorch#134191
reports AdamW's step growing from 2.5% to 33% of the training step under FSDP2 from that dispatch and
foreach overhead. On CPU the gap shows as: only torch's own fused optimizers (``AdamW(fused=True)``)
are fast; BertAdam and LAMB, which reduce over whole parameters (their norms need a collective across
the shards), have no fused torch version. This measures each optimizer's step on the same sharded
model, beside the memory-traffic floor of one Adam-like pass over this rank's local shards.

N ranks (default 2) are spawned with gloo and a hard timeout (``--timeout``), ``--threads`` torch
threads each. The model (``transformers.BertModel(BertConfig())``, built from its config) gets
``fully_shard`` per encoder layer, then at the root. Each row: one forward/backward (FSDP2
reduce-scatters every gradient into a sharded DTensor), a fresh optimizer, 3 warm-up steps (building
the optimizer, ``fuse_optimizer``, state creation and compilation: "first 3 steps (s)"), then
``--steps`` timed ``opt.step()`` calls, each after a barrier (gradients stay, state advances). Reported:
rank 0's median and the max over ranks of each rank's median; "vs adamw-fused" is rank 0's median over
that of the ``adamw-fused`` row of the same run. A row that raises (e.g. ``ShardedParameterError``
from ``fuse_optimizer`` on DTensors) is reported as n/a and the other rows go on.

    python benchmarks/bench_fsdp2_step.py                              # BERT-base, 2 ranks, 1 thread each
    python benchmarks/bench_fsdp2_step.py --model tiny --steps 3       # a quick smoke run
    python benchmarks/bench_fsdp2_step.py --rows adamw-fused,bertadam,bertadam-bagua,floor
    python benchmarks/bench_fsdp2_step.py --device cuda --world-size 1     # a GPU, NCCL (one rank per GPU)
    python benchmarks/bench_fsdp2_step.py --device cuda --world-size 1 --offload   # FSDP2's CPU offloading

On CUDA (NCCL, rank r on GPU r) each step is timed with CUDA events, and "host ms" is the time the
Python call takes to issue the step without waiting for the GPU: the DTensor dispatch and launch
overhead of pytorch#134191, side by side with the device time.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing.connection
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import warnings

import torch

# Benchmark this checkout, whatever an editable install elsewhere points at.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REFERENCE = "adamw-fused"
ROWS = ["adamw-foreach", "adamw-forloop", REFERENCE, "adamw-bagua", "adamw-fused-bagua", "bertadam", "bertadam-bagua", "lamb", "lamb-bagua", "floor",
        "floor-bertadam", "floor-lamb"]
BYTES_PER_ELEM = 28  # fp32 Adam-like step: read p, g, m, v (16 B) + write p, m, v (12 B)
MODELS = {"bert-base": {}, "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                    "intermediate_size": 256, "vocab_size": 1000, "max_position_embeddings": 128},
          # BERT-base's 199 parameters at a tiny size: on a CPU a step's time is then mostly its host side
          "deep-tiny": {"hidden_size": 32, "num_hidden_layers": 12, "num_attention_heads": 2,
                        "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 64}}


def make_optimizer(row, params):
    from bagua_integrations import fuse_optimizer
    from bagua_integrations.optim import BertAdam, Lamb

    if row == "adamw-fused-bagua":  # torch's own fused kernel, over the flat buffers of this rank's shards
        return fuse_optimizer(torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True), replace_step=True)
    kind, _, fused = row.partition("-")
    if kind == "adamw" and fused != "bagua":
        flag = {"foreach": {"foreach": True}, "forloop": {"foreach": False}, "fused": {"fused": True}}[fused]
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **flag)
    opt = {"adamw": lambda: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=False),
           "bertadam": lambda: BertAdam(params, lr=1e-4),  # seed defaults: each parameter's grad clipped to norm 1.0
           "lamb": lambda: Lamb(params, lr=1e-4, weight_decay=0.01)}[kind]()
    return fuse_optimizer(opt, replace_step=True) if fused == "bagua" else opt


def _flat_copies(params):
    """Flat copies of this rank's local shards and their gradients (plain tensors), zero moments, and a
    learning rate as a tensor (an input of the compiled floors: nothing to constant-fold)."""
    local = [(p.to_local() if hasattr(p, "to_local") else p).detach() for p in params]
    grads = [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for p in params]
    p = torch.cat([t.reshape(-1) for t in local])
    g = torch.cat([t.reshape(-1) for t in grads])
    return p, g, torch.zeros_like(p), torch.zeros_like(p), torch.tensor(1e-4, device=p.device)


def floor_steps(params):
    """Step functions of an Adam-like pass over flat copies of this rank's local shards (plain tensors):
    reads p, g, m, v and writes p, m, v, eager and torch.compile'd (one kernel)."""
    p, g, m, v, lr = _flat_copies(params)

    def adam(p, g, m, v, lr):
        m.mul_(0.9).add_(g, alpha=0.1)
        v.mul_(0.999).addcmul_(g, g, value=0.001)
        p.mul_(1 - 0.01 * lr).addcdiv_(m, v.sqrt().add_(1e-8), value=-lr)

    compiled = torch.compile(adam, fullgraph=True)
    return {"eager": lambda: adam(p, g, m, v, lr), "compiled": lambda: compiled(p, g, m, v, lr)}


def lamb_floor_step(params):
    """LAMB's own memory traffic, compiled, over flat copies of this rank's local shards: the update and
    its norm in one pass (reads p, g, m, v; writes m, v), the trust-ratio step in a second (the norms are
    one over the whole buffer here: the same traffic as one per parameter, without a collective)."""
    p, g, m, v, lr = _flat_copies(params)

    def lamb(p, g, m, v, lr):
        m.mul_(0.9).add_(g, alpha=0.1)
        v.mul_(0.999).addcmul_(g, g, value=0.001)
        update = m / (v.sqrt() + 1e-6) + 0.01 * p
        p.sub_(lr * (p.norm() / update.norm()) * update)

    compiled = torch.compile(lamb, fullgraph=True)
    return lambda: compiled(p, g, m, v, lr)


def bertadam_floor_step(params):
    """BertAdam's own memory traffic (its default per-parameter clipping), compiled, over flat copies of
    this rank's local shards: the gradient's norm in one pass (reads g), then the clipped gradient written
    back and the Adam update (reads p, g, m, v; writes p, g, m, v). The clip bound is an input so large
    that the gradient keeps its values from step to step; the traffic is the same."""
    p, g, m, v, lr = _flat_copies(params)
    bound = torch.tensor(1e30, device=p.device)

    def bertadam(p, g, m, v, lr, bound):
        g.mul_(torch.clamp(bound / (g.norm() + 1e-6), max=1.0))
        m.mul_(0.9).add_(g, alpha=0.1)
        v.mul_(0.999).addcmul_(g, g, value=0.001)
        p.sub_(lr * (m / (v.sqrt() + 1e-6) + 0.01 * p))

    compiled = torch.compile(bertadam, fullgraph=True)
    return lambda: compiled(p, g, m, v, lr, bound)


def new_grads(params, args):
    """With ``--fresh-grads``: before each step, every parameter gets a new gradient object (copies of
    the first backward's), as after ``zero_grad(set_to_none=True)`` and a backward in training (FSDP2
    then hands the optimizer new DTensor gradients). Without: the same gradients every step."""
    if not args.fresh_grads:
        return None
    saved = [None if p.grad is None else p.grad.detach().clone() for p in params]

    def renew():
        for p, grad in zip(params, saved):
            p.grad = None if grad is None else grad.clone()

    return renew


def time_steps(step, steps, dist, cuda=False, before=None):
    """(seconds of the first 3 steps, seconds of each timed step, host seconds of issuing each).
    On CUDA a step's time is its CUDA-event time; its host time is the Python call alone.
    ``before``: run ahead of every step, untimed."""
    started = time.perf_counter()
    for _ in range(3):  # warm-up: state creation, compilation, one warm step
        if before is not None:
            before()
        step()
    if cuda:
        torch.cuda.synchronize()
    first3 = time.perf_counter() - started
    times, host = [], []
    for _ in range(steps):
        if before is not None:
            before()
        dist.barrier()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record()
        started = time.perf_counter()
        step()
        host.append(time.perf_counter() - started)
        if cuda:
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            times.append(host[-1])
    return first3, times, host


def worker(rank, world, port, args, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import BertConfig, BertModel

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=args.timeout),
                            **({"device_id": torch.device("cuda", rank)} if cuda else {}))
    torch.manual_seed(0)  # the same full model on every rank before sharding
    model = BertModel(BertConfig(**MODELS[args.model])).to(args.device)
    mesh = init_device_mesh(args.device, (world,))
    options = {}
    if args.offload:  # shards, gradients and state in host memory: every row's step runs on the CPU
        from torch.distributed.fsdp import CPUOffloadPolicy

        options["offload_policy"] = CPUOffloadPolicy(pin_memory=cuda)
    for layer in model.encoder.layer:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen).to(args.device)
    results = {}
    for row in args.rows:
        params = list(model.parameters())  # afresh: a fused optimizer may have replaced them
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids)
        (out.last_hidden_state.pow(2).mean() + out.pooler_output.pow(2).mean()).backward()
        res = {"params": sum(type(p).__name__ == "DTensor" for p in params),
               "local": sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if row == "floor":  # both variants; the parent keeps the one faster on rank 0, on every rank
                    res["variants"] = {label: dict(zip(("first3", "times", "host"), time_steps(step, args.steps, dist, cuda)))
                                       for label, step in floor_steps(params).items()}
                    res.update(label=min(res["variants"], key=lambda k: statistics.median(res["variants"][k]["times"])))
                    res.update(res["variants"][res["label"]])
                elif row in ("floor-lamb", "floor-bertadam"):
                    floor = lamb_floor_step if row == "floor-lamb" else bertadam_floor_step
                    first3, times, host = time_steps(floor(params), args.steps, dist, cuda)
                    res.update(first3=first3, times=times, host=host)
                else:
                    started = time.perf_counter()
                    opt = make_optimizer(row, params)
                    build = time.perf_counter() - started
                    first3, times, host = time_steps(opt.step, args.steps, dist, cuda, before=new_grads(params, args))
                    res.update(first3=build + first3, times=times, host=host)
                    del opt
        except Exception as exc:  # noqa: BLE001 - a row that cannot run is reported, not fatal
            res["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:100]}".replace("|", "/")
        gc.collect()
        results[row] = res
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:  # after each row: a hang keeps the rest
            json.dump(results, f)
        if rank == 0:
            done = res.get("error") or f"{statistics.median(res['times']) * 1e3:.2f} ms (rank 0 median)"
            print(f"#   {row}: {done}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


def _entry(rank, world, port, args, out_dir):
    try:
        worker(rank, world, port, args, out_dir)
    except BaseException as exc:  # noqa: BLE001 - reported, then this process leaves at once
        print(f"# rank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)  # skip interpreter teardown: gloo's destructors may block on a peer that is gone


def launch(args, out_dir):
    """Spawn the ranks; kill every one still running at ``--timeout``. Returns the exit codes (None: killed)."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, args.world_size, port, args, out_dir), daemon=True)
             for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + args.timeout
    running = {proc.sentinel for proc in procs}
    while running and time.monotonic() < deadline:
        running -= set(multiprocessing.connection.wait(list(running), timeout=deadline - time.monotonic()))
    hung = [proc.sentinel in running for proc in procs]  # is_alive() may race a process that is just ending
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
    return [None if h else proc.exitcode for h, proc in zip(hung, procs)]


def hardware_line(args):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    gpu = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}); host " if args.device == "cuda" else ""
    backend = "nccl" if args.device == "cuda" else "gloo"
    return (f"{gpu}{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}; "
            f"world size {args.world_size} ({backend}), {args.threads} torch thread(s) per rank, model {args.model}"
            f"{', CPU offloading (the step runs on the host)' if args.offload else ''}"
            f"{', new gradients before each step' if args.fresh_grads else ''}{load}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="bert-base")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row (median reported)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before every rank is killed")
    parser.add_argument("--json", help="also write every rank's results here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: NCCL, rank r on GPU r (needs --world-size <= the GPUs), CUDA-event timing")
    parser.add_argument("--fresh-grads", action="store_true",
                        help="new gradient objects before each step (untimed), as zero_grad(set_to_none=True) "
                             "and a backward give in training")
    parser.add_argument("--offload", action="store_true",
                        help="FSDP2's CPUOffloadPolicy (pinned on cuda): the optimizer step runs on the host")
    args = parser.parse_args(argv)
    if args.device == "cuda" and args.world_size > torch.cuda.device_count():
        parser.error(f"--device cuda: {args.world_size} ranks need as many GPUs (NCCL: one rank per GPU), "
                     f"{torch.cuda.device_count()} visible; pass --world-size {max(torch.cuda.device_count(), 1)}")
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if unknown := [r for r in args.rows if r not in ROWS]:
        parser.error(f"unknown rows {unknown}; choose from {ROWS}")
    if args.device == "cpu":
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile-worker pool per rank on a small CPU
    print(f"# Optimizer step under FSDP2 (fully_shard per encoder layer + root), {args.steps} timed steps per row")
    print(f"# hardware: {hardware_line(args)}", flush=True)
    with tempfile.TemporaryDirectory() as out_dir:
        codes = launch(args, out_dir)
        ranks = []
        for r in range(args.world_size):
            path = os.path.join(out_dir, f"rank{r}.json")
            if not os.path.exists(path):
                ranks.append({})
                continue
            with open(path) as f:
                ranks.append(json.load(f))
    if "label" in ranks[0].get("floor", {}):  # rank 0's faster floor variant, on every rank
        label = ranks[0]["floor"]["label"]
        for rk in (rk["floor"] for rk in ranks if label in rk.get("floor", {}).get("variants", {})):
            rk.update(rk["variants"][label], label=label)
    median = {row: [statistics.median(rk[row]["times"]) * 1e3 for rk in ranks if "times" in rk.get(row, {})]
              for row in args.rows}
    ref = median[REFERENCE][0] if median.get(REFERENCE) and "times" in ranks[0].get(REFERENCE, {}) else None
    print()
    print(f"| optimizer step | ms / step (rank 0, median) | ms / step (max over ranks of medians) | vs {REFERENCE} "
          f"| first 3 steps (s) | DTensor params / rank | local M elements / rank (rank 0 / max) | GB/s ({BYTES_PER_ELEM} B/elem, rank 0) "
          "| host ms (rank 0, issuing the step) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in args.rows:
        res = ranks[0].get(row)
        errors = [rk[row]["error"] for rk in ranks if "error" in rk.get(row, {})]
        if res is None or errors or len(median[row]) < args.world_size:
            why = errors[0] if errors else "did not finish on every rank"
            print(f"| {row} | n/a ({why}) | | | | | | | |")
            continue
        ms, local = median[row][0], [rk[row]["local"] for rk in ranks]
        name = {"floor": f"floor ({res.get('label')}: one Adam pass over the flat local shards)",
                "floor-bertadam": "floor-bertadam (compiled: the clipping norm's pass, then the clipped Adam pass)",
                "floor-lamb": "floor-lamb (compiled: LAMB's two passes over the flat local shards)"}.get(row, row)
        print(f"| {name} | {ms:.2f} | {max(median[row]):.2f} | {f'{ms / ref:.2f}x' if ref else '-'} | {res['first3']:.1f} "
              f"| {res['params']} | {local[0] / 1e6:.2f} / {max(local) / 1e6:.2f} | {BYTES_PER_ELEM * local[0] / ms / 1e6:.1f} "
              f"| {statistics.median(res['host']) * 1e3:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": hardware_line(args), "args": vars(args), "ranks": ranks, "exit_codes": codes}, f, indent=2)
    if any(code != 0 for code in codes):
        print(f"# rank exit codes: {codes} (None: killed at --timeout {args.timeout:.0f} s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
