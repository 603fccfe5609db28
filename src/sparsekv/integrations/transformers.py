"""Run a Hugging Face transformers model's indexed attention through sparsekv.

``pip install -e ".[hf]"``; this module imports transformers, the rest of
sparsekv never does.

    model = AutoModelForCausalLM.from_pretrained(path)     # GLM-5-Next: AutoModelForImageTextToText
    patch_model(model, page_size=64, num_pages=512)         # in place; returns the model
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32)
    get_manager(model).metrics()                             # every page is free again
    unpatch_model(model)

After :func:`patch_model`, every indexed-attention module (Qwen4Exp: the QSA
indexer and its gated attention) runs as a sparsekv layer built on the
module's own weights (shared, not copied): its keys, values and raw indexer
keys live in one :class:`~sparsekv.PagedKVCacheManager` (pages allocated as
requests grow), and it runs sparsekv's compress / score / select and sparse
attention ops. Everything else (linear-attention layers, MoE, norms,
embeddings, the LM head, ``generate``'s loop) stays Hugging Face's.

How a call maps onto the manager:

* A Hugging Face cache object (``DynamicCache``, the default of ``generate``
  and of ``model(..., use_cache=True)``) becomes one *generation*: on its first
  forward each batch row claims one manager request, and the cache's
  indexed-attention layers are replaced by :class:`SparseKVCacheLayer` (no
  tensors, lengths only). ``use_cache=False`` runs a temporary generation that
  is released when the forward returns.
* Left padding (``attention_mask`` zeros before a row's first token) is never
  stored: each row's real tokens sit at request positions ``0, 1, 2, ...``,
  which is where ``generate`` places them too (``position_ids`` from the mask).
  Positions shifted by a constant per row (Hugging Face's default
  ``position_ids`` under left padding) are accepted, as RoPE attention only
  sees differences; any other position pattern raises. Padding rows of the
  attention output are zero.
* **When a generation ends** (its pages go back to the manager):
  ``model.generate`` releases every cache it drove when it returns or raises
  (a cache it returned refuses further use); a cache used in direct
  ``model(...)`` calls is released when it is garbage-collected, when
  ``cache.reset()`` is called (it can then start again), or by
  :func:`end_generation`; :func:`unpatch_model` releases all.

Not supported, raised as :class:`UnsupportedFeatureError` (a
``NotImplementedError``) the moment it is asked for: beam search, assisted /
speculative decoding and anything else that reorders, crops or reshuffles a
filled cache; static, offloaded or quantized caches; right padding or holes in
the mask; 4-d masks; multi-axis (vision) positions; ``output_attentions``;
gradients (call under ``torch.no_grad()`` / ``torch.inference_mode()``).
A cache filled by an unpatched model is refused with a ``ValueError``.
:func:`patch_model` raises ``NotImplementedError`` for attention projections
that a tensor-parallel plan (``tp_plan``) split over ranks (the MLA families'
plans do; Qwen4Exp's leaves them whole and works under ``tp_plan="auto"``).
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
from torch import nn
from transformers.cache_utils import Cache

from .._checks import check_int
from ..cache.manager import PagedKVCacheManager
from .hf_adapters import ADAPTERS, AttentionAdapter
from .hf_cache import CallPlan, Generation, SparseKVCacheLayer, UnsupportedFeatureError, plan_call

_STATE_ATTR = "_sparsekv_patch"


class PatchState:
    """What :func:`patch_model` installed on one model (kept on the model as ``_sparsekv_patch``)."""

    def __init__(self, model: nn.Module, text_model: nn.Module, adapter: AttentionAdapter,
                 manager: PagedKVCacheManager, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.text_model = text_model
        self.adapter = adapter
        self.manager = manager
        self.dtype = dtype
        self.device = device
        self.layer_ids = [module.layer_idx for module in adapter.attentions]
        self.active: _ForwardCall | None = None
        self.generate_depth = 0
        self.generate_log: dict[int, Generation] = {}
        self.live: dict[int, Generation] = {}

    def forget(self, generation: Generation) -> None:
        self.live.pop(id(generation), None)

    def generation_of(self, cache: object) -> Generation:
        """The generation of a Hugging Face cache object, adopting a fresh one on first sight."""
        if not isinstance(cache, Cache):
            raise TypeError(f"past_key_values: expected a transformers Cache, got {type(cache).__name__}")
        layers = cache.layers
        if len(layers) <= max(self.layer_ids):
            raise ValueError(f"past_key_values: the cache has {len(layers)} layers; build it with the model's "
                             "config (DynamicCache(config=model.config)) or let the model create it")
        current = [layers[i] for i in self.layer_ids]
        ours = [isinstance(layer, SparseKVCacheLayer) for layer in current]
        if all(ours):
            generation = current[0].generation
            if any(layer.generation is not generation for layer in current):
                raise ValueError("past_key_values: its layers belong to different generations")
            generation.check_usable(self)
            return generation
        for layer in current:
            if type(layer).__name__ not in self.adapter.cache_layer_class_names or layer.get_seq_length() or (
                    getattr(layer, "indexer_keys", None) is not None and layer.indexer_keys.numel()):
                raise ValueError(
                    f"past_key_values: its indexed-attention layers are {type(layer).__name__} "
                    f"holding {layer.get_seq_length()} tokens; the sparsekv-patched model needs a fresh "
                    "DynamicCache (static, quantized or offloaded caches, and caches filled without sparsekv, "
                    "are not supported)")
        generation = Generation(self.manager, self)
        for i in self.layer_ids:
            layers[i] = SparseKVCacheLayer(generation)
        weakref.finalize(cache, generation.release).atexit = False
        return generation

    def close_all(self, reason: str) -> None:
        for generation in list(self.live.values()):
            generation.close(reason)


class _ForwardCall:
    """One forward of the patched text model: its inputs, and the plan its first patched layer needs."""

    def __init__(self, state: PatchState, batch_size: int, tokens: int, attention_mask, position_ids) -> None:
        self.state = state
        self.batch_size = batch_size
        self.tokens = tokens
        self.attention_mask = attention_mask
        self.position_ids = position_ids
        self.cache: object = None
        self.plan: CallPlan | None = None
        self.temporary = False

    def plan_for(self, cache: object) -> CallPlan:
        if self.plan is not None:
            if cache is not self.cache:
                raise ValueError("past_key_values: every layer of one forward must get the same cache object")
            return self.plan
        state = self.state
        if cache is None:
            generation = Generation(state.manager, state)
            self.temporary = True
        else:
            generation = state.generation_of(cache)
        plan = plan_call(generation, self.batch_size, self.tokens, self.attention_mask, self.position_ids,
                         state.device)
        self.cache, self.plan = cache, plan
        generation.on_release = state.forget
        state.live[id(generation)] = generation
        if state.generate_depth:
            state.generate_log[id(generation)] = generation
        return plan

    def finish(self, failed: bool) -> None:
        plan = self.plan
        if plan is None:
            return
        if self.temporary:
            plan.generation.release()
        elif failed:
            # Hugging Face's own layers may have updated their part of the cache before the failure.
            plan.generation.broken_reason = "a forward call on this cache failed midway"
        else:
            plan.generation.commit(plan)


def _var_keyword_name(signature: inspect.Signature) -> str | None:
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return parameter.name
    return None


def _wrap_text_forward(state: PatchState) -> None:
    text_model = state.text_model
    original = text_model.forward
    signature = inspect.signature(original)
    extra_name = _var_keyword_name(signature)
    mask_index = list(signature.parameters).index("attention_mask")

    @functools.wraps(original)
    def forward(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        extra = arguments.get(extra_name, {}) if extra_name else {}
        if extra.get("output_attentions", getattr(text_model.config, "output_attentions", False)):
            raise UnsupportedFeatureError("output_attentions: the sparsekv-patched attention never forms the "
                                          "dense attention weights")
        inputs = arguments.get("input_ids")
        if inputs is None:
            inputs = arguments.get("inputs_embeds")
        if inputs is None:
            return original(*args, **kwargs)
        mask = arguments.get("attention_mask")
        if isinstance(mask, dict):
            raise UnsupportedFeatureError("attention_mask: precomputed mask mappings are not supported by the "
                                          "sparsekv-patched attention; pass the 2-d padding mask")
        if state.active is not None:
            raise RuntimeError("the sparsekv-patched model does not support nested forward calls")
        call = _ForwardCall(state, inputs.shape[0], inputs.shape[1], mask, arguments.get("position_ids"))
        cache = arguments.get("past_key_values")
        use_cache = arguments.get("use_cache")
        if use_cache is None:
            use_cache = getattr(text_model.config, "use_cache", True)
        masks = state.adapter.mask_mapping(inputs, mask)
        if masks is not None:
            if len(args) > mask_index:
                args = (*args[:mask_index], masks, *args[mask_index + 1:])
            else:
                kwargs["attention_mask"] = masks
        if cache is not None or not use_cache:
            # Before any layer runs: a refused call (mask, positions, pages) leaves every cache untouched.
            call.plan_for(cache)
        state.active = call
        try:
            output = original(*args, **kwargs)
        except BaseException:
            call.finish(failed=True)
            raise
        finally:
            state.active = None
        call.finish(failed=False)
        return output

    text_model.forward = forward


def _attention_forward(state: PatchState, ordinal: int):
    adapter = state.adapter

    def forward(hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, past_key_values=None,
                **kwargs):
        call = state.active
        if call is None:
            raise RuntimeError("a sparsekv-patched attention module runs only inside its model's forward")
        if torch.is_grad_enabled() and hidden_states.requires_grad:
            raise UnsupportedFeatureError("gradients: the sparsekv-patched attention is inference-only; call the "
                                          "model under torch.no_grad() or torch.inference_mode()")
        if hidden_states.dtype != state.dtype or hidden_states.device != state.device:
            raise ValueError(f"hidden_states: the patched cache holds {state.dtype} on {state.device}, got "
                             f"{hidden_states.dtype} on {hidden_states.device}; unpatch and patch the model again "
                             "after changing its dtype or device")
        plan = call.plan_for(past_key_values)
        batch, tokens, hidden = hidden_states.shape
        flat = hidden_states.reshape(batch * tokens, hidden)
        scratch = plan.generation.adapter_scratch
        if plan.row_index is None:
            output = adapter.forward(ordinal, flat, plan.batch, scratch).view(batch, tokens, -1)
        else:
            output = flat.new_zeros(batch * tokens, hidden)
            if plan.row_index.numel():
                rows = flat.index_select(0, plan.row_index)
                output.index_copy_(0, plan.row_index, adapter.forward(ordinal, rows, plan.batch, scratch))
            output = output.view(batch, tokens, hidden)
        return (output,) + (None,) * (adapter.output_arity - 1)

    return forward


def _check_generate_options(model: nn.Module, kwargs: dict) -> None:
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)

    def option(name: str):
        return kwargs[name] if name in kwargs else getattr(config, name, None)

    if (option("num_beams") or 1) > 1:
        raise UnsupportedFeatureError(f"beam search (num_beams={option('num_beams')}) reorders the cache, which "
                                      "the sparsekv-patched attention does not support")
    if kwargs.get("assistant_model") is not None or option("prompt_lookup_num_tokens") is not None:
        raise UnsupportedFeatureError("assisted / prompt-lookup decoding crops the cache, which the "
                                      "sparsekv-patched attention does not support")
    implementation = option("cache_implementation")
    if implementation not in (None, "dynamic"):
        raise UnsupportedFeatureError(f"cache_implementation={implementation!r}: the sparsekv-patched model runs "
                                      "on the default dynamic cache only")


def _wrap_generate(state: PatchState) -> None:
    model = state.model
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        _check_generate_options(model, kwargs)
        state.generate_depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            state.generate_depth -= 1
            if not state.generate_depth:
                log, state.generate_log = state.generate_log, {}
                for generation in log.values():
                    generation.close("generate() returned")

    model.generate = generate


def _find_text_model(model: nn.Module) -> tuple[nn.Module, type[AttentionAdapter], list[nn.Module]]:
    found = []
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            continue
        for adapter in ADAPTERS:
            attentions = [layer.self_attn for layer in layers
                          if isinstance(getattr(layer, "self_attn", None), nn.Module)
                          and adapter.matches(layer.self_attn)]
            if attentions:
                found.append((module, adapter, sorted(attentions, key=lambda m: m.layer_idx)))
    if not found:
        names = sorted(name for adapter in ADAPTERS for name in adapter.attention_class_names)
        raise ValueError(f"model: no indexed-attention module sparsekv can run in {type(model).__name__} "
                         f"(supported: {', '.join(names)})")
    if len(found) > 1:
        raise ValueError(f"model: {len(found)} decoder stacks with indexed attention; patch one text model at a time")
    return found[0]


def patch_model(model: nn.Module, *, page_size: int = 64, num_pages: int = 512,
                device: torch.device | str | None = None) -> nn.Module:
    """Run ``model``'s indexed-attention layers through sparsekv, in place; returns ``model``.

    Args:
        model: a ``*ForCausalLM`` (GLM-5-Next: ``Glm5NextForConditionalGeneration``)
            or a bare text model of a supported family (Qwen4Exp, GLM-5-Next,
            GLM-5, DeepSeek-V3.2), in eval mode or under ``torch.no_grad()``.
        page_size: tokens per cache page (default 64).
        num_pages: pages in the manager (default 512, i.e. 32768 cached tokens
            over all live sequences); every patched layer's cache rows of one
            token range share one page id. MLA families: a multiple of
            ``index_kpool``.
        device: where the pages live; must be the attention weights' device
            (the default).

    Raises ``ValueError`` when the model has no supported module, is already
    patched, or its attention weights span several devices or dtypes.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    check_int("page_size", page_size, minimum=1)
    check_int("num_pages", num_pages, minimum=1)
    text_model, adapter_cls, attentions = _find_text_model(model)
    if getattr(model, _STATE_ATTR, None) is not None or getattr(text_model, _STATE_ATTR, None) is not None:
        raise ValueError("model: already patched; call unpatch_model first")
    weights = [adapter_cls.weight_of(module) for module in attentions]
    dtypes, devices = {w.dtype for w in weights}, {w.device for w in weights}
    if len(dtypes) != 1 or len(devices) != 1:
        raise ValueError(f"model: the indexed-attention weights span dtypes {sorted(map(str, dtypes))} and devices "
                         f"{sorted(map(str, devices))}; sparsekv needs one of each")
    dtype, weight_device = dtypes.pop(), devices.pop()
    if device is not None and torch.device(device) != weight_device:
        raise ValueError(f"device: the attention weights are on {weight_device}, got {device!r}; move the model "
                         "first")
    adapter = adapter_cls(text_model, attentions)
    manager = PagedKVCacheManager(adapter.cache_groups(dtype, page_size), page_size=page_size, num_pages=num_pages,
                                  device=weight_device, enable_prefix_caching=False)
    state = PatchState(model, text_model, adapter, manager, dtype, weight_device)
    for ordinal, module in enumerate(attentions):
        module.forward = _attention_forward(state, ordinal)
    _wrap_text_forward(state)
    if callable(getattr(model, "generate", None)):
        _wrap_generate(state)
    setattr(model, _STATE_ATTR, state)
    if text_model is not model:
        setattr(text_model, _STATE_ATTR, state)
    return model


