"""The 2-rank benchmark of bench_distributed.py over a slow link: where communication algorithms matter.

The two gloo ranks run in two network namespaces joined by a veth pair whose both ends are shaped
by a ``tc`` token bucket filter (``tbf``), so each direction carries at most the given rate. For
each rate, a fresh pair of processes times, interleaved in rounds, one step (zero_grad, forward,
backward, optimizer step) of torch DDP and of Bagua's algorithms on an MLP with ~25 MB of fp32
gradients, and counts the bytes each step writes to the sockets (rank 0). The step time is the
median over all steps of rank 0; "vs DDP" is the median over rounds of (variant / DDP in the same
round), with quartiles. Variants whose algorithm is not registered are skipped with a note;
``async`` (background averaging) is timed last, against DDP alone. Settings: VARIANTS below.

tbf settings: ``burst`` = 1 ms of traffic at the rate (at least 32 KiB: 125 kB at 1 Gbit/s, 1.25 MB
at 10 Gbit/s), ``latency 50ms`` (the queue holds 50 ms of traffic before dropping). tbf charges
veth's GSO super-packets at their full length (and splits those over ``burst``), so the rate holds
with offloads on; each table's header gives the gloo throughput measured over the link.

Needs root on Linux (``ip netns``, ``tc`` from iproute2; the sch_tbf module); elsewhere it prints
one ``skipped: ...`` line and exits 0. Namespaces are named ``bagua-bench-<pid>-0/1``, removed at
exit, and leftovers of a crashed run (dead pid) are removed at start.

    sudo python benchmarks/bench_slow_link.py                    # 1gbit and 10gbit: about a minute on 2 cores
    sudo python benchmarks/bench_slow_link.py --rates 1gbit none --rounds 9 --json out.json
    sudo python benchmarks/bench_slow_link.py --rounds 1 --steps 1 --rates 1gbit   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_distributed import MB, Variant, _bytes_per_step, _interleaved, build_model  # noqa: E402  (adds the repo)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import bagua_integrations.optim  # noqa: E402
from bagua_integrations.distributed import get_algorithm, list_algorithms  # noqa: E402

# variant -> registered algorithm (None: torch DDP), bagua_init kwargs, optimizer factory (None: SGD
# momentum 0.9, lr 1e-3), extra warm-up steps before timing. Async runs in a phase of its own (see _async_phase).
QADAM_WARMUP = 2  # QAdam's full-precision steps; they and the first compressed steps are not timed
VARIANTS = {
    "ddp": dict(algorithm=None),
    "gradient_allreduce": dict(algorithm="gradient_allreduce"),
    "bytegrad": dict(algorithm="bytegrad", kwargs=dict(hierarchical=False)),
    "decentralized": dict(algorithm="decentralized"),
    "low_precision_decentralized": dict(algorithm="low_precision_decentralized"),
    # with a fused optimizer the weights lie in one buffer: a round gathers and scatters no copy of them
    "low_precision_decentralized_fused": dict(algorithm="low_precision_decentralized", fused=True),
    # QAdam is an Adam: fused (one compiled kernel, as fuse_optimizer makes it) it costs what DDP's SGD
    # step costs here; unfused, its eager step is 2-3x that (a row of its own, not in the default set)
    "qadam": dict(algorithm="qadam", warmup=QADAM_WARMUP, fused=True,
                  optimizer=lambda params: bagua_integrations.optim.QAdam(params, lr=1e-3, warmup_steps=QADAM_WARMUP)),
    "qadam_unfused": dict(algorithm="qadam", warmup=QADAM_WARMUP,
                          optimizer=lambda params: bagua_integrations.optim.QAdam(params, lr=1e-3, warmup_steps=QADAM_WARMUP)),
    "async": dict(algorithm="async", kwargs=dict(sync_interval_ms=100)),
    # DDP with the optimizer QAdam is: the like-for-like peer of qadam (see PEERS), torch's fastest Adam
    "ddp_adam": dict(algorithm=None, optimizer=lambda params: torch.optim.Adam(params, lr=1e-3, fused=True)),
    # bytegrad as the HF Trainer / Accelerate integration runs it: torch DDP with its communication hook
    "bytegrad_ddp_hook": dict(algorithm=None, ddp_hook="bytegrad"),
}
# variant -> the variant it is also compared with, round by round (a second "vs" line under the table):
# a user choosing between DDP and QAdam trains Adam either way
PEERS = {"qadam": "ddp_adam", "qadam_unfused": "ddp_adam"}
NAMESPACE_PREFIX = "bagua-bench-"
ADDRESSES = ("10.77.0.1", "10.77.0.2")  # rank 0's address is the rendezvous (MASTER) address
BASE_PORT = 29500


def _rate(rate: str) -> str:
    if rate != "none":
        tbf_settings(rate)
    return rate


def tbf_settings(rate: str):
    """``tc ... tbf`` arguments for a rate such as ``1gbit`` (tc units: k/m/g = 10^3/10^6/10^9 bit/s)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"rate {rate!r}: expected e.g. 100mbit, 1gbit, 10gbit, or none")
    bits = float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]]
    return ["rate", rate, "burst", str(max(32 * 1024, int(bits / 8 / 1000))), "latency", "50ms"]


