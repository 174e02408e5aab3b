"""Every use of torch's private API, in one place.

Each function here reaches into something torch does not promise to keep. They are
collected so that a new torch release breaks *this* module, loudly, instead of silently
changing the math somewhere else: ``tests/test_torch_compat.py`` exercises each one on the
installed torch and fails with the function's name if the private API moved.

Checked on torch 2.1 - 2.13 (the package's supported range); ``CHECKED_ON`` is the newest
release the tests ran on.
"""

from __future__ import annotations

import os
from typing import Callable, Tuple

import torch

CHECKED_ON = "2.13.0"

__all__ = [
    "CHECKED_ON",
    "unwrapped_step",
    "forget_float_specializations",
    "queue_end_of_backward",
    "inductor_backend",
    "step_keeping_lr_scheduler_marker",
    "mark_step_taken",
    "tensor_version",
]


def unwrapped_step(cls) -> Tuple[Callable, bool]:
    """``cls.step`` without torch's profiling/hook wrapper and its grad-mode wrapper.

    Returns ``(step, strips_grad_mode)``. Private: torch marks its hook wrapper with
    ``hooked`` (``Optimizer._patch_step_function``) and the grad-mode wrapper is the inner
    function ``_use_grad`` of ``torch/optim/optimizer.py``, recognised by its code name.
    The grad-mode wrapper graph-breaks on purpose (so that Dynamo traces an inference graph);
    callers get the same effect by setting the grad mode themselves, which keeps
    ``fullgraph=True`` possible.
    """
    fn = cls.step
    if getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    code = getattr(fn, "__code__", None)
    if code is not None and code.co_name == "_use_grad" and code.co_filename.endswith(os.path.join("optim", "optimizer.py")):
        return fn.__wrapped__, True
    return fn, False


def forget_float_specializations() -> None:
    """Clear Dynamo's process-wide memory of floats it had to specialize.

    Private: ``torch._dynamo.symbolic_convert.TensorifyState`` remembers, by symbolic name
    ("zf0", ...), floats that once had to be specialized and applies that to every later
    frame: one optimizer whose step branches on a float would make every other optimizer
    recompile on each new learning rate. Torch releases without it need nothing.
    """
    try:
        from torch._dynamo.symbolic_convert import TensorifyState
    except ImportError:
        return
    TensorifyState.clear()


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (what DDP's reducer does).

    Private: ``Variable._execution_engine.queue_callback``; only valid inside backward.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def inductor_backend() -> Callable:
    """Inductor's ``compile_fx``, used as a counting ``torch.compile`` backend (private module path)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx


def step_keeping_lr_scheduler_marker(optimizer: torch.optim.Optimizer, new_step: Callable) -> Callable:
    """``new_step`` made fit to replace ``optimizer.step`` after an LR scheduler wrapped it.

    Private: a scheduler built before ``step`` is replaced tags its wrapper with
    ``_wrapped_by_lr_sched`` and sets ``optimizer._opt_called`` when called; without them it
    warns "optimizer.step() has been overridden" / "lr_scheduler.step() before
    optimizer.step()". Returns ``new_step`` itself when no scheduler wrapped ``step``.
    """
    if not getattr(optimizer.__dict__.get("step"), "_wrapped_by_lr_sched", False):
        return new_step

    def step(*args, **kwargs):
        optimizer._opt_called = True
        return new_step(*args, **kwargs)

    step._wrapped_by_lr_sched = True
    step.__doc__ = new_step.__doc__
    return step


def mark_step_taken(optimizer: torch.optim.Optimizer) -> None:
    """Tell LR schedulers that ``optimizer`` stepped (``fuse_step()`` bypasses their wrapper).

    Private: schedulers read ``optimizer._opt_called`` to warn about ``scheduler.step()``
    before ``optimizer.step()``.
    """
    optimizer._opt_called = True


def tensor_version(tensor: torch.Tensor) -> int:
    """Autograd's in-place modification counter of ``tensor`` (underscored attribute ``_version``)."""
    return tensor._version
