"""Bytes per token of a model's conversation state, from its config alone (no weights).

docs/facts.md (section 1) in code: for every decoder layer, what one token costs as K+V
(``2 * kv_heads * head_dim * itemsize``) and as a residual checkpoint
(``hidden_size * itemsize``), which of the two exact forms is smaller, and what
transformers' own ``DynamicCache(config=...)`` would hold for ``n`` tokens (the
"standard cache equivalent" of docs/facts.md, section 2, which the memory gauge compares against).

Which layers are sliding is decided by ``transformers.cache_utils.get_layer_types_and_kwargs``,
the very function ``DynamicCache`` uses, so our notion of "sliding" cannot drift from
transformers' (Gemma 3: 5 sliding : 1 full; Mistral/Phi-3 with ``sliding_window`` set: every
layer; Qwen2 with ``use_sliding_window: false``: none).

Importing this module does not import torch or transformers; only the functions that need a
config do.

Bundled configs (``configs/<alias>.json``) are architecture snapshots of public
``config.json`` files, so ``kvchat inspect gemma-3-4b`` works offline without the weights.
``gemma-3-4b`` holds the *text* part (``text_config``) of the multimodal
``google/gemma-3-4b-it`` config, spelled out with the defaults that config relies on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvchat.errors import ModelLoadError, ModelNotFoundError

CONFIGS_DIR = Path(__file__).with_name("configs")

FORMS = ("residual", "kv", "auto")

_ITEMSIZE = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
}
_CANONICAL_DTYPE = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
# Layer types whose cache is a ``DynamicSlidingWindowLayer`` (keeps the last window - 1 tokens).
_WINDOWED_KINDS = ("sliding_attention", "chunked_attention")
_SUPPORTED_KINDS = ("full_attention", *_WINDOWED_KINDS)


def dtype_itemsize(dtype: Any) -> tuple[str, int]:
    """``"bfloat16"`` / ``"bf16"`` / ``torch.bfloat16`` -> ``("bfloat16", 2)``."""
    name = str(dtype).removeprefix("torch.").lower()
    name = _CANONICAL_DTYPE.get(name, name)
    if name not in _ITEMSIZE:
        raise ValueError(f"unsupported dtype {dtype!r}: use float32, bfloat16 or float16")
    return name, _ITEMSIZE[name]


@dataclass(frozen=True)
class LayerFootprint:
    """Per-token cost of one decoder layer, in bytes."""

    index: int
    kind: str  # "full_attention" | "sliding_attention" (or "chunked_attention", cached alike)
    sliding_window: int | None
    kv_heads: int
    head_dim: int
    hidden_size: int
    kv_bytes: int  # K+V per token: 2 * kv_heads * head_dim * itemsize
    residual_bytes: int  # one residual checkpoint per token: hidden_size * itemsize
    query_heads: int = 0  # attention heads (sizes the scores of streamed attention)

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    @property
    def smaller_exact_form(self) -> str:
        """``"residual"`` or ``"kv"``, whichever is smaller; a tie is ``"kv"`` (no recompute)."""
        return "residual" if self.residual_bytes < self.kv_bytes else "kv"

    @property
    def residual_to_kv(self) -> float:
        """Residual bytes / K+V bytes: < 1 only where a checkpoint actually saves memory."""
        return self.residual_bytes / self.kv_bytes

    def cold_bytes(self, form: str) -> int:
        """Bytes per token to keep this layer's state in ``form`` (residual | kv | auto)."""
        if form == "auto":
            form = self.smaller_exact_form
        if form == "kv":
            return self.kv_bytes
        if form == "residual":
            return self.residual_bytes
        raise ValueError(f"unknown form {form!r}: use one of {', '.join(FORMS)}")

    def standard_cache_tokens(self, n_tokens: int) -> int:
        """Tokens transformers' DynamicCache keeps at this layer after ``n_tokens`` went in.

        ``DynamicSlidingWindowLayer.update`` keeps ``[-sliding_window + 1:]``: the last
        ``window - 1`` tokens (all of them while fewer).
        """
        if n_tokens < 0:
            raise ValueError("n_tokens must be >= 0")
        if self.sliding_window is None:
            return n_tokens
        return min(n_tokens, max(self.sliding_window - 1, 0))

    def standard_cache_resident_tokens(self, n_tokens: int, last_update: int = 1) -> int:
        """Tokens' worth of storage the DynamicCache layer actually keeps alive.

        A sliding layer's ``keys`` is a *view* into ``torch.cat([old, new])``, so the storage of
        the last update's whole concatenation stays resident: ``min(n - c, window - 1) + c`` for
        a last update of ``c`` tokens (``window`` per sliding layer while decoding one token at
        a time; the whole prompt right after a single-chunk prefill). Full layers: ``n``.
        """
        if self.sliding_window is None:
            return n_tokens
        c = max(0, min(last_update, n_tokens))
        return self.standard_cache_tokens(n_tokens - c) + c


