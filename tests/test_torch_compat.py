"""bagua_integrations/_torch_compat.py on the installed torch.

Each test exercises one compat function the way the package uses it. When a torch release
moves the private API underneath, the failure names the function and the torch version, so
the fix starts in that one module.
"""

from __future__ import annotations

import contextlib
import math
import operator
import types
import warnings

import pytest
import torch

from bagua_integrations import _torch_compat as compat

WHERE = "bagua_integrations/_torch_compat.py"


def changed(name: str, detail: str = "") -> str:
    """The failure message: which function, which torch, what was seen."""
    return f"{name}: torch {torch.__version__} changed private API used by {WHERE}" + (f" ({detail})" if detail else "")


@pytest.fixture
def private_api(private_api_guard):
    """``with private_api("fn"):`` -- any error inside fails with :func:`changed`'s message."""
    return lambda name: private_api_guard(lambda detail: changed(name, detail))


def _scheduler_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, UserWarning)
            and ("overridden" in str(w.message) or "before `optimizer.step()`" in str(w.message))]


# ------------------------------------------------------------------------------ unwrapped_step
def test_unwrapped_step_of_adamw_is_the_raw_function_without_grad_mode(private_api):
    name = "unwrapped_step"
    with private_api(name):
        param = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.AdamW([param], lr=0.1)  # the first instance installs torch's hook wrapper
        assert getattr(torch.optim.AdamW.step, "hooked", False), changed(name, "AdamW.step carries no 'hooked' mark")
        step, strips_grad_mode = compat.unwrapped_step(torch.optim.AdamW)
        assert strips_grad_mode is True, changed(name, "torch's _use_grad wrapper was not recognised on AdamW.step")
        # AdamW's own step, or Adam's where AdamW inherits it (torch >= 2.8)
        assert step.__qualname__ in ("AdamW.step", "Adam.step"), changed(name, f"got {step.__qualname__}")
        assert not hasattr(step, "hooked") and not hasattr(step, "__wrapped__"), changed(name, "a wrapper is left")
        # the raw function is AdamW's step: called under no_grad it updates like opt.step()
        twin = torch.nn.Parameter(torch.ones(3))
        twin_opt = torch.optim.AdamW([twin], lr=0.1)
        param.grad, twin.grad = torch.full((3,), 0.5), torch.full((3,), 0.5)
        opt.step()
        with torch.no_grad():
            step(twin_opt)
        assert torch.equal(param, twin), changed(name, "the unwrapped step updates differently")


def test_unwrapped_step_of_a_plain_subclass_returns_its_own_step(private_api):
    name = "unwrapped_step"

    class Plain(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1))

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(p.grad, alpha=-group["lr"])

    raw = Plain.__dict__["step"]
    with private_api(name):
        Plain([torch.nn.Parameter(torch.ones(2))])  # installs the hook wrapper on Plain.step
        assert Plain.step is not raw, changed(name, "torch no longer wraps a subclass's step on first use")
        step, strips_grad_mode = compat.unwrapped_step(Plain)
        assert step is raw, changed(name, f"got {step!r}, not the subclass's own step")
        assert strips_grad_mode is False, changed(name, "a plain step was taken for torch's _use_grad wrapper")


# ------------------------------------------------------------------------------ forget_float_specializations
def test_forget_float_specializations_clears_dynamos_memory(private_api):
    name = "forget_float_specializations"
    try:
        from torch._dynamo.symbolic_convert import TensorifyState
    except ImportError:
        if torch.torch_version.TorchVersion(torch.__version__) >= "2.6":  # it came with torch 2.6
            pytest.fail(changed(name, "torch._dynamo.symbolic_convert.TensorifyState is gone"))
        pytest.skip(f"torch {torch.__version__} predates TensorifyState: nothing to forget")
    with private_api(name):
        assert callable(getattr(TensorifyState, "clear", None)), changed(name, "TensorifyState.clear is gone")
        TensorifyState.specialize("zf_bagua_test")
        assert TensorifyState.should_specialize("zf_bagua_test")
        compat.forget_float_specializations()
        assert not TensorifyState.should_specialize("zf_bagua_test"), changed(name, "the specialization survived")


# ------------------------------------------------------------------------------ compiled_steps_unsupported
@pytest.mark.parametrize("path, oldest", [("elementwise", "2.6"), ("segmented", "2.11"), ("per-tensor", "2.10")])
def test_compiled_steps_unsupported_names_the_releases_before_the_oldest_that_works(path, oldest):
    """The thresholds themselves are checked by the compiled-step tests, run on those releases."""
    name = "compiled_steps_unsupported"
    reason = compat.compiled_steps_unsupported(path)
    old = compat._RELEASE < oldest
    assert (reason is not None) == old, changed(name, f"release {compat._RELEASE}, {path}: {reason!r}")
    if old:
        assert str(compat._RELEASE) in reason and (oldest in reason or "2.6" in reason), reason


