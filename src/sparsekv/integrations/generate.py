"""``sparsekv generate``: run a local Hugging Face checkpoint through the patched attention and report.

    sparsekv generate --model DIR --prompt-tokens N --new-tokens M [--dtype bf16] [--batch B]

``DIR`` holds ``config.json`` and safetensors of a supported family (no hub
access), loaded as ``AutoModelForCausalLM`` or, for a family that generates
through its multimodal class (GLM-5-Next), ``AutoModelForImageTextToText``;
"pages used" counts the family's main cache group (keys and values, or MLA
latent rows). The prompt is ``B`` rows of ``N`` random token ids (seeded); decoding
is greedy, one token per step through the model's cache. The report: prefill
and decode tokens/s, the most pages in use, and the sparse-read fraction (the
cached tokens the sparse attention read over what dense causal attention would
have read, summed over every query row and patched layer).

This module imports transformers only inside :func:`run_generate`, so the
``sparsekv`` command can register it without the ``hf`` extra installed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass

DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}


@dataclass(frozen=True)
class GenerateReport:
    """What one :func:`run_generate` measured (times in seconds)."""

    model_type: str
    dtype: str
    device: str
    batch: int
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    pages_used: int
    num_pages: int
    page_size: int
    sparse_read_fraction: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch * self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch * self.new_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def to_text(self) -> str:
        return "\n".join([
            f"model            {self.model_type} ({self.dtype}, {self.device}), batch {self.batch}",
            f"prefill          {self.prompt_tokens} tokens/row in {self.prefill_seconds:.3f} s "
            f"({self.prefill_tokens_per_s:.1f} tokens/s)",
            f"decode           {self.new_tokens} tokens/row in {self.decode_seconds:.3f} s "
            f"({self.decode_tokens_per_s:.1f} tokens/s)",
            f"pages used       {self.pages_used} of {self.num_pages} (page size {self.page_size})",
            f"sparse reads     {100 * self.sparse_read_fraction:.1f}% of the tokens dense attention would read",
        ])

    def to_dict(self) -> dict:
        return {**asdict(self), "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s}


class GenerateError(ValueError):
    """A usage or checkpoint problem, with a message for the command line."""


def run_generate(model_dir: str | os.PathLike, *, prompt_tokens: int, new_tokens: int, dtype: str = "fp32",
                 batch: int = 1, page_size: int = 64, device: str = "cpu", seed: int = 0,
                 progress: bool = True) -> GenerateReport:
    """Load ``model_dir`` with transformers, patch it, prefill random prompts and decode greedily.

    Raises :class:`GenerateError` for a missing folder, an unknown dtype,
    non-positive counts, or transformers not installed.
    """
    if dtype not in DTYPE_NAMES:
        raise GenerateError(f"dtype: expected one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    for name, value in (("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens), ("batch", batch)):
        if value < 1:
            raise GenerateError(f"{name}: expected a positive count, got {value}")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise GenerateError(f"model: {os.fspath(model_dir)!r} has no config.json")
    try:
        import torch
        from tqdm import tqdm
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, DynamicCache

        from .transformers import end_generation, get_manager, patch_model
    except ImportError as err:
        raise GenerateError(f"sparsekv generate needs transformers: pip install -e \".[hf]\" ({err})") from None

    torch_dtype = getattr(torch, DTYPE_NAMES[dtype])
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, local_files_only=True)
    except ValueError as err:  # GLM-5-Next generates through its image-text-to-text class
        if "Unrecognized configuration class" not in str(err):
            raise
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch_dtype, local_files_only=True)
    model = model.to(device).eval()
    num_pages = batch * -(-(prompt_tokens + new_tokens) // page_size) + 1
    patch_model(model, page_size=page_size, num_pages=num_pages)
    manager, adapter = get_manager(model), model._sparsekv_patch.adapter
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, prompt_tokens), generator=generator).to(device)
    cache = DynamicCache(config=model.config)
    pages_used = 0
    with torch.inference_mode():
        warm = DynamicCache(config=model.config)  # first calls load compiled kernels: keep them out of the timing
        model(ids[:, :8], past_key_values=warm, logits_to_keep=1)
        end_generation(warm)
        adapter.reset_read_counts()
        start = time.perf_counter()
        logits = model(ids, past_key_values=cache, logits_to_keep=1).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        _ = token.tolist()  # wait for the device
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in tqdm(range(new_tokens), desc="decode", unit="token", disable=not progress or new_tokens < 64,
                      file=sys.stderr):
            logits = model(token, past_key_values=cache, logits_to_keep=1).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
        _ = token.tolist()
        decode = time.perf_counter() - start
        pages_used = manager.metrics().groups[adapter.main_group].pages_used
    causal = int(adapter.tokens_causal)
    end_generation(cache)
    return GenerateReport(
        model_type=model.config.model_type, dtype=DTYPE_NAMES[dtype], device=str(device), batch=batch,
        prompt_tokens=prompt_tokens, new_tokens=new_tokens, prefill_seconds=prefill, decode_seconds=decode,
        pages_used=pages_used, num_pages=num_pages, page_size=page_size,
        sparse_read_fraction=int(adapter.tokens_read) / causal if causal else 0.0)


def add_generate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``generate`` options to ``parser`` and make :func:`generate_command` its handler."""
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--model", required=True, metavar="DIR", help="folder with config.json and *.safetensors")
    parser.add_argument("--prompt-tokens", type=int, required=True, help="random prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, required=True, help="greedy decode steps")
    parser.add_argument("--dtype", default="fp32", help="fp32 (default), bf16 or fp16")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together (default 1)")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per cache page (default 64)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt tokens")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(handler=generate_command)
    return parser


def generate_command(args: argparse.Namespace) -> int:
    """Run ``sparsekv generate``; exit status 0, or 2 for a usage or checkpoint error."""
    try:
        report = run_generate(args.model, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                              dtype=args.dtype, batch=args.batch, page_size=args.page_size, device=args.device,
                              seed=args.seed, progress=not args.no_progress)
    except GenerateError as err:
        print(f"sparsekv generate: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        import json

        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.to_text())
    return 0


__all__ = ["GenerateError", "GenerateReport", "add_generate_arguments", "generate_command", "run_generate"]
