"""A model ready to chat, as loading produces it, and the fingerprint that names it on disk."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.engine.models.model_dir import GGUF_INDEX_NAME

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from kvchat.engine.kvdirect.arch import ArchAdapter
    from kvchat.engine.kvdirect.footprint import ModelFootprint

_SAMPLE = 1 << 20


@dataclass
class LoadedModel:
    """A model ready to chat: weights, tokenizer, and what the engine derives from them."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    device: torch.device
    dtype: str
    weights_bytes: int
    footprint: ModelFootprint  # at the model's dtype
    weights_mode: str = "none"
    path: Path | None = None  # the resolved model directory, when there is one
    _adapter: ArchAdapter | None = field(default=None, repr=False)
    _fingerprint: str | None = field(default=None, repr=False)

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.model.config, self.weights_mode, self.path)
        return self._fingerprint

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def adapter(self) -> ArchAdapter:
        if self._adapter is None:
            from kvchat.engine.kvdirect.arch import ArchAdapter

            self._adapter = ArchAdapter(self.model)
        return self._adapter

    def install_attention(self) -> None:
        """Route the model's attention through kvchat's (``kvchat.engine.kvdirect.attention``)."""
        from kvchat.engine.kvdirect.arch import UnsupportedArchitectureError
        from kvchat.engine.kvdirect.attention import route

        try:
            route(self.model, self.adapter())
        except UnsupportedArchitectureError:
            route(self.model)  # no adapter: recorded as such, its own attention serves


def fingerprint(config: PretrainedConfig, weights_mode: str, model_dir: Path | None) -> str:
    """sha256 over the config, the weights files' headers, sizes and first/last MiB, and the
    weight quantization: enough to tell two models (or two quantizations) apart in
    milliseconds, where hashing every weight byte would cost seconds at each start."""
    digest = hashlib.sha256()
    digest.update(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    digest.update(weights_mode.encode())
    if model_dir is not None:
        for weights in sorted(Path(model_dir).glob("*.safetensors")):
            size = weights.stat().st_size
            digest.update(f"{weights.name}:{size}".encode())
            with open(weights, "rb") as fh:
                digest.update(fh.read(_SAMPLE))
                fh.seek(max(0, size - _SAMPLE))
                digest.update(fh.read(_SAMPLE))
        index = Path(model_dir) / GGUF_INDEX_NAME
        if index.is_file():  # a converted GGUF: its sha256, and the tensors the index names
            digest.update(index.read_bytes())
            source = json.loads((Path(model_dir) / "kvchat-source.json").read_text("utf-8"))
            digest.update(str(source.get("sha256")).encode())  # not its path: files move
    return digest.hexdigest()
