"""Issue 14 item 2: ``async`` model averaging (background rounds over its own process group).

Rounds are timing-dependent, so the reference is an invariant that holds for any timing: with a
loss linear in the weights every rank's gradient is a constant of its data, and averaging rounds
applied as corrections (``w += avg - snapshot``) never lose or double a local update. So after
``abort()`` (which ends with a synchronous average) every rank must hold exactly
``w0 - lr * mean over ranks of (sum of its gradients)``, computed here with plain tensors, even
though rounds ran while training went on. Setting ``w = avg`` instead (losing the steps taken
during a round) fails it.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from _dist_utils import gloo_threads, run_ranks, values
from bagua_integrations import _torch_compat

LR, STEPS, DIM = 0.1, 30, 64


def _data(rank, step):
    return torch.randn(DIM, generator=torch.Generator().manual_seed(1000 * rank + step))


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(DIM))
        self.b = torch.nn.Parameter(torch.randn(3, 5))

    def forward(self, x):
        return (self.w * x).sum() + self.b.sum() * x[0]


def _train(rank, world, sleep_s=0.004, interval_ms=0, warmup=2, watch=False, fused=False):
    from bagua_integrations import bagua_init, fuse_optimizer

    model = Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if fused:
        fuse_optimizer(optimizer)
    wrapped, _ = bagua_init(model, optimizer, "async", sync_interval_ms=interval_ms, warmup_steps=warmup, timeout=30)
    algorithm = wrapped.algorithm
    changed_inside_a_step = []
    for step in range(STEPS):
        x = _data(rank, step)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        wrapped(x).backward()
        time.sleep(sleep_s * (1 + rank))  # rank 1 is the slow one: rounds overlap many steps
        if watch:  # the weights must not change between forward and the optimizer step
            changed_inside_a_step.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
        optimizer.fuse_step() if fused else optimizer.step()
    rounds_before_abort = algorithm.rounds_applied
    local = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    algorithm.abort(wrapped)
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # aborted: a few more steps start no round
    started = algorithm.rounds_started
    for step in range(STEPS, STEPS + 3):
        optimizer.zero_grad()
        wrapped(_data(rank, step)).backward()
        optimizer.step()
    idle_after_abort = algorithm.rounds_started == started
    algorithm.resume(wrapped)
    for step in range(STEPS + 3, STEPS + 6):
        optimizer.zero_grad()
        wrapped(_data(rank, step)).backward()
        optimizer.step()
        time.sleep(0.01)
    algorithm.abort(wrapped)
    after_resume = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"final": final.clone(), "local": local, "rounds": rounds_before_abort, "idle_after_abort": idle_after_abort,
            "rounds_after_resume": algorithm.rounds_started - started, "after_resume": after_resume.clone(),
            "changed_inside_a_step": any(changed_inside_a_step)}


def _expected(world, steps):
    """w0 - lr * mean over ranks of the sum of their (constant) gradients."""
    model = Linear()
    total_w, total_b = torch.zeros(DIM), torch.zeros(3, 5)
    for rank in range(world):
        for step in range(steps):
            x = _data(rank, step)
            total_w += x
            total_b += x[0]
    return torch.cat([(model.w - LR * total_w / world).detach(), (model.b - LR * total_b / world).detach().reshape(-1)])


@pytest.mark.parametrize("world,fused", [(2, False), (3, True)])
def test_async_rounds_lose_no_update_and_abort_leaves_equal_weights(world, fused):
    results = values(run_ranks(_train, world, _args(fused), timeout=180))
    want = _expected(world, STEPS)
    for result in results:
        assert result["rounds"] >= 2, result["rounds"]  # rounds really ran during training
        torch.testing.assert_close(result["final"], want, rtol=1e-5, atol=1e-5)
        assert torch.equal(result["final"], results[0]["final"])  # every rank the same after abort
        assert result["idle_after_abort"] and result["rounds_after_resume"] >= 1
        torch.testing.assert_close(result["after_resume"], _expected(world, STEPS + 6), rtol=1e-5, atol=1e-5)
    # before the final average the ranks differed (training was not lock-stepped into equality)
    assert not torch.equal(results[0]["local"], results[1]["local"])


def _args(fused):
    return (0.004, 0, 2, False, fused)


def _event_mid_training(rank, world, event, at=15):
    """Train with rounds running; at step ``at`` every rank takes a checkpoint, re-attaches the
    algorithm, or loads the same weights into the model. Returns what the invariant needs."""
    from bagua_integrations import bagua_init

    model = Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    wrapped, _ = bagua_init(model, optimizer, "async", sync_interval_ms=0, warmup_steps=2, timeout=30)
    algorithm = wrapped.algorithm
    saved = None
    for step in range(STEPS):
        if step == at:
            assert algorithm.rounds_started >= 2  # rounds are running when it happens
            if event == "checkpoint":
                wrapped.algorithm_state_dict()
                saved = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
            elif event == "reattach":
                algorithm.reattach(list(model.parameters()), optimizer, algorithm.group)  # as after_step(params=new)
            elif event == "load":
                model.load_state_dict(Linear().state_dict())
        optimizer.zero_grad()
        wrapped(_data(rank, step)).backward()
        time.sleep(0.004 * (1 + rank))
        optimizer.step()
    algorithm.abort(wrapped)
    return {"saved": saved, "final": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()}


def _expected_from(start, world, first, last):
    """``start`` minus lr times the mean over ranks of their gradients of steps first..last-1."""
    total_w, total_b = torch.zeros(DIM), torch.zeros(3, 5)
    for rank in range(world):
        for step in range(first, last):
            x = _data(rank, step)
            total_w += x
            total_b += x[0]
    return start - LR * torch.cat([total_w, total_b.reshape(-1)]) / world


@pytest.mark.parametrize("event", ["checkpoint", "reattach", "load"])
def test_rounds_in_flight_are_settled_when_every_rank_acts_together(event):
    """A round's corrections sum to zero only once every rank has applied it, and the ranks are
    usually a round apart: a checkpoint must hold no half-applied round (the mean of the saved
    weights is exact), re-attaching must not drop one, loaded weights must not get a stale one."""
    results = values(run_ranks(_event_mid_training, 2, (event,), timeout=180))
    w0 = torch.cat([p.detach().reshape(-1) for p in Linear().parameters()])
    if event == "load":
        want = _expected_from(w0, 2, 15, STEPS)
    else:
        want = _expected(2, STEPS)
    for result in results:
        torch.testing.assert_close(result["final"], want, rtol=1e-5, atol=1e-5)
    if event == "checkpoint":
        mean = (results[0]["saved"] + results[1]["saved"]) / 2
        torch.testing.assert_close(mean, _expected(2, 15), rtol=1e-5, atol=1e-5)


def _reattach_many(rank, world, times):
    """Re-attach ``times`` times with rounds running; for each averaging group that died: how
    many tensors were averaged over it, and how many of them were already freed when it died."""
    import weakref

    from bagua_integrations import bagua_init
    from bagua_integrations.distributed import comm

    sent, freed_at_death = {}, []
    average = comm.average

    def recording_average(flat, group=None, timeout=None):
        if group is not None and group is not torch.distributed.group.WORLD and id(group) not in sent:
            sent[id(group)] = []

            def died(key=id(group)):  # runs as the group's Python object goes, before its C++ destructor
                refs = sent.pop(key)
                freed_at_death.append((len(refs), sum(ref() is None for ref in refs)))

            weakref.finalize(group, died).atexit = False
        if id(group) in sent:
            sent[id(group)].append(weakref.ref(flat))
        return average(flat, group, timeout)

    comm.average = recording_average
    model = Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    wrapped, _ = bagua_init(model, optimizer, "async", sync_interval_ms=0, warmup_steps=2, timeout=30)
    algorithm = wrapped.algorithm
    for _ in range(times):
        for step in range(4):
            optimizer.zero_grad()
            wrapped(_data(rank, step)).backward()
            time.sleep(0.001 * (1 + rank))
            optimizer.step()
        algorithm.reattach(list(model.parameters()), optimizer, algorithm.group)
    algorithm.abort(wrapped)
    return freed_at_death


def test_re_attaching_with_rounds_running_never_deadlocks_in_the_groups_destroy():
    """Destroying the averaging group joins gloo's threads while holding the GIL; a gloo thread
    that then frees a finished round's tensor (its last reference) needs the GIL: a deadlock.
    Seen on torch 2.5.1 (gdb) within ~100 re-attaches, when the round's buffers were new each
    round and dropped before the destroy. So every tensor averaged over the group must still be
    alive when the group dies (checked on every torch), and 120 re-attaches must finish."""
    for groups in values(run_ranks(_reattach_many, 2, (120,), timeout=150)):
        assert len(groups) == 120  # one averaging group per attach, each destroyed by the next
        assert sum(averaged for averaged, _ in groups) >= 120  # rounds ran: tensors went over them
        assert [freed for _, freed in groups if freed] == []


def test_async_refuses_settings_of_the_wrong_type_by_name():
    from bagua_integrations.distributed import AlgorithmConfigError, AsyncModelAverage

    for bad in (dict(sync_interval_ms="500"), dict(sync_interval_ms=float("nan")), dict(sync_interval_ms=None),
                dict(warmup_steps=2.5), dict(warmup_steps=float("inf")), dict(timeout="5"), dict(timeout=True)):
        with pytest.raises(AlgorithmConfigError, match=next(iter(bad))):
            AsyncModelAverage(**bad)


def test_weights_never_change_inside_a_step():
    """The background thread never writes the model: rounds are applied between steps only."""
    for result in values(run_ranks(_train, 2, (0.004, 0, 0, True), timeout=180)):
        assert result["rounds"] >= 2 and not result["changed_inside_a_step"]


def _dead_peer(rank, world):
    from bagua_integrations import bagua_init
    from bagua_integrations.distributed import CommunicationError

    model = Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    wrapped, _ = bagua_init(model, optimizer, "async", sync_interval_ms=0, timeout=5)
    start = time.monotonic()
    try:
        for step in range(400):
            if rank == 1 and step == 5:
                import os

                os._exit(3)  # dies without a word
            optimizer.zero_grad()
            wrapped(_data(rank, step)).backward()
            optimizer.step()
            time.sleep(0.005)
        wrapped.algorithm.abort()
    except CommunicationError as error:
        seconds = time.monotonic() - start
        # caught and training goes on: averaging must not stop in silence (the worker is gone)
        later = []
        for step in range(3):
            optimizer.zero_grad()
            wrapped(_data(rank, step)).backward()
            try:
                optimizer.step()
                later.append(None)
            except CommunicationError as again:
                later.append(str(again))
        started = time.monotonic()
        wrapped.algorithm.detach()  # no abort protocol with a gone peer: returns at once
        return {"error": "CommunicationError", "seconds": seconds, "message": str(error), "later": later,
                "detach_seconds": time.monotonic() - started}
    return {"error": None}


def test_a_dead_peer_ends_training_with_a_named_error_within_the_timeout():
    results = run_ranks(_dead_peer, 2, timeout=120, pg_timeout=30)
    survivor = results[0]
    assert survivor.ok, survivor.describe()
    assert survivor.value["error"] == "CommunicationError", survivor.value
    assert survivor.value["seconds"] < 60, survivor.value
    assert all(message and "restart every rank from a checkpoint" in message for message in survivor.value["later"]), survivor.value
    assert survivor.value["detach_seconds"] < 5, survivor.value


def _mismatch(rank, world):
    from bagua_integrations import bagua_init

    model = Linear()
    bagua_init(model, torch.optim.SGD(model.parameters(), lr=LR), "async", sync_interval_ms=100 * (rank + 1), timeout=30)


def test_ranks_with_different_intervals_fail_by_name_on_every_rank():
    for result in run_ranks(_mismatch, 2, timeout=120, pg_timeout=30):
        assert result.error_type == "bagua_integrations.distributed.errors.ModelMismatchError", result.describe()
        assert "sync_interval_ms" in result.error


def test_bad_settings_are_refused():
    from bagua_integrations.distributed import AlgorithmConfigError, get_algorithm

    with pytest.raises(AlgorithmConfigError, match="peer_selection_mode"):
        get_algorithm("async", peer_selection_mode="shift_one")
    with pytest.raises(AlgorithmConfigError, match=">= 0"):
        get_algorithm("AsyncModelAverage", sync_interval_ms=-1)


# ---------------------------------------------------------------------- leaving the process (issue 29)
EXIT_TIMEOUT = 2.0  # the algorithm's timeout in the exit tests; the process group's is 30 s
EXIT_MARGIN = 5.0  # generous, for a loaded machine: what is measured is a hang, not a speed


def _leave(rank, world, log_dir, abort_at_end, peer_stays):
    """Train with rounds running, then return: the process exits as a script does (atexit) and the
    parent times it. Warnings (the exit abort warns where it cannot finish) go to a file per rank.
    ``peer_stays``: rank 1 stays alive without reaching its own exit (a long evaluation or save)
    until rank 0's process is gone, so rank 0 leaves with a peer that never comes."""
    import gc
    import os
    import warnings

    from bagua_integrations import bagua_init

    log = os.path.join(log_dir, f"warnings{rank}.txt")

    def record(message, category, filename, lineno, file=None, line=None):
        with open(log, "a") as handle:
            handle.write(f"{category.__name__}: {message}\n")

    warnings.showwarning = record
    warnings.simplefilter("always")
    model = Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    wrapped, optimizer = bagua_init(model, optimizer, "async", sync_interval_ms=0, warmup_steps=2, timeout=EXIT_TIMEOUT)
    for step in range(STEPS):
        optimizer.zero_grad()
        wrapped(_data(rank, step)).backward()
        time.sleep(0.004 * (1 + rank))
        optimizer.step()
    rounds = wrapped.algorithm.rounds_started
    if abort_at_end:
        wrapped.algorithm.abort()  # as HF's callback does at the end of train()
    # a script's training function returns: its model and optimizer go, and the garbage collector
    # may free them before the exit (here always); the rounds they left running must still end
    # at exit (a weak reference from the exit hook lost them: no abort, no warning, a SIGABRT)
    del wrapped, optimizer, model
    gc.collect()
    if peer_stays and rank == 1:
        store = _torch_compat.default_store()  # served by rank 0's process: fails once it is gone
        give_up = time.monotonic() + 60
        try:
            while time.monotonic() < give_up:
                store.check(["bagua_integrations/test/never-set"])
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - rank 0 has exited
            pass
    return {"rounds": rounds}


