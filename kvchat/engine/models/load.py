"""From a model spec to a ``LoadedModel``: resolve, load, quantize, measure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvchat.engine.models.device import checkpoint_dtype, pick_device, pick_dtype
from kvchat.engine.models.loaded import LoadedModel
from kvchat.engine.models.messages import Progress, quiet_transformers
from kvchat.engine.models.quantize import WEIGHT_MODES, auto_weights, weights_nbytes
from kvchat.engine.models.resolve import ResolvedModel, resolve_model
from kvchat.engine.models.settings import ModelSettings
from kvchat.errors import ModelLoadError
from kvchat.units import error_line


def load(
    spec: str,
    *,
    device: str = ModelSettings.device,
    dtype: str = ModelSettings.dtype,
    weights: str = ModelSettings.weights,
    threads: int | None = None,
    decode_threads: int | None = None,
    progress: Progress | None = None,
) -> LoadedModel:
    """Resolve ``spec`` (alias, repo id, directory or .gguf) and load it ready to chat, with
    every front end's defaults (``ModelSettings``) for what is not given.

    ``weights``: "none", "int8", "int4", or "auto" (see ``quantize.auto_weights``).
    ``threads``: CPU threads for torch (default: physical cores, see ``kvchat.threads``).
    ``decode_threads``: threads for single-row calls (default: ``decode_threads_for``).
    """
    from kvchat.threads import (
        apply_threads,
        decode_threads_for,
        prefer_passive_wait,
        set_decode_threads,
    )

    prefer_passive_wait()  # a no-op when torch is already loaded; see kvchat.threads
    from kvchat.engine.models.lean_imports import leave_out_scipy

    leave_out_scipy()
    from kvchat.engine.kvdirect.footprint import footprint_from_config
    from kvchat.engine.models.heap import return_freed_memory

    say = progress or (lambda _msg: None)
    threads = apply_threads(threads)
    resolved = resolve_model(spec, progress=say)
    if weights == "auto":
        weights = auto_weights(resolved.path, pick_device(device).type)
    say(f"loading {resolved.name} from {resolved.path} ({weights_label(weights)})")
    model, tokenizer = load_model(resolved, device=device, dtype=dtype, weights=weights)
    return_freed_memory()
    param = next(model.parameters())
    dtype_name = str(getattr(model, "dtype", param.dtype)).removeprefix("torch.")
    weights_bytes = weights_nbytes(model)
    set_decode_threads(decode_threads or decode_threads_for(weights_bytes, threads))
    from kvchat.engine.models.decode_step import prepare_decode_step

    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=resolved.name,
        device=param.device,
        dtype=dtype_name,
        weights_bytes=weights_bytes,
        footprint=footprint_from_config(model.config, dtype_name),
        weights_mode=weights,
        path=resolved.path,
    )
    # Every cache then runs kvchat's attention (one order of summation on every path), and
    # the decode step is built over it.
    loaded.install_attention()
    prepare_decode_step(model)
    return loaded


def load_with(settings: ModelSettings, progress: Progress | None = None) -> LoadedModel:
    """:func:`load` with a front end's model settings (the default model when none is named)."""
    from kvchat.engine.models.registry import DEFAULT_MODEL

    return load(
        settings.model or DEFAULT_MODEL,
        device=settings.device,
        dtype=settings.dtype,
        weights=settings.weights,
        threads=settings.threads,
        decode_threads=settings.decode_threads,
        progress=progress,
    )


