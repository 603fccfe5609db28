"""qsa_compress_keys_paged (SPEC 2.2): reference vs a per-sequence naive, CPU vs reference, errors."""

from __future__ import annotations

import contextlib
import os
import platform
import random

import pytest
import torch
from test_qsa_cases import DTYPES, assert_spec_close, build_paged_cache, make_collection, poisoned, random_key_counts

import sparsekv
from sparsekv import qsa_compress_keys_paged, rope_freqs_cis
from sparsekv.kernels.cpu._bits import (bf16_to_f32, f16_to_f32, f16_to_f32_in_integers, f32_to_bf16, f32_to_f16,
                                       f32_to_f16_in_integers)
from sparsekv.kernels.cpu import _bits as cpu_bits
from sparsekv.kernels.cpu import qsa as cpu_qsa
from sparsekv.kernels.reference import qsa as ref_qsa
from sparsekv.numerics import sqrt_rn


def naive_block_key(raw: torch.Tensor, gamma: torch.Tensor, freqs_row: torch.Tensor, eps: float) -> torch.Tensor:
    """One block from its ``[R, D]`` raw keys, written out element-wise in fp32 (SPEC 2.2 steps 1-3)."""
    dtype = raw.dtype
    ratio, dim = raw.shape
    rotary = freqs_row.shape[0]
    acc = torch.zeros(dim, dtype=torch.float32)
    for i in range(ratio):
        acc = acc + raw[i].float()
    m = (acc / ratio).to(dtype).float()
    squares = torch.zeros((), dtype=torch.float32)
    for d in range(dim):  # channel order, as the reference defines it
        squares = squares + m[d] * m[d]
    inv = 1.0 / sqrt_rn(squares / dim + eps)
    x = (m * inv * (1.0 + gamma.float())).to(dtype).float()
    half = rotary // 2
    cos = freqs_row[0::2].to(dtype).float()
    sin = freqs_row[1::2].to(dtype).float()
    y = x.clone()
    y[:half] = x[:half] * cos - x[half:rotary] * sin
    y[half:rotary] = x[half:rotary] * cos + x[:half] * sin
    return y.to(dtype)


