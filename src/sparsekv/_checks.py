"""Argument checks shared by every public op.

One place raises for bad user input, with the argument's name and what was
expected. ``TypeError`` for the wrong kind or dtype, ``ValueError`` for the
wrong shape or value. Never ``assert``: asserts vanish under ``python -O``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

KEY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64, torch.uint32)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    value: object,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``value`` is a tensor of the given rank, shape and dtype.

    ``shape`` entries that are ``None`` match any size. Returns ``value``.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got shape {tuple(value.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, value.shape)):
            if want is not None and want != got:
                pretty = tuple("*" if s is None else s for s in shape)
                raise ValueError(
                    f"{name}: expected shape {pretty}, got {tuple(value.shape)} (axis {axis})"
                )
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in ({_dtype_names(dtypes)}), got {value.dtype}")
    if device is not None and value.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {value.device}")
    return value


def check_same_dtype(names: Sequence[str], *tensors: torch.Tensor) -> None:
    """Raise ``TypeError`` unless every tensor has the dtype of the first."""
    first = tensors[0].dtype
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != first:
            raise TypeError(f"{name}: expected dtype {first} (same as {names[0]}), got {t.dtype}")


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Check that ``value`` is a Python int (bools refused) at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def as_index_tensor(name: str, value: torch.Tensor, *, ndim: int) -> torch.Tensor:
    """Return an int32 copy/view of an integer index tensor (int32, int64 or uint32).

    uint32 values are reinterpreted bit for bit (so the uint32 sentinel
    ``0xFFFFFFFF`` becomes ``-1``); int64 values outside the int32 range
    become ``-1`` too, so that they stay invalid instead of wrapping around
    to a valid page.
    """
    check_tensor(name, value, ndim=ndim, dtypes=INDEX_DTYPES)
    if value.dtype == torch.int32:
        return value
    if value.dtype == torch.uint32:
        return value.contiguous().view(torch.int32)
    out_of_range = (value < -(2**31)) | (value >= 2**31)
    return torch.where(out_of_range, torch.full_like(value, -1), value).to(torch.int32)


def host_array(t: torch.Tensor) -> np.ndarray:
    """``t``'s values as a numpy array: a view for CPU tensors, a host copy (a sync) for device tensors.

    Value checks read through numpy: the same checks without a torch op's
    overhead (several microseconds each) per check.
    """
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def check_offsets(name: str, offsets: torch.Tensor, *, batch: int | None = None) -> torch.Tensor:
    """Check a ``[B+1]`` row-offset vector: integer, starts at 0, non-decreasing.

    Reads the values (a host sync for device tensors). Returns it as int32.
    """
    offsets = as_index_tensor(name, offsets, ndim=1)
    if batch is not None and offsets.shape[0] != batch + 1:
        raise ValueError(f"{name}: expected shape ({batch + 1},) = batch + 1, got {tuple(offsets.shape)}")
    if offsets.shape[0] < 1:
        raise ValueError(f"{name}: expected at least one entry, got an empty tensor")
    values = host_array(offsets)
    if int(values[0]) != 0:
        raise ValueError(f"{name}: expected offsets[0] == 0, got {int(values[0])}")
    if offsets.shape[0] > 1 and bool((values[1:] < values[:-1]).any()):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {offsets.tolist()}")
    return offsets
