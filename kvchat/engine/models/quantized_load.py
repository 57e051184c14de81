"""Load a model with int8 / int4 weights, one tensor at a time, never a float copy of it all.

Two passes, both holding at most one float tensor at a time:

1. once per (model files, mode): the float weights are read tensor by tensor (no memory
   map, see ``weights_file``), each Linear weight quantized (``qlinear``), and the small form
   streamed to ``<cache>/weights/<model>-<hash>/<mode>.safetensors``; later loads skip this;
2. an empty model skeleton (``meta_init.empty_model``: parameters on the meta
   device, buffers real) gets the small form's tensors, quantized Linears replaced by
   ``Int8Linear`` / ``Int4Linear``, the embedding by ``Int8Embedding``.

What is quantized: every ``nn.Linear`` inside the decoder, to the mode (int4 falls back to
int8 for a shape its kernel cannot take, and, for a model from a GGUF, for a tensor the file
kept at more than 4 bits; see ``quantize_linear``; a GGUF's Q4_0/Q4_1 tensors are taken as
the file's codes and scales, never dequantized); the vocabulary matrix, shared by the
embedding and a tied ``lm_head`` (one copy, as in the float model), to int8 per row (per-row
scales suit both, since a row is a token in either use), or, in int4 mode, kept int4 when
the GGUF holds it in Q4_0/Q4_1. Norms and biases stay float in ``--dtype``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvchat.engine.models import gguf_weights, int4_kernel, qlinear
from kvchat.engine.models.fused import fuse_siblings
from kvchat.engine.models.heap import return_freed_memory
from kvchat.engine.models.meta_init import empty_model, fill_tensor
from kvchat.engine.models.weights_file import (
    LazyTensor,
    TensorWriter,
    lazy_tensors,
    read_header,
    read_tensors,
)

# 2: a model from a GGUF keeps its 4-bit grids, and its wider tensors go to int8 (below).
# 3: a GGUF's Q4_0/Q4_1 tensors are its own codes and fp16 scales; in int4 mode a 4-bit
# vocabulary table stays int4.
FORMAT = "kvchat-weights-3"
_PARTS = ("qweight", "scales", "zeros", "mins")

__all__ = ["FORMAT", "load_quantized", "small_form_path"]


def small_form_path(model_dir: Path, mode: str) -> Path:
    """Where the small form of ``model_dir``'s weights in ``mode`` is kept (in the cache)."""
    from kvchat.paths import cache_dir

    digest = hashlib.sha256(str(Path(model_dir).resolve()).encode())
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        st = f.stat()
        digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    index = Path(model_dir) / gguf_weights.INDEX_NAME
    if index.is_file():  # a converted GGUF: its weights are the GGUF's, which the index names
        digest.update(index.read_bytes())
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model_dir).name)[:60]
    return cache_dir() / "weights" / f"{name}-{digest.hexdigest()[:12]}" / f"{mode}.safetensors"


def load_quantized(
    model_dir: Path,
    config: Any,
    dtype: torch.dtype,
    mode: str,
    *,
    key_mapping: dict[str, str] | None = None,
    attn_implementation: str = "sdpa",
    device: torch.device | None = None,
) -> nn.Module:
    """The model of ``model_dir`` with ``mode`` ("int8" | "int4") weights, in eval mode.

    Built straight on ``device`` (default CPU): off CPU the layers keep the portable form.
    """
    path = small_form_path(model_dir, mode)
    if not _is_small_form(path, mode):
        _write_small_form(model_dir, config, mode, path, key_mapping or {})
        return_freed_memory()  # the float tensors just read, before the model is built
    return _load_small_form(path, config, dtype, attn_implementation, device)


# -- pass 1: the small form --------------------------------------------------------------
def _is_small_form(path: Path, mode: str) -> bool:
    try:
        _entries, meta, _start = read_header(path)
    except (OSError, ValueError):
        return False
    return meta.get("format") == FORMAT and meta.get("mode") == mode


def _roles(config: Any) -> tuple[nn.Module, set[str], str, str]:
    """The skeleton (float dtype irrelevant), names of quantizable Linears, and the names of
    the input embedding and output head modules."""
    model = empty_model(config, torch.float32, "eager")
    names = {id(m): n for n, m in model.named_modules()}
    embed = names[id(model.get_input_embeddings())]
    head = names[id(model.get_output_embeddings())]
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != head}
    return model, linears, embed, head


