"""Convert a ``.gguf`` once into a directory that loads in seconds.

The directory is ``kvchat.paths.cache_dir()/models/<name>-<sha256[:12]>/``: the config and
tokenizer transformers derives from the GGUF's metadata (re-parsing them costs seconds at
every start), and an index of the GGUF's tensors (``gguf_weights``): the weights stay in the
GGUF, which the quantized load re-expresses into kvchat's small form once and
``--weights none`` dequantizes at load. No float copy is written, except for the
architectures whose tensors transformers builds from several GGUF tensors (the MoE ones):
those get a float32 safetensors file as before.

Cache safety: every write goes to a temporary sibling (``.tmp-*``) that is renamed into place
only when complete, so a killed conversion never leaves a directory that looks valid, and two
processes converting the same file at once both end up using one complete directory (the
loser of the rename deletes its copy). Temporary leftovers older than a day are swept.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvchat.engine.models.gguf_header import GgufHeader, read_header, write_config_view
from kvchat.engine.models.gguf_weights import (
    ADOPTED_NAME,
    SOURCE_NAME,
    read_layout,
    write_index,
)
from kvchat.engine.models.messages import Progress, quiet_transformers
from kvchat.engine.models.model_dir import is_model_dir
from kvchat.errors import ModelLoadError
from kvchat.paths import cache_dir
from kvchat.storage.atomic import fsync_dir
from kvchat.units import error_line

_STALE_TMP_SECONDS = 24 * 3600


def safe_stem(filename: str) -> str:
    stem = filename[:-5] if filename.lower().endswith(".gguf") else filename
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip(".-") or "model"


def converted_dir(gguf_name: str, sha256: str) -> Path:
    return cache_dir() / "models" / f"{safe_stem(gguf_name)}-{sha256[:12]}"


def convert_gguf(
    gguf: Path, target: Path, sha256: str, say: Progress, *, adopt: bool = False
) -> None:
    """Convert ``gguf`` once into a directory at ``target``, atomically.

    Why by hand: transformers refuses ``save_pretrained`` on a GGUF-loaded model, so
    drop ``config.quantization_config`` and write config, index and tokenizer ourselves.
    ``adopt``: move the GGUF into the directory (a file kvchat fetched, which nothing else
    keeps); otherwise the directory records the GGUF's path and reads it there.
    """
    models = target.parent
    models.mkdir(parents=True, exist_ok=True)
    sweep_stale(models)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=models))
    try:
        say(f"reading {gguf.name} once (10-60 s; later loads take seconds)")
        started = time.monotonic()
        _write_converted(gguf, tmp, say)
        where = str(gguf.resolve())
        if adopt:
            os.replace(gguf, tmp / ADOPTED_NAME)
            where = ADOPTED_NAME
        (tmp / SOURCE_NAME).write_text(
            json.dumps(
                {
                    "gguf": gguf.name,
                    "sha256": sha256,
                    "path": where,
                    "converted_at": int(time.time()),
                },
                indent=2,
            ),
            encoding="utf-8",
        )
        _publishable(tmp)
        _fsync_tree(tmp)
        try:
            _publish(tmp, target)
        except FileExistsError:
            say("another kvchat process finished the same conversion first; using it")
        else:
            with contextlib.suppress(OSError):  # durability only: the rename has published it
                fsync_dir(models)
            say(f"converted in {time.monotonic() - started:.0f} s: {target}")
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(
            f"could not convert {gguf.name} ({error_line(exc)}); pass a transformers model "
            "directory instead, or a GGUF of a supported architecture (llama, gemma3, qwen2, "
            "phi3, ...)"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_converted(gguf: Path, out: Path, say: Progress) -> None:
    """Config, tokenizer and the index of the weights of ``gguf``, written into ``out``
    (float32 weights instead of the index where ``gguf_weights.write_index`` declines).

    Float32 weights go one tensor at a time (:func:`_stream_weights`), so the conversion never
    holds a float32 copy of the whole model: that copy was 513 MiB for the default model,
    twice the RSS of the chat that follows. Each tensor is what transformers' own GGUF
    loader computes (``load_gguf_checkpoint``: dequantize, undo llama.cpp's Q/K permutation,
    map names), and the file has the bytes ``safetensors.torch.save_model`` writes for the
    loaded model (tests/engine/models/test_models.py). ``from_pretrained(gguf_file=...)`` would
    compute the same tensors but refuses to run without accelerate, which it does not use
    for this, and which would then be imported by every chat process.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvchat.engine.models.meta_init import parameters_on_meta

    with quiet_transformers(), _gguf_progress(say):
        # Nothing here parses the vocabulary arrays but the tokenizer: gguf's reader builds
        # a numpy view per element, slow for each pass over a large vocabulary.
        header = read_header(gguf)
        overrides = rope_overrides(header)
        layout = read_layout(header)
        with tempfile.TemporaryDirectory(prefix="kvchat-gguf-") as tmp:
            view = Path(tmp) / gguf.name
            write_config_view(gguf, header, view)
            config = AutoConfig.from_pretrained(view.parent, gguf_file=view.name, **overrides)
        say("reading the GGUF tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name, **_tokenizer_type(config)
        )
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.tie_weights()
        indexed = write_index(gguf, layout, model, _saved_names(model)[0], out)
        if indexed:
            say(f"indexed the weights of {gguf.name}")
        else:
            say("dequantizing the GGUF weights")
            weights_file = out / "model.safetensors"
            if not _stream_weights(gguf, model, weights_file, say):
                _whole_weights(gguf, model, weights_file)
        say("writing the config and tokenizer")
        model.config.save_pretrained(out)
        if model.generation_config is not None:
            with contextlib.suppress(Exception):
                model.generation_config.save_pretrained(out)
        tokenizer.save_pretrained(out)
    del model