# ------------------------------------------------------------------------------ floats_used_directly
def _graphs_under_a_changing_lr(use_directly: bool) -> "tuple[int, torch.Tensor, torch.Tensor]":
    """SGD's update (``alpha=-lr`` as ScalarsAsOperands rewrites it) compiled with Inductor over 5
    learning rates; returns (graphs, compiled result, eager result)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compat.inductor_backend()(gm, example_inputs)

    def step(p, g, group):
        kept = compat.floats_used_directly([group["lr"]]) if use_directly else None
        p.add_(g * -group["lr"])
        return kept

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    p, eager_p, g = torch.ones(8), torch.ones(8), torch.linspace(0, 1, 8)
    for lr in (0.5, 0.25, 0.125, 0.1, 0.05):
        compat.forget_float_specializations()  # as CompiledStep does before each call
        compiled(p, g, {"lr": lr})
        step(eager_p, g, {"lr": lr})
    compat.forget_float_specializations()
    return len(graphs), p, eager_p


def test_floats_used_directly_keeps_a_learning_rate_in_an_expression_symbolic(private_api):
    """Torch 2.6 - 2.12 specialize a float reached only through ``-lr``: one graph per learning rate."""
    name = "floats_used_directly"
    if compat.compiled_steps_unsupported():
        pytest.skip(compat.compiled_steps_unsupported())
    from bagua_integrations._compile import compiler_available

    if not compiler_available():
        pytest.skip("torch.compile does not work here")
    with private_api(name):
        torch.compiler.reset()
        graphs, p, eager_p = _graphs_under_a_changing_lr(use_directly=True)
        assert graphs <= 2, changed(name, f"{graphs} graphs for 5 learning rates")
        torch.testing.assert_close(p, eager_p, rtol=1e-6, atol=1e-7)
        if compat.floats_need_a_direct_use():  # the check above can fail: without it, one graph per lr
            torch.compiler.reset()
            graphs, _, _ = _graphs_under_a_changing_lr(use_directly=False)
            assert graphs > 2, changed("floats_need_a_direct_use", f"torch {torch.__version__} no longer specializes "
                                       f"a float in an expression ({graphs} graphs): narrow the version branch")
        else:
            assert compat.floats_used_directly([0.5]) is None, changed(name, "does something where not needed")


def test_the_direct_use_is_made_on_the_steps_device():
    """A CPU tensor in a GPU step's graph is a C++ kernel: the first compile of a GPU process then
    built Inductor's whole CPU toolchain (a fused LAMB's first compiled step on an H200, torch 2.11:
    46-72 s with it, 5.5 s without)."""
    if not compat.floats_need_a_direct_use():
        pytest.skip(f"torch {torch.__version__} needs no direct use")
    kept = compat.floats_used_directly([0.5, 0.25], device="meta")
    assert kept.device.type == "meta" and kept.dim() == 0
    assert compat.floats_used_directly([0.5]).device.type == "cpu"


# ------------------------------------------------------------------------------ symbolic_sqrt_functions
def test_symbolic_sqrt_functions_are_what_dynamo_records_for_math_sqrt(private_api):
    """``math.sqrt`` of a dynamic int is recorded as one of them (the prologue replays it: AdaFactor's
    ``1 / math.sqrt(step)``)."""
    name = "symbolic_sqrt_functions"
    if compat.compiled_steps_unsupported():
        pytest.skip(compat.compiled_steps_unsupported())
    targets = []

    def backend(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(lambda x, n: x * math.sqrt(n), backend=backend, dynamic=True, fullgraph=True)
    with private_api(name):
        torch.testing.assert_close(compiled(torch.ones(3), 9), torch.full((3,), 3.0))
        recorded = {t for t in targets if t is not operator.mul}
        assert recorded and recorded <= (compat.symbolic_sqrt_functions() | {math.sqrt}), changed(
            name, f"math.sqrt of a symbol is recorded as {recorded}")


# ------------------------------------------------------------------------------ queue_end_of_backward
def test_queue_end_of_backward_runs_after_every_gradient(private_api):
    name = "queue_end_of_backward"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    seen = []

    def at_end():
        seen.append([p.grad is not None for p in model.parameters()])

    queued = []

    def hook(grad):
        if not queued:  # first gradient of this backward: queue once
            queued.append(True)
            compat.queue_end_of_backward(at_end)
        return grad

    model[2].weight.register_hook(hook)
    with private_api(name):
        model(torch.randn(3, 4)).sum().backward()
        assert seen == [[True] * 4], changed(name, f"callback runs: {seen}")


# ------------------------------------------------------------------------------ inductor_backend
def test_inductor_backend_is_a_compile_backend(private_api):
    import inspect

    name = "inductor_backend"
    with private_api(name):
        backend = compat.inductor_backend()
        assert callable(backend), changed(name, f"{backend!r} is not callable")
        assert backend.__name__ == "compile_fx", changed(name, f"got {backend.__name__}")
        assert len(inspect.signature(backend).parameters) >= 2, changed(name, "no (graph_module, example_inputs) signature")


def test_inductor_reads_thresholds_raised_patches_compile_fx(private_api):
    import inspect

    from torch._inductor import config

    name = "inductor_reads_thresholds_raised"
    with private_api(name):
        patches = compat.inductor_reads_thresholds_raised(2)
        assert patches["realize_reads_threshold"] == config.realize_reads_threshold + 2, changed(name, str(patches))
        assert patches["realize_acc_reads_threshold"] >= 2 + 2, changed(name, str(patches))
        for key in patches:
            assert hasattr(config, key), changed(name, f"inductor config has no {key}")
        assert "config_patches" in inspect.signature(compat.inductor_backend()).parameters, changed(
            name, "compile_fx takes no config_patches")
        with config.patch(patches):  # the patch applies
            assert config.realize_reads_threshold == patches["realize_reads_threshold"]


def test_inductor_with_post_grad_pass_runs_the_pass_and_keeps_a_users_own(private_api):
    """Our pass runs on the functional graph Inductor compiles (``post_grad_custom_pre_pass``, through
    ``config_patches``, merged with those a caller passes); a pass the user set is left in place."""
    from bagua_integrations._compile import post_grad_pass
    from bagua_integrations._compile import compiler_available

    name = "inductor_with_post_grad_pass"
    if post_grad_pass() is None:
        pytest.skip("this torch has no CustomGraphPass")
    if not compiler_available():
        pytest.skip("no working compiler")
    with private_api(name):
        from torch._inductor import config
        from torch._inductor.custom_graph_pass import CustomGraphPass

        seen, patches_seen = [], []

        class Count(CustomGraphPass):
            def __call__(self, graph):
                seen.append(sum(1 for n in graph.nodes if n.op == "call_function"))

            def uuid(self):
                return "bagua-test-count-pass"

        def backend(gm, example_inputs):
            def compile_fx(gm, example_inputs, config_patches=None):
                patches_seen.append(dict(config_patches))
                return compat.inductor_backend()(gm, example_inputs, config_patches=config_patches)
            compile_graph = compat.inductor_with_post_grad_pass(compile_fx, Count())
            return compile_graph(gm, example_inputs, config_patches={"realize_reads_threshold": 4})

        torch._dynamo.reset()
        with config.patch({"fx_graph_cache": False}):  # a cached graph skips the passes
            out = torch.compile(lambda x: (x * 2 + 1).sin(), backend=backend)(torch.arange(4.0))
        assert torch.allclose(out, (torch.arange(4.0) * 2 + 1).sin())
        assert seen and seen[0] > 0, changed(name, "the post-grad pass did not run")
        assert patches_seen[0]["realize_reads_threshold"] == 4, changed(name, str(patches_seen))
        plain = object()
        with config.patch({"post_grad_custom_pre_pass": Count()}):
            assert compat.inductor_with_post_grad_pass(plain, Count()) is plain  # the user's pass stays
        assert compat.inductor_with_post_grad_pass(plain, None) is plain
        torch._dynamo.reset()


def test_block_loops_pass_stores_in_the_loop_that_reduces_per_block(private_api):
    """A segmented step's shape: a value of the run's length written back to an input and reduced per
    block. Inductor's C++ backend emits two loops over the run for it (the value computed in each);
    with the pass, one loop over the blocks that stores and reduces each block. Same bits."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    from bagua_integrations._compile import compiler_available

    name = "block_loops_pass"
    scheduler_pass = compat.block_loops_pass()
    if scheduler_pass is None:
        pytest.skip("this torch's Inductor has no scheduler pass (_pre_fusion_custom_pass)")
    if not compiler_available():
        pytest.skip("no working compiler")
    blocks, block = 512, 256

    def step(m, g):
        new = m * 0.9 + g * 0.1
        m.copy_(new)
        return (new * new).reshape(blocks, block).sum(1)

    gen = torch.Generator().manual_seed(0)
    m0, g = torch.randn(blocks * block, generator=gen), torch.randn(blocks * block, generator=gen)
    results = {}
    with private_api(name):
        for with_pass in (False, True):
            def backend(gm, example_inputs, with_pass=with_pass):
                return compat.inductor_with_post_grad_pass(compat.inductor_backend(), None,
                                                           scheduler_pass if with_pass else None)(gm, example_inputs)
            torch._dynamo.reset()
            m = m0.clone()
            with config.patch({"fx_graph_cache": False}):
                out, codes = run_and_get_code(torch.compile(step, backend=backend, fullgraph=True), m, g)
            results[with_pass] = (m, out, "\n".join(codes).count("for(int64_t x0="))  # outer loops (any thread count)
        torch._dynamo.reset()
    assert torch.equal(results[True][0], m0 * 0.9 + g * 0.1)
    assert torch.equal(results[True][0], results[False][0]) and torch.equal(results[True][1], results[False][1])
    assert results[False][2] == 2, changed(name, f"without the pass: {results[False][2]} loops, where 2 were seen")
    assert results[True][2] == 1, changed(name, f"with the pass: {results[True][2]} loops over the run, not one")