def _source_tensors(
    model_dir: Path, key_mapping: dict[str, str]
) -> Iterator[tuple[str, LazyTensor | gguf_weights.GgufTensor]]:
    if gguf_weights.has_index(model_dir):
        for tensor in gguf_weights.gguf_tensors(model_dir):
            yield tensor.name, tensor
        return
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        for lazy in lazy_tensors(f):
            name = lazy.name
            for pattern, repl in key_mapping.items():
                name = re.sub(pattern, repl, name)
            yield name, lazy


# Rows of the vocabulary table converted at a time: the table is the largest tensor of most
# checkpoints (1.3 GB in bf16 for Gemma 3 4B), and held whole it set the loading peak.
VOCAB_BLOCK_ROWS = 4096


def _write_vocab(writer: TensorWriter, target: str, table: Any, mode: str) -> None:
    """The vocabulary table, read and written a block of rows at a time: in int4 mode a
    table the GGUF holds in 4 bits keeps the file's codes (:func:`_write_int4_vocab`), any
    other is int8 per row (per-row quantization: each block's result is the whole table's,
    row for row)."""
    if mode == "int4" and table.int4_parts(0, 1) is not None:
        _write_int4_vocab(writer, target, table)
        return
    scales: list[torch.Tensor] = []

    def quantized_blocks() -> Iterator[torch.Tensor]:
        for rows in table.rows(VOCAB_BLOCK_ROWS):
            parts = qlinear.quantize_int8(rows)
            scales.append(parts["scales"])
            yield parts["qweight"]

    writer.add_rows(f"{target}.qweight", torch.int8, table.shape, quantized_blocks())
    writer.add(f"{target}.scales", torch.cat(scales))


