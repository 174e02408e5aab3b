"""Run a function on several gloo ranks in fresh processes, with hard timeouts, and collect results.

Workers get ``(rank, world_size, *args)`` after ``init_process_group`` (gloo, CPU, with a
timeout); whatever they return or raise is written to a file, so a crashed, killed or hung
rank can never hang the test: the parent kills every process at the deadline. With
``exit_normally=True`` a worker then leaves like a script does (``atexit`` handlers, interpreter
teardown), and :attr:`RankResult.exit_seconds` says how long that took.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing.connection
import os
import random
import signal
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.multiprocessing as mp


def gloo_threads() -> List[str]:
    """Names of this process's threads that belong to gloo, sorted (Linux: /proc; torch names them).

    What the exit tests read at the start of the interpreter's teardown: a gloo thread still running
    then is the cause of the exit abort (see ``destroy_process_groups_at_exit``)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as handle:
                names.append(handle.read().strip())
        except OSError:
            pass
    return sorted(name for name in names if "gloo" in name)


def _ephemeral_ports_start() -> int:
    """The first port of the range the kernel hands out for binds to port 0 (Linux; else IANA's 49152)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


_PORTS = random.Random()  # seeded from the OS: each pytest-xdist worker draws its own ports


def free_port() -> int:
    """A TCP port free now, for a store the test's ranks will bind a second or two later (when their
    processes have started). Chosen below the ephemeral range: every socket bound to port 0 meanwhile
    (gloo's connections, another test's on the other pytest-xdist worker) comes from that range, so
    none of them can take it; at random, so two workers do not try the same ports in turn."""
    start = _ephemeral_ports_start()
    low = min(20000, start // 2)
    for _ in range(200):
        port = _PORTS.randrange(low, start)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # (a range that busy: any free port)
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error_type: Optional[str] = None  # qualified class name of what the worker raised
    error: Optional[str] = None
    traceback: Optional[str] = None
    exitcode: Optional[int] = None
    hung: bool = False
    #: seconds from the worker's return to the end of its process (``exit_normally=True`` only)
    exit_seconds: Optional[float] = None
    #: every thread's Python stack when a hung worker was stopped (faulthandler), to see where it hung
    stacks: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error_type is None and not self.hung and self.exitcode == 0

    def describe(self) -> str:
        if self.hung:
            where = f"; its threads' Python stacks then:\n{self.stacks}" if self.stacks else ""
            return f"rank {self.rank}: still running at the deadline (killed){where}"
        if self.error_type:
            return f"rank {self.rank}: {self.error_type}: {self.error}\n{self.traceback}"
        return f"rank {self.rank}: exit code {self.exitcode}, no result"


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, env: Dict[str, str],
           result_dir: str, pg_timeout: float, exit_normally: bool = False) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % int(env.get("LOCAL_WORLD_SIZE", world_size))))
    torch.set_num_threads(1)
    # a worker still running at the deadline is asked for its threads' stacks first (see run_ranks)
    stacks = open(os.path.join(result_dir, f"stacks{rank}.txt"), "w")  # (open until the process ends)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    result: Dict[str, Any] = {}
    try:
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        result["value"] = fn(rank, world_size, *args)
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        result["error_type"] = f"{type(error).__module__}.{type(error).__qualname__}"
        result["error"] = str(error)
        result["traceback"] = traceback.format_exc()
    result["returned_at"] = time.time()
    torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    if exit_normally:
        return  # atexit handlers and interpreter teardown run: the parent times them
    # Skip interpreter teardown: a peer may be gone and gloo's destructors may block.
    os._exit(0)


def run_ranks(fn: Callable, world_size: int = 2, args: tuple = (), *, timeout: float = 240.0,
              pg_timeout: float = 60.0, env: Optional[Dict[str, str]] = None,
              exit_normally: bool = False) -> List[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; never hangs.

    ``exit_normally``: after ``fn`` returns, each process exits as a script does (atexit
    handlers, interpreter teardown) instead of skipping teardown; ``exit_seconds`` of each
    result is how long that took (a process still exiting at ``timeout`` is killed: ``hung``).
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    env = {k: str(v) for k, v in (env or {}).items()}
    with tempfile.TemporaryDirectory() as result_dir:
        procs = [
            ctx.Process(target=_entry, args=(rank, world_size, port, fn, args, env, result_dir, pg_timeout, exit_normally),
                        daemon=True)
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        ended_at: List[Optional[float]] = [None] * world_size
        running = {proc.sentinel: rank for rank, proc in enumerate(procs)}
        while running and deadline > time.monotonic():
            for sentinel in multiprocessing.connection.wait(list(running), timeout=deadline - time.monotonic()):
                ended_at[running.pop(sentinel)] = time.time()
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))  # an ended one is reaped at once
        hung = [proc.is_alive() for proc in procs]
        if any(hung):  # where each hung one is, before it is killed
            for proc in procs:
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1.0)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        results = []
        for rank, proc in enumerate(procs):
            path = os.path.join(result_dir, f"rank{rank}.pt")
            result = RankResult(rank, exitcode=proc.exitcode, hung=hung[rank])
            stacks = os.path.join(result_dir, f"stacks{rank}.txt")
            if hung[rank] and os.path.exists(stacks):
                with open(stacks) as handle:
                    result.stacks = handle.read()[-6000:] or None
            if os.path.exists(path):
                saved = torch.load(path, weights_only=False)
                result.value = saved.get("value")
                result.error_type = saved.get("error_type")
                result.error = saved.get("error")
                result.traceback = saved.get("traceback")
                if exit_normally and ended_at[rank] is not None and "returned_at" in saved:
                    result.exit_seconds = ended_at[rank] - saved["returned_at"]
            elif not hung[rank] and result.exitcode == 0:
                result.error_type, result.error = "missing", "the worker exited without writing a result"
            results.append(result)
    return results


def values(results: List[RankResult]) -> List[Any]:
    """Every rank's return value, or an AssertionError with every rank's failure."""
    failed = [r for r in results if not r.ok]
    if failed:
        raise AssertionError("ranks failed:\n" + "\n".join(r.describe() for r in failed))
    return [r.value for r in results]


# ---------------------------------------------------------------------- scenario batches
def run_scenarios(rank: int, world_size: int, scenarios: Dict[str, Callable], names: List[str]) -> Dict[str, Any]:
    """Run several named scenarios in one process group; one failing does not hide the others.

    Returns ``name -> ("ok", value)`` or ``("error", traceback)``. A barrier between
    scenarios keeps ranks aligned after a failure that happened before any collective.
    """
    out: Dict[str, Any] = {}
    for name in names:
        try:
            out[name] = ("ok", scenarios[name](rank, world_size))
        except BaseException:  # noqa: BLE001
            out[name] = ("error", traceback.format_exc())
        try:
            torch.distributed.barrier()
        except BaseException:  # noqa: BLE001
            break
    return out


def scenario_value(results: List[RankResult], name: str) -> List[Any]:
    """Per-rank values of one scenario from :func:`run_scenarios`; AssertionError if any rank failed."""
    per_rank = values(results)
    errors = [f"rank {rank}:\n{outcome[1]}" for rank, res in enumerate(per_rank)
              for outcome in [res.get(name, ("error", "scenario did not run (an earlier one broke the group)"))]
              if outcome[0] != "ok"]
    if errors:
        raise AssertionError(f"scenario {name!r} failed:\n" + "\n".join(errors))
    return [res[name][1] for res in per_rank]


def descendants(pid: int) -> List[int]:
    """The processes under ``pid`` (children, theirs, ...), read from Linux's /proc; [] elsewhere."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def signal_all(pids: List[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except OSError:  # gone already
            pass