def _tokenizer_type(config: Any) -> dict[str, str]:
    """The tokenizer class to read a GGUF's tokenizer with, named after the config's model
    type, where transformers maps that type to a class: told nothing, ``AutoTokenizer``
    parses the whole file again to find the type, vocabulary arrays included."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    return {"tokenizer_type": model_type} if TOKENIZER_MAPPING_NAMES.get(model_type) else {}


def rope_overrides(source: Path | GgufHeader) -> dict[str, Any]:
    """``rope_parameters`` for the rope settings llama.cpp reads from a GGUF (its path, or
    its :func:`read_header`) that transformers' GGUF loader drops: the scaling type and
    factor (Gemma 3 4B and larger run their global layers with linear x8 scaling; without it
    the converted model is another model), YaRN's original context, and Gemma 3's sliding
    layers' own base frequency. Empty when the file has none of them."""
    header = read_header(source) if isinstance(source, (str, Path)) else source
    arch = header.value("general.architecture")
    kind = header.value(f"{arch}.rope.scaling.type")
    factor = header.value(f"{arch}.rope.scaling.factor")
    base = header.value(f"{arch}.rope.freq_base")
    scaled: dict[str, Any] = {"rope_type": "default"}
    if kind in ("linear", "yarn") and factor is not None and float(factor) != 1.0:
        scaled = {"rope_type": kind, "factor": float(factor)}
        original = header.value(f"{arch}.rope.scaling.original_context_length")
        if kind == "yarn" and original:
            scaled["original_max_position_embeddings"] = int(original)
    if arch == "gemma3":
        swa_base = header.value(f"{arch}.rope.freq_base_swa")
        if swa_base is None and scaled["rope_type"] == "default":
            return {}
        full = {**scaled, "rope_theta": float(base if base is not None else 1_000_000.0)}
        sliding = {"rope_type": "default", "rope_theta": float(swa_base or 10_000.0)}
        return {"rope_parameters": {"full_attention": full, "sliding_attention": sliding}}
    if scaled["rope_type"] == "default":
        return {}
    return {"rope_parameters": {**scaled, "rope_theta": float(base if base is not None else 1e4)}}


class _NotStreamable(Exception):
    """This architecture's tensor processor builds tensors across several GGUF tensors."""