def test_mark_placeholder_without_source_lets_a_backend_add_several_inputs(private_api):
    """Two hoisted scalars are two inputs our backend adds to a Dynamo graph; AOTAutograd checks
    every placeholder's source (torch 2.5.1 refused a second ``None`` one)."""
    from bagua_integrations._compile import compiler_available
    from bagua_integrations._scalar_prologue import with_scalar_prologue

    if not compiler_available():
        pytest.skip("needs a working torch.compile (C++ compiler)")
    name = "mark_placeholder_without_source"
    added = []

    def inductor(gm, example_inputs, **kwargs):
        added.extend(n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("bagua_hoisted"))
        return compat.inductor_backend()(gm, example_inputs, **kwargs)

    def f(t, step):
        return t * (1 - 0.9 ** step) + t / (1 - 0.999 ** step)  # two scalars of the step: two added inputs

    with private_api(name):
        compiled = torch.compile(f, backend=lambda gm, ex: with_scalar_prologue(inductor, gm, ex), fullgraph=True)
        t = torch.rand(64)
        for step in (1, 2, 3):
            torch.testing.assert_close(compiled(t, step), f(t, step))
        assert len(set(added)) == 2, changed(name, f"hoisted inputs {added}")


def _counting_backend():
    """A ``torch.compile`` backend that runs each graph as traced, and the list of graphs it got."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def test_cpu_kernels_truncate_float_min_max_matches_inductors_cpp_printer(private_api):
    import sympy

    name = "cpu_kernels_truncate_float_min_max"
    with private_api(name):
        try:
            from torch.utils._sympy.printers import CppPrinter
        except ImportError:  # torch 2.5
            from torch._inductor.codegen.cpp_utils import CppPrinter

        x = sympy.Symbol("x", real=True, integer=False)
        printed = CppPrinter().doprint(sympy.Max(sympy.Float(0.0), x / 3))
        truncates = "int64_t" in printed and "double" not in printed
        assert compat.cpu_kernels_truncate_float_min_max() == truncates, changed(name, f"a float max prints as {printed}")


def test_dynamo_recompile_limit_lets_one_function_keep_more_graphs(private_api):
    name = "dynamo_recompile_limit"
    with private_api(name):
        graphs, backend = _counting_backend()
        f = torch.compile(lambda t: t * 2, backend=backend, dynamic=False)
        with compat.dynamo_recompile_limit(12):
            for n in range(1, 12):  # a new static shape each call: one graph each
                f(torch.ones(n))
        assert len(graphs) == 11, changed(name, f"{len(graphs)} graphs for 11 shapes (Dynamo's default stops at 8)")


def test_dynamo_recompile_limit_patches_only_where_the_graphs_need_it(private_api):
    """Told how many graphs there are, it leaves Dynamo's config alone while one more is allowed
    (a patch costs ~20 us a call), and still lets the function keep ``limit`` graphs."""
    import torch._dynamo.config as dynamo_config

    name = "dynamo_recompile_limit"
    with private_api(name):
        setting = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        default = getattr(dynamo_config, setting)
        with compat.dynamo_recompile_limit(default + 4, graphs=default - 1):
            assert getattr(dynamo_config, setting) == default  # one more graph is allowed already
        with compat.dynamo_recompile_limit(default + 4, graphs=default):
            assert getattr(dynamo_config, setting) == default + 4
        assert getattr(dynamo_config, setting) == default
        graphs, backend = _counting_backend()
        f = torch.compile(lambda t: t * 2, backend=backend, dynamic=False)
        for n in range(1, default + 4):  # a new static shape each call: one graph each
            with compat.dynamo_recompile_limit(default + 4, graphs=len(graphs)):
                f(torch.ones(n))
        assert len(graphs) == default + 3, changed(name, f"{len(graphs)} graphs for {default + 3} shapes")


def test_math_pow_kept_symbolic_keeps_an_int_step_count_from_recompiling(private_api):
    """Without it, Dynamo guards ``math.pow(beta, group["step"])`` on the step's value: one graph per step."""
    import math

    name = "math_pow_kept_symbolic"
    with private_api(name):
        graphs, backend = _counting_backend()

        def step(t, group):
            group["step"] += 1
            t.mul_(1.0 - math.pow(0.9, group["step"]))

        compiled = torch.compile(step, backend=backend, fullgraph=True)
        group, eager_group = {"step": 0}, {"step": 0}
        t, eager_t = torch.ones(3), torch.ones(3)
        for _ in range(6):
            with compat.math_pow_kept_symbolic():
                compiled(t, group)
            step(eager_t, eager_group)
        assert math.pow is not compat._math_pow_as_operator  # restored after each call
        assert len(graphs) <= 2, changed(name, f"{len(graphs)} graphs for 6 steps")
        assert torch.equal(t, eager_t) and group == eager_group == {"step": 6}