def _exit_warnings(log_dir, rank):
    import os

    path = os.path.join(log_dir, f"warnings{rank}.txt")
    return open(path).read() if os.path.exists(path) else ""


def _threads_left_at_exit(rank, world, log_dir, algorithm):
    """Train, then leave as a script does; the last exit handler (registered first) writes which
    gloo threads still run when the interpreter's teardown begins."""
    import atexit
    import gc
    import json
    import os

    import torch.distributed.nn.functional  # noqa: F401 - as torch.optim does: binds group=WORLD now

    from bagua_integrations import bagua_init

    def record_at_exit():
        with open(os.path.join(log_dir, f"threads{rank}.json"), "w") as handle:
            json.dump({"before": before, "at_teardown": gloo_threads()}, handle)

    atexit.register(record_at_exit)
    model = Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rounds = dict(sync_interval_ms=0, warmup_steps=2)
    extra = {"async": rounds, "async, model dropped": rounds, "hierarchical": dict(hierarchical_reduce=True),
             "own group": dict(process_group=torch.distributed.new_group())}  # the program keeps no reference
    wrapped, optimizer = bagua_init(model, optimizer, "async" if algorithm.startswith("async") else "gradient_allreduce",
                                    **extra.get(algorithm, {}))
    for step in range(8):
        optimizer.zero_grad()
        wrapped(_data(rank, step)).backward()
        optimizer.step()
    before = gloo_threads()
    if algorithm == "async, model dropped":  # a training function returned, a collection ran
        del wrapped, optimizer, model
        gc.collect()
    return len(before)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from Linux's /proc")