@dataclass(frozen=True)
class ModelFootprint:
    """Per-layer footprints of one model at one dtype, with totals and ratios."""

    model_type: str
    layers: tuple[LayerFootprint, ...]
    dtype: str
    itemsize: int
    name: str = ""  # the config's name_or_path (repo id, directory, or bundled source repo)
    kv_dtype: str = ""  # what K/V are held in, where narrower than ``dtype`` ("": ``dtype``)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))

    def with_kv_dtype(self, dtype: Any) -> ModelFootprint:
        """This footprint with K/V held in ``dtype`` (residual checkpoints stay in the
        model's own dtype, the residual stream's)."""
        name, itemsize = dtype_itemsize(dtype)
        if name == (self.kv_dtype or self.dtype):
            return self
        layers = tuple(
            replace(layer, kv_bytes=2 * layer.kv_heads * layer.head_dim * itemsize)
            for layer in self.layers
        )
        return replace(self, layers=layers, kv_dtype="" if name == self.dtype else name)

    # -- shape -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def sliding_layers(self) -> tuple[LayerFootprint, ...]:
        return tuple(layer for layer in self.layers if layer.is_sliding)

    @property
    def full_layers(self) -> tuple[LayerFootprint, ...]:
        return tuple(layer for layer in self.layers if not layer.is_sliding)

    # -- per token, all layers -----------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """K+V for one token at every layer (what a naive unbounded cache pays)."""
        return sum(layer.kv_bytes for layer in self.layers)

    def residual_bytes_per_token(self) -> int:
        """One residual checkpoint for one token at every layer."""
        return sum(layer.residual_bytes for layer in self.layers)

    def cold_bytes_per_token(self, form: str, *, past_window: bool = False) -> int:
        """Bytes to hold one token exactly at every layer in ``form`` (residual | kv | auto).

        ``auto`` takes the smaller form per layer. With ``past_window=True`` the token is older
        than every sliding window, so sliding layers need nothing for it at all.
        """
        if form not in FORMS:
            raise ValueError(f"unknown form {form!r}: use one of {', '.join(FORMS)}")
        layers = self.full_layers if past_window else self.layers
        return sum(layer.cold_bytes(form) for layer in layers)

    def kv_bytes_per_token_past_window(self) -> int:
        """Marginal K+V per token once every sliding window is full: full layers only."""
        return sum(layer.kv_bytes for layer in self.full_layers)

    # -- standard cache equivalent ----------------------------------------------------------
    def standard_cache_bytes(self, n_tokens: int) -> int:
        """Bytes of K+V that ``DynamicCache(config=...)`` holds after ``n_tokens`` (batch 1).

        Full layers hold every token, sliding layers the last ``window - 1`` (the count of
        ``layer.keys.nbytes + layer.values.nbytes``). See ``standard_cache_resident_bytes`` for
        the storage transformers actually keeps alive, which is slightly more.
        """
        return sum(layer.standard_cache_tokens(n_tokens) * layer.kv_bytes for layer in self.layers)

    def standard_cache_resident_bytes(self, n_tokens: int, last_update: int = 1) -> int:
        """Storage ``DynamicCache`` keeps alive after ``n_tokens``, the last update being
        ``last_update`` tokens long (1 while decoding; the prompt length after a prefill)."""
        return sum(
            layer.standard_cache_resident_tokens(n_tokens, last_update) * layer.kv_bytes
            for layer in self.layers
        )

    def full_cache_bytes(self, n_tokens: int) -> int:
        """K+V for every token at every layer, ignoring sliding windows (a naive cache)."""
        return n_tokens * self.kv_bytes_per_token()

    # -- ratios -------------------------------------------------------------------------
    def residual_to_kv_ratio(self) -> float:
        """All layers' residuals / all layers' K+V: the honest like-for-like ratio."""
        return self.residual_bytes_per_token() / self.kv_bytes_per_token()

    def headline_ratio(self) -> float:
        """All layers' K+V / ONE layer's residual: the paper's "136 KB vs 5 KB" comparison.

        Misleading: it sets one layer against all of them. Rebuilding every layer from a single
        residual (or the token id) means re-running the stack, i.e. a re-prefill.
        """
        return self.kv_bytes_per_token() / max(layer.residual_bytes for layer in self.layers)

    def counts_by_form(self) -> dict[str, int]:
        """How many layers pick each form under ``auto``."""
        counts = {"residual": 0, "kv": 0}
        for layer in self.layers:
            counts[layer.smaller_exact_form] += 1
        return counts