def _saved_names(model: Any) -> tuple[dict[str, str], dict[str, str]]:
    """Which name each GGUF-filled state-dict entry is saved under, and the metadata naming
    the others.

    ``safetensors.torch.save_model``'s rule: of names sharing one tensor (tied weights),
    the first in sorted order is saved and the metadata maps each other name to it. Where
    the input embedding is tied to others, only the embedding's own name takes a GGUF
    tensor (transformers ties the others to it after loading, so a GGUF's output tensor
    would be overwritten); the others are left out of the returned map.
    """
    embedding = model.get_input_embeddings()
    embedding_name = next(
        (f"{name}.weight" for name, module in model.named_modules() if module is embedding), None
    )
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    saved_as: dict[str, str] = {}
    metadata: dict[str, str] = {}
    for names in groups.values():
        kept = sorted(names)[0]
        for name in names:
            if len(names) == 1 or embedding_name not in names or name == embedding_name:
                saved_as[name] = kept
            if name != kept:
                metadata[name] = kept
    parameters = {name for names in groups.values() for name in names}
    for name in model.state_dict():
        if name not in parameters:
            saved_as[name] = name  # a persistent buffer
    return saved_as, metadata


# Tensors larger than this as float32 are dequantized in row pieces of about this size: the
# default model's 113 MiB embedding would otherwise exist whole, and gguf's numpy dequantizers
# hold several temporaries of the output's size besides.
PIECE_BYTES = 8 << 20


def _stream_weights(gguf: Path, model: Any, target: Path, say: Progress) -> bool:
    """Write ``model``'s float32 weights from ``gguf`` to ``target`` one tensor at a time
    (a large one in row pieces).

    False (and nothing written) for architectures whose transformers tensor processor
    assembles tensors from several GGUF tensors (the MoE ones): those take
    :func:`_whole_weights`.
    """
    import numpy as np
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    from kvchat.engine.models.streamed_safetensors import StreamedSafetensors, TensorLayout

    # The processors read the configuration as the GGUF states it (a key it lacks stays
    # absent), not as the model's config fills it in.
    gguf_config = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    reader = GGUFReader(str(gguf))
    architecture = read_field(reader, "general.architecture")[0]
    # The metadata (the tokenizer's vocabulary and merges, as ~100 MiB of small numpy arrays
    # for the default model) was read for the config and tokenizer already.
    reader.fields.clear()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=gguf_config)
    mapping = get_gguf_hf_weights_map(model, processor)
    saved_as, metadata = _saved_names(model)
    state = model.state_dict()
    layouts = {
        name: TensorLayout(str(state[name].dtype).removeprefix("torch."), tuple(state[name].shape))
        for name in set(saved_as.values())
    }
    # What a processor puts here itself is a tensor built across GGUF tensors.
    parsed: dict[str, Any] = {"tensors": {}, "config": gguf_config}

    def processed(data: Any, quant_type: Any, name: str) -> Any:
        result = processor.process(
            weights=dequantize(data, quant_type),
            name=name,
            tensor_key_mapping=mapping,
            parsed_parameters=parsed,
        )
        if parsed["tensors"]:
            raise _NotStreamable(architecture)
        return result

    tensors = list(reader.tensors)
    step = max(1, len(tensors) // 4)
    try:
        with StreamedSafetensors(target, layouts, metadata or None) as out:
            for i, tensor in enumerate(tensors, 1):
                shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
                rows = shape[0] if len(shape) == 2 else 0
                if rows and 4 * tensor.n_elements > PIECE_BYTES and _rowwise(processor, tensor):
                    name = saved_as.get(mapping.get(tensor.name, ""))
                    if name is not None:
                        out.check_part(name, "float32", shape)
                        piece = max(1, PIECE_BYTES // (4 * shape[1]))
                        for start in range(0, rows, piece):
                            rows_data = tensor.data[start : start + piece]
                            result = processed(rows_data, tensor.tensor_type, tensor.name)
                            array = np.ascontiguousarray(result.weights, dtype=np.float32)
                            out.write_part(name, start * shape[1] * 4, array)
                else:
                    result = processed(tensor.data, tensor.tensor_type, tensor.name)
                    name = saved_as.get(mapping.get(result.name, ""))
                    if name is not None:  # else a tensor the model has no place for, as before
                        array = np.ascontiguousarray(result.weights, dtype=np.float32)
                        out.write(name, array, "float32", array.shape)
                result = array = None
                if i % step == 0 or i == len(tensors):
                    say(f"dequantized {i}/{len(tensors)} tensors")
            missing = sorted(set(layouts) - out.written)
            for name in list(missing):
                if state[name].device.type != "meta":  # a persistent buffer the GGUF lacks
                    buffer = state[name].detach().contiguous()
                    out.write(name, buffer.numpy(), str(buffer.dtype).removeprefix("torch."),
                              tuple(buffer.shape))  # fmt: skip
                    missing.remove(name)
            if missing:
                raise ValueError(f"the GGUF lacks {len(missing)} weights, e.g. {missing[0]}")
    except _NotStreamable:
        target.unlink(missing_ok=True)
        return False
    finally:
        del reader
    return True


def _rowwise(processor: Any, tensor: Any) -> bool:
    """Whether ``processor`` computes each row of ``tensor`` from that row alone, so that it
    can process the tensor in row pieces: transformers' base processor (identity), Gemma's
    (norm weights minus one) and Llama's except for Q and K (their heads are permuted)."""
    from transformers.modeling_gguf_pytorch_utils import (
        Gemma2TensorProcessor,
        LlamaTensorProcessor,
        TensorProcessor,
    )

    kind = type(processor)
    if kind is LlamaTensorProcessor:
        return ".attn_q." not in tensor.name and ".attn_k." not in tensor.name
    return kind in (TensorProcessor, Gemma2TensorProcessor)


def _whole_weights(gguf: Path, model: Any, target: Path) -> None:
    """All tensors dequantized at once through ``load_gguf_checkpoint``, then saved: for the
    architectures :func:`_stream_weights` cannot take (it holds a float32 copy of the
    model)."""
    import safetensors.torch
    import torch
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tensors = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )["tensors"]
    model.load_state_dict(tensors, strict=False, assign=True)
    del tensors
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"the GGUF lacks {len(missing)} weights, e.g. {missing[0]}")
    safetensors.torch.save_model(model, str(target))


