"""Which kernel runs a call (DESIGN.md §5): the first family, in order of preference, whose
`can_implement(call)` says yes.

    forward(call: FwdCall) -> str    # fills call.out, call.lse; returns the family that ran
    backward(call: BwdCall) -> str   # fills call.dq, call.dk, call.dv

CUDA tensors: the families of FWD_FAMILIES / BWD_FAMILIES, each module imported lazily (an absent
one is skipped as "not built"). Why each skipped family was skipped is logged at DEBUG, which one
runs at INFO (once per specialisation). When none can, NotImplementedError lists every reason.
CPU tensors: the portable tiled reference (flashcuda.reference), with a warning, once, that the
CUDA kernels need a GPU.

FLASHCUDA_FORCE_KERNEL (tests, benchmarks): a comma-separated list of family names, e.g.
`fwd_simt,bwd_simt`; the entries starting with `fwd_` replace the forward's order of preference,
those starting with `bwd_` the backward's; `portable` runs the torch reference, also on CUDA.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterator
from types import ModuleType

from .._env import env_names, env_values
from .._log import log_once, logger
from .call import DTYPE_NAME, BwdCall, FwdCall

FWD_FAMILIES = ("fwd_sm90", "fwd_sm80", "fwd_simt")
BWD_FAMILIES = ("bwd_sm90", "bwd_sm90_wide", "bwd_sm80", "bwd_simt")
PORTABLE = "portable"
FORCE_ENV = "FLASHCUDA_FORCE_KERNEL"

_modules: dict[str, ModuleType | str] = {}


def _family(name: str) -> ModuleType | str:
    """The family's module, or the reason it cannot be used (memoised)."""
    found = _modules.get(name)
    if found is not None:
        return found
    full = f"{__package__}.{name}"
    try:
        found = importlib.import_module(full)
    except ModuleNotFoundError as exc:
        found = "not built" if exc.name == full else f"cannot be imported: {exc}"
    except ImportError as exc:
        found = f"cannot be imported: {exc}"
    _modules[name] = found
    return found


def families(direction: str) -> tuple[str, ...]:
    """The order of preference for 'fwd' or 'bwd', after FLASHCUDA_FORCE_KERNEL."""
    default = FWD_FAMILIES if direction == "fwd" else BWD_FAMILIES
    forced = os.environ.get(FORCE_ENV, "").strip()
    if not forced:
        return default
    names = [n.strip() for n in forced.split(",") if n.strip()]
    mine = tuple(n for n in names if n == PORTABLE or n.startswith(direction + "_"))
    return mine or default


def _candidates(call: FwdCall | BwdCall) -> Iterator[tuple[str, str | None]]:
    direction = "bwd" if isinstance(call, BwdCall) else "fwd"
    for name in families(direction):
        if name == PORTABLE:
            yield name, None
            continue
        module = _family(name)
        yield name, (module if isinstance(module, str) else module.can_implement(call))


def explain(call: FwdCall | BwdCall) -> list[tuple[str, str | None]]:
    """(family, reason it cannot run `call`, or None) for every family in order of preference."""
    return list(_candidates(call))


def _describe(call: FwdCall | BwdCall) -> str:
    if call.window_left is None and call.window_right is None:
        mask = "full"
    elif call.window_left is None and call.window_right == 0:
        mask = "causal"
    else:
        mask = f"window({call.window_left},{call.window_right})"
    gqa = f" gqa{call.nheads // call.nheads_kv}" if call.nheads != call.nheads_kv else ""
    det = " deterministic" if isinstance(call, BwdCall) and call.deterministic else ""
    return (f"{DTYPE_NAME.get(call.dtype, str(call.dtype))} d{call.head_dim} {mask}{gqa}{det} "
            f"on {call.device}")


def _run_portable(call: FwdCall | BwdCall) -> None:
    from .. import reference

    if isinstance(call, BwdCall):
        reference.attention_tiled_backward(
            call.dout, call.q, call.k, call.v, call.out, call.lse, call.softmax_scale,
            call.window_left, call.window_right, dq=call.dq, dk=call.dk, dv=call.dv)
    else:
        reference.attention_tiled(call.q, call.k, call.v, call.softmax_scale, call.window_left,
                                  call.window_right, out=call.out, lse=call.lse)


def _dispatch(call: FwdCall | BwdCall, direction: str) -> str:
    if call.device.type != "cuda":
        log_once(logging.WARNING,
                 f"tensors on {call.device.type}: running the portable PyTorch path (the tiled "
                 "reference); the CUDA kernels need a CUDA GPU")
        _run_portable(call)
        return PORTABLE
    return run_families(call, direction)


# the switches any family's can_implement reads (part of the plan key)
_KEY_ENV = env_names(FORCE_ENV, "FLASHCUDA_ENABLE_SM90", "FLASHCUDA_ENABLE_SM90_BWD",
                     "FLASHCUDA_ENABLE_SM90_BWD_WIDE",
                     "FLASHCUDA_SM90_BWD_WATCHDOG", "FLASHCUDA_SM90_BWD_FENCE",
                     "FLASHCUDA_SM90_BWD_DQ", "FLASHCUDA_SM90_BWD_DEFINES",
                     "FLASHCUDA_BWD_SM80_CONFIG")


def _plan_key(call: FwdCall | BwdCall, direction: str) -> tuple:
    """Everything can_implement looks at: two calls with equal keys get the same family."""
    extra = (call.deterministic,) if isinstance(call, BwdCall) else ()
    return (direction, env_values(_KEY_ENV), call.dtype, call.device, call.window_left,
            call.window_right, call.softmax_scale > 0, *extra, *call.layouts())


# plan key -> family module that can run it (the first choice, checked once).
_plans: dict[tuple, ModuleType] = {}


def run_families(call: FwdCall | BwdCall, direction: str) -> str:
    """Run `call` with the first family in order of preference that can implement it."""
    key = _plan_key(call, direction)
    module = _plans.get(key)
    if module is not None:
        module.run(call)  # run() re-checks can_implement: a stale plan cannot run a wrong kernel
        return module.__name__.rsplit(".", 1)[-1]
    what = _describe(call)
    reasons: list[str] = []
    for name, reason in _candidates(call):
        if reason is not None:
            log_once(logging.DEBUG, f"{direction} {what}: skipped {name}: {reason}")
            reasons.append(f"{name}: {reason}")
            continue
        log_once(logging.INFO, f"{direction} {what}: running {name}")
        if name == PORTABLE:
            _run_portable(call)
        else:
            module = _family(name)
            if isinstance(module, str):  # explain() already reported it; unreachable
                raise RuntimeError(module)
            module.run(call)
            if len(_plans) > 4096:
                _plans.clear()
            _plans[key] = module
        return name
    raise NotImplementedError(
        f"no flashcuda {direction} kernel can run {what}: " + "; ".join(reasons))


def forward(call: FwdCall) -> str:
    """Fill call.out / call.lse with the preferred family that can; return its name."""
    return _dispatch(call, "fwd")


def backward(call: BwdCall) -> str:
    """Fill call.dq / call.dk / call.dv with the preferred family that can; return its name."""
    return _dispatch(call, "bwd")


def _reset() -> None:
    """Forget imported families (tests)."""
    _modules.clear()
    _plans.clear()
    logger.debug("dispatch: family cache cleared")
