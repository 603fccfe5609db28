"""Argument checks shared by every public op.

One place raises for bad user input, with the argument's name and what was
expected. ``TypeError`` for the wrong kind or dtype, ``ValueError`` for the
wrong shape or value. Never ``assert``: asserts vanish under ``python -O``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

import numba
import numpy as np
import torch

from ._address import array_at
from ._env import host_checks

_INT32_MIN, _INT32_END = -(2**31), 2**31

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
    got = value.shape
    if shape is not None:
        if got != shape:  # a torch.Size equals a tuple of the same sizes; ``None`` entries fall through here
            _check_shape(name, got, shape)
    elif ndim is not None and len(got) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got shape {tuple(got)}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in ({_dtype_names(dtypes)}), got {value.dtype}")
    if device is not None and value.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {value.device}")
    return value


def _check_shape(name: str, got: torch.Size, shape: Sequence[int | None]) -> None:
    """Raise ``ValueError`` unless ``got`` has ``len(shape)`` sizes, each equal to ``shape``'s where that is not
    ``None``."""
    if len(got) != len(shape):
        raise ValueError(f"{name}: expected a {len(shape)}-d tensor, got shape {tuple(got)}")
    for axis, (want, size) in enumerate(zip(shape, got)):
        if want is not None and want != size:
            pretty = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {pretty}, got {tuple(got)} (axis {axis})")


def check_same_dtype(names: Sequence[str], *tensors: torch.Tensor) -> None:
    """Raise ``TypeError`` unless every tensor has the dtype of the first."""
    first = tensors[0].dtype
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != first:
            raise TypeError(f"{name}: expected dtype {first} (same as {names[0]}), got {t.dtype}")


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Check that ``value`` is an integer (Python or numpy; bools and floats refused) at least ``minimum``.

    Returns it as a Python int. ``2.7`` or ``3.0`` is a ``TypeError``, never truncated.
    """
    if type(value) is not int:  # the common case skips the abstract-class check (~0.3 us)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_float(name: str, value: object, *, minimum: float | None = None, positive: bool = False) -> float:
    """Check that ``value`` is a finite real number (bools refused), ``> 0`` when ``positive``,
    ``>= minimum`` when given. Returns it as a Python float."""
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
        value = float(value)
    if not math.isfinite(value) or (positive and value <= 0) or (minimum is not None and value < minimum):
        want = "a finite float" + (" > 0" if positive else "") + (f" >= {minimum}" if minimum is not None else "")
        raise ValueError(f"{name}: expected {want}, got {value}")
    return value


def check_instance(name: str, value: object, cls: type) -> object:
    """Check that ``value`` is a ``cls`` (``TypeError`` naming what it is otherwise). Returns it."""
    if not isinstance(value, cls):
        raise TypeError(f"{name}: expected a {cls.__name__}, got {type(value).__name__}")
    return value


