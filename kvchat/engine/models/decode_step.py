"""One decode step (one token in, its logits out) of a Llama, Qwen2 or Gemma 3 model, without
the layers of Python that transformers wraps around every module.

Why: at one row per call a SmolLM2 step is thousands of short ops, and transformers' module
calls, decorators, keyword plumbing and output records around them cost about one step in
seven on this 2-core CPU (``benchmarks/bench_decode_step.py``: the step alone decodes 1.16x
as fast as the model's forward). This step calls the same kernels on the same tensors, in the
same order, skipping only the wrapping. Where the model's modules do real work (the
projections, quantized or not; the rotary table; the embedding; the head) they are called
as they are, and attention goes through the model's own attention function (except for
quantized models, below).

Exactness: the step calls the attention function the model's forward calls (kvchat's, once
``kvchat.engine.kvdirect.attention.install`` has routed the model: the exact kernel every cache and
every path share), and the model's own modules for the rest. The only arithmetic spelled
out here is what transformers spells out in Python in ``modeling_llama``: RMSNorm,
``rotate_half`` and the rotary products, the residual adds and the gated MLP, each in the
same op order and dtypes. So the step gives the bits of the model's own ``forward``
(``torch.equal`` logits and K/V; ``tests/engine/models/test_decode_step.py``) in every weights mode.
The rotary products run over q's and k's heads in one tensor when the stacked projection
hands them over side by side: elementwise multiply and add round each element alone, so
that changes no bit.

The layers in C++: for the quantized CPU form the default model and a Gemma 3 GGUF take,
each layer's two halves around the cache's update and attention (the norms, q/k/v and
rotary; then o_proj and the MLP) run in ``kvchat.engine.models.native`` once its library is
built (in the background, at first use) and has given these halves' bits on this machine;
until then, without a C++ compiler, or with ``KVCHAT_NATIVE=0``, the Python halves below
run, with the same output. Where the routed attention would call the exact kernel as it
stands (no streamed layer pending, a causal mask or none), the second half calls it itself
(``takes_exact_kernel``), with the operands kvchat's attention function hands it: the same
bits, without the Python around a ctypes call in every layer.

What it does not do: module hooks do not fire (nothing of transformers' or torch's hook
machinery runs). A cache that keeps the layers' inputs (the KV-Direct cache's residual
checkpoints, taken by a forward pre-hook on the model path) is handed them through its
``note_layer_input(layer_idx, hidden)`` instead. Anything else is left to the model path:
:func:`decode_step_for` returns None for models it does not know, in training mode, or with
hooks on a layer it would skip.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvchat.engine.kvdirect.attention import takes_exact_kernel
from kvchat.engine.kvdirect.exact_attention import window_of
from kvchat.engine.kvdirect.interface import layer_input_observer

__all__ = ["DecodeStep", "decode_step_for", "forget_decode_step", "prepare_decode_step"]

_steps: weakref.WeakKeyDictionary[nn.Module, DecodeStep | None] = weakref.WeakKeyDictionary()


def decode_step_for(model: nn.Module) -> DecodeStep | None:
    """The model's :class:`DecodeStep` (built once), or None where it does not apply."""
    try:
        step = _steps[model]
    except KeyError:
        step = _steps[model] = DecodeStep.build(model) or Gemma3DecodeStep.build(model)
    if step is None or model.training or step.hooked(model):
        return None
    return step


def prepare_decode_step(model: nn.Module) -> None:
    """Build ``model``'s step now, and with it start (or load) its C++ layers, so that the
    first reply does not wait for either."""
    step = decode_step_for(model)
    if step is not None:
        step.wait_for_native(0)


def forget_decode_step(model: nn.Module) -> None:
    """Drop the step built for ``model`` (call after replacing its modules)."""
    _steps.pop(model, None)


