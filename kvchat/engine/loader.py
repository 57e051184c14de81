"""From a model spec to a ``LoadedModel``: resolve, load, quantize, measure."""

from __future__ import annotations

from collections.abc import Callable

from kvchat.engine.session import LoadedModel

Progress = Callable[[str], None]


def load(
    spec: str,
    *,
    device: str = "auto",
    dtype: str = "float32",
    weights: str = "none",
    threads: int | None = None,
    progress: Progress | None = None,
) -> LoadedModel:
    """Resolve ``spec`` (alias, repo id, directory or .gguf) and load it ready to chat.

    ``weights``: "none", "int8", "int4", or "auto" (see ``quantize.auto_weights``).
    ``threads``: CPU threads for torch (default: physical cores, see ``engine.threads``).
    """
    from kvchat.engine.threads import apply_threads, prefer_passive_wait

    prefer_passive_wait()  # a no-op when torch is already loaded; see engine.threads
    from kvchat.engine.footprint import footprint_from_config
    from kvchat.engine.heap import return_freed_memory
    from kvchat.engine.models import load_model, pick_device, resolve_model, weights_nbytes
    from kvchat.engine.quantize import auto_weights

    say = progress or (lambda _msg: None)
    apply_threads(threads)
    resolved = resolve_model(spec, progress=say)
    if weights == "auto":
        weights = auto_weights(resolved.path, pick_device(device).type)
    say(f"loading {resolved.name} from {resolved.path} ({weights_label(weights)})")
    model, tokenizer = load_model(resolved, device=device, dtype=dtype, weights=weights)
    return_freed_memory()
    param = next(model.parameters())
    dtype_name = str(getattr(model, "dtype", param.dtype)).removeprefix("torch.")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=resolved.name,
        device=param.device,
        dtype=dtype_name,
        weights_bytes=weights_nbytes(model),
        footprint=footprint_from_config(model.config, dtype_name),
        weights_mode=weights,
        path=resolved.path,
    )


def weights_label(weights: str) -> str:
    return "full-precision weights" if weights == "none" else f"{weights} weights"
