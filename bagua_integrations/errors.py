"""Named exceptions and warnings of bagua_integrations.

Every refusal says what went wrong and what to do about it, so a user never has to
guess whether the fused optimizer changed their math.
"""


class FusionError(RuntimeError):
    """Base class for errors raised while fusing or stepping a fused optimizer."""


class NotAnOptimizerError(FusionError, TypeError):
    """``fuse_optimizer`` was given something that is not a ``torch.optim.Optimizer``."""


class EmptyOptimizerError(FusionError, ValueError):
    """The optimizer has no parameters to fuse."""


class AlreadyFusedError(FusionError):
    """The optimizer was fused before; fusing again would re-flatten its views."""


class NotElementwiseError(FusionError):
    """The optimizer's update of one element depends on other elements.

    Flattening such an optimizer (LAMB, LARS, Adafactor, per-parameter clipping, ...)
    would silently change its math, so it is refused unless the caller asks for the
    exact unfused fallback or explicitly forces fusion.
    """


class LateReductionError(NotElementwiseError):
    """A param group fused elementwise began reducing over whole parameters after the probes'
    window (e.g. clipping after a warm-up) and cannot switch to an exact path here; nothing of
    that step was applied."""


class LayoutChangedError(FusionError):
    """A fused parameter changed device, dtype or shape after fusing."""


class ShardedParameterError(FusionError, TypeError):
    """DTensor parameters that a fused optimizer cannot hold: not sharded by FSDP2 (tensor
    parallelism), mixed with plain parameters in one optimizer, or param groups added after fusing. FSDP2's shards themselves fuse (``fuse_optimizer`` docs)."""


class SharedParameterError(FusionError, ValueError):
    """A parameter is listed in two param groups (or twice in one): the unfused optimizer steps it
    once per listing, which one slot of a flat buffer cannot reproduce."""


class ShardCollectiveError(FusionError):
    """The all-reduce that combines per-parameter reductions (LAMB's norms, BertAdam's clipping) across
    the ranks' FSDP2 shards failed: a rank stopped, crashed or timed out. A communication failure, not
    a compile failure: a compiled step raises it as it is rather than falling back to eager."""


class FusionMismatchError(FusionError):
    """Verification mode (``fuse_optimizer(opt, verify=N)``) found a fused step that differs from
    the unfused one; the parameters and state hold the unfused step's result."""


class FusionFallbackWarning(UserWarning):
    """Some parameters keep the exact unfused (per-tensor) update."""


class CompileFallbackWarning(UserWarning):
    """The compiled fused step could not be used; the eager fused step runs instead."""


def first_line(exc: BaseException) -> str:
    """``Type: first line of its message``: another library's exception inside one line of ours."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
