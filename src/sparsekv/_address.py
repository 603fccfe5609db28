"""Tensors reach numba functions by address: ``t.data_ptr()`` and a shape, made an array inside (:func:`array_at`).

A numpy view of a tensor (``Tensor.numpy()``) is cheap while its code is in
the caches, but the code of a decode step's host work is cold: the kernel
before it (the previous op, the previous layer) has streamed megabytes
through every cache level. Measured on the 2-core development machine right
after a block score that read 34 MB, one call each: ``Tensor.numpy()`` 57 us,
a numba call given a numpy view 13 us, the same call given an address and a
length 10 us with no view to make (1.9 us warm). So the kernels' entry points
and the host-side value checks (:mod:`sparsekv._checks`) both take addresses.

Example, a numba function reading an int32 tensor ``offsets`` (C-contiguous, on the CPU, kept alive by the
caller for the call)::

    @numba.njit
    def first(address, n):
        return array_at(address, (n,), np.int32)[0]

    first(offsets.data_ptr(), offsets.shape[0])
"""

from __future__ import annotations

import numba
from numba import types
from numba.extending import intrinsic


@intrinsic
def _pointer_to(typingctx, address, like):
    """``address`` (an integer) as a pointer to elements like ``like``'s: an array, a numpy dtype, or a number
    class such as ``np.float32`` (numba only)."""
    if isinstance(like, (types.Array, types.DType)):
        element = like.dtype
    elif isinstance(like, types.NumberClass):
        element = like.instance_type
    else:
        return None
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return types.CPointer(element)(address, like), codegen


@numba.njit(cache=True, nogil=True, inline="always")
def array_at(address, shape, like):
    """The C-contiguous array of ``shape`` (a tuple) at ``address``, elements like ``like``'s (an array, a numpy
    dtype such as :func:`sparsekv.kernels.cpu._bits.numba_dtype`'s, or a number class such as ``np.float32``),
    numba only. The caller passes a C-contiguous tensor's own shape, kept alive for the call, with elements
    of the type ``like`` names (bf16 as ``uint16`` bits, fp16 as ``int16``, as
    :func:`sparsekv.kernels.cpu._bits.as_numba`)."""
    return numba.carray(_pointer_to(address, like), shape)


__all__ = ["array_at"]
