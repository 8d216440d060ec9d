"""Input contracts of the ladder entry points: ValueError / TypeError naming the argument, the
expected and the actual value, raised before any launch.

Order of checks in every entry point: types and dtypes, ranks, shapes, `out`, contiguity, devices
(last, so shape and dtype errors are testable with CPU or meta tensors), overlap of `out` with
the inputs.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def _names(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def tensor(name: str, t: object, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
           ndim: int | None = None, min_ndim: int = 0) -> torch.Tensor:
    """`t` is a tensor of one of `dtypes`, of rank `ndim` (or at least `min_ndim`)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_names(dtypes)}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(
            f"{name}: expected a {ndim}-D tensor, got {t.dim()}-D with shape {tuple(t.shape)}"
        )
    if t.dim() < min_ndim:
        raise ValueError(
            f"{name}: expected at least {min_ndim} dimensions, got {t.dim()}-D with shape "
            f"{tuple(t.shape)}"
        )
    return t


def same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name}: expected dtype {ref.dtype} (the dtype of {ref_name}), got {t.dtype}")


def shape(name: str, t: torch.Tensor, expected: Sequence[int], why: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({why}), got {tuple(t.shape)}")


def real(name: str, value: object) -> float:
    """A Python or numpy real number (not a bool, not a tensor)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number (int or float), got {type(value).__name__}")
    return float(value)


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def out(t: object, expected_shape: Sequence[int], dtype: torch.dtype, why: str) -> torch.Tensor:
    """A caller's `out=`: a contiguous tensor of exactly the shape and dtype the rung produces."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"out: expected dtype {dtype} ({why}), got {t.dtype}")
    shape("out", t, expected_shape, why)
    contiguous("out", t)
    return t


def contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor, got strides {t.stride()} for shape "
            f"{tuple(t.shape)}; pass {name}.contiguous()"
        )


def cuda_devices(**tensors: torch.Tensor | None) -> torch.device:
    """Every tensor given is on one CUDA device; returns it."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    device = first.device
    for name, t in items[1:]:
        if t.device != device:
            raise ValueError(
                f"{name}: expected a tensor on {device} (the device of {first_name}), got {t.device}"
            )
    if device.type != "cuda":
        raise ValueError(
            f"{first_name}: expected a CUDA tensor, got a tensor on {device} (the ladder kernels "
            f"run on the GPU: move the inputs with .cuda())"
        )
    return device


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def no_overlap(out_t: torch.Tensor, allow_alias: bool = False, **inputs: torch.Tensor) -> None:
    """`out` shares no memory with an input, except (when `allow_alias`) by being that very
    tensor: the elementwise and softmax rungs may run in place."""
    o0, o1 = _byte_range(out_t)
    if o0 == o1:
        return
    for name, t in inputs.items():
        i0, i1 = _byte_range(t)
        if i0 == i1 or o1 <= i0 or i1 <= o0:
            continue
        same = (out_t.data_ptr() == t.data_ptr() and out_t.shape == t.shape
                and out_t.stride() == t.stride() and out_t.dtype == t.dtype)
        if allow_alias and same:
            continue
        rule = (f"out may be {name} itself (in place) but must not otherwise share memory with it"
                if allow_alias else "out must not share memory with an input")
        raise ValueError(f"out: overlaps the memory of {name}; {rule}")