def test_ints_symbolic_from_the_first_graph_spares_the_recompile_of_a_step_count(private_api):
    """A Python int step count in a param group and in each state entry, named as the compiled step
    names them (its argument is ``optimizer``): one graph over 5 steps with the context, two without
    (a constant first, then a symbol). Where the release has no ``dynamic_sources``, it does nothing."""
    name = "ints_symbolic_from_the_first_graph"
    with private_api(name):
        import torch.compiler

        param = torch.ones(3)  # (a leaf without grad: the step writes it in place)
        places = [("group", 0, "step"), ("state", None, "count")]

        def step(optimizer):
            group = optimizer.param_groups[0]
            group["step"] += 1
            entry = optimizer.state[group["params"][0]]
            entry["count"] += 1
            group["params"][0].mul_(1.0 + 0.1 * group["step"] - 0.01 * entry["count"])

        def graphs_for(context):
            graphs, backend = _counting_backend()
            compiled = torch.compile(step, backend=backend, fullgraph=True)
            # (not a torch.optim.Optimizer: Dynamo would add its own "capturable" key to the group)
            opt = types.SimpleNamespace(param_groups=[{"params": [param], "step": 1}], state={param: {"count": 1}})
            for _ in range(5):
                with context():
                    compiled(opt)
            return len(graphs), opt

        if not hasattr(getattr(torch.compiler, "config", None), "dynamic_sources"):
            pytest.skip(f"torch {torch.__version__} has no torch.compiler.config.dynamic_sources (the context does nothing)")
        with_it, opt = graphs_for(lambda: compat.ints_symbolic_from_the_first_graph(places))
        without, _ = graphs_for(contextlib.nullcontext)
        assert opt.param_groups[0]["step"] == 6 and opt.state[param]["count"] == 6
        assert without == 2, f"Dynamo itself: {without} graphs (expected a constant, then a symbol)"
        assert with_it == 1, changed(name, f"{with_it} graphs for 5 steps: the names no longer match Dynamo's")
        assert torch.compiler.config.dynamic_sources == "", "the config was left patched"


# ------------------------------------------------------------------------------ LR-scheduler markers
def _sgd():
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    return param, torch.optim.SGD([param], lr=0.1)


def test_step_keeping_lr_scheduler_marker_keeps_a_scheduler_quiet(private_api):
    name = "step_keeping_lr_scheduler_marker"
    with private_api(name):
        param, opt = _sgd()

        def new_step():
            with torch.no_grad():
                param.sub_(0.1 * param.grad)

        assert compat.step_keeping_lr_scheduler_marker(opt, new_step) is new_step, changed(name, "no scheduler yet")
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        assert getattr(opt.__dict__.get("step"), "_wrapped_by_lr_sched", False), changed(name, "scheduler wrapper mark")
        opt.step = compat.step_keeping_lr_scheduler_marker(opt, new_step)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            opt.step()
            scheduler.step()
        assert not _scheduler_warnings(record), changed(name, f"warned: {_scheduler_warnings(record)}")
        assert torch.allclose(param, torch.full((2,), 0.9)), changed(name, "new_step did not run")

        # the check above can fail: a bare replacement makes the scheduler complain
        _, bare = _sgd()
        bare_scheduler = torch.optim.lr_scheduler.LambdaLR(bare, lambda s: 1.0)
        bare.step = lambda: None
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            bare.step()
            bare_scheduler.step()
        assert any("overridden" in m for m in _scheduler_warnings(record)), changed(name, "the scheduler no longer warns")


def test_mark_step_taken_tells_the_scheduler_a_step_happened(private_api):
    name = "mark_step_taken"
    with private_api(name):
        _, opt = _sgd()
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        compat.mark_step_taken(opt)  # what fuse_step() does instead of calling the wrapped opt.step()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            scheduler.step()
        assert not _scheduler_warnings(record), changed(name, f"warned: {_scheduler_warnings(record)}")

        _, unmarked = _sgd()
        unmarked_scheduler = torch.optim.lr_scheduler.LambdaLR(unmarked, lambda s: 1.0)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            unmarked_scheduler.step()
        assert any("before `optimizer.step()`" in m for m in _scheduler_warnings(record)), (
            changed(name, "the scheduler no longer warns about a missing optimizer.step()")
        )


# ------------------------------------------------------------------------------ tensor_version
def test_tensor_version_counts_in_place_changes(private_api):
    name = "tensor_version"
    if not hasattr(compat, name):
        pytest.skip(f"{WHERE} has no {name}")
    with private_api(name):
        t = torch.zeros(3)
        before = compat.tensor_version(t)
        t.add_(1)
        assert compat.tensor_version(t) == before + 1, changed(name, "an in-place add did not bump the version")
        t + 1
        assert compat.tensor_version(t) == before + 1, changed(name, "an out-of-place add bumped the version")


def test_tensor_versions_reads_each_tensors_version(private_api):
    name = "tensor_versions"
    with private_api(name):
        a, b = torch.zeros(()), torch.zeros(3)
        before = compat.tensor_versions([a, b])
        assert before == [compat.tensor_version(a), compat.tensor_version(b)], changed(name, f"got {before}")
        b[1:].fill_(1)  # through a view: views share their base's counter
        assert compat.tensor_versions([a, b]) == [before[0], before[1] + 1], changed(name, "a view's edit was not counted")


