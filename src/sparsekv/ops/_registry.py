"""Backend choice for every public op.

Each op family ``F`` has one module per backend with functions of the same
names: ``sparsekv.kernels.reference.F`` (readable PyTorch, the oracle),
``sparsekv.kernels.cpu.F`` (fast CPU path) and ``sparsekv.kernels.triton.F``
(GPU kernels; on CPU tensors only through Triton's interpreter).

A backend module may leave out an op (or a whole family): the registry then
runs the reference implementation for it (:func:`load_kernel`), so no backend
carries stubs that re-export the reference.

``SPARSEKV_BACKEND`` (read in :mod:`sparsekv._env`) overrides the automatic choice:

* ``auto`` (default): ``cpu`` for CPU tensors, ``triton`` for CUDA tensors
  (``reference`` when Triton is missing);
* ``reference``: the PyTorch oracle on any device;
* ``cpu`` / ``triton``: force that backend (``triton`` on CPU tensors needs
  ``TRITON_INTERPRET=1``).

``SPARSEKV_DEBUG=1`` makes GPU ops run the host-side validation (page
bounds, offsets) that they otherwise skip to stay free of host syncs.

:func:`out_op` registers every public op's body as an out-style torch custom
op ``sparsekv::<name>`` and gives the public Python function its entry point.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

import torch

from .._env import BACKEND_ENV, BACKENDS, debug_checks, is_cpu, requested_backend

__all__ = ["BACKENDS", "BACKEND_ENV", "choose_backend", "debug_checks", "dispatch_needed", "kernel", "load_kernel",
           "optional_kernel", "out_op", "triton_status"]


@functools.lru_cache(maxsize=None)
def triton_status() -> tuple[bool, str]:
    """Whether Triton kernels can run here, and why not when they cannot."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        return False, f"triton is not importable ({exc})"
    return True, "ok"


def choose_backend(device: torch.device) -> str:
    """The backend an op on ``device`` runs with, honouring ``SPARSEKV_BACKEND``."""
    forced = requested_backend()
    if forced != "auto":
        if forced == "triton":
            ok, why = triton_status()
            if not ok:
                raise RuntimeError(f"{BACKEND_ENV}=triton but {why}")
            if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
                raise RuntimeError(f"{BACKEND_ENV}=triton on CPU tensors needs TRITON_INTERPRET=1")
        if forced == "cpu" and device.type != "cpu":
            raise RuntimeError(f"{BACKEND_ENV}=cpu but the tensors are on {device}")
        return forced
    if is_cpu(device):
        return "cpu"
    if device.type == "cuda" and triton_status()[0]:
        return "triton"
    return "reference"


def _no_outputs(*args: object) -> None:
    """The fake (meta) implementation of every out-style op: the outputs are the caller's tensors."""
    return None


def dispatch_needed(args: tuple) -> bool:
    """Whether a call must go through torch's dispatcher: under torch.compile/export, for tensor
    subclasses (fake or functional tensors), meta tensors, or tensors that require grad while grad
    mode is on. An ``nn.Parameter`` (a layer's weight) is a plain tensor here, and so is one that
    requires grad under ``torch.no_grad()`` (inference: autograd records nothing, and the dispatcher
    cost 70-90 us a call)."""
    if torch.compiler.is_compiling():
        return True
    grad_mode = torch.is_grad_enabled()
    for a in args:  # a plain loop: ``any`` over a generator cost 1.0 us for seven arguments, this 0.76
        if type(a) in _PLAIN_TENSOR_TYPES:
            if (a.requires_grad and grad_mode) or a.is_meta:
                return True
        elif isinstance(a, torch.Tensor):
            return True
    return False


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def out_op(name: str, mutates_args: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """Register ``body`` as the custom op ``sparsekv::<name>`` (writes its outputs in place, returns None).

    The returned entry runs ``body`` directly on plain tensors and goes through
    the dispatcher (``torch.ops.sparsekv.<name>``) whenever torch traces or a
    tensor needs it (:func:`dispatch_needed`): the custom op's Python layers
    cost ~70 us a call, a third of a decode-sized score kernel. Both paths run
    the same ``body``; the op object is ``entry.custom_op``, its name (the
    kernel's name in every backend) ``entry.op_name``.
    """

    def register(body: Callable) -> Callable:
        op = torch.library.custom_op(f"sparsekv::{name}", mutates_args=mutates_args)(body)
        op.register_fake(_no_outputs)

        @functools.wraps(body)
        def entry(*args: object) -> None:
            if dispatch_needed(args):
                return op(*args)
            return body(*args)

        entry.custom_op = op
        entry.op_name = name
        return entry

    return register


def kernel(family: str, name: str, device: torch.device) -> Callable:
    """The implementation of ``family.name`` for tensors on ``device``."""
    return load_kernel(choose_backend(device), family, name)


def optional_kernel(family: str, name: str, device: torch.device) -> Callable | None:
    """The chosen backend's own ``name`` in ``family`` for tensors on ``device``, or ``None`` where it has none.

    For what a backend may offer beyond the ops (a fast path set up once and
    run many times, such as :class:`sparsekv.kernels.cpu.kpool.ScorePlan`):
    no reference stands in, the caller falls back to the op itself.
    """
    return _own_function(choose_backend(device), family, name)


def _own_function(backend: str, family: str, name: str) -> Callable | None:
    """``name`` from ``sparsekv.kernels.<backend>.<family>``; ``None`` where the module does not exist (the
    reference's must) or does not define it. Any other import failure propagates."""
    module_name = f"sparsekv.kernels.{backend}.{family}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name or backend == "reference":
            raise
        return None
    return getattr(module, name, None)


@functools.lru_cache(maxsize=None)
def load_kernel(backend: str, family: str, name: str) -> Callable:
    """``name`` from ``sparsekv.kernels.<backend>.<family>``, or the reference's when that backend lacks it.

    A backend lacks an op when its family module does not exist or does not
    define the name. Any other import failure (a broken module, a missing
    dependency of it) propagates. Example: were ``sparsekv.kernels.cpu.kpool``
    without ``mla_kpool_seed_tail``, ``load_kernel("cpu", "kpool",
    "mla_kpool_seed_tail")`` would return the reference's (today every backend
    defines every op).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    found = _own_function(backend, family, name)
    if found is not None:
        return found
    if backend == "reference":
        raise LookupError(f"sparsekv.kernels.reference.{family} defines no {name!r}: every op needs a reference "
                          "implementation")
    return load_kernel("reference", family, name)
