"""The weights of a converted GGUF, read from the GGUF itself: no float copy on disk.

A converted directory (``gguf.convert_gguf``) holds the config, the tokenizer and an index,
``gguf-tensors.json``: for each GGUF tensor, the model name it fills, its ggml type, and
where its bytes are in the file. Reading a tensor seeks there, dequantizes it with gguf's
own dequantizer and applies transformers' tensor processor (llama.cpp's Q/K head order
undone, Gemma's norm offsets), so each tensor is the one transformers' GGUF loader computes
(tests/engine/models/test_gguf_weights.py). The float32 file earlier conversions wrote beside
the small form was 5x the GGUF (538 MB for the default model's 98 MB file); now the quantized
small form (``quantized_load``) is the only weights kvchat writes, and ``--weights none``
dequantizes at load.

Reads go through ``readinto`` into memory of their own, not a memory map (see
``weights_file``): a mapped page stays in the process's RSS.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvchat.engine.models.gguf_header import GgufHeader
from kvchat.engine.models.model_dir import GGUF_INDEX_NAME
from kvchat.errors import ModelLoadError

INDEX_NAME = GGUF_INDEX_NAME
SOURCE_NAME = "kvchat-source.json"
FORMAT = "kvchat-gguf-index-1"
# Where a GGUF adopted into the converted directory (the PyPI models) lives in it.
ADOPTED_NAME = "model.gguf"

__all__ = [
    "ADOPTED_NAME",
    "INDEX_NAME",
    "GgufTensor",
    "gguf_path",
    "gguf_tensors",
    "has_index",
    "load_float_model",
    "read_layout",
    "record_gguf_path",
    "write_index",
]


def has_index(model_dir: Path) -> bool:
    return (Path(model_dir) / INDEX_NAME).is_file()


def _processor_kind(processor: Any) -> str | None:
    """How a transformers tensor processor transforms a tensor, when it does so one GGUF
    tensor at a time (and None for those that build a tensor from several, the MoE ones):
    "identity", "llama" (Q and K rows permuted back), or "gemma" (norm offsets)."""
    from transformers.modeling_gguf_pytorch_utils import (
        Gemma2TensorProcessor,
        LlamaTensorProcessor,
        TensorProcessor,
    )

    return {
        TensorProcessor: "identity",
        LlamaTensorProcessor: "llama",
        Gemma2TensorProcessor: "gemma",
    }.get(type(processor))


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it (numpy scalars and arrays from the GGUF's metadata)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def read_layout(header: GgufHeader) -> dict:
    """What the index needs from a GGUF's header: its architecture, head counts and each
    tensor's type, shape and place."""
    architecture = header.value("general.architecture")
    # The processors read the head counts as the GGUF states them (a key it lacks stays
    # absent, and then llama.cpp's Q/K order is left as it is, as transformers' loader does).
    heads = {
        "num_attention_heads": header.value(f"{architecture}.attention.head_count"),
        "num_key_value_heads": header.value(f"{architecture}.attention.head_count_kv"),
    }
    tensors = [
        {
            "gguf": tensor.name,
            "type": tensor.tensor_type,
            "dtype": tensor.dtype,
            "data_shape": list(tensor.data_shape),
            "shape": list(reversed(tensor.shape)),
            "offset": tensor.data_offset,
            "nbytes": tensor.n_bytes,
        }
        for tensor in header.tensors
    ]
    return {
        "architecture": architecture,
        "heads": {k: _plain(v) for k, v in heads.items() if v is not None},
        "tensors": tensors,
    }