# ---------------------------------------------------------------------- worker (one rank, inside its namespace)
def _make_variant(name, args):
    """A Variant, or a string saying why it is skipped (its algorithm is not registered)."""
    spec = VARIANTS[name]
    if spec["algorithm"] is None:
        variant = Variant(name, args, ddp=True, make_optimizer=spec.get("optimizer"))
        if spec.get("ddp_hook"):
            variant.wrapped.register_comm_hook(None, get_algorithm(spec["ddp_hook"], hierarchical=False).ddp_comm_hook)
        return variant
    if spec["algorithm"] not in list_algorithms():
        return f"{name}: skipped, algorithm {spec['algorithm']!r} is not registered (have: {', '.join(list_algorithms())})"
    variant = Variant(name, args, spec["algorithm"], fused=spec.get("fused", False), make_optimizer=spec.get("optimizer"),
                      **spec.get("kwargs", {}))
    x = torch.randn(args.batch, args.width)
    for _ in range(spec.get("warmup", 0)):
        variant.step(x, x)
    return variant


def _link_mb_per_s(nbytes: int, rank: int) -> float:
    """One-way gloo throughput, rank 0 -> rank 1 (best of 3 sends of ``nbytes``, each acknowledged)."""
    data, ack, best = torch.zeros(nbytes // 4), torch.zeros(1), 0.0
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(data, 1)
            dist.recv(ack, 1)
        else:
            dist.recv(data, 0)
            dist.send(ack, 0)
        best = max(best, nbytes / MB / (time.perf_counter() - start))
    return best


def _async_phase(ddp, variant, args, rank):
    """Async averages in a background thread, which would load the link during other variants' steps:
    it is timed last, against DDP only, with its rounds stopped (``abort``, outside the timed part of a
    step) while DDP steps and started again (``resume``) before its own."""
    algorithm = variant.wrapped.algorithm
    running = [True]
    ddp_step, async_step = ddp.step, variant.step

    def paused_ddp_step(x, y):
        if running[0]:
            algorithm.abort(variant.wrapped)
            running[0] = False
        return ddp_step(x, y)

    def resumed_async_step(x, y):
        if not running[0]:
            algorithm.resume(variant.wrapped)
            running[0] = True
        return async_step(x, y)

    ddp.step, variant.step = paused_ddp_step, resumed_async_step
    timings = _interleaved([ddp, variant], args, rank)
    wire = _bytes_per_step(variant, args, rank, steps=args.wire_steps)
    algorithm.abort(variant.wrapped)
    return timings, wire


def worker(config):
    args = argparse.Namespace(**config)
    rank = args.rank
    log = (lambda msg: print(f"[{args.rate}] {msg}", file=sys.stderr, flush=True)) if rank == 0 else (lambda msg: None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{ADDRESSES[0]}:{args.port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    result = {"rate": args.rate, "tbf": args.tbf, "ms": {}, "ratios": {}, "wire_bytes": {}, "notes": []}

    def save():
        if rank == 0:
            with open(args.out, "w") as handle:
                json.dump(result, handle)

    result["link_MBps"] = _link_mb_per_s(args.param_bytes, rank)
    log(f"gloo send rank 0 -> 1: {result['link_MBps']:.0f} MB/s; building variants")
    variants = []
    for name in args.variants:
        if name == "async":
            continue  # built and timed last, so that its background averaging cannot slow the others
        variant = _make_variant(name, args)
        if isinstance(variant, str):
            result["notes"].append(variant)
        else:
            variants.append(variant)
    log(f"timing {', '.join(v.name for v in variants)}: {args.rounds} rounds x {args.steps} steps")
    timings = _interleaved(variants, args, rank, peers=PEERS)
    result["ratios"] = timings.pop("ratios")
    result["peer_ratios"] = timings.pop("peer_ratios", {})
    result["cpu_ms"] = timings.pop("cpu_ms")
    result["ms"] = timings
    log("counting bytes on the wire")
    result["wire_bytes"] = {v.name: _bytes_per_step(v, args, rank, steps=args.wire_steps) for v in variants}
    save()  # the rows so far, should the async phase fail
    late = _make_variant("async", args) if "async" in args.variants else None
    if isinstance(late, str):
        result["notes"].append(late)
    elif late is not None:
        log("timing async against ddp")
        timings, wire = _async_phase(variants[0], late, args, rank)
        result["ms"]["async"], result["ratios"]["async"] = timings["async"], timings["ratios"]["async"]
        result["cpu_ms"]["async"] = timings["cpu_ms"]["async"]
        result["wire_bytes"]["async"] = wire
    save()
    dist.barrier()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: a background averaging thread must not keep the rank alive


# ---------------------------------------------------------------------- parent: namespaces, shaping, launching
def _ip(*argv):
    try:
        done = subprocess.run(["ip", *argv], capture_output=True, text=True)
    except FileNotFoundError:
        raise OSError("no `ip` command (iproute2)") from None
    if done.returncode:
        raise OSError(f"`ip {' '.join(argv)}`: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _remove_leftovers():
    """Namespaces of earlier runs whose process is gone (a crash or a kill -9 skipped their teardown)."""
    try:
        listed = _ip("netns", "list")
    except OSError:
        return
    for line in listed.splitlines():
        match = re.match(rf"({re.escape(NAMESPACE_PREFIX)}(\d+)-[01])\b", line)
        if match and not os.path.exists(f"/proc/{match[2]}"):
            try:
                _ip("netns", "del", match[1])
            except OSError as error:
                print(f"could not remove leftover namespace {match[1]}: {error}", file=sys.stderr)


def _create_link(namespaces, veths):
    """The second namespace (main() made the first, as its permission check) and the veth pair."""
    _ip("netns", "add", namespaces[1])
    _ip("link", "add", veths[0], "netns", namespaces[0], "type", "veth", "peer", "name", veths[1], "netns", namespaces[1])
    for ns, veth, address in zip(namespaces, veths, ADDRESSES):
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", veth)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "set", veth, "up")


def _shape(namespaces, veths, tbf):
    """Both ends, so that both directions are limited; ``tbf=None`` removes the shaping."""
    for ns, veth in zip(namespaces, veths):
        if tbf is None:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", veth, "root"], capture_output=True)
        else:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", veth, "root", "tbf", *tbf],
                           check=True)


def _run_ranks(namespaces, veths, config, time_limit):
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=veths[rank], OMP_NUM_THREADS="1")
        command = ["ip", "netns", "exec", namespaces[rank], sys.executable, os.path.abspath(__file__),
                   "--worker", json.dumps(dict(config, rank=rank))]
        procs.append(subprocess.Popen(command, env=env))
    deadline = time.monotonic() + time_limit
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one rank failed: the other would wait for it until gloo's timeout
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0, 0]:
        return f"ranks exited with {codes}" + (f" (killed after --time-limit {time_limit:g} s)" if time.monotonic() >= deadline else "")
    return None


def _hardware() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            model = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores ({model}), Linux {platform.release()}"


def report(result) -> str:
    shaping = "no tc (unlimited veth)" if result["tbf"] is None else "tbf " + " ".join(result["tbf"]) + " on both veth ends"
    lines = [f"## {result['rate']}: {shaping}; gloo send measured {result['link_MBps']:.0f} MB/s "
             f"({result['link_MBps'] * MB * 8 / 1e9:.2f} Gbit/s)", "",
             "| variant | ms/step | vs DDP [quartiles] | CPU ms/step | MB on the wire/step |",
             "|---|---:|---:|---:|---:|"]
    for name, ms in result["ms"].items():
        low, mid, high = result["ratios"][name]
        wire = result["wire_bytes"].get(name)
        cpu = result.get("cpu_ms", {}).get(name)
        lines.append(f"| {name} | {ms:.1f} | {mid:.3f}x [{low:.2f}-{high:.2f}] | "
                     f"{'n/a' if cpu is None else f'{cpu:.1f}'} | {'n/a' if wire is None else f'{wire / MB:.2f}'} |")
    lines.append("CPU ms/step: rank 0's process, all threads (gloo's too), median; near ms/step, the step "
                 "is bound by compute, not by the link")
    for name, (peer, (low, mid, high)) in result.get("peer_ratios", {}).items():
        lines.append(f"{name} vs {peer} (the same optimizer over DDP): {mid:.3f}x [{low:.2f}-{high:.2f}]")
    lines += [f"note: {note}" for note in result["notes"]]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", type=_rate, default=["1gbit", "10gbit"], help="tc rates; 'none': no shaping")
    parser.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v not in ("qadam_unfused", "low_precision_decentralized_fused")], choices=list(VARIANTS),
                        help="ddp is always run first (the baseline)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    parser.add_argument("--wire-steps", type=int, default=3, help="steps over which the bytes are counted")
    parser.add_argument("--message-size", type=int, default=4 * MB, help="bucket bytes (bagua message_size, DDP bucket_cap_mb)")
    parser.add_argument("--time-limit", type=float, default=600, help="seconds per rate before the ranks are killed")
    parser.add_argument("--json", help="also write the raw numbers here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    args.variants = ["ddp"] + [v for v in args.variants if v != "ddp"]

    pid = os.getpid()
    namespaces = [f"{NAMESPACE_PREFIX}{pid}-{i}" for i in (0, 1)]
    veths = [f"bgv{pid}{side}" for side in "ab"]  # interface names: at most 15 characters
    _remove_leftovers()
    try:
        _ip("netns", "add", namespaces[0])
    except OSError as error:
        print(f"skipped: network namespaces not permitted here ({error}); run as root on Linux")
        return 0
    param_bytes = sum(p.numel() * p.element_size() for p in build_model(args.width, args.depth).parameters())
    print(f"# bench_slow_link: 2 ranks in network namespaces joined by a veth pair, gloo, CPU: {_hardware()}, "
          f"1 thread per rank; MLP {args.depth}x{args.width} ({param_bytes / MB:.1f} MB fp32 gradients), "
          f"batch {args.batch}/rank, bucket {args.message_size / MB:g} MB; median of {args.rounds} rounds x "
          f"{args.steps} steps; vs DDP: median over rounds of (variant / DDP in the same round), [quartiles]\n",
          flush=True)
    results, failed, out = [], False, os.path.join(tempfile.gettempdir(), f"bench_slow_link_{pid}.json")
    try:
        _create_link(namespaces, veths)
        for index, rate in enumerate(args.rates):
            tbf = None if rate == "none" else tbf_settings(rate)
            _shape(namespaces, veths, tbf)
            if os.path.exists(out):
                os.remove(out)
            config = dict(vars(args), worker=None, json=None, rate=rate, tbf=tbf, port=BASE_PORT + index,
                          param_bytes=param_bytes, out=out)
            print(f"[{rate}] starting the two ranks", file=sys.stderr, flush=True)
            failure = _run_ranks(namespaces, veths, config, args.time_limit)
            failed = failed or failure is not None
            if not os.path.exists(out):
                print(f"## {rate}: no result ({failure})\n", flush=True)
                continue
            with open(out) as handle:
                result = json.load(handle)
            if failure:
                result["notes"].append(f"the run did not finish ({failure}): rows measured before that")
            results.append(result)
            print(report(result) + "\n", flush=True)
    finally:
        for ns in namespaces:
            try:
                _ip("netns", "del", ns)
            except OSError:
                pass
        if os.path.exists(out):
            os.remove(out)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"hardware": _hardware(), "param_bytes": param_bytes, "args": vars(args), "rates": results},
                      handle, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