def _int_attr(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


def footprint_from_config(config: Any, dtype: Any = "bfloat16") -> ModelFootprint:
    """Per-layer bytes per token of the model ``config`` describes, at ``dtype``.

    ``config`` is a transformers ``PretrainedConfig`` (multimodal configs are fine: the decoder
    text config is used). ``dtype=None`` takes the config's own dtype, else bfloat16.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = dtype or "bfloat16"
    dtype_name, itemsize = dtype_itemsize(dtype)

    text = config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", "") or getattr(text, "model_type", "")
    if getattr(text, "kv_lora_rank", None) is not None:
        raise ModelLoadError(
            f"{model_type} uses multi-head latent attention, whose cache kvchat cannot size; "
            "pick a model with standard attention"
        )

    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    per_layer = getattr(text, "per_layer_config", None)
    if per_layer is None or len(per_layer) != len(layer_types):
        per_layer = [text] * len(layer_types)

    layers = []
    for index, (kind, kwargs, layer_cfg) in enumerate(
        zip(layer_types, layer_kwargs, per_layer, strict=True)
    ):
        if kind not in _SUPPORTED_KINDS:
            raise ModelLoadError(
                f"{model_type} layer {index} is {kind!r}; kvchat supports "
                f"{', '.join(_SUPPORTED_KINDS)} layers only"
            )
        hidden = _int_attr(layer_cfg, "hidden_size", "n_embd", "d_model")
        heads = _int_attr(layer_cfg, "num_attention_heads", "n_head")
        if hidden is None or heads is None:
            raise ModelLoadError(
                f"{model_type} config has no hidden_size / num_attention_heads; "
                "pass a decoder-only causal LM"
            )
        head_dim = _int_attr(layer_cfg, "head_dim") or hidden // heads
        kv_heads = _int_attr(layer_cfg, "num_key_value_heads", "n_kv_heads") or heads
        window = kwargs.get("sliding_window") if kind in _WINDOWED_KINDS else None
        layers.append(
            LayerFootprint(
                index=index,
                kind=kind,
                sliding_window=int(window) if window is not None else None,
                kv_heads=kv_heads,
                head_dim=head_dim,
                hidden_size=hidden,
                kv_bytes=2 * kv_heads * head_dim * itemsize,
                residual_bytes=hidden * itemsize,
                query_heads=heads,
            )
        )
    if not layers:
        raise ModelLoadError(f"{model_type} config has no decoder layers; pass a causal LM")
    return ModelFootprint(
        model_type=model_type,
        layers=tuple(layers),
        dtype=dtype_name,
        itemsize=itemsize,
        name=str(getattr(config, "name_or_path", "") or ""),
    )


# -- configs ---------------------------------------------------------------------------------


def bundled_aliases() -> list[str]:
    """Aliases with a bundled config snapshot, sorted."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def bundled_config_dict(alias: str) -> dict[str, Any]:
    """The raw bundled ``config.json`` snapshot for ``alias``."""
    path = CONFIGS_DIR / f"{alias}.json"
    if not path.is_file():
        raise ModelNotFoundError(
            f"no bundled config for {alias!r}; bundled: {', '.join(bundled_aliases())}"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def bundled_sources() -> dict[str, str]:
    """Alias -> the public repo its snapshot was taken from (the json's ``_name_or_path``)."""
    return {
        alias: bundled_config_dict(alias).get("_name_or_path", "") for alias in bundled_aliases()
    }


def config_from_dict(data: dict[str, Any]) -> Any:
    """A transformers config from a ``config.json`` dict, the way ``from_pretrained`` builds it."""
    from transformers import AutoConfig

    data = dict(data)
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ModelLoadError("config has no model_type; pass a transformers config.json")
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as exc:  # unknown model_type
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot build a {model_type!r} config: {first}") from exc


def load_config(spec: str | os.PathLike[str]) -> Any:
    """A transformers config for ``spec``, offline.

    ``spec`` is a local model directory (with config.json), a ``.gguf`` file, a bundled alias
    (``bundled_aliases()``), or a Hugging Face repo id already in the local cache. A repo id
    that is not cached but is the source of a bundled snapshot gets the snapshot.
    """
    from transformers import AutoConfig

    text = os.fspath(spec)
    path = Path(text).expanduser()
    try:
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelNotFoundError(
                    f"{text} has no config.json; pass a transformers model directory or an alias"
                )
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
        if path.is_file() and path.suffix.lower() == ".gguf":
            return AutoConfig.from_pretrained(
                str(path.parent), gguf_file=path.name, local_files_only=True
            )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the config of {text}: {_first_line(exc)}") from exc

    if text in bundled_aliases():
        return config_from_dict(bundled_config_dict(text))

    try:
        return AutoConfig.from_pretrained(text, local_files_only=True)
    except Exception as exc:  # hub/cache errors come in many classes
        for alias, source in bundled_sources().items():
            if source and source.lower() == text.lower():
                return config_from_dict(bundled_config_dict(alias))
        raise ModelNotFoundError(
            f"no config for {text!r} offline: pass an alias ({', '.join(bundled_aliases())}), "
            "a local model directory, or a repo id already in the Hugging Face cache"
        ) from exc


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
