"""numba's on-disk cache for sparsekv's kernels, fresh only while every CPU kernel source is unchanged.

numba keys a cached function on its own source file alone, so a kernel
cached before an edit of a helper it calls from another file (a tile in
``_tile_ir.py``, ``widen`` in ``_bits.py``, ``exp_f32`` in ``_math.py``) would
be loaded in the next process as the old machine code. Importing this module
puts :class:`KernelSourcesLocator` first among numba's cache locators (its
hook for where a cached function lives and how fresh it is). It claims the
functions defined in the ``sparsekv`` package and adds to numba's freshness
stamp of their file a digest of every ``.py`` file in ``kernels/cpu`` and of
the numba and llvmlite versions (:func:`kernel_sources_digest`). When any of
them changes, numba finds the stamp of its index stale, compiles again and
overwrites the entries.

Where the cache lives stays numba's choice, made by its own locators:
``NUMBA_CACHE_DIR`` if set, else ``__pycache__`` beside the source when it is
writable, else the user's cache directory (a read-only install). The target
CPU (``NUMBA_CPU_NAME``, ``NUMBA_CPU_FEATURES``) is already part of numba's
key for each entry. A ``NUMBA_CACHE_LOCATOR_CLASSES`` set by the user replaces
the locator list, this locator included.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import llvmlite
import numba
from numba.core import caching

_KERNEL_DIR = Path(__file__).resolve().parent
_PACKAGE_PREFIX = str(_KERNEL_DIR.parent.parent) + os.sep  # .../sparsekv/


def kernel_sources_digest(directory: Path = _KERNEL_DIR) -> str:
    """sha256 (hex) of the numba and llvmlite versions and the name and bytes of every ``*.py`` in ``directory``."""
    digest = hashlib.sha256(f"numba {numba.__version__}, llvmlite {llvmlite.__version__}\n".encode())
    for path in sorted(directory.glob("*.py")):
        source = path.read_bytes()
        digest.update(f"{path.name} {len(source)}\n".encode())
        digest.update(source)
    return digest.hexdigest()


_DIGEST = kernel_sources_digest()

_LOCATOR_BASE = getattr(caching, "_CacheLocator", None)
_LOCATOR_LIST = getattr(getattr(caching, "CacheImpl", None), "_locator_classes", None)


class KernelSourcesLocator(_LOCATOR_BASE or object):
    """The locator numba would pick for a function of the ``sparsekv`` package (``inner``), with the kernel
    sources' digest added to its source stamp; ``None`` from :meth:`from_function` for any other function."""

    def __init__(self, inner, digest: str) -> None:
        self._inner = inner
        self._digest = digest

    def ensure_cache_path(self) -> None:
        self._inner.ensure_cache_path()

    def get_cache_path(self) -> str:
        return self._inner.get_cache_path()

    def get_source_stamp(self):
        return self._digest, self._inner.get_source_stamp()

    def get_disambiguator(self) -> str:
        return self._inner.get_disambiguator()

    @property
    def _py_file(self):  # numba names the source file through it when it cannot cache a function
        return getattr(self._inner, "_py_file", None)

    @classmethod
    def from_function(cls, py_func, py_file):
        if not os.path.realpath(py_file).startswith(_PACKAGE_PREFIX):
            return None
        for locator_class in _LOCATOR_LIST:
            if locator_class is cls:
                continue
            inner = locator_class.from_function(py_func, py_file)
            if inner is not None:
                return cls(inner, _DIGEST)
        return None


if _LOCATOR_BASE is None or not isinstance(_LOCATOR_LIST, list):
    warnings.warn(f"numba {numba.__version__} has no caching._CacheLocator or CacheImpl._locator_classes: "
                  "sparsekv's cached kernels are keyed on their own file only (numba 0.62 - 0.68 have both); "
                  "delete the *.nbi and *.nbc files of sparsekv/kernels/cpu/__pycache__ after editing a kernel "
                  "helper", RuntimeWarning, stacklevel=2)
elif KernelSourcesLocator not in _LOCATOR_LIST:
    _LOCATOR_LIST.insert(0, KernelSourcesLocator)
