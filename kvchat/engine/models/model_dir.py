"""What makes a directory a loadable transformers model, judged from its files alone."""

from __future__ import annotations

import json
from pathlib import Path

# The index of a converted GGUF's weights (``gguf_weights.INDEX_NAME``; that module imports
# transformers' GGUF helpers lazily, but this one stays free of the engine's other modules).
GGUF_INDEX_NAME = "gguf-tensors.json"


def is_model_dir(path: Path) -> bool:
    """A complete model directory: config, tokenizer, and safetensors weights or (a converted
    GGUF) the index of the GGUF's weights, with the GGUF itself where the directory keeps it
    (one elsewhere is looked for when it is read)."""
    if not (path / "config.json").is_file():
        return False
    has_weights = any(path.glob("*.safetensors")) or (
        (path / GGUF_INDEX_NAME).is_file() and _kept_gguf_present(path)
    )
    has_tokenizer = any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    )
    return has_weights and has_tokenizer


def _kept_gguf_present(path: Path) -> bool:
    try:
        where = json.loads((path / "kvchat-source.json").read_text(encoding="utf-8"))["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return Path(where).is_absolute() or (path / where).is_file()


def has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(isinstance(config, dict) and config.get("chat_template"))