# ------------------------------------------------------------------------------ register_state_dict_post_hook
def test_register_state_dict_post_hook_runs_for_submodules_and_edits_in_place(private_api):
    name = "register_state_dict_post_hook"
    with private_api(name):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        seen = []

        def hook(module, state_dict, prefix, local_metadata):
            seen.append(prefix)
            state_dict[prefix + "weight"] = torch.zeros(2, 2)

        handle = compat.register_state_dict_post_hook(model[1], hook)
        state = model.state_dict()
        assert seen == ["1."], changed(name, f"the hook saw prefixes {seen}")
        assert torch.equal(state["1.weight"], torch.zeros(2, 2)), changed(name, "the in-place edit was lost")
        assert not torch.equal(state["0.weight"], torch.zeros(2, 2))
        assert model[1].state_dict(prefix="x.")["x.weight"].eq(0).all(), changed(name, "not run on the module itself")
        handle.remove()
        assert not torch.equal(model.state_dict()["1.weight"], torch.zeros(2, 2)), changed(name, "handle.remove() failed")


def test_compiled_kernels_may_fuse_multiply_add_says_when_cpu_kernels_round_like_eager(private_api):
    from bagua_integrations._compile import compiler_available

    if not compiler_available():
        pytest.skip("torch.compile is not usable here")
    # (1 + 2**-12)**2 rounds to 1 + 2**-11 in fp32 (a tie, to even): minus that is 0 eagerly, 2**-24 fused
    a = torch.full((64,), 1 + 2**-12)
    c = torch.full((64,), -(1 + 2**-11))
    compiled = torch.compile(lambda a, b, c: a * b + c, fullgraph=True)(a, a, c)
    assert torch.equal(a * a + c, torch.zeros(64))
    if not compat.compiled_kernels_may_fuse_multiply_add("cpu"):
        assert torch.equal(compiled, torch.zeros(64)), changed(
            "compiled_kernels_may_fuse_multiply_add", "said CPU kernels keep a * b + c rounded twice, and they fused it")
    assert compat.compiled_kernels_may_fuse_multiply_add("cuda")


# ------------------------------------------------------------------------------ coverage of the module
TESTED = {
    "mark_placeholder_without_source",
    "CHECKED_ON", "unwrapped_step", "forget_float_specializations", "queue_end_of_backward", "inductor_backend",
    "step_keeping_lr_scheduler_marker", "mark_step_taken", "tensor_version", "tensor_versions", "register_state_dict_post_hook",
    "inductor_reads_thresholds_raised", "dynamo_recompile_limit", "math_pow_kept_symbolic",
    "compiled_steps_unsupported", "floats_used_directly", "floats_need_a_direct_use", "cpu_kernels_truncate_float_min_max",
    "compiled_kernels_may_fuse_multiply_add", "ints_symbolic_from_the_first_graph", "inductor_with_post_grad_pass",
    "start_cpu_vector_isa_checks", "block_loops_pass", "symbolic_sqrt_functions",
}


def test_every_compat_function_has_a_test_here():
    untested = sorted(set(compat.__all__) - TESTED)
    assert not untested, f"{WHERE} has function(s) without a test in tests/test_torch_compat.py: {untested}"


# ------------------------------------------------------------------------------ default_store, process_group_timeout
@pytest.fixture
def one_rank_gloo_group():
    """A gloo world of one rank in this process, with a 7 s timeout; destroyed afterwards."""
    import datetime

    import torch.distributed as dist
    from _dist_utils import free_port

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=7))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_default_store_is_the_rendezvous_key_value_store(private_api, one_rank_gloo_group):
    name = "default_store"
    with private_api(name):
        store = compat.default_store()
        store.set("bagua_integrations/compat", "7")
        assert store.check(["bagua_integrations/compat"]), changed(name, "a key just set is missing")
        assert not store.check(["bagua_integrations/never-set"]), changed(name, "check() finds a missing key")
        assert store.get("bagua_integrations/compat") == b"7", changed(name, "get() returned something else")


def test_process_group_timeout_is_the_init_timeout(private_api, one_rank_gloo_group):
    import datetime

    import torch.distributed as dist

    name = "process_group_timeout"
    with private_api(name):
        assert compat.process_group_timeout(default=None) == datetime.timedelta(seconds=7), changed(name)
        assert compat.process_group_timeout(dist.group.WORLD, default=None) == datetime.timedelta(seconds=7), changed(name)


def test_process_group_timeout_falls_back_to_torch_default_where_it_cannot_be_read():
    import datetime

    class Unreadable:
        def _get_backend(self, device):
            raise RuntimeError("no backend")

    assert compat.process_group_timeout(Unreadable()) == datetime.timedelta(minutes=30)
    assert compat.process_group_timeout(Unreadable(), default=datetime.timedelta(seconds=3)) == datetime.timedelta(seconds=3)
    with pytest.raises(RuntimeError, match="no backend"):
        compat.process_group_timeout(Unreadable(), default=None)


TESTED.update({"default_store", "process_group_timeout"})


# ------------------------------------------------------------------------------ all_reduce_with_timeout
def _all_reduce_with_timeout(rank, world):
    import datetime

    import torch.distributed as dist

    second = datetime.timedelta(seconds=1)
    summed = torch.full((3,), float(rank + 1))
    compat.all_reduce_with_timeout(summed, dist.ReduceOp.SUM, None, second).wait()
    largest = torch.tensor([10 * rank], dtype=torch.int64)
    compat.all_reduce_with_timeout(largest, dist.ReduceOp.MAX, dist.group.WORLD, second).wait()
    store = compat.default_store()
    message = None
    # Rank 1 launches a collective rank 0 never joins: gloo itself must end it after 1 s. Rank 0 hosts
    # the store and waits on it, so it is the last to use it (a waiting client on rank 1 could see
    # the store's host exit first: "Connection reset by peer").
    if rank == 1:
        alone = compat.all_reduce_with_timeout(torch.ones(1), dist.ReduceOp.SUM, None, second)
        try:
            alone.wait()  # no timeout here: only the collective's own can end it
        except RuntimeError as error:
            message = str(error)
        store.set("compat/all_reduce_with_timeout", "done")
    else:  # longer than the group's 8 s, which gloo waits before torch 2.9 (the store's default is the same 8 s)
        store.wait(["compat/all_reduce_with_timeout"], datetime.timedelta(seconds=60))
    return {"summed": summed, "largest": int(largest.item()), "message": message}


