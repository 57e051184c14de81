"""Convert a ``.gguf`` once into a plain safetensors directory that loads in seconds.

The directory is ``kvchat.paths.cache_dir()/models/<name>-<sha256[:12]>/``: a GGUF load
through transformers re-parses and dequantizes the file every time (20-50 s); the converted
directory loads in ~2 s.

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

from kvchat.errors import ModelLoadError
from kvchat.models.messages import Progress, one_line, quiet_transformers
from kvchat.models.model_dir import is_model_dir
from kvchat.paths import cache_dir
from kvchat.storage.atomic import fsync_dir

_STALE_TMP_SECONDS = 24 * 3600


def safe_stem(filename: str) -> str:
    stem = filename[:-5] if filename.lower().endswith(".gguf") else filename
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip(".-") or "model"


def converted_dir(gguf_name: str, sha256: str) -> Path:
    return cache_dir() / "models" / f"{safe_stem(gguf_name)}-{sha256[:12]}"


def convert_gguf(gguf: Path, target: Path, sha256: str, say: Progress) -> None:
    """Dequantize ``gguf`` once into a safetensors directory at ``target``, atomically.

    Recipe from DESIGN §3: transformers refuses ``save_pretrained`` on a GGUF-loaded model, so
    drop ``config.quantization_config`` and write config, weights and tokenizer ourselves.
    Weights are kept in float32: the GGUF's dequantized values are exact there, and bf16 would
    round them (``load_model`` casts to the requested dtype at load time).
    """
    models = target.parent
    models.mkdir(parents=True, exist_ok=True)
    sweep_stale(models)
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
            with contextlib.suppress(OSError):  # durability only: the rename has published it
                fsync_dir(models)
            say(f"converted in {time.monotonic() - started:.0f} s: {target}")
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(
            f"could not convert {gguf.name} ({one_line(exc)}); pass a transformers model "
            "directory instead, or a GGUF of a supported architecture (llama, gemma3, qwen2, "
            "phi3, ...)"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_converted(gguf: Path, out: Path, say: Progress) -> None:
    """Config, float32 weights and tokenizer of ``gguf``, written into ``out``.

    transformers' own GGUF loader (``load_gguf_checkpoint``: dequantize, undo llama.cpp's
    Q/K permutation, map names) fills a skeleton whose parameters take no memory.
    ``from_pretrained(gguf_file=...)`` would compute the same tensors
    (tests/models/test_models.py) but refuses to run without accelerate, which it does not
    use for this, and which would then be imported by every chat process.
    """
    import safetensors.torch
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kvchat.models.meta_init import parameters_on_meta

    with quiet_transformers(), _gguf_progress(say):
        say("reading the GGUF tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        say("dequantizing the GGUF weights")
        tensors = load_gguf_checkpoint(
            str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
        )["tensors"]
        model.load_state_dict(tensors, strict=False, assign=True)
        del tensors
        model.tie_weights()
        missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        if missing:
            raise ValueError(f"the GGUF lacks {len(missing)} weights, e.g. {missing[0]}")
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