def run_cases_in_worker(out_dir: str, cases: List[str], run_case: Callable[[str], Dict[str, Any]],
                        before_each: Optional[Callable[[], None]] = None,
                        extra: Optional[Callable[[], Dict[str, Any]]] = None) -> None:
    """The loop of a :func:`run_torchrun_cases` worker: ``run_case(case)`` for each case, and rank 0
    writes ``out_dir/<case>.json`` (plus ``seconds`` and ``extra()``).

    A case that raises on a rank ends that rank's process at once (exit code 1), after writing
    the traceback to ``<case>.crash-rank<r>.json`` and to stderr: torchrun then stops the other ranks and the
    test fails with the traceback. Going on with the next case instead hung the run, when only
    one rank raised: the other was still in the case's collectives while this one started the
    next case's (seen: a rank whose output pipe broke mid-case; 18 minutes in two different DDP
    collectives, gloo's 120 s timeout never fired)."""
    import json
    import sys

    import torch.distributed as dist

    for case in cases:
        started = time.time()
        if before_each is not None:
            before_each()
        try:
            result = run_case(case)
        except BaseException:  # noqa: BLE001 - reported, then this rank ends
            crash = traceback.format_exc()[-3000:]
            rank = dist.get_rank() if dist.is_initialized() else 0
            with open(os.path.join(out_dir, f"{case}.crash-rank{rank}.json"), "w") as handle:
                json.dump({"crash": crash}, handle)
            print(f"case {case} raised on rank {rank}:\n{crash}", file=sys.stderr, flush=True)
            os._exit(1)
        result["seconds"] = round(time.time() - started, 2)
        result.update(extra() if extra is not None else {})
        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(os.path.join(out_dir, f"{case}.json"), "w") as handle:
                json.dump(result, handle)
    if dist.is_initialized():
        dist.barrier()


