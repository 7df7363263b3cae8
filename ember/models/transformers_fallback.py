"""Any Hugging Face decoder through its own transformers code, on ember's paged KV cache, backends and graphs.

The transformers causal-LM class is built with its parameters on the meta device (its buffers, such as rotary
tables, are computed for real) and filled by ember's loader, whose parameter names are the checkpoint's. Its
`nn.Linear` layers become ember's `Linear` (`ember::linear`, so the GEMV routing and the fusion passes apply; the
projections that read one input in a row are packed into one weight once loaded, ember.models.fallback_packing),
its LM head ember's `LMHead`. An attention function registered in transformers' attention interface under the name
"ember" hands each layer's q, k and v to `ember::attention` through an ember `Attention` module attached to that
layer, which the runner binds to its KV-cache group and backend like a native model's.

A step's tokens run as one packed sequence, [1, num_tokens], with ember's positions as `position_ids` (the
modules apply their rotary embeddings from them) and no transformers cache. Since the attention function is not a
name transformers' mask interface knows, no mask is built: ember's metadata says where each request starts.

What every layer hands its attention function (head counts, scale, sliding window, soft cap, anything else) is
recorded by one forward on the meta device at build time, before any weight loads; a layer whose attention ember
cannot compute refuses the model with the reason. At run time each call is checked against that record.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from ember.attention_backends.base import AttentionLayerOptions
from ember.models.fallback_attention import (ATTENTION_CHILD, ATTN_IMPLEMENTATION, FallbackUnsupported,  # noqa: F401
                                             probing, register_attention)
from ember.models.fallback_check import causal_lm_class, fallback_refusal
from ember.models.fallback_packing import pack_siblings, sibling_groups
from ember.models.fallback_rotary import tabulate_rotary
from ember.models.layers.attention import Attention
from ember.models.layers.embedding import LMHead
from ember.models.layers.linear import Linear

logger = logging.getLogger("ember")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside go to the meta device (no memory, no init); buffers are made for real. A
    parameter already on meta is registered as it is, so tied weights stay one parameter."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=False)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@contextlib.contextmanager
def buffers_on_meta(model: nn.Module) -> Iterator[None]:
    """Every buffer of `model` on the meta device for the duration (the build-time forward), then put back."""
    saved = [(m, name, buf) for m in model.modules() for name, buf in m._buffers.items() if buf is not None]
    for m, name, buf in saved:
        m._buffers[name] = buf.to("meta")
    try:
        yield
    finally:
        for m, name, buf in saved:
            m._buffers[name] = buf


class _GivenHidden(nn.Module):
    """Stands in for the decoder stack when the causal LM's own forward computes logits: it returns the hidden
    states it is given, so the family's own head code (scaling, soft cap) runs on ember's rows."""

    def __init__(self):
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        # the widest base-model output, so that a head reading any of its fields finds it (None)
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=self.hidden)


@dataclass
class _Parts:
    """What the wrapper keeps outside its module tree: the transformers model, and its head view (a shallow copy
    whose decoder stack is `_GivenHidden`, so that its forward is the family's head code on given rows)."""
    hf: nn.Module
    head: nn.Module
    head_kwargs: dict[str, Any]
    renamings: list
    # (parent module, names of its linear children that read one input in a row), packed once weights are loaded
    sibling_groups: list = field(default_factory=list)


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM behind ember's model interface: forward(ids [T], positions [T]) -> hidden [T, H],
    compute_logits(hidden [N, H]) -> float32 [N, V]. Its parameter names are the transformers model's own."""
    packed_modules: dict[str, list[str]] = {}      # transformers keeps each projection its own
    skips_prefill = False
    runs_transformers_code = True                  # (not split over tensor-parallel ranks)

    def __init__(self, config, prefix: str = ""):
        super().__init__()
        self.config = config
        hf_config = config.to_transformers() if hasattr(config, "to_transformers") else config
        name = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
        try:
            self._build(hf_config, prefix)
        except FallbackUnsupported as exc:
            raise FallbackUnsupported(f"model {name} cannot run through the transformers fallback: {exc}") from None

    def _build(self, hf_config, prefix: str) -> None:
        reason = fallback_refusal(hf_config)
        if reason is not None:
            raise FallbackUnsupported(reason)
        register_attention()
        cls = causal_lm_class(hf_config)
        with torch.device("cpu"), parameters_on_meta():
            hf = cls._from_config(hf_config, attn_implementation=ATTN_IMPLEMENTATION,
                                  dtype=torch.get_default_dtype()).eval()
        if hf._parameters or hf._buffers:
            raise FallbackUnsupported(f"{cls.__name__} holds tensors outside its submodules "
                                      f"({sorted([*hf._parameters, *hf._buffers])})")
        self.hf_class = cls
        self._base_name = hf.base_model_prefix
        with torch.device("meta"):
            _replace_head(hf)
            num_linears = replace_linears(hf)
        for child_name, child in hf.named_children():
            self.add_module(child_name, child)
        self._parts = _Parts(hf, _head_view(hf), _head_arguments(cls), checkpoint_renamings(hf))
        num_layers = self._attach_attention(hf, prefix)
        import transformers
        logger.info("%s runs through the transformers fallback (transformers %s): %d attention layers on "
                    "ember::attention, %d linear layers on ember::linear", cls.__name__, transformers.__version__,
                    num_layers, num_linears)

    def _attach_attention(self, hf: nn.Module, prefix: str) -> int:
        """Run the model once on the meta device to learn what each layer hands its attention function, check it,
        and give each layer an ember Attention under ATTENTION_CHILD; returns how many layers."""
        ids = torch.zeros(2, dtype=torch.long, device="meta")
        linear_calls: list = []
        hooks = [m.register_forward_pre_hook(lambda m, args: linear_calls.append((m, args[0] if args else None)))
                 for m in hf.modules() if isinstance(m, Linear)]
        try:
            with torch.no_grad(), buffers_on_meta(hf), probing() as calls:
                hidden = self.forward(ids, torch.arange(2, device="meta"))      # [2, H]
                logits = self._logits(hidden)
        finally:
            for hook in hooks:
                hook.remove()
        parents = {id(child): (module, name) for module in hf.modules() for name, child in module.named_children()}
        self._parts.sibling_groups = sibling_groups(linear_calls, parents)
        vocab = int(getattr(hf.config.get_text_config(), "vocab_size", logits.shape[-1]))
        if tuple(logits.shape) != (2, vocab):
            raise FallbackUnsupported(f"its head gives logits of shape {tuple(logits.shape)} for 2 tokens, not "
                                      f"(2, {vocab})")
        num_layers = int(hf.config.get_text_config().num_hidden_layers)
        if not calls:
            raise FallbackUnsupported("no layer called the attention interface (state-space or recurrent layers?)")
        modules = [m for m, _ in calls]
        if len(calls) != num_layers or len({id(m) for m in modules}) != len(modules):
            raise FallbackUnsupported(f"{len({id(m) for m in modules})} attention modules made {len(calls)} "
                                      f"attention calls for {num_layers} layers; every layer must be one standard "
                                      f"attention (no recurrent, state-space or linear-attention layers)")
        check_windows(hf.config.get_text_config(), [o for _, o in calls])
        names = {id(m): n for n, m in self.named_modules()}
        for module, options in calls:
            layer_name = f"{prefix}{names[id(module)]}.{ATTENTION_CHILD}"
            o = options
            module.add_module(ATTENTION_CHILD, Attention(layer_name, o.num_heads, o.num_kv_heads, o.head_size,
                                                         o.scale, o.sliding_window, o.logits_soft_cap))
        return len(calls)

    # -- the model interface --
    def checkpoint_target(self, name: str) -> tuple[str, None] | None:
        """(the parameter, no shard) a checkpoint tensor loads into where transformers renames it for this class
        (e.g. GPT-NeoX's `embed_out` -> `lm_head`); None where the name is the parameter's own."""
        renamed = name
        for renaming in self._parts.renamings:
            renamed, _ = renaming.rename_source_key(renamed)
        return None if renamed == name else (renamed, None)

    @property
    def decoder(self) -> nn.Module:
        """The transformers decoder stack (embedding, layers, final norm)."""
        return getattr(self, self._base_name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, H]: the step as one packed sequence."""
        out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out[0][0]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] as the causal LM's own forward computes them from its last hidden
        states (the LM head, then the family's scaling or soft cap)."""
        head = self._parts.head
        stub = head._modules[self._base_name]
        stub.hidden = hidden[None]
        try:
            return head(**self._parts.head_kwargs)[0][0]
        finally:
            stub.hidden = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V], through the family's own head code."""
        return self._logits(hidden).float()

    def stamp_layers_path(self) -> None:
        """Traced whole: transformers layers may differ by index (layer types, their rotary tables)."""
        return None

    def compile_identity(self) -> dict[str, str]:
        """What besides the config decides the traced code: the transformers version and class."""
        import transformers
        return {"model_impl": "transformers", "transformers": transformers.__version__,
                "class": self.hf_class.__name__}

    def init_buffers(self, device: torch.device) -> None:
        """Once the weights are in: move the transformers buffers (rotary frequencies, made on the CPU at build) to
        `device`, give rotary embeddings their cos/sin tables (ember.models.fallback_rotary), and pack sibling
        projections (q/k/v, gate/up) into one weight each (ember.models.fallback_packing)."""
        for module in self._parts.hf.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != torch.device(device):
                    module._buffers[name] = buf.to(device)
        tables = tabulate_rotary(self._parts.hf, device)
        if tables:
            logger.info("%d rotary embedding(s) read cos/sin tables by position (ember.models.fallback_rotary)", tables)
        groups, self._parts.sibling_groups = self._parts.sibling_groups, []
        if groups:
            packed = pack_siblings(groups)
            logger.info("packed %d groups of sibling projections (%s, ...) into one weight each", packed,
                        "/".join(groups[0][1]))


