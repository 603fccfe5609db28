"""How a public op reaches its body: dispatcher or not, which backend (SPARSEKV_BACKEND), the reference fallback."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import sparsekv.kernels
from sparsekv import PagedKVCacheCollection
from sparsekv._env import requested_backend
from sparsekv.kernels.cpu import cache as cpu_cache
from sparsekv.kernels.cpu import kpool as cpu_kpool
from sparsekv.kernels.reference import kpool as ref_kpool
from sparsekv.kernels.reference import select as ref_select
from sparsekv.ops import _registry
from sparsekv.ops import cache as cache_ops
from sparsekv.ops import kpool as kpool_ops
from sparsekv.ops import qsa as qsa_ops
from sparsekv.ops import select as select_ops
from sparsekv.ops._registry import dispatch_needed, choose_backend, load_kernel


def test_plain_tensors_skip_the_dispatcher_and_everything_else_takes_it():
    plain = torch.zeros(3)
    assert not dispatch_needed((plain, 4, 2.0, None))
    assert dispatch_needed((plain, torch.zeros(3, requires_grad=True)))
    with torch.no_grad():  # inference: a weight that requires grad records nothing
        assert not dispatch_needed((plain, torch.nn.Parameter(torch.zeros(3))))
    assert dispatch_needed((plain, torch.empty(3, device="meta")))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(plain)
        assert dispatch_needed((fake,))


def test_entry_and_registered_op_write_the_same_scores():
    gen = torch.Generator().manual_seed(3)
    q, keys = torch.randn(2, 3, 16, generator=gen), torch.randn(2 * 5, 16, generator=gen)
    positions, offsets = torch.tensor([9, 19], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    direct, dispatched = torch.empty(2, 5), torch.empty(2, 5)
    qsa_ops._block_score_op(direct, q, keys, positions, offsets, 4, 2.0)
    assert qsa_ops._block_score_op.custom_op is not None
    torch.ops.sparsekv.qsa_block_score(dispatched, q, keys, positions, offsets, 4, 2.0)
    assert torch.equal(direct, dispatched) and torch.isfinite(direct[:, :2]).all()


# ---------------------------------------------------------------------------
# SPARSEKV_BACKEND and the reference fallback
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["cuda", "CPU", "reference ", "numba"])
def test_an_unknown_sparsekv_backend_is_a_value_error_naming_the_variable_and_value(monkeypatch, value):
    monkeypatch.setenv("SPARSEKV_BACKEND", value)
    with pytest.raises(ValueError, match=rf"SPARSEKV_BACKEND: expected one of auto, reference, cpu, triton; "
                                         rf"got {re.escape(repr(value))}"):
        requested_backend()
    blocks = torch.zeros(1, 1, 1, 2, 1, 4)
    collection = PagedKVCacheCollection(blocks, torch.tensor([0]), torch.tensor([[0]]), max_seq_length=1,
                                        max_cache_length=0)
    with pytest.raises(ValueError, match="SPARSEKV_BACKEND"):
        cache_ops.paged_store(collection, torch.ones(1, 1, 4), torch.tensor([0, 1]), layer_idx=0, plane=0)
    assert not blocks.any()


@pytest.mark.parametrize("value, expected", [(None, "auto"), ("", "auto"), ("auto", "auto"),
                                             ("reference", "reference"), ("cpu", "cpu"), ("triton", "triton")])
def test_known_sparsekv_backend_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("SPARSEKV_BACKEND", raising=False)
    else:
        monkeypatch.setenv("SPARSEKV_BACKEND", value)
    assert requested_backend() == expected


def test_forced_reference_backend_runs_the_reference(monkeypatch):
    monkeypatch.setenv("SPARSEKV_BACKEND", "reference")
    assert choose_backend(torch.device("cpu")) == "reference"
    monkeypatch.setenv("SPARSEKV_BACKEND", "cpu")
    assert choose_backend(torch.device("cpu")) == "cpu"


def test_a_backend_falls_back_to_the_reference_for_the_ops_it_lacks(monkeypatch):
    monkeypatch.delattr(cpu_kpool, "mla_kpool_seed_tail")
    load_kernel.cache_clear()
    try:
        assert load_kernel("cpu", "kpool", "mla_kpool_seed_tail") is ref_kpool.mla_kpool_seed_tail
    finally:
        load_kernel.cache_clear()  # the attribute comes back after the test
    assert load_kernel("cpu", "cache", "paged_store") is cpu_cache.paged_store
    assert load_kernel("cpu", "kpool", "mla_kpool_compress") is cpu_kpool.mla_kpool_compress
    with pytest.raises(LookupError, match="defines no 'no_such_op'"):
        load_kernel("cpu", "kpool", "no_such_op")
    with pytest.raises(ValueError, match="backend: expected one of reference, cpu, triton, got 'gpu'"):
        load_kernel("gpu", "kpool", "mla_kpool_compress")


def test_a_missing_family_module_falls_back_but_a_broken_one_raises(monkeypatch):
    real_import = importlib.import_module
    missing = {"sparsekv.kernels.cpu.select": "sparsekv.kernels.cpu.select"}  # module name -> missing name

    def import_module(name, *args):
        if name in missing:
            raise ModuleNotFoundError(f"No module named {missing[name]!r}", name=missing[name])
        return real_import(name, *args)

    monkeypatch.setattr(_registry.importlib, "import_module", import_module)
    uncached = _registry.load_kernel.__wrapped__
    assert uncached("cpu", "select", "select_blocks_expand") is ref_select.select_blocks_expand
    missing["sparsekv.kernels.cpu.select"] = "numba"  # the module exists, a dependency of it is missing
    with pytest.raises(ModuleNotFoundError, match="numba"):
        uncached("cpu", "select", "select_blocks_expand")


def test_no_backend_module_re_exports_a_reference_kernel():
    """A backend leaves an op out instead of binding the reference's function (the registry falls back)."""
    op_names = {entry.op_name for module in (cache_ops, kpool_ops, qsa_ops, select_ops)
                for entry in vars(module).values() if hasattr(entry, "op_name")}
    assert {"paged_store", "mla_kpool_seed_tail", "select_blocks_expand"} <= op_names
    kernels_dir = Path(sparsekv.kernels.__file__).parent
    reference = {name: getattr(importlib.import_module(f"sparsekv.kernels.reference.{path.stem}"), name)
                 for path in (kernels_dir / "reference").glob("[!_]*.py") for name in op_names
                 if hasattr(importlib.import_module(f"sparsekv.kernels.reference.{path.stem}"), name)}
    assert set(reference) == op_names, "every op needs a reference kernel"
    for backend in ("cpu", "triton"):
        for path in (kernels_dir / backend).glob("[!_]*.py"):
            module = importlib.import_module(f"sparsekv.kernels.{backend}.{path.stem}")
            for name in op_names:
                assert getattr(module, name, None) is not reference[name], f"{module.__name__}.{name} is a stub"