@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "async", "async, model dropped", "hierarchical", "own group"])
def test_gloo_threads_are_joined_before_the_interpreter_tears_down(tmp_path, algorithm):
    """The exit race's cause, checked directly: a gloo worker thread still running when Python
    finalizes can drop the last reference to a Python tensor there and kill the rank with
    ``terminate called without an active exception`` (1 run in about 60 of the exit test above on
    torch 2.14.1). Destroying the groups at exit joins those threads only when nothing else keeps
    a group: neither this package's caches (async's own group was kept by them) nor torch's
    ``torch.distributed.nn.functional``, which binds ``group=WORLD`` when it is imported after
    ``init_process_group`` (building any torch optimizer imports it), nor the node groups of a
    hierarchical reduction (4 ranks as 2 nodes x 2), nor a model the loop is done with (its
    gradient hooks held it in a cycle the garbage collector could not see), with a group of its own.
    async's rounds end at exit even when the garbage collector freed its model first (its exit
    hook held it weakly: the rounds' group, and its threads, outlived the model into the teardown)."""
    import json

    hierarchy = dict(world_size=4, env={"LOCAL_WORLD_SIZE": 2}) if algorithm == "hierarchical" else dict(world_size=2)
    results = run_ranks(_threads_left_at_exit, args=(str(tmp_path), algorithm), timeout=120, pg_timeout=30,
                        exit_normally=True, **hierarchy)
    for result in results:
        assert result.ok, result.describe()
        if not result.value:
            pytest.skip("this torch does not name gloo's threads")
        with open(tmp_path / f"threads{result.rank}.json") as handle:
            threads = json.load(handle)
        assert threads["before"], threads
        assert threads["at_teardown"] == [], f"rank {result.rank}: gloo threads left running into teardown: {threads}"