def write_index(gguf: Path, layout: dict, model: Any, saved_as: dict[str, str], out: Path) -> bool:
    """Write ``out/gguf-tensors.json`` for ``model`` (a skeleton of the GGUF's config) from
    the GGUF's ``layout`` (:func:`read_layout`) and return True; False (nothing written) for
    an architecture whose tensor processor builds tensors across GGUF tensors.

    ``saved_as`` maps each state-dict name that takes a GGUF tensor to the name its tensor is
    saved under (tied weights share one, and only the input embedding of a tied group takes
    a tensor; see ``gguf._saved_names``). A GGUF tensor with no place in the model is indexed
    with no name, as transformers' loader skips it."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    architecture, heads = layout["architecture"], layout["heads"]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=heads)
    kind = _processor_kind(processor)
    if kind is None:
        return False
    mapping = get_gguf_hf_weights_map(model, processor)
    tensors = []
    for tensor in layout["tensors"]:
        name = mapping.get(tensor["gguf"])
        entry = {"gguf": tensor["gguf"], "name": name if name in saved_as else None}
        tensors.append(entry | tensor)
    filled = {saved_as[t["name"]] for t in tensors if t["name"] is not None}
    state = model.state_dict()
    missing = sorted(n for n in set(saved_as.values()) - filled if state[n].device.type == "meta")
    if missing:
        raise ValueError(f"the GGUF lacks {len(missing)} weights, e.g. {missing[0]}")
    index = {
        "format": FORMAT,
        "architecture": architecture,
        "processor": kind,
        "heads": heads,
        "gguf_bytes": gguf.stat().st_size,
        "tensors": tensors,
    }
    (out / INDEX_NAME).write_text(json.dumps(index), encoding="utf-8")
    return True


def _read_index(model_dir: Path) -> dict:
    try:
        index = json.loads((Path(model_dir) / INDEX_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"the index of the converted GGUF in {str(model_dir)!r} is unreadable ({exc}); "
            "delete that directory and run again to convert the GGUF anew"
        ) from None
    if index.get("format") != FORMAT:
        raise ModelLoadError(
            f"{str(model_dir)!r} was converted by another kvchat version; delete it and run "
            "again to convert the GGUF anew"
        )
    return index


def gguf_path(model_dir: Path, index: dict | None = None) -> Path:
    """The GGUF a converted directory reads its weights from (checked to exist, same size);
    ``index``: the directory's index, when the caller has read it already."""
    model_dir = Path(model_dir)
    try:
        source = json.loads((model_dir / SOURCE_NAME).read_text(encoding="utf-8"))
        path = model_dir / source["path"]  # an absolute path stays as it is
    except (OSError, ValueError, KeyError, TypeError):
        raise ModelLoadError(
            f"{str(model_dir)!r} does not say which GGUF it was converted from; delete it and "
            "run again with the .gguf file"
        ) from None
    expected = (index or _read_index(model_dir))["gguf_bytes"]
    try:
        size = path.stat().st_size
    except OSError:
        size = None
    if size != expected and not Path(source["path"]).is_absolute():
        raise ModelLoadError(
            f"the GGUF kept in {str(model_dir)!r} is damaged or gone; delete that directory "
            "and run again to fetch the model anew"
        )
    if size != expected:
        state = "is gone" if size is None else "has changed"
        raise ModelLoadError(
            f"the GGUF {str(path)!r} this model was converted from {state}; pass the .gguf "
            "file itself with --model (kvchat reads its weights from it)"
        )
    return path


def record_gguf_path(model_dir: Path, gguf: Path) -> None:
    """Point ``model_dir`` at ``gguf`` (the same file, found elsewhere), atomically."""
    source_file = Path(model_dir) / SOURCE_NAME
    source = json.loads(source_file.read_text(encoding="utf-8"))
    if source.get("path") == str(gguf):
        return
    source["path"] = str(gguf)
    tmp = source_file.with_name(f".tmp-{os.getpid()}-{SOURCE_NAME}")
    tmp.write_text(json.dumps(source, indent=2), encoding="utf-8")
    os.replace(tmp, source_file)