def _publish(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; FileExistsError if a complete ``target`` won the race.

    A ``target`` that exists but is incomplete (someone deleted files from it by hand) is moved
    aside under a ``.tmp-`` name and deleted, then the rename is retried once.
    """
    for attempt in range(2):
        try:
            os.rename(tmp, target)
            return
        except OSError:
            if is_model_dir(target):
                raise FileExistsError(str(target)) from None
            if attempt or not target.exists():
                raise
            aside = target.with_name(f".tmp-broken-{target.name}-{os.getpid()}")
            os.rename(target, aside)
            shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def _gguf_progress(say: Progress) -> Iterator[None]:
    """Route transformers' raw tqdm bar over GGUF tensors to ``say`` (a bar would tear the TUI).

    transformers uses ``tqdm`` directly there, not its own switchable bars, so the module
    attribute is swapped for the duration of the conversion.
    """
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - layout change in a future transformers
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)

    def report(iterable: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        items = list(iterable)
        step = max(1, len(items) // 4)
        for i, item in enumerate(items, 1):
            yield item
            if i % step == 0 or i == len(items):
                say(f"dequantized {i}/{len(items)} tensors")

    gguf_utils.tqdm = report
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _publishable(path: Path) -> None:
    """mkdtemp makes 0700 directories; give the published one the usual umask-based mode."""
    umask = os.umask(0)
    os.umask(umask)
    with contextlib.suppress(OSError):
        path.chmod(0o777 & ~umask)
        for child in path.iterdir():
            if child.is_file():
                child.chmod(0o666 & ~umask)


def _fsync_tree(root: Path) -> None:
    """Flush the files before the rename publishes them (a crash must not publish zeros)."""
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    with contextlib.suppress(OSError):
        fsync_dir(root)


def sweep_stale(parent: Path) -> None:
    """Remove ``.tmp-*`` leftovers of killed runs (older than a day, so never a live one)."""
    now = time.time()
    for entry in parent.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