def _replace_head(hf: nn.Module) -> None:
    """The output projection as ember's LMHead (float32 logits, `ember::logits` on a GPU); tied to the input
    embedding when transformers tied them."""
    head, embedding = hf.get_output_embeddings(), hf.get_input_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return        # a head of its own kind stays; its nn.Linear, if any, becomes ember's Linear
    tied = head.weight is embedding.weight
    if tied:
        embedding.tp_size = 1       # what a tied LMHead reads of its embedding: the fallback runs on one rank
    lm_head = LMHead(head.out_features, head.in_features, tied_to=embedding if tied else None)
    if not tied:
        lm_head.weight = head.weight
    attribute = next(n for n, child in hf.named_children() if child is head)
    setattr(hf, attribute, lm_head)


def _head_view(hf: nn.Module) -> nn.Module:
    """A shallow copy of the causal LM whose decoder stack is `_GivenHidden`: its forward is the family's head."""
    view = copy.copy(hf)
    view._modules = dict(hf._modules)
    view._modules[hf.base_model_prefix] = _GivenHidden()
    return view


def _head_arguments(cls) -> dict[str, Any]:
    """The keyword arguments the head view's forward takes: no cache, logits for every row given."""
    params = inspect.signature(cls.forward).parameters
    kwargs: dict[str, Any] = {"use_cache": False} if "use_cache" in params else {}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 0
    return kwargs