def check_bool(name: str, value: object) -> bool:
    """Check that ``value`` is a bool (``0``/``1`` refused)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def as_index_tensor(name: str, value: torch.Tensor, *, ndim: int,
                    device: torch.device | None = None) -> torch.Tensor:
    """Return an int32 copy/view of an integer index tensor (int32, int64 or uint32), on ``device`` when given.

    uint32 ``0xFFFFFFFF`` (the sentinel as a uint32 table spells it) becomes
    ``-1``. Any other value that int32 cannot hold (int64 outside
    ``[-2**31, 2**31)``, uint32 at or above ``2**31``) raises ``ValueError``
    naming the value the caller passed, where values are checked
    (:func:`host_checks`); on a GPU without checks it becomes ``-1``, so that
    it stays invalid (masked) instead of wrapping around to a valid page.
    The result moves only when it is elsewhere (a no-op ``.to`` costs 0.25 us).
    """
    result = _as_int32(name, value, ndim)
    return result if device is None or result.device == device else result.to(device)


def _as_int32(name: str, value: torch.Tensor, ndim: int) -> torch.Tensor:
    check_tensor(name, value, ndim=ndim, dtypes=INDEX_DTYPES)
    if value.dtype == torch.int32:
        return value
    if value.dtype == torch.int64 and value.is_cpu:  # one scan and one cast: the torch ops below took 8-25 us
        values = value.reshape(-1).numpy()
        bad = _first_outside_int32(values)
        if bad >= 0:
            _raise_outside_int32(name, int(values[bad]), tuple(int(i) for i in np.unravel_index(bad, value.shape)))
        return value.to(torch.int32)
    wide = value.to(torch.int64)
    if value.dtype == torch.uint32:
        out_of_range = (wide >= _INT32_END) & (wide != 0xFFFFFFFF)
    else:
        out_of_range = (wide < _INT32_MIN) | (wide >= _INT32_END)
    if host_checks(value.device) and value.numel() and bool(out_of_range.any()):
        where = tuple(int(i) for i in torch.nonzero(out_of_range)[0])
        _raise_outside_int32(name, int(wide[where]), where)
    if value.dtype == torch.uint32:
        return value.contiguous().view(torch.int32)
    return torch.where(out_of_range, torch.full_like(wide, -1), wide).to(torch.int32)


@numba.njit(cache=True, nogil=True)
def _first_outside_int32(values):
    """Index of the first of ``values`` (1-d int64) outside ``[-2**31, 2**31)``, or -1."""
    for i in range(values.shape[0]):
        if values[i] < -(2**31) or values[i] >= 2**31:
            return i
    return -1


def _raise_outside_int32(name: str, value: int, where: tuple[int, ...]) -> None:
    index = where[0] if len(where) == 1 else list(where)
    raise ValueError(f"{name}: expected values that fit in int32 [-2**31, 2**31), got {value} at index {index}")


def host_array(t: torch.Tensor) -> np.ndarray:
    """``t``'s values as a numpy array: a view for CPU tensors, a host copy (a sync) for device tensors.

    Value checks read through numpy: the same checks without a torch op's
    overhead (several microseconds each) per check.
    """
    return t.numpy() if t.is_cpu else t.cpu().numpy()


def host_int32(t: torch.Tensor) -> torch.Tensor:
    """An int32 tensor's values as a C-contiguous CPU tensor for the numba value checks, which take its
    address (:func:`sparsekv._address.array_at`): ``t`` itself when it is one, else a contiguous or host
    copy (a sync for device tensors). Keep it alive while they read it. Another dtype raises ``TypeError``:
    its memory read as int32 would be other values, or past its end."""
    if t.dtype != torch.int32:
        raise TypeError(f"expected an int32 tensor for a value check, got {t.dtype}")
    return (t if t.is_cpu else t.cpu()).contiguous()


@numba.njit(cache=True, nogil=True)
def _offsets_fault(address, n, total):
    """What is wrong with the ``n >= 1`` int32 offsets at ``address``: 0 nothing, 1 the first is not 0, 2 one
    is below the one before it, 3 the last is not ``total`` (``total < 0``: not checked)."""
    values = array_at(address, (n,), np.int32)
    if values[0] != 0:
        return 1
    for i in range(1, n):
        if values[i] < values[i - 1]:
            return 2
    if total >= 0 and values[n - 1] != total:
        return 3
    return 0


@numba.njit(cache=True, nogil=True)
def _first_negative(address, n):
    """Index of the first negative of the ``n`` int32 values at ``address``, or -1."""
    values = array_at(address, (n,), np.int32)
    for i in range(n):
        if values[i] < 0:
            return i
    return -1


@numba.njit(cache=True, nogil=True)
def largest(values):
    """The largest of the 1-d integer ``values`` (not empty; numpy's ``max`` on a decode batch's few entries
    took ~2 us, this ~0.2)."""
    if values.shape[0] == 0:
        raise ValueError("largest: expected at least one value")
    best = values[0]
    for i in range(1, values.shape[0]):
        best = max(best, values[i])
    return best


@numba.njit(cache=True, nogil=True)
def most_rows(offsets):
    """``(b, rows)``: the first of the sequences with the most rows in ``offsets [B+1]`` (``(-1, 0)`` when
    ``B = 0``)."""
    best, most = -1, 0
    for b in range(offsets.shape[0] - 1):
        rows = offsets[b + 1] - offsets[b]
        if best < 0 or rows > most:
            best, most = b, rows
    return best, most


def check_offsets(name: str, offsets: torch.Tensor, *, batch: int | None = None, total: int | None = None,
                  total_of: str = "rows", device: torch.device | None = None) -> torch.Tensor:
    """Check a ``[B+1]`` row-offset vector: integer, starts at 0, non-decreasing, ends at ``total``.

    ``batch``: the expected ``B``; ``total``: the expected last offset, with
    ``total_of`` naming what it counts (``"q rows"``). Shape and dtype are
    always checked; the values only where :func:`host_checks` says (a host
    read, a sync for device tensors). Returns the offsets as int32, on
    ``device`` when given.
    """
    offsets = as_index_tensor(name, offsets, ndim=1, device=device)
    if batch is not None and offsets.shape[0] != batch + 1:
        raise ValueError(f"{name}: expected shape ({batch + 1},) = batch + 1, got {tuple(offsets.shape)}")
    if offsets.shape[0] < 1:
        raise ValueError(f"{name}: expected at least one entry, got an empty tensor")
    if not host_checks(offsets.device):
        return offsets
    values = host_int32(offsets)
    fault = _offsets_fault(values.data_ptr(), values.shape[0], -1 if total is None else total)
    if fault == 1:
        raise ValueError(f"{name}: expected offsets[0] == 0, got {int(values[0])}")
    if fault == 2:
        raise ValueError(f"{name}: expected non-decreasing offsets, got {values.tolist()}")
    if fault == 3:
        raise ValueError(f"{name}: expected the last offset to equal the {total} {total_of}, got {int(values[-1])}")
    return offsets


def check_nonnegative(name: str, lengths: torch.Tensor, *, batch: int | None = None,
                      device: torch.device | None = None) -> torch.Tensor:
    """Check a ``[B]`` vector of counts or positions (cache lengths, key counts, query positions): integer, ``>= 0``.

    Values are read where :func:`host_checks` says. Returns it as int32, on ``device`` when given.
    """
    lengths = as_index_tensor(name, lengths, ndim=1, device=device)
    if batch is not None and lengths.shape[0] != batch:
        raise ValueError(f"{name}: expected shape ({batch},) = batch, got {tuple(lengths.shape)}")
    if host_checks(lengths.device) and lengths.numel():
        values = host_int32(lengths)
        bad = _first_negative(values.data_ptr(), values.shape[0])
        if bad >= 0:
            raise ValueError(f"{name}: expected values >= 0, got {int(values[bad])} at index {bad}")
    return lengths


def check_freqs_cis_rows(table_rows: int, num_blocks: torch.Tensor | np.ndarray, ratio: int) -> None:
    """Raise ``ValueError`` unless a ``freqs_cis`` table of ``table_rows`` rows holds every block start.

    ``num_blocks [B]``: blocks pooled per sequence; block ``j`` of a sequence
    is rotated at position ``j * ratio``, so the last one needs row
    ``(num_blocks[b] - 1) * ratio``. Reads the values (a host read).
    """
    counts = host_array(num_blocks) if isinstance(num_blocks, torch.Tensor) else np.asarray(num_blocks)
    if counts.size == 0:
        return
    b = int(np.argmax(counts))
    needed = (int(counts[b]) - 1) * ratio
    if needed >= table_rows:
        raise ValueError(f"freqs_cis: sequence {b} needs position {needed} (its block {int(counts[b]) - 1}) "
                         f"but the table has {table_rows} rows")