class GgufTensor:
    """One model tensor of a converted GGUF, dequantized when asked: whole, or a block of
    rows at a time where each row depends only on itself (the interface of
    ``weights_file.LazyTensor``, so the quantized load reads either)."""

    def __init__(self, path: Path, entry: dict, index: dict) -> None:
        self.path = path
        self.name: str = entry["name"]
        self.shape: list[int] = list(entry["shape"])
        self._entry = entry
        self._index = index

    def read(self) -> Any:
        return self._values(0, self._entry["data_shape"][0] if self._entry["data_shape"] else 0)

    def rows(self, block: int) -> Iterator[Any]:
        rows = self.shape[0] if len(self.shape) == 2 else 0
        if not rows or not self._rowwise():
            yield self.read()
            return
        for start in range(0, rows, block):
            yield self._values(start, min(block, rows - start))

    def int4_parts(self, start: int = 0, count: int | None = None) -> dict[str, Any] | None:
        """For a Q4_0 or Q4_1 matrix, rows ``[start, start + count)`` in kvchat's int4 form
        (``qlinear``) taken from the file itself: its codes, and its blocks' own fp16 scales
        (``scales``) and, for Q4_1, minimums (``mins``). Nothing is dequantized: the values
        are the file's exactly, in as many bytes. A row range needs a tensor whose rows are
        its own (:meth:`rows`). None for other types."""
        import numpy as np
        import torch
        from gguf import GGMLQuantizationType

        kind = GGMLQuantizationType(self._entry["type"])
        four_bit = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
        if len(self.shape) != 2 or kind not in four_bit:
            return None
        rows, cols = self.shape
        count = rows - start if count is None else count
        if (start, count) != (0, rows) and not self._rowwise():
            raise ValueError(f"{self.name}: its rows are permuted as a whole")
        row_bytes = self._entry["nbytes"] // rows
        raw = self._bytes(self._entry["offset"] + start * row_bytes, count * row_bytes)
        raw = raw.reshape(count, cols // 32, -1)
        numbers = {"scales": raw[..., :2]}
        if kind == GGMLQuantizationType.Q4_1:
            numbers["mins"] = raw[..., 2:4]
        packed = raw[..., 2 * len(numbers) :]
        # The file's block holds column j in byte j's low nibble and column j + 16 in its
        # high one; kvchat's form holds columns 2i and 2i + 1 in byte i.
        columns = np.concatenate((packed & 15, packed >> 4), axis=-1).reshape(count, cols)
        parts = {"qweight": columns[:, 0::2] | (columns[:, 1::2] << 4)}
        for name, pairs in numbers.items():
            parts[name] = pairs.copy().view(np.float16)[..., 0]
        gguf = self._entry["gguf"]
        return {
            name: torch.from_numpy(np.ascontiguousarray(self._processed(value, gguf)))
            for name, value in parts.items()
        }

    def _rowwise(self) -> bool:
        gguf = self._entry["gguf"]
        if self._index["processor"] == "llama":
            return ".attn_q." not in gguf and ".attn_k." not in gguf
        return True

    def _values(self, start: int, count: int) -> Any:
        import numpy as np
        import torch
        from gguf import GGMLQuantizationType, dequantize

        entry = self._entry
        data_shape = entry["data_shape"]
        whole = not data_shape or (start == 0 and count == data_shape[0])
        if whole:
            offset, nbytes, shape = entry["offset"], entry["nbytes"], data_shape
        else:
            row_bytes = entry["nbytes"] // data_shape[0]
            offset, nbytes = entry["offset"] + start * row_bytes, count * row_bytes
            shape = [count, *data_shape[1:]]
        raw = self._bytes(offset, nbytes)
        data = raw.view(np.dtype(entry["dtype"])).reshape(shape)
        values = dequantize(data, GGMLQuantizationType(entry["type"]))
        values = self._processed(values, entry["gguf"])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def _bytes(self, offset: int, nbytes: int) -> Any:
        import numpy as np

        from kvchat.engine.models.weights_file import read_exactly

        raw = np.empty(nbytes, dtype=np.uint8)
        read_exactly(self.path, offset, memoryview(raw), self._entry["gguf"])
        return raw

    def _processed(self, values: Any, gguf_name: str) -> Any:
        kind = self._index["processor"]
        if kind == "identity":
            return values
        from transformers.modeling_gguf_pytorch_utils import (
            Gemma2TensorProcessor,
            LlamaTensorProcessor,
        )

        processor = (LlamaTensorProcessor if kind == "llama" else Gemma2TensorProcessor)(
            config=self._index["heads"]
        )
        result = processor.process(
            weights=values,
            name=gguf_name,
            tensor_key_mapping={gguf_name: self.name},
            parsed_parameters={"tensors": {}, "config": self._index["heads"]},
        )
        return result.weights


def gguf_tensors(model_dir: Path) -> Iterator[GgufTensor]:
    """Each model tensor of the converted GGUF in ``model_dir``, in file order."""
    index = _read_index(model_dir)
    path = gguf_path(model_dir, index)
    for entry in index["tensors"]:
        if entry["name"] is not None:
            yield GgufTensor(path, entry, index)


def load_float_model(model_dir: Path, config: Any, dtype: Any, attn_implementation: str) -> Any:
    """The model of a converted GGUF with float weights in ``dtype``, dequantized at load one
    tensor at a time (``--weights none``), in eval mode."""
    from kvchat.engine.models.heap import return_freed_memory
    from kvchat.engine.models.meta_init import empty_model, fill_tensor

    model = empty_model(config, dtype, attn_implementation)
    for tensor in gguf_tensors(model_dir):
        values = tensor.read().to(dtype)
        fill_tensor(model, tensor.name, values)
        del values
        return_freed_memory()
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"the GGUF lacks {len(missing)} weights, e.g. {missing[0]}")
    return model.eval()