def random_case(rng: random.Random, dtype: torch.dtype, *, dim: int = 24, ratio: int | None = None):
    ratio = ratio or rng.choice([1, 2, 3, 4, 5])
    batch = rng.randrange(1, 10)
    key_counts = random_key_counts(rng, batch, ratio)
    page_size = rng.choice([3, 4, 8, 16])
    num_layers = rng.randrange(1, 4)
    layer = rng.randrange(num_layers)
    rotary = rng.choice([2, 8, dim])
    histories = [torch.randn(n, 1, dim).to(dtype) for n in key_counts]
    blocks, table = build_paged_cache(histories, page_size=page_size, num_layers=num_layers, layer=layer,
                                      kv=rng.choice([1, 2]), stride_pad=rng.choice([0, 0, 7]), rng=rng)
    full_blocks = max(n // ratio for n in key_counts)
    max_blocks = rng.choice([full_blocks, full_blocks + 2, max(full_blocks - 1, 0), 1])
    gamma = (torch.randn(dim) * 0.3).to(rng.choice([dtype, torch.float32]))
    freqs = rope_freqs_cis(max(key_counts) + 1, rotary, theta=1e4)
    return {"ratio": ratio, "key_counts": key_counts, "histories": histories, "blocks": blocks, "table": table,
                "layer": layer, "max_blocks": max_blocks, "gamma": gamma, "freqs": freqs, "eps": 1e-6}


def run_kernel(fn, case, dtype):
    out = poisoned((len(case["key_counts"]) * case["max_blocks"], case["gamma"].shape[0]), dtype)
    fn(out, case["gamma"], case["freqs"], torch.tensor(case["key_counts"], dtype=torch.int32), case["blocks"],
       case["table"], case["layer"], case["ratio"], case["eps"])
    return out


def naive_output(case, dtype):
    mb, dim = case["max_blocks"], case["gamma"].shape[0]
    out = torch.zeros(len(case["key_counts"]) * mb, dim, dtype=dtype)
    for b, history in enumerate(case["histories"]):
        for j in range(min(case["key_counts"][b] // case["ratio"], mb)):
            raw = history[j * case["ratio"] : (j + 1) * case["ratio"], 0]
            out[b * mb + j] = naive_block_key(raw, case["gamma"], case["freqs"][j * case["ratio"]], case["eps"])
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_reference_matches_per_sequence_naive(dtype, seed):
    rng = random.Random(seed)
    got, want = [], []
    for _ in range(12):
        case = random_case(rng, dtype)
        got.append(run_kernel(ref_qsa.qsa_compress_keys_paged, case, dtype).reshape(-1))
        want.append(naive_output(case, dtype).reshape(-1))
    assert_spec_close(torch.cat(got), torch.cat(want), what="reference vs naive")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_cpu_matches_reference(dtype):
    rng = random.Random(random.randrange(1 << 30))
    got, want = [], []
    for _ in range(15):
        case = random_case(rng, dtype, dim=rng.choice([8, 24, 128]))
        got.append(run_kernel(cpu_qsa.qsa_compress_keys_paged, case, dtype).reshape(-1))
        want.append(run_kernel(ref_qsa.qsa_compress_keys_paged, case, dtype).reshape(-1))
    assert_spec_close(torch.cat(got), torch.cat(want), what="cpu vs reference")
    # every rounding point and summation order is fixed, so the CPU path is bit-exact
    assert torch.equal(torch.cat(got).view(torch.uint8), torch.cat(want).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cpu_bits_do_not_depend_on_the_worker_count(dtype, seed, monkeypatch):
    """The kernel's row tasks taken as they go by 1, 2 or 5 workers (more than the threads there are): the
    reference's bits each time."""
    rng = random.Random(seed)
    for _ in range(2):
        case = random_case(rng, dtype, dim=rng.choice([24, 128]), ratio=2)
        # enough rows for runs of several 64-row tasks: 3 sequences of up to 1500 keys
        case["key_counts"] = [rng.randrange(1000, 1500) for _ in range(3)]
        case["histories"] = [torch.randn(n, 1, case["gamma"].shape[0]).to(dtype) for n in case["key_counts"]]
        case["blocks"], case["table"] = build_paged_cache(case["histories"], page_size=16, num_layers=1, layer=0,
                                                          kv=1, stride_pad=0, rng=rng)
        case["layer"], case["max_blocks"] = 0, max(case["key_counts"]) // 2
        case["freqs"] = rope_freqs_cis(max(case["key_counts"]) + 1, case["freqs"].shape[1], theta=1e4)
        want = run_kernel(ref_qsa.qsa_compress_keys_paged, case, dtype)
        for workers in (1, 2, 5):
            monkeypatch.setattr(cpu_qsa, "threads_for", lambda work, n=workers: contextlib.nullcontext(n))
            got = run_kernel(cpu_qsa.qsa_compress_keys_paged, case, dtype)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{workers} workers"


@pytest.mark.parametrize("fp16_path", ["this machine's", "integer fallback"])
def test_half_precision_bit_conversions_match_torch(fp16_path):
    """The CPU kernels' bf16/fp16 <-> fp32 conversions: every 16-bit pattern, and round-to-nearest-even
    (fp16 both through the CPU's own conversions, where it has them, and the integer fallback)."""
    import numba
    import numpy as np

    f16_widen, f16_narrow = ((f16_to_f32, f32_to_f16) if fp16_path == "this machine's"
                             else (f16_to_f32_in_integers, f32_to_f16_in_integers))

    @numba.njit
    def roundtrip(bf16_bits, f16_bits, values, widened_bf16, widened_f16, narrowed_bf16, narrowed_f16):
        for i in range(bf16_bits.shape[0]):
            widened_bf16[i] = bf16_to_f32(bf16_bits[i])
            widened_f16[i] = f16_widen(f16_bits[i])
        for i in range(values.shape[0]):
            narrowed_bf16[i] = f32_to_bf16(values[i])
            narrowed_f16[i] = f16_narrow(values[i])

    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), dtype=torch.int64).to(torch.int32)
    specials = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 65536.0, 2.9802322e-08, 6.1035156e-05,
                             float("inf"), -float("inf"), float("nan")])
    values = torch.cat([random_bits.view(torch.float32), specials, torch.randn(50_000) * 1e-5, torch.randn(50_000)])
    out = [np.empty(65536, np.float32), np.empty(65536, np.float32),
           np.empty(values.shape[0], np.uint16), np.empty(values.shape[0], np.int16)]
    roundtrip(patterns.view(torch.uint16).numpy(), patterns.numpy(), values.numpy(), *out)
    for got, dtype in ((out[0], torch.bfloat16), (out[1], torch.float16)):
        want = patterns.view(dtype).float()
        assert torch.equal(torch.from_numpy(got).isnan(), want.isnan())
        assert torch.equal(torch.from_numpy(got)[~want.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32))
    nan = values.isnan()
    for got, dtype, bits in ((out[2], torch.bfloat16, torch.uint16), (out[3], torch.float16, torch.int16)):
        want = values.to(dtype).view(bits)
        assert torch.equal(torch.from_numpy(got)[~nan], want[~nan])
        assert torch.from_numpy(got).view(dtype)[nan].isnan().all()