def test_all_reduce_with_timeout_reduces_and_gloo_ends_it_at_its_timeout():
    """The process group's timeout is 8 s; a collective given 1 s must fail in gloo after 1 s
    (gloo names the timeout it waited: 1000ms), not at the group's 8 s, where
    gloo_honours_collective_timeouts() says so; before torch 2.9 gloo waits the group's 8 s."""
    from _dist_utils import run_ranks

    name = "all_reduce_with_timeout"
    results = run_ranks(_all_reduce_with_timeout, 2, timeout=120, pg_timeout=8)
    for result in results:
        assert result.ok, changed(name, result.describe())
        assert torch.equal(result.value["summed"], torch.full((3,), 3.0)), changed(name, f"sum {result.value['summed']}")
        assert result.value["largest"] == 10, changed(name, f"max {result.value['largest']}")
    message = results[1].value["message"]
    assert message is not None, changed(name, "a collective no peer joined completed")
    honoured = compat.gloo_honours_collective_timeouts()
    waited = "1000ms" if honoured else "8000ms"
    assert waited in message, changed("gloo_honours_collective_timeouts" if honoured or "1000ms" in message else name,
                                      f"expected gloo to wait {waited}: {message}")


TESTED.update({"all_reduce_with_timeout", "gloo_honours_collective_timeouts"})


# ------------------------------------------------------------------------------ dynamo_dispatches_foreach_to_modes
def test_dynamo_dispatches_foreach_to_modes_routes_clip_grad_norm_through_a_traced_mode(private_api):
    """Traced by Dynamo, a torch function mode must see clip_grad_norm_'s ``_foreach_norm``
    and ``_foreach_mul_``, as it does in eager (without the compat call it does not)."""
    from torch.overrides import TorchFunctionMode

    name = "dynamo_dispatches_foreach_to_modes"
    if compat.compiled_steps_unsupported("segmented"):  # only compiled segmented steps need it
        pytest.skip(compat.compiled_steps_unsupported("segmented"))

    class Doubling(TorchFunctionMode):  # foreach norms come back doubled: visible in the result
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return [t * 2 for t in out] if func is torch._foreach_norm else out

    def clip(p):
        with Doubling():
            torch.nn.utils.clip_grad_norm_([p], 1.0, foreach=True)
        return p.grad

    def param():
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.full((4,), 3.0)
        return p

    with private_api(name):
        compat.dynamo_dispatches_foreach_to_modes()
        torch.compiler.reset()
        eager = clip(param())  # norm 6 doubled to 12: scaled by 1/12
        compiled = torch.compile(clip, fullgraph=True, backend="eager")(param())
        assert torch.allclose(eager, torch.full((4,), 0.25)), changed(name, f"eager clip gave {eager}")
        assert torch.allclose(compiled, eager), changed(name, f"the traced mode missed _foreach_norm: {compiled}")


TESTED.add("dynamo_dispatches_foreach_to_modes")


# ------------------------------------------------------------------------------ the late-reduction check's helpers
def test_aten_operator_packet_carries_the_operators_tags(private_api):
    """_late_reductions tells pointwise operators from reductions by ATen's own tags."""
    with private_api("aten_operator_packet"):
        add, total = compat.aten_operator_packet("add_"), compat.aten_operator_packet("sum")
        assert any(torch.Tag.pointwise in getattr(add, o).tags for o in add.overloads()), changed("aten_operator_packet")
        assert not any(torch.Tag.pointwise in getattr(total, o).tags for o in total.overloads())
        assert compat.aten_operator_packet("no_such_operator_here") is None


def test_size_hint_reads_the_value_a_symbolic_size_was_traced_with(private_api):
    seen = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                seen.append(compat.size_hint(value.numel()))
        return gm.forward

    with private_api("size_hint"):
        torch._dynamo.reset()
        torch.compile(lambda x: x * 2, backend=backend, dynamic=True, fullgraph=True)(torch.ones(7))
        assert seen and all(n == 7 for n in seen), changed("size_hint", f"saw {seen}")
        assert compat.size_hint(5) == 5


def test_exception_chain_reaches_what_a_backend_raised(private_api):
    """CompiledStep._backend refuses a graph by raising; Dynamo wraps that exception."""

    class Refused(Exception):
        pass

    def backend(gm, example_inputs):
        raise Refused("refused")

    with private_api("exception_chain"):
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            torch.compile(lambda x: x + 1, backend=backend, fullgraph=True)(torch.ones(3))
        assert any(isinstance(e, Refused) for e in compat.exception_chain(info.value)), changed(
            "exception_chain", f"{type(info.value).__name__} does not lead to the backend's exception")


TESTED.update({"aten_operator_packet", "size_hint", "exception_chain"})


