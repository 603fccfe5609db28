"""bf16 and fp16 in numba CPU kernels: tensors as raw 16-bit arrays, widened and rounded bit-exactly as torch casts.

numba has neither 16-bit float type, so a kernel receives a bf16 tensor as its
``uint16`` bit patterns and an fp16 tensor as its ``int16`` bit patterns
(:func:`as_numba`; the two integer types keep the formats apart when numba
picks a specialisation). Inside a kernel :func:`widen` turns an element of
either, or of a float array, into float32 exactly, and :func:`narrow` rounds a
float32 to the element type of an output array, to nearest even, exactly as
torch casts (NaN as torch writes it). Every one of the 65536 patterns of each
format widens as torch widens it.

Example: a bf16 ``[T, D]`` tensor ``k`` reaches a kernel as
``as_numba(k)`` (``uint16 [T, D]``); there ``widen(bits[t, d])`` is the
float32 value of ``k[t, d]`` and ``out[t, d] = narrow(value, out)`` stores a
float32 ``value`` rounded to bf16 when ``out`` is ``as_numba`` of a bf16
tensor, and unchanged when it is a float32 array.

bf16 conversions are 32-bit integer operations in LLVM IR (a shift; a
rounding add), so loops over them vectorise. fp16 conversions use LLVM's
``half`` type, which x86 CPUs with F16C (``VCVTPH2PS``/``VCVTPS2PH``) and
aarch64 convert in hardware, 16 lanes at a time; on other CPUs they fall back
to integer arithmetic (``f16_to_f32_in_integers``, ``f32_to_f16_in_integers``:
branches, scalar, 4x slower in the compress kernel).
"""

from __future__ import annotations

import platform

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic, overload


