"""sha256 of model files, remembered per (path, size, mtime) so a multi-GB GGUF hashes once."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from kvchat.paths import cache_dir
from kvchat.storage.atomic import write_text_atomic

HASH_BLOCK = 1 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _sha_memo_path(path: Path) -> Path:
    key = hashlib.sha256(str(path).encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return cache_dir() / "models" / ".sha256" / f"{key}.json"


def file_sha256_memo(path: Path) -> str:
    """sha256 of a GGUF, remembered by (path, size, mtime): multi-GB files hash in seconds."""
    st = path.stat()
    memo = _sha_memo_path(path)
    try:
        data = json.loads(memo.read_text(encoding="utf-8"))
        if (
            data.get("path") == str(path)
            and data.get("size") == st.st_size
            and data.get("mtime_ns") == st.st_mtime_ns
        ):
            return str(data["sha256"])
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    sha = file_sha256(path)
    _remember_sha(path, sha)
    return sha


def _remember_sha(path: Path, sha: str) -> None:
    st = path.stat()
    memo = _sha_memo_path(path)
    with contextlib.suppress(OSError):  # a memo that is not written is only a slower next run
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(
            memo,
            json.dumps(
                {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
            ),
        )