def run_torchrun_cases(script, out_dir, cases: List[str], timeout: float) -> Dict[str, Any]:
    """``torchrun --standalone --nproc_per_node 2 script out_dir *cases`` on gloo/CPU, then the JSON
    each case wrote as ``out_dir/<case>.json``. A timeout or a non-zero exit fails the test with
    the run's output (never hangs: ``timeout`` seconds at most, plus 30 to collect the stacks).

    At the deadline torchrun and every process under it get SIGABRT first: with
    ``PYTHONFAULTHANDLER`` set each prints every thread's Python stack, so a hang that shows once
    in many runs says where it hung (the cases that finished wrote their JSON). Then SIGKILL, also
    for a worker torchrun left behind (each runs in a session of its own)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(script), str(out_dir), *cases]
    proc = subprocess.Popen(command, env=env, cwd=str(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        finished = sorted(path.stem for path in Path(out_dir).glob("*.json"))
        # torchrun starts each worker in a session of its own: signal the processes, not a group
        processes = [proc.pid, *descendants(proc.pid)]
        signal_all(processes, signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            signal_all([proc.pid, *descendants(proc.pid), *processes], signal.SIGKILL)
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a process out of reach holds the pipes: give up reading
                stdout, stderr = "", "(no output: the pipes stayed open after every process was killed)"
        signal_all(processes, signal.SIGKILL)  # a worker torchrun left behind
        pytest.fail(f"torchrun did not finish in {timeout}s; cases finished: {finished}; its output, then "
                    f"every thread's stack at the deadline:\n{stdout[-3000:]}\n{stderr[-30000:]}")
    done = subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
    if done.returncode != 0:
        crashes = [f"{path.stem}: {json.loads(path.read_text())['crash']}"
                   for path in sorted(Path(out_dir).glob("*.crash-rank*.json"))]
        pytest.fail(f"torchrun exited with {done.returncode}; cases that raised: {crashes}\n"
                    f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    found = {}
    for case in cases:
        path = Path(out_dir) / f"{case}.json"
        assert path.is_file(), f"the worker wrote no result for {case}:\n{done.stderr[-3000:]}"
        found[case] = json.loads(path.read_text())
    return found


def case_result(results: Dict[str, Any], name: str) -> Any:
    """One case's result from :func:`run_torchrun_cases`; fails with its traceback if it crashed."""
    result = results[name]
    assert "crash" not in result, f"{name} crashed:\n{result['crash']}"
    return result


def fsdp2_runs_on_cpu() -> bool:
    """FSDP2's forward and backward run on CPU (gloo): they record events on CPU streams, which
    ``torch.cpu.Stream`` can do from torch 2.7 or later (2.5.1 and 2.6.0 fail with "'Stream' object has
    no attribute 'record_event'"; 2.10.0 and later checked to work)."""
    return hasattr(torch.cpu.Stream, "record_event")