@intrinsic
def _bf16_bits_to_f32(typingctx, bits):
    """Low 16 bits of an integer, as bf16 -> float32: shifted into the high half of a 32-bit word."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        low = builder.trunc(args[0], ir.IntType(16)) if bits.bitwidth > 16 else args[0]
        word = builder.shl(builder.zext(low, i32), ir.Constant(i32, 16))
        return builder.bitcast(word, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_to_bf16_bits(typingctx, value):
    """float32 -> bf16 bits (``uint16``), to nearest even, NaN -> ``0x7FC0``, in 32-bit integer ops.

    ``bits + 0x7FFF + lsb`` cannot wrap for a non-NaN float (the largest is
    ``0xFF7FFFFF``), and NaNs are replaced afterwards, so 32 bits suffice and
    the conversion vectorises 16 lanes wide (numba's own integer typing would
    widen the arithmetic to 64 bits).
    """
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        lsb = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = builder.lshr(builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), lsb), ir.Constant(i32, 16))
        is_nan = builder.fcmp_unordered("uno", args[0], args[0])
        result = builder.select(is_nan, ir.Constant(i32, 0x7FC0), rounded)
        return builder.trunc(result, ir.IntType(16))

    return types.uint16(types.float32), codegen


@numba.njit(cache=True)
def bf16_to_f32(bits):
    """bf16 bit pattern (any integer type) -> its float32 value: the pattern shifted into the high half."""
    return _bf16_bits_to_f32(bits)


@numba.njit(cache=True)
def f32_to_bf16(value):
    """float32 -> bf16 bit pattern (``uint16``), rounded to nearest even; NaN -> ``0x7FC0``."""
    return _f32_to_bf16_bits(np.float32(value))


@intrinsic
def _f16_bits_to_f32(typingctx, bits):
    """Low 16 bits of an integer, as fp16 -> float32: LLVM's ``fpext half`` (``VCVTPH2PS``, exact,
    subnormals included; 16 lanes at a time in a vectorised loop)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(16)) if bits.bitwidth > 16 else args[0]
        return builder.fpext(builder.bitcast(low, ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_to_f16_bits(typingctx, value):
    """float32 -> fp16 bits (``int16``): LLVM's ``fptrunc`` to ``half`` (``VCVTPS2PH``: to nearest even,
    overflow to inf, subnormal results exact), NaN -> ``sign | 0x7E00`` as torch writes it."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i16 = ir.IntType(16)
        rounded = builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), i16)
        sign = builder.and_(rounded, ir.Constant(i16, 0x8000))
        nan = builder.or_(sign, ir.Constant(i16, 0x7E00))
        return builder.select(builder.fcmp_unordered("uno", args[0], args[0]), nan, rounded)

    return types.int16(types.float32), codegen


def target_cpu_features() -> set[str]:
    """The CPU features numba compiles for (``+avx512bf16``, ...): ``NUMBA_CPU_FEATURES`` when set, none
    when only ``NUMBA_CPU_NAME`` is (a portable build), else the host's."""
    features = numba.core.config.CPU_FEATURES
    if features is None:
        features = "" if numba.core.config.CPU_NAME else get_host_cpu_features()
    return set(features.split(","))


def _half_conversions_in_hardware() -> bool:
    """Whether numba compiles for a CPU that converts fp16 itself (x86 with F16C, or aarch64); elsewhere
    LLVM would call runtime helpers that numba's JIT may not have."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    return machine in ("x86_64", "amd64") and "+f16c" in target_cpu_features()


HALF_CONVERSIONS_IN_HARDWARE = _half_conversions_in_hardware()


@numba.njit(cache=True)
def f16_to_f32_in_integers(bits):
    """:func:`f16_to_f32` in integer arithmetic, for CPUs without fp16 conversions."""
    h = np.int64(np.uint16(bits))
    sign = (h & 0x8000) << 16
    exponent = (h >> 10) & 0x1F
    mantissa = h & 0x3FF
    if exponent == 0:  # zero or subnormal: mantissa * 2**-24, exact in float32
        magnitude = np.float32(mantissa) * np.float32(5.9604644775390625e-08)
        return -magnitude if sign else magnitude
    if exponent == 31:
        return np.uint32(sign | 0x7F800000 | (mantissa << 13)).view(np.float32)
    return np.uint32(sign | ((exponent + 112) << 23) | (mantissa << 13)).view(np.float32)


@numba.njit(cache=True)
def f32_to_f16_in_integers(value):
    """:func:`f32_to_f16` in integer arithmetic, for CPUs without fp16 conversions."""
    bits = np.int64(np.float32(value).view(np.uint32))
    sign = (bits >> 16) & 0x8000
    magnitude = bits & 0x7FFFFFFF
    if magnitude > 0x7F800000:
        return np.int16(np.uint16(sign | 0x7E00))  # NaN
    if magnitude >= 0x47800000:  # >= 65536 (or inf): inf
        return np.int16(np.uint16(sign | 0x7C00))
    if magnitude < 0x38800000:  # below 2**-14: subnormal half, round(|x| * 2**24) to even
        scaled = np.int64(np.rint(abs(np.float32(value)) * np.float32(16777216.0)))
        return np.int16(np.uint16(sign | scaled))
    mantissa = magnitude & 0x7FFFFF
    half = (((magnitude >> 23) - 112) << 10) | (mantissa >> 13)
    rest = mantissa & 0x1FFF
    if rest > 0x1000 or (rest == 0x1000 and (half & 1)):
        half += 1  # a carry into the exponent is right, up to inf
    return np.int16(np.uint16(sign | half))


@numba.njit(cache=True)
def f16_to_f32(bits):
    """fp16 bit pattern (any integer type) -> its float32 value (exact, subnormals included)."""
    if HALF_CONVERSIONS_IN_HARDWARE:  # a global: numba compiles one branch
        return _f16_bits_to_f32(bits)
    return f16_to_f32_in_integers(bits)


@numba.njit(cache=True)
def f32_to_f16(value):
    """float32 -> fp16 bit pattern (``int16``), rounded to nearest even; overflow -> inf, NaN -> ``0x7E00``."""
    if HALF_CONVERSIONS_IN_HARDWARE:
        return _f32_to_f16_bits(np.float32(value))
    return f32_to_f16_in_integers(value)


def widen(x):
    """Element of a bf16 (``uint16`` bits), fp16 (``int16`` bits) or float array -> float32 (numba only)."""
    raise NotImplementedError


@overload(widen)
def _widen_overload(x):
    if x == types.uint16:
        return lambda x: bf16_to_f32(x)
    if x == types.int16:
        return lambda x: f16_to_f32(x)
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    return None


def narrow(value, like):
    """float32 -> the element type of the array ``like``, rounded to nearest even (numba only)."""
    raise NotImplementedError


@overload(narrow)
def _narrow_overload(value, like):
    if like.dtype == types.uint16:
        return lambda value, like: f32_to_bf16(value)
    if like.dtype == types.int16:
        return lambda value, like: f32_to_f16(value)
    if like.dtype == types.float32:
        return lambda value, like: np.float32(value)
    return None


def as_numba(t: torch.Tensor) -> np.ndarray:
    """A numpy view of ``t`` (no copy): bf16 as ``uint16`` bits, fp16 as ``int16`` bits, other dtypes as they are."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)  # via int16: torch's uint16 numpy support is recent
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy()
    return t.numpy()


_NUMBA_DTYPES = {torch.bfloat16: np.dtype(np.uint16), torch.float16: np.dtype(np.int16)}


def numba_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of :func:`as_numba`'s view of a ``dtype`` tensor (bf16 ``uint16``, fp16 ``int16`` bits)."""
    found = _NUMBA_DTYPES.get(dtype)
    if found is None:
        found = _NUMBA_DTYPES[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
    return found


@numba.njit(cache=True, nogil=True, inline="always")
def copy_row(target, source):
    """``target[:] = source`` for two 1-d arrays of one element type (e.g. :func:`as_numba` views), a loop
    between the views: numba's slice assignment measured 2.4x slower for float32 rows of 512, 6x for bf16."""
    for i in range(source.shape[0]):
        target[i] = source[i]
