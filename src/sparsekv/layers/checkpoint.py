"""Checkpoint loading: safetensors files read by the checkpoint's own weight names.

A checkpoint folder holds ``config.json`` and one or more ``*.safetensors``
files (sharded checkpoints may add ``model.safetensors.index.json``; its
``weight_map`` is used when present, otherwise every file's keys are
listed). Tensors are read lazily, one name at a time, so loading the few
layers this library builds from a large checkpoint reads only those.

A module's weights are its ``state_dict()`` names under a prefix, e.g.
``QSAAttention`` at ``model.layers.3.self_attn.`` needs
``model.layers.3.self_attn.q_proj.weight`` ...; the module attributes carry
Hugging Face's names, so a checkpoint HF's ``save_pretrained`` wrote loads
as is. A missing weight or one of the wrong shape raises ``ValueError``
naming it and the expected shape (a missing one also lists what the
checkpoint holds next to it, which shows a renamed weight at a glance).
Weights the modules do not use (other layers, MLPs, vision towers) are ignored.

HF roots the decoder layers differently per model class: ``model.layers.N.``
(``*ForCausalLM``), ``model.language_model.layers.N.`` (multimodal
``*ForConditionalGeneration``), ``layers.N.`` (a bare text model).
:func:`load_slice_weights` finds which of these the checkpoint uses.

Example::

    config, reader = open_checkpoint("ckpt/")
    load_module_weights(layer, reader, "model.layers.3.self_attn.")
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

import torch

from .config import ModelConfig, load_config, save_config

INDEX_FILE = "model.safetensors.index.json"


class CheckpointReader:
    """Lazy access to the tensors of one safetensors file or a folder of them, by name.

    Args:
        path: a ``.safetensors`` file or a folder holding some.

    ``names()`` lists every tensor, ``shape(name)`` reads a shape without
    loading the data, ``get(name)`` loads one tensor (on the CPU).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        path = os.fspath(path)
        if os.path.isdir(path):
            index_path = os.path.join(path, INDEX_FILE)
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"checkpoint: no *.safetensors file in {path!r}")
            self._files = [os.path.join(path, f) for f in files]
        elif os.path.isfile(path):
            index_path = None
            self._files = [path]
        else:
            raise FileNotFoundError(f"checkpoint: no such file or folder {path!r}")
        self._location: dict[str, str] = {}
        if index_path is not None and os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as handle:
                weight_map = json.load(handle).get("weight_map", {})
            for name, file in weight_map.items():
                self._location[name] = os.path.join(path, file)
        else:
            for file in self._files:
                with safe_open(file, framework="pt") as handle:
                    for name in handle.keys():
                        self._location[name] = file

    def names(self) -> list[str]:
        return sorted(self._location)

    def __contains__(self, name: object) -> bool:
        return name in self._location

    def _file_of(self, name: str) -> str:
        if name not in self._location:
            raise KeyError(name)
        return self._location[name]

    def shape(self, name: str) -> tuple[int, ...]:
        with self._safe_open(self._file_of(name), framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        with self._safe_open(self._file_of(name), framework="pt") as handle:
            return handle.get_tensor(name)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """``get(name)`` narrowed to ``start:stop`` along ``dim``, reading only those elements from the file."""
        with self._safe_open(self._file_of(name), framework="pt") as handle:
            return handle.get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]


TensorSource = CheckpointReader | Mapping[str, torch.Tensor]


def _shape_of(source: TensorSource, name: str) -> tuple[int, ...]:
    if isinstance(source, CheckpointReader):
        return source.shape(name)
    return tuple(source[name].shape)


def _tensor_of(source: TensorSource, name: str) -> torch.Tensor:
    if isinstance(source, CheckpointReader):
        return source.get(name)
    return source[name]


def _missing_weight(source: TensorSource, full: str, shape: tuple[int, ...]) -> ValueError:
    """The error for a missing weight, listing the checkpoint's names beside it (a renamed weight shows)."""
    parts = full.split(".")[:-1]  # the owning module, or its parent for a module's weight / bias
    if full.rsplit(".", 1)[-1] in ("weight", "bias") and parts:
        parts = parts[:-1]
    parent = ".".join(parts) + "." if parts else ""
    names = source.names() if isinstance(source, CheckpointReader) else sorted(source)
    nearby = [name[len(parent):] for name in names if name.startswith(parent)]
    where = (f"; the checkpoint holds under {parent!r}: {', '.join(nearby[:12])}{' ...' if len(nearby) > 12 else ''}"
             if nearby else f"; the checkpoint holds nothing under {parent!r}")
    return ValueError(f"checkpoint: missing weight {full!r} (expected shape {shape}){where}")