class _Layer:
    """What one decoder layer's step reads, looked up once."""

    __slots__ = (
        "attention",
        "down",
        "gate",
        "gate_up",
        "index",
        "input_norm",
        "o_proj",
        "post_norm",
        "q",
        "k",
        "v",
        "qkv",
        "up",
        "act",
    )

    def __init__(self, index: int, layer: nn.Module) -> None:
        from kvchat.engine.models.fused import stacked_group

        attn, mlp = layer.self_attn, layer.mlp
        self.index = index
        self.attention = attn
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.q, self.k, self.v, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.qkv = stacked_group([self.q, self.k, self.v])
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.gate_up = stacked_group([self.gate, self.up])
        self.act = mlp.act_fn


def _families() -> dict[type, tuple[type, type]]:
    """Causal LM class -> (its decoder layer class, its RMSNorm class), for the families
    whose decode step is Llama's: same norms (op for op), rotary, gated MLP, attention call."""
    families: dict[type, tuple[type, type]] = {}
    try:
        from transformers.models.llama import modeling_llama as llama

        families[llama.LlamaForCausalLM] = (llama.LlamaDecoderLayer, llama.LlamaRMSNorm)
    except ImportError:
        pass
    try:
        from transformers.models.qwen2 import modeling_qwen2 as qwen2

        families[qwen2.Qwen2ForCausalLM] = (qwen2.Qwen2DecoderLayer, qwen2.Qwen2RMSNorm)
    except ImportError:
        pass
    return families