def _switch_away_from_async(rank, world):
    from bagua_integrations.distributed import ModelSwitchWrapper

    model = Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    # the world group's worker threads name themselves when they first run: after a collective they
    # have (measured before one, the baseline missed them 1 time in 3, and "after" had two more)
    torch.distributed.barrier()
    world_only = gloo_threads()
    wrapper = ModelSwitchWrapper(model, optimizer).switch_to("async", sync_interval_ms=0, warmup_steps=1)
    for step in range(12):
        optimizer.zero_grad()
        wrapper(_data(rank, step)).backward()
        optimizer.step()
    with_async = gloo_threads()
    wrapper.switch_to("gradient_allreduce")
    return {"world": world_only, "async": with_async, "after": gloo_threads()}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from Linux's /proc")
def test_switching_away_from_async_joins_its_groups_threads():
    """async's own process group is destroyed when it detaches: its gloo threads end then, not at
    the process's exit (this package's record of the group kept it, and them, alive)."""
    for threads in values(run_ranks(_switch_away_from_async, 2, timeout=120, pg_timeout=30)):  # (every rank's failure)
        if not threads["world"]:
            pytest.skip("this torch does not name gloo's threads")
        assert len(threads["async"]) > len(threads["world"]), threads  # its own group had threads
        assert threads["after"] == threads["world"], threads