# Gemma 3 4B/12B/27B checkpoints are image+text models; for chat we load only the language
# model (saves the ~0.4 B-parameter vision tower). Both key layouts seen in the wild are mapped.
_GEMMA3_TEXT_KEYS = {
    r"^language_model\.model\.": "model.",
    r"^model\.language_model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}


def load_model(
    resolved: ResolvedModel,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    weights: str = "none",
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` from a resolved directory, in eval mode, on ``device``.

    ``weights`` is "none" (float in ``dtype``), "int8" or "int4" (weight-only quantized
    Linears, loaded one tensor at a time; see ``kvchat.engine.models.quantized_load``).
    Multimodal Gemma 3 checkpoints come back as a text-only ``Gemma3ForCausalLM``.
    Every failure is a one-line :class:`ModelLoadError`.
    """
    if weights not in WEIGHT_MODES:
        raise ModelLoadError(f"unknown weights mode {weights!r}; use {', '.join(WEIGHT_MODES)}")
    dev = pick_device(device)
    path = resolved.path
    torch_dtype = pick_dtype(dtype, dev, checkpoint_dtype(path))

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvchat.engine.models import gguf_weights

    from_gguf = gguf_weights.has_index(path)
    try:
        with quiet_transformers():
            tokenizer = load_tokenizer(path, from_gguf=from_gguf)
            config = AutoConfig.from_pretrained(path)
            key_mapping: dict[str, str] | None = None
            if getattr(config, "model_type", None) == "gemma3" and hasattr(config, "text_config"):
                config, key_mapping = config.text_config, _GEMMA3_TEXT_KEYS
            if weights != "none":
                if not from_gguf and not any(path.glob("*.safetensors")):
                    raise ModelLoadError(
                        f"--weights {weights} reads safetensors weights and {str(path)!r} has "
                        "none; use --weights none"
                    )
                from kvchat.engine.models.quantized_load import load_quantized

                model = load_quantized(
                    path, config, torch_dtype, weights, key_mapping=key_mapping, device=dev
                )
                return model, tokenizer
            if from_gguf:  # dequantized at load: no float copy of a GGUF is kept on disk
                model = gguf_weights.load_float_model(path, config, torch_dtype, "sdpa")
                _read_generation_config(model, path)
            else:
                kwargs: dict[str, Any] = {"dtype": torch_dtype}
                if key_mapping is not None:
                    kwargs.update(config=config, key_mapping=key_mapping)
                if dev.type != "cpu" and _accelerate_installed():
                    # Streams the weights straight to the device; transformers needs accelerate
                    # for any device_map. Without it they load on the CPU and move (below).
                    kwargs["device_map"] = str(dev)
                try:
                    model = AutoModelForCausalLM.from_pretrained(
                        path, attn_implementation="sdpa", **kwargs
                    )
                except (ValueError, ImportError) as exc:
                    if "sdpa" not in str(exc).lower():
                        raise
                    model = AutoModelForCausalLM.from_pretrained(
                        path, attn_implementation="eager", **kwargs
                    )
    except ModelLoadError:
        raise
    except torch.OutOfMemoryError as exc:
        raise ModelLoadError(
            f"{resolved.name!r} does not fit on {dev} ({error_line(exc)}); try --weights int4, "
            "a smaller model, or --device cpu"
        ) from None
    except Exception as exc:
        raise ModelLoadError(
            f"could not load {resolved.name!r} from {str(path)!r} ({error_line(exc)}); check the "
            "files, or pass another directory or .gguf file"
        ) from None
    model.eval()
    try:
        model.to(dev)
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        raise ModelLoadError(
            f"{resolved.name!r} does not fit on {dev} ({error_line(exc)}); try --weights int4, "
            "a smaller model, or --device cpu"
        ) from None
    return model, tokenizer


def load_tokenizer(path: Any, *, from_gguf: bool) -> Any:
    """The directory's tokenizer. A GGUF's directory holds the ``tokenizer.json`` kvchat
    wrote from the GGUF, which is the whole tokenizer, so it loads into the generic fast
    class: a model's own class (``GemmaTokenizer``) keeps Python copies of the vocabulary
    and merges besides, more than the tokenizer itself for Gemma 3's 262K tokens, and encodes,
    decodes and renders the same (tests/engine/models/test_load.py)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if from_gguf and (Path(path) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def _read_generation_config(model: Any, path: Any) -> None:
    """The directory's generation defaults (stop ids), as ``from_pretrained`` reads them."""
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass  # none saved: the config's defaults stand


def _accelerate_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


def weights_label(weights: str) -> str:
    return "full-precision weights" if weights == "none" else f"{weights} weights"