def _check_weights(module: torch.nn.Module, source: TensorSource, prefix: str) -> dict[str, torch.Tensor]:
    """Every ``module.state_dict()`` entry's name and shape checked against ``source``; returns the targets."""
    targets = module.state_dict(keep_vars=True)
    for name, target in targets.items():
        full = prefix + name
        if full not in source:
            raise _missing_weight(source, full, tuple(target.shape))
        got = _shape_of(source, full)
        if got != tuple(target.shape):
            raise ValueError(
                f"checkpoint: weight {full!r} has shape {got}, expected {tuple(target.shape)}"
            )
    return targets


def load_module_weights(module: torch.nn.Module, source: TensorSource, prefix: str = "") -> list[str]:
    """Copy every ``module.state_dict()`` entry from ``source[prefix + name]``.

    Args:
        module: the layer; its parameters keep their dtype and device (the
            checkpoint tensor is converted), so a float32 parameter such as
            the k-pool ``index_kpool_compress_ape`` stays float32 in a bf16 model.
        source: a :class:`CheckpointReader` or a dict of tensors.
        prefix: the module's checkpoint prefix, e.g. ``"model.layers.3.self_attn."``.

    Returns the checkpoint names read. Raises ``ValueError`` naming the first
    missing weight (with its expected shape) or the first weight whose shape
    differs, and writes nothing in that case.
    """
    targets = _check_weights(module, source, prefix)
    with torch.no_grad():
        for name, target in targets.items():
            value = _tensor_of(source, prefix + name)
            if value.dtype.is_floating_point != target.dtype.is_floating_point:
                raise ValueError(
                    f"checkpoint: weight {prefix + name!r} has dtype {value.dtype}, expected a "
                    f"{'floating' if target.dtype.is_floating_point else 'integer'} tensor"
                )
            target.copy_(value.to(device=target.device, dtype=target.dtype))
    return [prefix + name for name in targets]


def module_state(module: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The module's tensors under their checkpoint names (the inverse of :func:`load_module_weights`)."""
    return {prefix + name: value.detach().cpu().contiguous() for name, value in module.state_dict().items()}


def open_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, CheckpointReader]:
    """Read ``path/config.json`` and open the folder's safetensors files."""
    return load_config(path), CheckpointReader(path)


def save_checkpoint(path: str | os.PathLike, config: ModelConfig,
                    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write ``config.json`` and ``model.safetensors`` into the folder ``path`` (created if needed)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_config(config, os.path.join(path, "config.json"))
    items = dict(tensors.items() if isinstance(tensors, Mapping) else tensors)
    save_file({name: value.detach().cpu().contiguous() for name, value in items.items()},
              os.path.join(path, "model.safetensors"))




# Where HF's model classes root the decoder: *ForCausalLM, multimodal *ForConditionalGeneration, bare text model.
CHECKPOINT_ROOTS = ("model.", "model.language_model.", "")


def checkpoint_root(source: TensorSource, pairs: list[tuple[torch.nn.Module, str]]) -> str:
    """The root (``CHECKPOINT_ROOTS``) under which ``source`` holds the weights of ``pairs`` (prefixed ``model.``).

    The first root holding the first weight of the first pair wins;
    ``"model."`` when none does (the missing-weight error then names it).
    """
    first = next(((prefix, name) for module, prefix in pairs for name in module.state_dict()), None)
    if first is None:
        return "model."
    prefix, name = first
    for root in CHECKPOINT_ROOTS:
        if root + prefix.removeprefix("model.") + name in source:
            return root
    return "model."


def load_slice_weights(model: torch.nn.Module, source: TensorSource) -> list[str]:
    """Load every ``(module, prefix)`` of ``model.checkpoint_modules()`` (prefixes under ``model.``).

    The checkpoint may root them elsewhere (:data:`CHECKPOINT_ROOTS`, found by
    :func:`checkpoint_root`). Every weight is checked before the first is written.
    """
    pairs = model.checkpoint_modules()
    root = checkpoint_root(source, pairs)
    pairs = [(module, root + prefix.removeprefix("model.")) for module, prefix in pairs]
    for module, prefix in pairs:  # validate all names and shapes first
        _check_weights(module, source, prefix)
    loaded: list[str] = []
    for module, prefix in pairs:
        loaded += load_module_weights(module, source, prefix)
    return loaded


def slice_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.checkpoint_modules()`` under its checkpoint name."""
    state: dict[str, torch.Tensor] = {}
    for module, prefix in model.checkpoint_modules():
        state.update(module_state(module, prefix))
    return state


__all__ = ["CHECKPOINT_ROOTS", "CheckpointReader", "checkpoint_root", "load_module_weights", "load_slice_weights",
           "module_state", "open_checkpoint", "save_checkpoint", "slice_state"]
