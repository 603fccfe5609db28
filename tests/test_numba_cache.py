"""numba's on-disk cache never serves a kernel built from older sources: a change to a helper module in
kernels/cpu (a file numba's own per-file key does not watch) makes the next process compile its callers again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numba
import pytest

import sparsekv
from sparsekv.kernels.cpu._jit_cache import KernelSourcesLocator, kernel_sources_digest

# A caller in its own file, of a helper in another (_math.exp_f32): numba keys the caller's cache on
# _probe.py alone.
_PROBE = """
import numba
import numpy as np

from ._math import exp_f32


@numba.njit(cache=True)
def probe(x):
    return exp_f32(x)
"""

_RUN = """
import json
import numpy as np
from sparsekv.kernels.cpu._probe import probe
value = float(probe(np.float32(-1.0)))
stats = probe.stats
print(json.dumps({"value": value, "hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values())}))
"""

# Appended to the helper module: exp_f32 then returns 0 for every x below 0 (its floor).
_EDIT = "\n_EXP_FLOOR = np.float32(0.0)\n"


def _copy_kernels(root: Path) -> Path:
    """``sparsekv/kernels/cpu`` copied under ``root`` without compiled files, its parents empty packages (no
    torch to import: a fast subprocess), and the probe added; returns the copy's kernels/cpu folder."""
    kernels = root / "sparsekv" / "kernels" / "cpu"
    shutil.copytree(Path(sparsekv.__file__).parent / "kernels" / "cpu", kernels,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for package in (root / "sparsekv", root / "sparsekv" / "kernels"):
        (package / "__init__.py").write_text("")
    (kernels / "_probe.py").write_text(_PROBE)
    return kernels


def _run(root: Path, cache_dir: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["PYTHONPATH"] = str(root)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = str(cache_dir)
    result = subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("where", ["in_tree", "numba_cache_dir"])
def test_a_changed_helper_module_recompiles_its_cached_callers(tmp_path, where):
    kernels = _copy_kernels(tmp_path / "src")
    cache_dir = tmp_path / "numba_cache" if where == "numba_cache_dir" else None

    first = _run(tmp_path / "src", cache_dir)
    assert (first["hits"], first["misses"]) == (0, 1)
    assert abs(first["value"] - 0.36787944) < 1e-6

    warm = _run(tmp_path / "src", cache_dir)
    assert (warm["hits"], warm["misses"]) == (1, 0), "the second process did not load the cached probe"
    assert warm["value"] == first["value"]

    with open(kernels / "_math.py", "a") as helper:
        helper.write(_EDIT)
    edited = _run(tmp_path / "src", cache_dir)
    assert (edited["hits"], edited["misses"]) == (0, 1), "a cached probe was served after its helper changed"
    assert edited["value"] == 0.0

    indexes = list((cache_dir or kernels / "__pycache__").rglob("_probe.probe-*.nbi"))
    assert indexes, "the probe was not cached where numba's own locator puts it"
    if cache_dir is not None:
        assert not list((kernels / "__pycache__").glob("*.nbi")), "NUMBA_CACHE_DIR was not respected"


def test_the_digest_covers_every_kernel_source(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    before = kernel_sources_digest(tmp_path)
    (tmp_path / "b.py").write_text("y = 3\n")
    assert kernel_sources_digest(tmp_path) != before
    (tmp_path / "b.py").write_text("y = 2\n")
    assert kernel_sources_digest(tmp_path) == before
    (tmp_path / "c.py").write_text("")
    assert kernel_sources_digest(tmp_path) != before


def test_functions_outside_the_package_keep_numbas_own_locator():
    def outside(x):
        return x

    assert KernelSourcesLocator.from_function(outside, __file__) is None
    assert KernelSourcesLocator in numba.core.caching.CacheImpl._locator_classes
