"""A refused resume names both sides: the saved model and the loaded one (name, dtype,
weights, fingerprint), and what to load instead."""

from __future__ import annotations

import pytest

from kvchat.storage import ConversationStore, ModelMismatchError

SAVED_FP = "sha256:" + "a" * 64
LOADED_FP = "sha256:" + "b" * 64


def _saved(tmp_path, weights: str = "none") -> str:
    store = ConversationStore(tmp_path)
    conv = store.create(
        model_name="smollm2-135m",
        fingerprint=SAVED_FP,
        dtype="float32",
        settings={"weights": weights},
    )
    conv.close()
    return conv.id


def _refusal(tmp_path, conv_id: str, **loaded) -> str:
    with pytest.raises(ModelMismatchError) as exc:
        ConversationStore(tmp_path).open(conv_id, **loaded)
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_same_name_other_quantization_names_both_weights(tmp_path):
    conv_id = _saved(tmp_path)
    text = _refusal(
        tmp_path, conv_id, fingerprint=LOADED_FP, dtype="float32",
        model_name="smollm2-135m", weights="int8",
    )  # fmt: skip
    assert (
        "saved with model smollm2-135m (dtype float32, weights none, fingerprint sha256:aaaaa"
        in text
    )
    assert (
        "loaded one is model smollm2-135m (dtype float32, weights int8, fingerprint sha256:bbbbb"
        in text
    )
    assert "other weight quantization" in text and "--weights none" in text


def test_same_name_other_files_says_the_files_differ(tmp_path):
    conv_id = _saved(tmp_path)
    text = _refusal(
        tmp_path, conv_id, fingerprint=LOADED_FP, dtype="float32",
        model_name="smollm2-135m", weights="none",
    )  # fmt: skip
    assert "files differ" in text and "sha256:aaaaa" in text and "sha256:bbbbb" in text


def test_other_model_and_dtype_are_named(tmp_path):
    conv_id = _saved(tmp_path)
    text = _refusal(
        tmp_path, conv_id, fingerprint=LOADED_FP, dtype="bfloat16",
        model_name="qwen2.5-0.5b", weights="none",
    )  # fmt: skip
    assert "loaded one is model qwen2.5-0.5b (dtype bfloat16" in text
    assert "--model smollm2-135m --dtype float32" in text


def test_only_the_dtype_differs(tmp_path):
    conv_id = _saved(tmp_path)
    text = _refusal(
        tmp_path, conv_id, fingerprint=SAVED_FP, dtype="bfloat16", model_name="smollm2-135m"
    )
    assert "the dtype differs" in text and "--dtype float32" in text