def test_exit_with_rounds_running_is_prompt_when_every_rank_exits(tmp_path):
    """The normal end of a loop that never aborts (fairseq): every rank's exit abort finishes the
    rounds together, in well under the timeout, without a warning."""
    results = run_ranks(_leave, 2, (str(tmp_path), False, False), timeout=120, pg_timeout=30, exit_normally=True)
    for result in results:
        assert result.ok, result.describe()
        assert result.value["rounds"] >= 2, result.value  # rounds were running at exit
        assert result.exit_seconds < EXIT_MARGIN, (result.rank, result.exit_seconds)
        assert "could not finish" not in _exit_warnings(tmp_path, result.rank)


@pytest.mark.skipif(not _torch_compat.gloo_honours_collective_timeouts(),
                    reason="before torch 2.9 gloo runs a collective to the process group's timeout (documented)")
def test_exit_with_a_peer_that_never_comes_warns_within_the_timeout(tmp_path):
    """Issue 29: rank 0 leaves with rounds running while rank 1 is alive elsewhere. The exit abort
    gives up after ``timeout`` with a warning; the process must then end, not wait in gloo until
    the process group's own timeout (30 s here, 30 minutes by default) for the collective it gave up."""
    results = run_ranks(_leave, 2, (str(tmp_path), False, True), timeout=150, pg_timeout=30, exit_normally=True)
    leaving = results[0]
    assert leaving.ok, leaving.describe()
    assert leaving.exit_seconds < EXIT_TIMEOUT + EXIT_MARGIN, f"rank 0 took {leaving.exit_seconds:.1f} s to exit"
    assert "async model averaging could not finish its rounds at exit" in _exit_warnings(tmp_path, 0)


def test_exit_after_abort_waits_for_no_peer(tmp_path):
    """Aborted at the end of training (HF's callback) and no round since: every rank already holds
    the same weights and no round is running, so the exit has nothing to finish with its peers and
    rank 0 leaves at once while rank 1 is still busy (a save, an evaluation), without a warning."""
    results = run_ranks(_leave, 2, (str(tmp_path), True, True), timeout=150, pg_timeout=30, exit_normally=True)
    leaving = results[0]
    assert leaving.ok, leaving.describe()
    assert leaving.exit_seconds < EXIT_MARGIN, f"rank 0 took {leaving.exit_seconds:.1f} s to exit"
    assert "could not finish" not in _exit_warnings(tmp_path, 0)