def _rms_norm(norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``, op for op (its casts are no-ops on float32 input)."""
    input_dtype = hidden.dtype
    if input_dtype != torch.float32:
        hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    if input_dtype != torch.float32:
        hidden = hidden.to(input_dtype)
    return norm.weight * hidden


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecodeStep:
    """``model(input_ids=[[t]], cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]``
    for a ``LlamaForCausalLM``, in fewer Python frames."""

    family = "llama"  # which halves the C++ layers run for it

    def __init__(self, model: nn.Module) -> None:
        # No reference to ``model`` itself: the step is the value of a weak-keyed table
        # whose key is the model, and a value holding its key would keep both alive.
        base = model.model
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = base.norm
        self.head = model.lm_head
        self.config = model.config
        self.decoder_layers = list(base.layers[: self.config.num_hidden_layers])
        self.layers = [_Layer(i, layer) for i, layer in enumerate(self.decoder_layers)]
        self.head_dim = self.layers[0].attention.head_dim
        self.skipped: list[nn.Module] = [base, self.norm]
        for layer, parts in zip(self.decoder_layers, self.layers):
            self.skipped += [layer, parts.attention, layer.mlp, parts.input_norm, parts.post_norm]
        # A model kvchat quantized on the CPU can run its layers in C++ (below).
        from kvchat.engine.models.fused import weight_widths

        self.packs_gqa = bool(weight_widths(model))
        from transformers.masking_utils import create_causal_mask

        self.create_mask = create_causal_mask
        # The layers in C++ (kvchat.engine.models.native), for the quantized forms it serves: its
        # build starts here in the background and the step switches over once it is built
        # and agrees bit for bit; until then, and without a compiler, the Python layers run.
        self.use_native = True
        self.native: Any = None
        self._native_build: Any = None
        if self.packs_gqa:
            from kvchat.engine.models.native import build as native_build
            from kvchat.engine.models.native.layers import serves

            if serves(self):
                self._native_build = native_build.start()

    @classmethod
    def build(cls, model: nn.Module) -> DecodeStep | None:
        """A step for ``model`` if it is a Llama or a Qwen2 model built as transformers
        builds them (Qwen2's decoder is Llama's with biased q/k/v projections; its
        sliding-window layers are left to the model path), else None."""
        families = _families()
        family = families.get(type(model))
        if family is None:
            return None
        layer_type, norm_type = family
        layer_types = getattr(model.config, "layer_types", None) or []
        if any(kind != "full_attention" for kind in layer_types):
            return None
        base = model.model
        norms = [base.norm]
        for layer in base.layers:
            if type(layer) is not layer_type:
                return None
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
        if any(type(n) is not norm_type for n in norms):
            return None
        return cls(model)

    def hooked(self, model: nn.Module) -> bool:
        """Whether ``model`` or a module this step skips has hooks (the model path must run
        them). The KV-Direct cache's own pre-hooks are fine: the step hands their input over
        itself."""
        for module in [model, *self.skipped]:
            if module._forward_hooks or module._backward_hooks:
                return True
            for hook in module._forward_pre_hooks.values():
                if not getattr(hook, "kvchat_layer_input", False):
                    return True
        return False

    def __call__(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits ([vocab]) for ``input_ids`` ([1, 1]) after ``cache``'s tokens."""
        hidden = self.embed(input_ids)
        past = cache.get_seq_length()
        position_ids = (torch.arange(1, device=hidden.device) + past).unsqueeze(0)
        mask = self.create_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            cache=cache,
            position_ids=position_ids,
        )
        cos, sin = self.rotary(hidden, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        note_input = layer_input_observer(cache)
        native = self._native_layers() if hidden.dtype == torch.float32 else None
        attention = self._attention_function()
        attends = native is not None and native.attention_kernel != 0
        for layer in self.layers:
            index = layer.index
            if note_input is not None:
                note_input(index, hidden)
            if native is not None:
                query, key, value = native.before_attention(index, hidden, cos, sin)
            else:
                query, key, value = self.python_before_attention(layer, hidden, cos, sin)
            key, value = cache.update(key, value, index)
            module, scaling = layer.attention, layer.attention.scaling
            window = window_of(module, {})
            if attends and takes_exact_kernel(
                attention, module, query, mask, key.shape[-2], window
            ):
                hidden = native.attended_after_attention(
                    index, hidden, query, key, value, scaling, window
                )
                continue
            out, _ = attention(module, query, key, value, mask, dropout=0.0, scaling=scaling)
            attended = out.reshape(1, 1, -1)
            if native is not None:
                hidden = native.after_attention(index, hidden, attended)
            else:
                hidden = self.after_attention(layer, hidden, attended.contiguous())
        hidden = _rms_norm(self.norm, hidden)
        return self.head(hidden)[0, -1]

    def python_before_attention(
        self, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's rotated query and key, and value, from its input (``[1, 1, hidden]``):
        the input norm, the projections and the rotary products."""
        x = _rms_norm(layer.input_norm, hidden)
        return self._qkv(layer, x, cos, sin, self.head_dim)

    def _native_layers(self) -> Any:
        """The C++ layers once built and checked; None until then, or without them."""
        if not self.use_native or "after_attention" in self.__dict__:
            return None  # off, or a replaced after_attention (bench_compile.py) must run
        if self._native_build is not None and self._native_build.done():
            self._take_build()
        return self.native

    def wait_for_native(self, timeout: float | None = None) -> bool:
        """Block until the C++ layers' build ends (benchmarks and tests); whether they are
        in use now."""
        if self._native_build is not None:
            self._native_build.wait(timeout)
            if self._native_build.done():
                self._take_build()
        return self.native is not None

    def _take_build(self) -> None:
        """Load the ended build's library and use it if it agrees (else the Python layers)."""
        from kvchat.engine.models.native.layers import NativeLayers, load_library

        build, self._native_build = self._native_build, None
        path = build.wait()
        self.native = None
        if path is None or not load_library(str(path)):
            return
        try:
            layers = NativeLayers(self)
            self.native = layers if layers.agrees(self) else None
        except RuntimeError:  # an op's schema or a kernel refused: the Python layers serve
            pass

    def after_attention(
        self, layer: _Layer, residual: torch.Tensor, attention_out: torch.Tensor
    ) -> torch.Tensor:
        """The layer's output from its input (``residual``) and its attention's output
        (``[1, 1, heads * head_dim]``): o_proj, the residual add, the post-attention norm and
        the gated MLP. It computes no K/V, so a replacement (``benchmarks/bench_compile.py``
        sets a torch.compile'd one on an instance) changes no replay: a checkpoint replays
        from the layer inputs every cache records alike."""
        hidden = residual + layer.o_proj(attention_out)
        x = _rms_norm(layer.post_norm, hidden)
        if layer.gate_up is not None:
            gate, up = layer.gate_up.split(x)
            gate, up = gate.reshape(1, 1, -1), up.reshape(1, 1, -1)
        else:
            gate, up = layer.gate(x), layer.up(x)
        return hidden + layer.down(layer.act(gate) * up)

    def _attention_function(self) -> Callable[..., Any]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )

    @staticmethod
    def _qkv(
        layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated query and key, and value, as ``[1, heads, 1, head_dim]`` (the shapes
        ``LlamaAttention`` hands on)."""
        group = layer.qkv
        if group is not None and not group.has_bias:
            # One kernel call; q and k sit side by side in its output: rotate them as one.
            stacked = group.stacked(x)
            q_width, k_width = group.widths[0], group.widths[1]
            qk = stacked[:, : q_width + k_width].view(1, 1, -1, head_dim).transpose(1, 2)
            qk = (qk * cos) + (_rotate_half(qk) * sin)
            q_heads = q_width // head_dim
            value = stacked[:, q_width + k_width :].view(1, 1, -1, head_dim).transpose(1, 2)
            return qk[:, :q_heads], qk[:, q_heads:], value
        if group is not None:
            q, k, v = group.split(x)
        else:
            q, k, v = layer.q(x), layer.k(x), layer.v(x)
        query = q.view(1, 1, -1, head_dim).transpose(1, 2)
        key = k.view(1, 1, -1, head_dim).transpose(1, 2)
        value = v.view(1, 1, -1, head_dim).transpose(1, 2)
        query = (query * cos) + (_rotate_half(query) * sin)
        key = (key * cos) + (_rotate_half(key) * sin)
        return query, key, value


class _GemmaParts:
    """What a Gemma 3 layer's step reads beyond Llama's, looked up once."""

    __slots__ = ("k_norm", "kind", "post_ff_norm", "pre_ff_norm", "q_norm", "window")

    def __init__(self, layer: nn.Module, kind: str) -> None:
        self.q_norm, self.k_norm = layer.self_attn.q_norm, layer.self_attn.k_norm
        self.pre_ff_norm = layer.pre_feedforward_layernorm
        self.post_ff_norm = layer.post_feedforward_layernorm
        self.window = layer.self_attn.sliding_window
        self.kind = kind


class Gemma3DecodeStep(DecodeStep):
    """The step for a ``Gemma3ForCausalLM`` (text): Llama's skeleton with Gemma 3's own
    parts, each called as the model's forward calls it: q/k norms after the projections,
    four norms per block (input, post-attention, pre- and post-feedforward), the GeGLU MLP,
    a rotary table and a mask per layer type (sliding or global), the sliding window handed
    to attention, and the final logit soft-cap when the config has one. The norms are the
    model's own modules (``Gemma3RMSNorm`` computes ``(x * w)`` in float32, unlike Llama's).
    The C++ layers serve it too (``native/decode_layer.cpp``'s ``gemma_*`` halves)."""

    family = "gemma3"

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        self.layer_types = list(config.layer_types[: config.num_hidden_layers])
        self.gemma = [
            _GemmaParts(layer, kind)
            for layer, kind in zip(model.model.layers[: config.num_hidden_layers], self.layer_types)
        ]
        super().__init__(model)
        from transformers.masking_utils import create_sliding_window_causal_mask

        self.create_sliding_mask = create_sliding_window_causal_mask
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        for parts in self.gemma:
            self.skipped += [parts.q_norm, parts.k_norm, parts.pre_ff_norm, parts.post_ff_norm]

    @classmethod
    def build(cls, model: nn.Module) -> DecodeStep | None:
        try:
            from transformers.models.gemma3 import modeling_gemma3 as gemma3
        except ImportError:
            return None
        if type(model) is not gemma3.Gemma3ForCausalLM:
            return None
        config = model.config
        if getattr(config, "use_bidirectional_attention", False):
            return None
        if getattr(config, "attn_logit_softcapping", None) is not None:
            return None
        if type(model.model.norm) is not gemma3.Gemma3RMSNorm:
            return None
        if any(type(layer) is not gemma3.Gemma3DecoderLayer for layer in model.model.layers):
            return None
        return cls(model)

    def __call__(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        hidden = self.embed(input_ids)
        past = cache.get_seq_length()
        position_ids = (torch.arange(1, device=hidden.device) + past).unsqueeze(0)
        kwargs = {
            "config": self.config,
            "inputs_embeds": hidden,
            "attention_mask": None,
            "cache": cache,
            "position_ids": position_ids,
        }
        masks = {
            "full_attention": self.create_mask(**kwargs),
            "sliding_attention": self.create_sliding_mask(**kwargs),
        }
        rotary = {}
        for kind in set(self.layer_types):
            cos, sin = self.rotary(hidden, position_ids, kind)
            rotary[kind] = (cos.unsqueeze(1), sin.unsqueeze(1))
        note_input = layer_input_observer(cache)
        native = self._native_layers() if hidden.dtype == torch.float32 else None
        attention = self._attention_function()
        attends = native is not None and native.attention_kernel != 0
        for layer, parts in zip(self.layers, self.gemma):
            index = layer.index
            if note_input is not None:
                note_input(index, hidden)
            cos, sin = rotary[parts.kind]
            if native is not None:
                query, key, value = native.before_attention(index, hidden, cos, sin)
            else:
                query, key, value = self.python_before_attention(layer, hidden, cos, sin)
            key, value = cache.update(key, value, index)
            module, mask = layer.attention, masks[parts.kind]
            if attends and takes_exact_kernel(
                attention, module, query, mask, key.shape[-2], parts.window
            ):
                hidden = native.attended_after_attention(
                    index, hidden, query, key, value, module.scaling, parts.window
                )
                continue
            out, _ = attention(
                module, query, key, value, mask, dropout=0.0,
                scaling=module.scaling, sliding_window=parts.window,
            )  # fmt: skip
            attended = out.reshape(1, 1, -1)
            if native is not None:
                hidden = native.after_attention(index, hidden, attended)
            else:
                hidden = self.after_attention(layer, hidden, attended.contiguous())
        logits = self.head(self.norm(hidden))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits[0, -1]

    def python_before_attention(
        self, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        parts = self.gemma[layer.index]
        x = layer.input_norm(hidden)
        q, k, v = layer.qkv.split(x) if layer.qkv is not None else (
            layer.q(x), layer.k(x), layer.v(x)
        )  # fmt: skip
        query = parts.q_norm(q.view(1, 1, -1, self.head_dim).transpose(1, 2))
        key = parts.k_norm(k.view(1, 1, -1, self.head_dim).transpose(1, 2))
        value = v.view(1, 1, -1, self.head_dim).transpose(1, 2)
        query = (query * cos) + (_rotate_half(query) * sin)
        key = (key * cos) + (_rotate_half(key) * sin)
        return query, key, value

    def after_attention(
        self, layer: _Layer, residual: torch.Tensor, attention_out: torch.Tensor
    ) -> torch.Tensor:
        parts = self.gemma[layer.index]
        hidden = residual + layer.post_norm(layer.o_proj(attention_out))
        x = parts.pre_ff_norm(hidden)
        if layer.gate_up is not None:
            gate, up = layer.gate_up.split(x)
            gate, up = gate.reshape(1, 1, -1), up.reshape(1, 1, -1)
        else:
            gate, up = layer.gate(x), layer.up(x)
        return hidden + parts.post_ff_norm(layer.down(layer.act(gate) * up))