def _fsdp2_shard_pointers(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layer = torch.nn.Linear(4, 3)  # 3 rows over 2 ranks: uneven, rank 1's shard is padded
    fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
    params = list(layer.parameters())
    found = compat.fsdp2_params(params)
    assert set(found) == {id(p) for p in params}, changed("fsdp2_params", "FSDPParam not found by its sharded_param")
    fsdp_param, weight = found[id(params[0])], params[0]
    padded = torch.zeros(compat.fsdp2_padded_numel(fsdp_param))
    assert padded.numel() == 2 * 4, changed("fsdp2_padded_numel", str(padded.numel()))
    local = padded[: compat.local_shard(weight).numel()].view(compat.local_shard(weight).shape)
    before = compat.fsdp2_shard_pointers(list(found.values()))
    compat.fsdp2_point_shard_at(fsdp_param, padded, local)
    assert compat.fsdp2_shard_points_at(fsdp_param, padded), changed("fsdp2_point_shard_at")
    after = compat.fsdp2_shard_pointers(list(found.values()))
    index = list(found.values()).index(fsdp_param)
    assert after[index] == after[len(found) + index] == padded.data_ptr() != before[index], changed(
        "fsdp2_shard_pointers", f"{before} -> {after}")
    assert [a for i, a in enumerate(after) if i % len(found) != index] == [
        b for i, b in enumerate(before) if i % len(found) != index], changed("fsdp2_shard_pointers", "others moved")
    padded.fill_(2.0)
    layer(torch.ones(1, 4)).sum().backward()  # FSDP2 all-gathers the padded shard it was pointed at
    full = weight.full_tensor()
    return bool((full == 2.0).all()), tuple(compat.local_shard(weight).shape)


def test_fsdp2_shards_can_be_pointed_at_other_memory():
    from _dist_utils import fsdp2_runs_on_cpu

    if not fsdp2_runs_on_cpu():
        pytest.skip("FSDP2 does not run on CPU with this torch")
    from _dist_utils import run_ranks, values

    for all_gathered_from_it, shape in values(run_ranks(_fsdp2_shard_pointers, 2, timeout=120)):
        assert all_gathered_from_it, changed("fsdp2_point_shard_at", "FSDP2 did not all-gather the new memory")
        assert shape[1] == 4


def _dtensor_over_checks(rank, world):
    """What dtensor_over makes of two local tensors (float32, float64), against a DTensor of that layout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    like = distribute_tensor(torch.randn(6, 4), init_device_mesh("cpu", (world,)), [Shard(0)])
    checks = []
    for local in (torch.randn(6, 4), torch.randn(6, 4, dtype=torch.float64)):
        wrapped = compat.dtensor_over(local, like)
        checks.append(dict(
            same_local=compat.local_shard(wrapped) is local,
            same_layout=(wrapped.device_mesh, wrapped.placements, wrapped.shape, wrapped.stride())
            == (like.device_mesh, like.placements, like.shape, like.stride()),
            dtype=str(wrapped.dtype), wanted=str(local.dtype), requires_grad=wrapped.requires_grad,
            same_values=torch.equal(wrapped.full_tensor(), local)))
    return checks


def test_dtensor_over_wraps_the_local_tensor_itself_as_the_dtensor_it_is_like(private_api):
    """On a spawned one-rank world: on torch 2.5.1, destroy_process_group now and then never returns
    after a DTensor was made on a gloo mesh (a loop of init, distribute_tensor, destroy hung in
    each of 7 tries, after 44 to 112 rounds where counted; 300 rounds on 2.13 never did), which
    stalled a CI run when this test ran inside pytest's process. A spawned rank skips that teardown."""
    from _dist_utils import run_ranks, values

    with private_api("dtensor_over"):
        (checks,) = values(run_ranks(_dtensor_over_checks, 1, timeout=120))
    for check in checks:
        assert check["same_local"], changed("dtensor_over", "the local tensor was copied")
        assert check["same_layout"], changed("dtensor_over", "another layout")
        assert check["dtype"] == check["wanted"] and not check["requires_grad"], changed("dtensor_over", check["dtype"])
        assert check["same_values"], changed("dtensor_over", "other values")


TESTED.update({"dtensor_over", "fsdp2_shard_pointers"})


# ------------------------------------------------------------------------------ drop_group_defaults_kept_by_torch
def test_drop_group_defaults_kept_by_torch_replaces_the_group_only_in_torch_distributed(monkeypatch):
    """Only defaults that *are* the group, in modules under ``torch.distributed``; both kinds of
    default. (The real default it exists for, ``torch.distributed.nn.functional``'s, is checked on
    2 ranks in test_async_model_average.py::test_gloo_threads_are_joined_before_the_interpreter_tears_down.)"""
    import sys
    import types

    group, other = object(), object()

    def make_module(name):
        def positional(x, group=group, op=other):
            return group

        def keyword(x, *, group=group, op=other):
            return group

        def unrelated(x, op=other):
            return op

        module = types.ModuleType(name)
        module.positional, module.keyword, module.unrelated = positional, keyword, unrelated
        monkeypatch.setitem(sys.modules, name, module)
        return module

    inside, outside = make_module("torch.distributed._bagua_probe"), make_module("bagua_probe_elsewhere")
    assert compat.drop_group_defaults_kept_by_torch(group) == 2
    assert inside.positional(1) is None and inside.keyword(1) is None
    assert inside.positional.__defaults__[1] is other and inside.keyword.__kwdefaults__["op"] is other
    assert inside.unrelated(1) is other
    assert outside.positional(1) is group and outside.keyword(1) is group
    assert compat.drop_group_defaults_kept_by_torch(group) == 0


TESTED.add("drop_group_defaults_kept_by_torch")


# ------------------------------------------------------------------------------ start_cpu_vector_isa_checks
_ISA_CHECKS = r"""
import json, platform, sys, threading
from torch._inductor import cpu_vec_isa
from bagua_integrations import _torch_compat as compat

if platform.machine() not in ("x86_64", "AMD64"):
    print(json.dumps({"skip": platform.machine()}))
    sys.exit()
from torch._inductor import cpp_builder
compiled, programs, builds, original, build = [], set(), [], cpu_vec_isa.VecISA.check_build, cpp_builder.CppBuilder.build

def recording(self, code):
    compiled.append((str(self), threading.current_thread().name))
    programs.add(code)
    return original(self, code)

def counting(self, *args, **kwargs):
    builds.append(threading.current_thread().name)
    return build(self, *args, **kwargs)

cpu_vec_isa.VecISA.check_build = recording
cpp_builder.CppBuilder.build = counting
reported = cpu_vec_isa.x86_isa_checker()
candidates = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list
              if str(isa).split() and all(flag in reported for flag in str(isa).split())]
wait = compat.start_cpu_vector_isa_checks()
import torch._inductor.compile_fx  # what _compile.compiler_available imports while the check runs
built = wait()
if len(candidates) < 2:  # one ISA (an AVX2-only CPU): nothing to answer from it, Inductor checks it itself
    print(json.dumps({"compiled": compiled, "built": built, "candidates": candidates}))
    sys.exit()

def checked_again(self, code):
    raise AssertionError(f"Inductor checked {self} again")

cpu_vec_isa.VecISA.check_build = checked_again
valid = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
bf16 = [bool(getattr(isa, "_is_avx512_bf16_supported", False)) for isa in cpu_vec_isa.valid_vec_isa_list()
        if hasattr(isa, "_is_avx512_bf16_supported")]
print(json.dumps({"compiled": compiled, "built": built, "candidates": candidates, "valid": valid,
                  "picked": str(cpu_vec_isa.pick_vec_isa()), "bf16": bf16, "programs": len(programs),
                  "builds": builds}))
"""


def test_only_the_best_vector_isa_is_compiled_and_inductor_reuses_the_answers(tmp_path):
    """Of the ISAs the CPU reports, only the best (the one Inductor uses) is compiled, in a thread
    (its further programs in a second one, each built once), while the main thread imports the
    rest of Inductor; the others are answered from it, and
    Inductor's own pass then compiles nothing and finds every reported ISA valid, the best one
    picked (an empty cache directory: the cold start a user's first run pays)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", _ISA_CHECKS], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, changed("start_cpu_vector_isa_checks", result.stderr[-2000:])
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    if "skip" in seen:
        pytest.skip(f"Inductor checks vector ISAs by compiling only on x86 ({seen['skip']} here)")
    if len(seen["candidates"]) < 2:
        # nothing started (nothing compiled here): the caller probes the compiler itself
        assert seen["built"] is False and seen["compiled"] == [], seen
        return
    assert seen["valid"], changed("start_cpu_vector_isa_checks", "no vector ISA found valid")
    assert seen["built"] is True, changed("start_cpu_vector_isa_checks", "its wait() did not say the check built")
    best = seen["candidates"][0]
    assert {isa for isa, _ in seen["compiled"]} == {best}, seen  # (its AVX512-BF16 program too, where reported)
    assert all(thread.startswith("vec-isa-check") for _, thread in seen["compiled"]), seen
    assert seen["valid"] == seen["candidates"] and seen["picked"] == best, seen
    assert len(set(seen["bf16"])) <= 1, seen  # the others' AVX512-BF16 answer is the best one's
    # each program built once: the best one's further programs (AVX512-BF16, VNNI, AMX), built in a
    # second thread beside its base program, are the very ones its check then asks for
    assert len(seen["builds"]) == seen["programs"], changed(
        "start_cpu_vector_isa_checks", f"{len(seen['builds'])} builds of {seen['programs']} programs")
    if seen["programs"] > 1:
        assert len(set(seen["builds"])) == 2, seen  # side by side


TESTED.add("inductor_checked_cpu_vector_isas")


# ------------------------------------------------------------------------------ start_precompiling_cpu_kernel_header
_HEADER_PRECOMPILE = r"""
import glob, json, os, sys, threading
import torch
from torch._inductor import codecache
from torch._inductor import config as inductor_config
from bagua_integrations import _torch_compat as compat

if not getattr(inductor_config, "cpp_cache_precompile_headers", False):
    print(json.dumps({"skip": f"Inductor of torch {torch.__version__} precompiles no header"}))
    sys.exit()
ran_in = []

def then():
    ran_in.append(threading.current_thread().name)
    compat.start_precompiling_cpu_kernel_header()

checked = compat.start_cpu_vector_isa_checks(then=then)()
if not checked:  # fewer than two ISAs to check here (or not x86): nothing ran `then`
    compat.start_precompiling_cpu_kernel_header()
for thread in threading.enumerate():
    if thread.name == "inductor-header-precompile":
        thread.join(600)

def headers():
    return {os.path.basename(path): os.stat(path).st_mtime_ns for path in glob.glob(os.path.join(codecache._HEADER_DIR, "*.gch"))}

before = headers()
out = torch.compile(lambda x: x * 2 + 1)(torch.ones(8))  # Inductor's first CPU kernel in this process
print(json.dumps({"checked": checked, "ran_in": ran_in, "before": before, "after": headers(), "ran": out[0].item() == 3}))
"""


def test_precompiled_header_is_the_one_inductors_first_cpu_kernel_uses(tmp_path):
    """The header built in the background (started once the vector ISA is checked) is the very one
    Inductor's first CPU kernel wants: built before that kernel, and not built again (nor another
    one beside it) when it compiles. An empty temporary directory: the first run on a machine."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TMPDIR=str(tmp_path), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", _HEADER_PRECOMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, changed("start_precompiling_cpu_kernel_header", result.stderr[-2000:])
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    if "skip" in seen:
        pytest.skip(seen["skip"])
    assert seen["ran"], seen
    if seen["checked"]:  # `then` ran once, in the checks' thread, after they built
        assert len(seen["ran_in"]) == 1 and seen["ran_in"][0].startswith("vec-isa-check"), seen
    assert len(seen["before"]) == 1, changed("start_precompiling_cpu_kernel_header", f"headers built before the kernel: {seen['before']}")
    assert seen["after"] == seen["before"], changed(
        "start_precompiling_cpu_kernel_header", f"the kernel built its own header: {seen['before']} then {seen['after']}")


