"""What makes a directory a loadable transformers model, judged from its files alone."""

from __future__ import annotations

import json
from pathlib import Path


def is_model_dir(path: Path) -> bool:
    """A complete transformers directory: config, safetensors weights, tokenizer."""
    if not (path / "config.json").is_file():
        return False
    has_weights = any(path.glob("*.safetensors"))
    has_tokenizer = any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    )
    return has_weights and has_tokenizer


def has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(isinstance(config, dict) and config.get("chat_template"))
