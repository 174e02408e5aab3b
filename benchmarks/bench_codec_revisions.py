"""The uint8 codec's bucket calls (bytegrad, qadam, low_precision_decentralized), this checkout
against another git revision's, side by side in one process.

    python benchmarks/bench_codec_revisions.py 30d5308                  # a 4 MB bucket, 2 chunks
    python benchmarks/bench_codec_revisions.py HEAD~1 --elements 6000000 --rounds 100

For changes around the kernels (the eager work a call does besides them), which separate runs of
``bench_distributed.py --codec-only`` cannot resolve on a shared machine: here both codecs run on the
same tensors, compiled, one thread, every call of both in a shuffled order each round, so background
load hits them alike; the table shows medians and their ratio. The bucket's end is not a whole block
(as most buckets' are not), so the partial last block is included. The other revision's
``bytegrad.py`` is loaded as a module of this package (its relative imports resolve to this checkout),
so it must work with this checkout's other modules; both must give the same bytes, which is checked.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # benchmark this checkout, whatever an editable install elsewhere points at

from bagua_integrations.distributed.algorithms import bytegrad  # noqa: E402

CODEC_PATH = "bagua_integrations/distributed/algorithms/bytegrad.py"


def codec_at(revision: str):
    """The ``bytegrad`` module of ``revision``, as a sibling of this checkout's (not registered as an algorithm)."""
    source = subprocess.run(["git", "show", f"{revision}:{CODEC_PATH}"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout
    source = source.replace("@register_algorithm(", "@(lambda *names, **options: (lambda cls: cls))(")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as handle:
        handle.write(source)
    name = f"{bytegrad.__package__}._bytegrad_at_{revision.replace('~', '_').replace('^', '_')}"
    spec = importlib.util.spec_from_file_location(name, handle.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    os.unlink(handle.name)
    return module


def calls(module, elements: int):
    """name -> call, for one codec module, and the tensors the checks compare."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(elements, generator=gen)
    copy = x + torch.randn(elements, generator=gen) * 1e-3
    momentum = torch.randn(elements, generator=gen)
    out = torch.empty(elements)
    grads = module.MinMaxUInt8(zero_exact=True, block=bytegrad.BLOCK, compile=True)  # bytegrad, qadam
    weights = module.MinMaxUInt8(zero_exact=False, block=bytegrad.BLOCK, compile=True)  # low_precision_decentralized
    chunk = grads.padded_length(-(-elements // 2))
    sent = grads.encode_chunks(x, 2)
    gathered = torch.cat([grads.average_chunks(sent, chunk)] * 2)
    return {
        "encode (bytegrad)": lambda: grads.encode_chunks(x, 2),
        "encode the momentum folded (qadam)": lambda: grads.encode_chunks(x, 2, momentum=(momentum, 0.9)),
        "average 2 ranks' chunks + encode": lambda: grads.average_chunks(sent, chunk),
        "decode into the bucket": lambda: grads.decode_into(gathered, out, chunk),
        "encode weights - copy (low_precision_decentralized)": lambda: weights.encode_chunks(x, 2, minus=copy),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revision", help="the git revision to compare against (e.g. HEAD~1)")
    parser.add_argument("--elements", type=int, default=(1 << 20) + 1000, help="fp32 elements in the bucket")
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = {"before": calls(codec_at(args.revision), args.elements), "after": calls(bytegrad, args.elements)}
    for name in runs["after"]:
        assert torch.equal(torch.as_tensor(runs["before"][name]()), torch.as_tensor(runs["after"][name]())), name
    order = [(side, name) for side in runs for name in runs[side]]
    for side, name in order * 3:  # compiled and warm
        runs[side][name]()
    times = {key: [] for key in order}
    for _ in range(args.rounds):
        random.shuffle(order)
        for side, name in order:
            start = time.perf_counter()
            runs[side][name]()
            times[(side, name)].append(time.perf_counter() - start)
    print(f"# uint8 codec, {args.revision} (before) against this checkout (after): one bucket of {args.elements} fp32 "
          f"({args.elements * 4 / 1e6:.1f} MB, 2 chunks), compiled, 1 thread; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}; "
          f"medians of {args.rounds} shuffled rounds\n")
    print("| call | before, us | after, us | after / before |\n|---|---:|---:|---:|")
    for name in runs["after"]:
        before = statistics.median(times[("before", name)]) * 1e6
        after = statistics.median(times[("after", name)]) * 1e6
        print(f"| {name} | {before:.0f} | {after:.0f} | {after / before:.3f}x |")


if __name__ == "__main__":
    main()