TESTED.add("start_precompiling_cpu_kernel_header")


def test_inductor_checked_cpu_vector_isas_follows_inductors_own_cache(monkeypatch):
    """The benchmarks' sign that a CUDA step's graph held a CPU kernel: Inductor's cached ISA list."""
    from torch._inductor import cpu_vec_isa

    torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(8))  # a CPU kernel: Inductor checks
    assert compat.inductor_checked_cpu_vector_isas() is True
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    assert compat.inductor_checked_cpu_vector_isas() is False
    cpu_vec_isa.valid_vec_isa_list()  # answered again from the cached per-ISA checks
    monkeypatch.delattr(cpu_vec_isa, "valid_vec_isa_list")
    assert compat.inductor_checked_cpu_vector_isas() is False  # a torch without it: no answer, no error


def _submodule_imports_in_functions(source: str):
    """(function, line, module) of each ``import a.b`` inside a function: it binds ``a`` as a local
    name of the whole function, so ``a`` read on a path that skips the import is unbound."""
    import ast

    found = []
    for function in ast.walk(ast.parse(source)):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    found += [(function.name, node.lineno, alias.name) for alias in node.names
                              if "." in alias.name and alias.asname is None]
    return found


def test_no_function_imports_a_submodule_by_a_plain_import():
    """A plain ``import torch._inductor.compile_fx`` in the compiler check's CPU branch made ``torch``
    a local name there: the CUDA branch read it unbound, the probe's ``except`` took that for "no
    Triton", and every compiled step on a GPU ran eagerly (H200, torch 2.11). CI has no GPU to see
    such a thing: inside functions, import a submodule by name (``importlib.import_module``) or
    with ``from a import b``."""
    import pathlib

    package = pathlib.Path(compat.__file__).parent
    found = [(path.name, *hit) for path in sorted(package.rglob("*.py"))
             for hit in _submodule_imports_in_functions(path.read_text())]
    assert found == [], f"plain submodule imports inside functions (function, line, module): {found}"
    broken = (  # the compiler check as it was, in short
        "import torch\n"
        "def compiler_available(device_type):\n"
        "    if device_type == 'cpu':\n"
        "        import torch._inductor.compile_fx\n"
        "    return torch.compile\n"
    )
    assert _submodule_imports_in_functions(broken) == [("compiler_available", 4, "torch._inductor.compile_fx")]