def replace_linears(model: nn.Module) -> int:
    """Swap every plain `nn.Linear` for ember's `Linear` holding the same parameters; returns how many."""
    count = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                linear = Linear(child.in_features, child.out_features, bias=child.bias is not None)
                linear.weight = child.weight
                if child.bias is not None:
                    linear.bias = child.bias
                setattr(module, child_name, linear)
                count += 1
    return count


def checkpoint_renamings(hf: nn.Module) -> list:
    """transformers' checkpoint-name transforms for this model, all of which must be plain renamings (the static
    check refused tensor conversions already)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming
    transforms = list(get_model_conversion_mapping(hf))
    other = sorted({type(t).__name__ for t in transforms if not isinstance(t, WeightRenaming)})
    if other:
        raise FallbackUnsupported(f"transformers converts its checkpoint tensors at load ({other}); ember's loader "
                                  f"reads checkpoint tensors as they are, renamed at most")
    return transforms


def check_windows(text_config, options: list[AttentionLayerOptions]) -> None:
    """The sliding windows the layers handed over must agree with the config: a layer typed "sliding_attention"
    has one, a "full_attention" layer none, and a config with a window (and no layer types) gives some layer one.
    Otherwise the modeling code applies its window somewhere ember cannot see (in a mask it builds itself)."""
    windows = [o.sliding_window for o in options]
    layer_types = list(getattr(text_config, "layer_types", None) or [])
    if layer_types and len(layer_types) == len(windows):
        wrong = [i for i, (t, w) in enumerate(zip(layer_types, windows))
                 if (t == "sliding_attention") != (w is not None)]
        if wrong:
            raise FallbackUnsupported(f"layers {wrong[:8]} are typed {[layer_types[i] for i in wrong[:8]]} but "
                                      f"handed their attention windows {[windows[i] for i in wrong[:8]]}")
        return
    configured = getattr(text_config, "sliding_window", None)
    if configured and getattr(text_config, "use_sliding_window", True) is not False and not any(windows):
        raise FallbackUnsupported(f"its config sets sliding_window {configured}, but no layer hands a window to "
                                  f"its attention function (the modeling code applies it in a mask of its own)")