_FP16_SUBPROCESS = """
import json, sys, numba, numpy as np
from sparsekv.kernels.cpu._bits import HALF_CONVERSIONS_IN_HARDWARE, f16_to_f32, f32_to_f16

@numba.njit
def convert(bits, values, widened, narrowed):
    for i in range(bits.shape[0]):
        widened[i] = f16_to_f32(bits[i])
    for i in range(values.shape[0]):
        narrowed[i] = f32_to_f16(values[i])

bits = np.arange(65536).astype(np.uint16).view(np.int16)
values = np.array(json.loads(sys.stdin.read()), np.int32).view(np.float32)
widened, narrowed = np.empty(65536, np.float32), np.empty(values.shape[0], np.int16)
convert(bits, values, widened, narrowed)
print(json.dumps({"hardware": HALF_CONVERSIONS_IN_HARDWARE, "widened": widened.view(np.uint32).tolist(),
                  "narrowed": narrowed.tolist()}))
"""


@pytest.mark.skipif(not cpu_bits.HALF_CONVERSIONS_IN_HARDWARE or platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="needs an x86 CPU with F16C to compile for one without")
def test_fp16_kernels_compiled_for_a_cpu_without_f16c_use_the_integer_path(tmp_path):
    """``widen``/``narrow`` pick their fp16 path from the CPU numba compiles for: without F16C the
    integer fallback, with the same bits as torch."""
    import json
    import subprocess
    import sys

    import numba

    features = numba.core.codegen.get_host_cpu_features().replace("+f16c", "-f16c")
    env = dict(os.environ, NUMBA_CPU_FEATURES=features, NUMBA_CACHE_DIR=str(tmp_path))
    values = torch.cat([torch.randn(20_000), torch.randn(20_000) * 1e-5, torch.randn(20_000) * 7e4])
    done = subprocess.run([sys.executable, "-c", _FP16_SUBPROCESS], input=json.dumps(values.view(torch.int32).tolist()),
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["hardware"] is False, "the subprocess still compiles the F16C conversions"
    want = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    widened = torch.tensor(result["widened"], dtype=torch.int64).to(torch.int32).view(torch.float32)
    finite = ~want.isnan()
    assert torch.equal(widened[finite], want[finite]) and widened[~finite].isnan().all()
    assert torch.equal(torch.tensor(result["narrowed"], dtype=torch.int16), values.to(torch.float16).view(torch.int16))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_public_op_edge_cases(backend, monkeypatch):
    """Counts 0, < R, exact multiples, partial blocks; max_blocks below the block count; rows stay put."""
    monkeypatch.setenv("SPARSEKV_BACKEND", backend)
    rng = random.Random(5)
    ratio, dim, dtype = 4, 16, torch.bfloat16
    key_counts = [0, 3, 8, 13, 40, 4]
    histories = [torch.randn(n, 1, dim).to(dtype) for n in key_counts]
    blocks, table = build_paged_cache(histories, page_size=8, num_layers=2, layer=1, kv=2, stride_pad=3, rng=rng)
    coll = make_collection(blocks, table, [max(n - 2, 0) for n in key_counts])
    gamma, freqs = torch.randn(dim) * 0.2, rope_freqs_cis(64, 8)
    case = {"ratio": ratio, "key_counts": key_counts, "histories": histories, "gamma": gamma, "freqs": freqs, "eps": 1e-6}
    for max_blocks in (3, 10):  # 3 < the 10 blocks of sequence 4: clamped, nothing spills into sequence 5
        out = qsa_compress_keys_paged(gamma, freqs, torch.tensor(key_counts), coll, 1, ratio=ratio, eps=1e-6,
                                      max_blocks=max_blocks)
        want = naive_output(dict(case, max_blocks=max_blocks), dtype)
        assert_spec_close(out, want, what=f"max_blocks={max_blocks}")
        per_seq = out.view(len(key_counts), max_blocks, dim)
        assert (per_seq[0] == 0).all() and (per_seq[1] == 0).all()  # no complete block
        assert (per_seq[3, 3:] == 0).all()  # 13 keys: 3 blocks, the partial 4th is never pooled
        assert (per_seq[5, 1:] == 0).all() and (per_seq[5, 0] != 0).any()


def test_cache_lengths_and_other_layers_do_not_matter():
    rng = random.Random(11)
    dim = 8
    key_counts = [9, 12]
    histories = [torch.randn(n, 1, dim) for n in key_counts]
    blocks, table = build_paged_cache(histories, page_size=4, num_layers=3, layer=1, rng=rng)
    gamma, freqs = torch.zeros(dim), rope_freqs_cis(16, dim)
    outs = []
    for lengths in ([0, 0], [9, 12], [3, 7]):
        coll = make_collection(blocks, table, lengths)
        outs.append(qsa_compress_keys_paged(gamma, freqs, torch.tensor(key_counts), coll, 1, ratio=4, eps=1e-6,
                                            max_blocks=3))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert not torch.isnan(outs[0]).any()  # layers 0 and 2 are NaN: the right layer was read


def test_out_argument_and_index_dtypes():
    rng = random.Random(3)
    dim = 8
    histories = [torch.randn(n, 1, dim, dtype=torch.float16) for n in (7, 8)]
    blocks, table = build_paged_cache(histories, page_size=4, rng=rng)
    coll = sparsekv.PagedKVCacheCollection(blocks, torch.tensor([7, 8], dtype=torch.uint32),
                                           table.view(torch.uint32), 1, 8)
    gamma, freqs = torch.randn(dim), rope_freqs_cis(8, 4)
    out = poisoned((6, dim), torch.float16)
    got = qsa_compress_keys_paged(gamma, freqs, torch.tensor([7, 8], dtype=torch.int64), coll, 0, ratio=2,
                                  eps=1e-5, out=out)
    assert got is out
    case = {"ratio": 2, "key_counts": [7, 8], "histories": histories, "gamma": gamma, "freqs": freqs, "eps": 1e-5, "max_blocks": 3}
    assert_spec_close(out, naive_output(case, torch.float16))


# ---- errors (SPEC 2.2) ------------------------------------------------------------

def _error_setup(num_heads=1, dim=8, batch=2):
    histories = [torch.randn(8, num_heads, dim) for _ in range(batch)]
    blocks, table = build_paged_cache(histories, page_size=4, rng=random.Random(0))
    return blocks, table, torch.zeros(dim), rope_freqs_cis(16, 4)


def _call(blocks, table, gamma, freqs, key_counts=(8, 8), lengths=None, **kw):
    coll = make_collection(blocks, table, list(lengths if lengths is not None else key_counts))
    args = {"ratio": 4, "eps": 1e-6, "max_blocks": 2}
    args.update(kw)
    return qsa_compress_keys_paged(gamma, freqs, torch.tensor(key_counts, dtype=torch.int32), coll, 0, **args)


def test_errors_batch_shapes():
    blocks, table, gamma, freqs = _error_setup()
    with pytest.raises(ValueError, match="empty batch"):
        coll = make_collection(blocks, table[:0], [])
        qsa_compress_keys_paged(gamma, freqs, torch.zeros(0, dtype=torch.int32), coll, 0, ratio=4, eps=1e-6,
                                max_blocks=2)
    with pytest.raises(ValueError, match="cache_lengths: expected 3 entries"):
        coll = make_collection(blocks, table, [8, 8])
        qsa_compress_keys_paged(gamma, freqs, torch.tensor([8, 8, 8]), coll, 0, ratio=4, eps=1e-6, max_blocks=2)
    coll = make_collection(blocks, table, [8, 8])
    coll.lookup_table = coll.lookup_table[:1]  # a table that no longer matches the batch
    with pytest.raises(ValueError, match="lookup_table: expected 2 rows"):
        qsa_compress_keys_paged(gamma, freqs, torch.tensor([8, 8]), coll, 0, ratio=4, eps=1e-6, max_blocks=2)
    with pytest.raises(ValueError, match="not a multiple of the batch size 2"):
        _call(blocks, table, gamma, freqs, max_blocks=None, out=torch.zeros(5, 8))


def test_errors_widths_and_heads():
    blocks, table, gamma, freqs = _error_setup()
    with pytest.raises(ValueError, match="width 6 differs from D"):
        _call(blocks, table, gamma, freqs, max_blocks=None, out=torch.zeros(4, 6))
    with pytest.raises(ValueError, match=r"head width 8 differs from D = len\(gamma\) = 10"):
        _call(blocks, table, torch.zeros(10), freqs)
    blocks2, table2, gamma2, freqs2 = _error_setup(num_heads=2)
    with pytest.raises(ValueError, match="one key head, got 2"):
        _call(blocks2, table2, gamma2, freqs2)


def test_errors_rotary():
    blocks, table, gamma, freqs = _error_setup()
    with pytest.raises(ValueError, match="differs from rotary_dim = 6"):
        _call(blocks, table, gamma, freqs, rotary_dim=6)
    with pytest.raises(ValueError, match="must be even"):
        _call(blocks, table, gamma, torch.zeros(16, 3))
    with pytest.raises(ValueError, match="<= D = 8"):
        _call(blocks, table, gamma, rope_freqs_cis(16, 10))
    message = r"freqs_cis: sequence 1 needs position 4 \(its block 1\) but the table has 4 rows"
    with pytest.raises(ValueError, match=message):
        _call(blocks, table, gamma, rope_freqs_cis(4, 4), key_counts=(3, 8))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_error_missing_page(backend, monkeypatch):
    monkeypatch.setenv("SPARSEKV_BACKEND", backend)
    blocks, table, gamma, freqs = _error_setup()
    table = table.clone()
    table[1, 1] = -1
    with pytest.raises(ValueError, match="sequence 1, position 4"):
        _call(blocks, table, gamma, freqs)
    table[1, 1] = blocks.shape[0] + 3
    with pytest.raises(ValueError, match="outside"):
        _call(blocks, table, gamma, freqs)
    # a missing page past the pooled blocks is never needed: no error
    out = _call(blocks, table, gamma, freqs, key_counts=(8, 3), lengths=(8, 3))
    assert (out[2:] == 0).all()


def test_errors_arguments():
    blocks, table, gamma, freqs = _error_setup()
    with pytest.raises(ValueError, match="max_blocks: required"):
        _call(blocks, table, gamma, freqs, max_blocks=None)
    with pytest.raises(ValueError, match="max_blocks: 3 disagrees"):
        _call(blocks, table, gamma, freqs, max_blocks=3, out=torch.zeros(4, 8))
    with pytest.raises(ValueError, match="ratio"):
        _call(blocks, table, gamma, freqs, ratio=0)
    with pytest.raises(ValueError, match="key_counts: expected values >= 0"):
        _call(blocks, table, gamma, freqs, key_counts=(-1, 8), lengths=(0, 8))
    with pytest.raises(TypeError, match="kv_collection"):
        qsa_compress_keys_paged(gamma, freqs, torch.tensor([8]), blocks, 0, ratio=4, eps=1e-6, max_blocks=2)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_raising_call_leaves_out_untouched(backend, monkeypatch):
    monkeypatch.setenv("SPARSEKV_BACKEND", backend)
    blocks, table, gamma, freqs = _error_setup()
    table = table.clone()
    table[1, 1] = -7  # a negative page id that is not the sentinel
    buf = torch.full((4, 8), float("nan"))
    buf.view(torch.int32)[0, 0] = 12345  # a payload a zero fill would overwrite
    before = buf.clone()
    with pytest.raises(ValueError, match=r"sequence 1, position 4: its page \(lookup_table\[1, 1\]\) is -7, outside"):
        _call(blocks, table, gamma, freqs, out=buf, max_blocks=None)
    assert torch.equal(buf.view(torch.int32), before.view(torch.int32)), "wrote before raising"
    with pytest.raises(ValueError, match="freqs_cis: sequence 0 needs position 4"):
        _call(blocks, table, gamma, rope_freqs_cis(2, 4), out=buf, max_blocks=None)
    assert torch.equal(buf.view(torch.int32), before.view(torch.int32)), "wrote before raising"