def _write_int4_vocab(writer: TensorWriter, target: str, table: Any) -> None:
    """A Q4_0/Q4_1 vocabulary table in kvchat's int4 form, from the file's own codes: the
    same values in the same bytes as the GGUF (Gemma 3 4B's Q4_0 table would be 1.8x as
    large in int8)."""
    rows, cols = table.shape
    scales: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []

    def code_blocks() -> Iterator[torch.Tensor]:
        for start in range(0, rows, VOCAB_BLOCK_ROWS):
            parts = table.int4_parts(start, min(VOCAB_BLOCK_ROWS, rows - start))
            scales.append(parts["scales"])
            zeros.append(parts.get("mins"))
            yield parts["qweight"]

    writer.add_rows(f"{target}.qweight", torch.uint8, [rows, cols // 2], code_blocks())
    writer.add(f"{target}.scales", torch.cat(scales))
    if zeros[0] is not None:
        writer.add(f"{target}.mins", torch.cat(zeros))


def quantize_linear(tensor: torch.Tensor, mode: str, from_gguf: bool) -> dict:
    """One decoder Linear's small form: int4 (group 32) in int4 mode where the kernel takes
    the shape, else int8 per row. From a GGUF, int4 takes the file's own 4-bit codes (Q4_0,
    Q4_1, Q4_K re-expressed), and a tensor the file kept wider (Q5_*, Q6_K, Q8_0, float)
    goes to int8: requantized to 4 bits, Gemma 3 270M's Q5_0/Q8_0 tensors cost 0.22 nats of
    NLL and a third of its top-1 agreement (benchmarks/bench_weights.py)."""
    if mode == "int4" and qlinear.int4_supported(tensor):
        parts = qlinear.quantize_int4(tensor, recover_grid=from_gguf)
        if not from_gguf or qlinear.int4_holds(tensor, parts):
            return parts
    return qlinear.quantize_int8(tensor)


def _write_small_form(
    model_dir: Path, config: Any, mode: str, path: Path, key_mapping: dict[str, str]
) -> None:
    _model, linears, embed, head = _roles(config)
    del _model
    tied = bool(getattr(config, "tie_word_embeddings", False))
    writer = TensorWriter(
        path, {"format": FORMAT, "mode": mode, "group": str(qlinear.GROUP), "tied": str(tied)}
    )
    vocab_done = False
    # A model kvchat converted from a GGUF: its tensors are the file's dequantized values.
    from_gguf = (Path(model_dir) / "kvchat-source.json").is_file()
    try:
        for name, lazy in _source_tensors(model_dir, key_mapping):
            module, _, attr = name.rpartition(".")
            if attr == "weight" and module in (embed, head):
                if tied and vocab_done:
                    continue  # the tied copy: one table serves both
                vocab_done = True
                _write_vocab(writer, "vocab" if tied else module, lazy, mode)
                return_freed_memory()
                continue
            matrix = attr == "weight" and module in linears and len(lazy.shape) == 2
            takes_int4 = matrix and qlinear.int4_supported(torch.empty(lazy.shape, device="meta"))
            own = lazy.int4_parts() if mode == "int4" and takes_int4 else None
            if own is not None:  # the file's 4-bit codes, not re-derived
                for part, value in own.items():
                    writer.add(f"{module}.{part}", value)
                del own
                continue
            tensor = lazy.read()
            if attr == "weight" and module in linears:
                parts = quantize_linear(tensor, mode, from_gguf)
                for part, value in parts.items():
                    writer.add(f"{module}.{part}", value)
            else:
                writer.add(name, tensor)
            del tensor
            return_freed_memory()  # the float tensor and its temporaries (see below)
    except BaseException:
        writer.abandon()
        raise
    writer.publish()


# -- pass 2: the model from the small form -----------------------------------------------
def _load_small_form(
    path: Path,
    config: Any,
    dtype: torch.dtype,
    attn_implementation: str,
    device: torch.device | None,
) -> nn.Module:
    entries, _meta, _start = read_header(path)
    model = empty_model(config, dtype, attn_implementation)
    names = {id(m): n for n, m in model.named_modules()}
    embed = names[id(model.get_input_embeddings())]
    head = names[id(model.get_output_embeddings())]

    # Each quantized layer is built as soon as its last part is read, so the portable form
    # (which the CPU layouts replace) is never held for more than one layer.
    expected: dict[str, int] = {}
    for name in entries:
        module, _, attr = name.rpartition(".")
        if attr in _PARTS:
            expected[module] = expected.get(module, 0) + 1
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in read_tensors(path):
        if device is not None and device.type != "cpu":
            tensor = tensor.to(device)
        module, _, attr = name.rpartition(".")
        if attr not in _PARTS:
            fill_tensor(model, name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
            continue
        parts = pending.setdefault(module, {})
        parts[attr] = tensor
        if len(parts) < expected[module]:
            continue
        del pending[module]
        if module == "vocab":
            _set_vocab(model, parts, embed, head, dtype)
        elif module == embed:
            _set_vocab(model, parts, embed, None, dtype)
        else:
            _replace_linear(model, module, parts, head=module == head)
        del parts
        # The portable form just read is garbage now; glibc would keep it as free heap and
        # grow past it (peak RSS measured 1.10-1.26x the final RSS without this, <= 1.05x
        # with it; a trim costs well under a millisecond here).
        return_freed_memory()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"{path.name} lacks {len(missing)} weights, e.g. {missing[0]}")
    if device is not None and device.type != "cpu":
        model.to(device)  # the skeleton's own buffers (rotary tables)
    else:
        fuse_siblings(model)
        return_freed_memory()  # the separate layers' kernel layouts, now stacked
    model.eval()
    return model


def _replace_linear(
    model: nn.Module, name: str, parts: dict[str, torch.Tensor], *, head: bool = False
) -> nn.Module:
    old = model.get_submodule(name)
    bias = getattr(old, "bias", None)
    bias = None if bias is None or bias.device.type == "meta" else bias.data
    if qlinear.is_int4(parts):
        new = qlinear.Int4Linear(parts, bias, float_output=head, tiled=qlinear.may_tile(name))
    else:
        new = qlinear.Int8Linear(parts, bias, qlinear.HEAD_REFINE_TOP if head else 0)
    _set_module(model, name, new)
    return new


def _set_vocab(
    model: nn.Module,
    parts: dict[str, torch.Tensor],
    embed: str,
    head: str | None,
    dtype: torch.dtype,
) -> None:
    old = model.get_submodule(embed)
    scale = getattr(old, "embed_scale", None)
    scale = scale if isinstance(scale, torch.Tensor) and scale.device.type != "meta" else None
    padding = getattr(old, "padding_idx", None)
    if qlinear.is_int4(parts):  # an int4 table (a GGUF's 4-bit one)
        if parts["qweight"].is_cpu and int4_kernel.available():
            table = qlinear.Int4Linear(parts, None, float_output=True)
            _set_module(model, embed, qlinear.Int4Embedding(table, dtype, scale, padding))
            if head is not None:  # tied: the head is the very same table
                _set_module(model, head, table)
            return
        # Only kvchat's kernel form keeps rows a lookup can read: int8 per row instead.
        parts = qlinear.quantize_int8(qlinear.dequantize_int4(parts))
    _set_module(model, embed, qlinear.Int8Embedding(parts, dtype, scale, padding))
    if head is not None:  # tied: the head's buffers are the very same tensors
        _replace_linear(model, head, parts, head=True)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
