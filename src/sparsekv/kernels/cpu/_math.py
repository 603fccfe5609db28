"""Vectorisable float32 math for the numba CPU kernels: ``exp_f32`` and the intrinsics it is built from.

numba lowers ``np.exp`` on a float32 to a libm call per element, which LLVM
cannot vectorise; :func:`exp_f32` is branch-free float32 arithmetic that it
vectorises 16 lanes wide. Used by the k-pool softmax and sparse attention.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# exp(x) = 2**n * exp(r), x = n*ln2 + r, |r| <= ln2/2; _LN2_HI has 9 significant bits, so
# n*_LN2_HI is exact for every n used here. _EXP_POLY: (exp(r) - 1 - r) / r**2 ~ sum c_i r**i, a
# relative-error least-squares fit on Chebyshev nodes (error 1.1e-9, far below float32's 6e-8).
_LOG2_E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_FLOOR = np.float32(-87.0)  # below this exp(x) < 1.7e-38: the kernel returns 0 (a normal 2**n needs n >= -126)
_EXP_POLY = tuple(np.float32(c) for c in (0.5, 0.1666666567325592, 0.041666269302368164, 0.00833342969417572,
                                          0.0013946021208539605, 0.00019826495554298162))


@intrinsic
def _bits_to_f32(typingctx, bits):
    """The float32 whose bits are the low 32 bits of the integer ``bits`` (a register move)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _fma_f32(typingctx, a, b, c):
    """``a*b + c`` with one rounding (``llvm.fma``, which LLVM vectorises)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
        return builder.call(fma, args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@numba.njit(inline="always", cache=True, error_model="numpy")
def exp_f32(x: np.float32) -> np.float32:
    """``exp(x)`` for float32 ``x <= 0``, in float32: within 1 ulp, branch-free, vectorisable.

    Cody-Waite reduction with fused multiply-adds, the degree-7 polynomial
    ``1 + r + r**2 * P(r)`` in Horner form, scaled by ``2**n`` built from its
    bits. 0 below ``_EXP_FLOOR``; NaN stays NaN; ``exp(0)`` is exactly 1.
    """
    clamped = _EXP_FLOOR if x < _EXP_FLOOR else x
    n = np.floor(clamped * _LOG2_E + np.float32(0.5))
    r = _fma_f32(-n, _LN2_HI, clamped)
    r = _fma_f32(-n, _LN2_LO, r)
    c = _EXP_POLY
    p = _fma_f32(c[5], r, c[4])
    p = _fma_f32(p, r, c[3])
    p = _fma_f32(p, r, c[2])
    p = _fma_f32(p, r, c[1])
    p = _fma_f32(p, r, c[0])
    p = _fma_f32(p, r * r, r) + np.float32(1.0)
    scale = _bits_to_f32((np.int32(n) + 127) << 23)  # 2**n, n >= -126: a normal float32
    y = p * scale
    return np.float32(0.0) if x < _EXP_FLOOR else y


@numba.njit(inline="always", cache=True, error_model="numpy")
def scale_logits(logits, n0, n1, lanes, scale, row_max):
    """``logits[n, :lanes] *= scale`` (float32) for ``n0 <= n < n1``, in key order, raising ``row_max [lanes]`` to
    the largest of them (the first of equal values stays; NaN never counts)."""
    for n in range(n0, n1):
        for h in range(lanes):
            value = logits[n, h] * np.float32(scale)
            logits[n, h] = value
            row_max[h] = value if value > row_max[h] else row_max[h]


@numba.njit(inline="always", cache=True, error_model="numpy")
def exp_weights(logits, n0, n1, lanes, row_max, denom):
    """``logits[n, h] = exp_f32(logits[n, h] - row_max[h])`` for ``n0 <= n < n1``, ``h < lanes``, each added to
    ``denom[h]`` in key order."""
    for n in range(n0, n1):
        for h in range(lanes):
            weight = exp_f32(logits[n, h] - row_max[h])
            logits[n, h] = weight
            denom[h] += weight


@numba.njit(inline="always", cache=True, error_model="numpy")
def scaled_softmax_in_place(logits, count, lanes, scale):
    """Turn ``logits[:count, :lanes]`` (float32 dots, one column per head) into unnormalised softmax weights.

    Each dot is first multiplied by ``scale`` (float32); then ``w = exp_f32(logit - max)`` per column, in
    key order. Returns ``(row_max [lanes], denom [lanes])`` float32, ``denom`` the sum of the weights in key
    order, so the log-sum-exp of a column is ``row_max + log(denom)``.
    """
    row_max = np.full(lanes, -np.inf, np.float32)
    scale_logits(logits, 0, count, lanes, scale, row_max)
    denom = np.zeros(lanes, np.float32)
    exp_weights(logits, 0, count, lanes, row_max, denom)
    return row_max, denom


@numba.njit(cache=True, nogil=True, error_model="numpy")
def scaled_softmax_of_members(logits, count, selected, scale):
    """:func:`scaled_softmax_in_place` where lane ``l`` counts only the keys ``n`` with ``selected[n, l]``
    (several query rows packed in one tile, each over its own keys among the tile's).

    A counted key's weight, and each lane's ``row_max`` and ``denom``, come out with exactly the operations
    and order :func:`scaled_softmax_in_place` uses on that lane's own keys: the others enter the max as
    ``-inf`` and the sum as an exact 0, and weigh 0. ``logits [count, lanes]`` float32, ``selected
    [count, lanes]`` bool. Returns ``(row_max, denom)``.
    """
    lanes = logits.shape[1]
    row_max = np.full(lanes, -np.inf, np.float32)
    for n in range(count):
        for lane in range(lanes):
            value = logits[n, lane] * np.float32(scale)
            logits[n, lane] = value
            candidate = value if selected[n, lane] else np.float32(-np.inf)
            row_max[lane] = candidate if candidate > row_max[lane] else row_max[lane]
    denom = np.zeros(lanes, np.float32)
    for n in range(count):
        for lane in range(lanes):
            weight = exp_f32(logits[n, lane] - row_max[lane])
            weight = weight if selected[n, lane] else np.float32(0.0)
            logits[n, lane] = weight
            denom[lane] += weight
    return row_max, denom
