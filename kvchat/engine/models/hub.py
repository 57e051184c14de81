"""The Hugging Face hub: its local cache, read without network, and snapshot downloads.

huggingface_hub is imported inside the functions that need it, so ``kvchat models`` stays fast.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvchat.engine.models.messages import Progress
from kvchat.engine.models.model_dir import is_model_dir
from kvchat.errors import ModelNotFoundError
from kvchat.units import error_line

# Repos whose licence must be accepted on the hub before a download works.
_GATED_PREFIXES = ("google/gemma-", "meta-llama/")


def is_gated(repo_id: str) -> bool:
    return repo_id.lower().startswith(_GATED_PREFIXES)


def gated_fix(repo_id: str) -> str:
    return (
        f"it is gated: accept its licence on https://huggingface.co/{repo_id}, run "
        f"`hf auth login` (or `huggingface-cli login`), then `hf download {repo_id}`"
    )


def _short_reason(exc: BaseException) -> str:
    """The hub library's error, cut to its first sentence (they run to paragraphs)."""
    text = error_line(exc).split(". ")[0]
    return text if len(text) <= 100 else text[:97] + "..."


def hf_cache_dir() -> Path:
    """The hub cache, read from the environment at call time.

    huggingface_hub freezes its constants at import, so honouring a later HF_HOME /
    HF_HUB_CACHE (tests, or a CLI flag that sets them) means computing it ourselves, with the
    same precedence as huggingface_hub.constants.
    """
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hf_cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of ``repo_id``'s main revision if it is complete, without network."""
    repo_dir = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    if not repo_dir.is_dir():  # fast path; also keeps huggingface_hub out of `kvchat models`
        return None
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, cache_dir=hf_cache_dir(), local_files_only=True))
    except Exception:
        return None
    return path if is_model_dir(path) else None


_HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.model",
    "*.tiktoken",
    "*.txt",
]


def hf_download(repo_id: str, label: str, fix: str, say: Progress) -> Path:
    say(f"downloading {repo_id} from the Hugging Face hub")
    try:
        from huggingface_hub import snapshot_download

        path = Path(
            snapshot_download(
                repo_id,
                cache_dir=hf_cache_dir(),
                allow_patterns=_HUB_PATTERNS,
                endpoint=os.environ.get("HF_ENDPOINT") or None,
            )
        )
    except Exception as exc:
        kind = type(exc).__name__
        if kind == "GatedRepoError":
            raise ModelNotFoundError(
                f"{label} is gated on the hub: accept its license on huggingface.co, run "
                f"`hf auth login`, then `hf download {repo_id}`"
            ) from None
        if kind in {"RepositoryNotFoundError", "RevisionNotFoundError"}:
            raise ModelNotFoundError(
                f"{label} does not exist on the Hugging Face hub (or is private); check the "
                "name with `kvchat models`, or pass a local directory or .gguf file"
            ) from None
        reason = f" ({_short_reason(exc)})" if not is_gated(repo_id) else ""
        raise ModelNotFoundError(
            f"{label} is not found locally and the hub is unreachable{reason}; {fix}"
        ) from None
    if not is_model_dir(path):
        raise ModelNotFoundError(
            f"{label} downloaded to {str(path)!r} but has no safetensors weights or tokenizer; "
            "pass a local directory saved by transformers or a .gguf file"
        )
    return path