def _state(model: nn.Module) -> PatchState:
    state = getattr(model, _STATE_ATTR, None)
    if not isinstance(state, PatchState):
        raise ValueError(f"model: {type(model).__name__} is not patched by sparsekv")
    return state


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`: release every live generation and restore Hugging Face's forwards."""
    state = _state(model)
    if state.model is not model:
        raise ValueError("model: unpatch the model that was patched (the outer model)")
    state.close_all("the model was unpatched")
    for module in state.adapter.attentions:
        del module.forward
    del state.text_model.forward
    if "generate" in model.__dict__:
        del model.generate
    delattr(model, _STATE_ATTR)
    if state.text_model is not model:
        delattr(state.text_model, _STATE_ATTR)
    return model


def get_manager(model: nn.Module) -> PagedKVCacheManager:
    """The :class:`~sparsekv.PagedKVCacheManager` holding a patched model's pages."""
    return _state(model).manager


def end_generation(cache: Cache) -> None:
    """Release the pages of a cache used in direct ``model(...)`` calls; the cache refuses further use."""
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, SparseKVCacheLayer):
            layer.generation.close("end_generation() was called")
            return
    raise ValueError("cache: it holds no sparsekv generation")


__all__ = ["PatchState", "SparseKVCacheLayer", "UnsupportedFeatureError", "end_generation", "get_manager",
           "patch_model", "unpatch_model"]
