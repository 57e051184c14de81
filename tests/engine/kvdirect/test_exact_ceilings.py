"""A ceiling changes memory, never the answer: real models, long multi-turn chats.

For each weights mode, one three-turn conversation over a ~600-token context runs with no
ceiling (the reference for bits) and under ceilings that stream attention (1-4 MB for the
default model) and one that does not. The logits of every forward call are ``torch.equal``
to the unbounded run's, and the greedy tokens equal ``--cache standard``'s. The same on
Gemma 3 270M (sliding and global layers), as plain completion.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import kvchat.engine.chat.generate as generate_module
from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings
from kvchat.engine.kvdirect import exact_attention
from kvchat.engine.models import int4_kernel
from tests.conftest import transformers_own_model
from tests.engine.kvdirect.test_disk_tier import long_text

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not exact_attention.available(os.environ.get("KVCHAT_TEST_DEVICE", "cpu")),
        reason="no exact attention kernel here (no C compiler, or not the CPU)",
    ),
]

PROMPTS = (
    long_text(40) + " Which shelf holds note 7, and what was moved there?",
    "Tell me more about the kettle.",
    "Now list every note about the violin.",
)
REPLY = SamplingSettings(max_new_tokens=40)


ROWS: list[int] = []  # rows of every forward call of the last converse()
RESERVES: list[int] = []  # the cache's growth reserve at every forward call of the last one


def converse(loaded, cache: CacheSettings, tmp_path: Path, monkeypatch, prompts=PROMPTS):
    """Replies (token ids per turn), the logits of every forward call, and the plans seen."""
    seen: list[torch.Tensor] = []
    original = generate_module.forward_ids
    ROWS.clear()
    RESERVES.clear()

    def recording(model, cache, input_ids, *args, **kwargs):
        logits = original(model, cache, input_ids, *args, **kwargs)
        seen.append(logits.detach().clone())
        ROWS.append(input_ids.shape[1])
        RESERVES.append(getattr(cache, "hot_reserve", 0))
        return logits

    monkeypatch.setattr(generate_module, "forward_ids", recording)
    session = ChatSession(loaded, cache=cache, spill_root=tmp_path)
    try:
        replies = [session.send(p, REPLY) for p in prompts]
        plans = session.plan.describe() if session.plan is not None else "standard"
    finally:
        session.close()
        monkeypatch.setattr(generate_module, "forward_ids", original)
    for r in replies:
        assert r.error is None, r.error
    return [r.tokens for r in replies], seen, plans


_RUNS: dict[tuple, tuple[list[list[int]], list[torch.Tensor], list[int]]] = {}


def reference(loaded, kind: str, tmp_path: Path, monkeypatch, prompts=PROMPTS):
    """``(tokens, logits, rows of each call)`` of the unbounded run (``kind="kvdirect"``) or
    of ``--cache standard``'s, computed once per model, weights mode and prompts in this
    process: every test here compares with the same reference runs."""
    key = (loaded.name, loaded.weights_mode, loaded.dtype, kind, prompts)
    if key not in _RUNS:
        settings = CacheSettings(kind="standard") if kind == "standard" else CacheSettings()
        tokens, logits, _ = converse(loaded, settings, tmp_path / kind, monkeypatch, prompts)
        _RUNS[key] = (tokens, logits, list(ROWS))
    return _RUNS[key]


def assert_every_ceiling_exact(loaded, ceilings, tmp_path, monkeypatch, prompts=PROMPTS):
    standard, _, _ = reference(loaded, "standard", tmp_path, monkeypatch, prompts)
    unbounded, reference_logits, rows = reference(
        loaded, "kvdirect", tmp_path, monkeypatch, prompts
    )
    assert unbounded == standard
    assert sum(len(t) for t in standard) >= 60  # replies long enough for a late flip to show
    streamed = 0
    for ceiling in ceilings:
        tokens, logits, plan = converse(
            loaded, CacheSettings(max_mem=ceiling), tmp_path / str(ceiling), monkeypatch, prompts
        )
        streamed += "streamed" in plan
        # The model's matmuls are not batch invariant: no ceiling may change a call's rows.
        assert ROWS == rows, f"{ceiling} B ({plan}): forward calls of other sizes"
        assert tokens == standard, f"{ceiling} B ({plan}): greedy tokens differ"
        assert len(logits) == len(reference_logits)
        for i, (a, b) in enumerate(zip(logits, reference_logits)):
            assert torch.equal(a, b), f"{ceiling} B ({plan}): forward call {i} differs"
    assert streamed >= 1  # at least one ceiling took the streamed path


def test_default_model_quantized_every_ceiling(smollm2_quantized, tmp_path, monkeypatch):
    assert_every_ceiling_exact(
        smollm2_quantized, [4_000_000, 2_000_000, 1_000_000, 8_000_000], tmp_path, monkeypatch
    )
    # The chat's calls take both of the int4 kernel's paths: the first prompt's chunks the
    # tiled one (on a CPU with AMX tiles), the later prompts and the decode steps the other.
    _, _, rows = reference(smollm2_quantized, "kvdirect", tmp_path, monkeypatch)
    assert max(rows) >= int4_kernel.TILED_ROWS
    assert any(1 < r < int4_kernel.TILED_ROWS for r in rows)


def test_ceilings_that_hold_the_chat_with_and_without_the_reserve(
    smollm2_quantized, tmp_path, monkeypatch
):
    """Ceilings that hold every token: 64 MB keeps the windows' growth reserve through the
    chat; 34 MB drops it mid-chat (the reserve no longer fits, then the disk tier may
    follow). Every forward call's logits equal the unbounded run's, its rows too."""
    _, unbounded, rows = reference(smollm2_quantized, "kvdirect", tmp_path, monkeypatch)
    standard, _, _ = reference(smollm2_quantized, "standard", tmp_path, monkeypatch)
    reserves = {}
    for ceiling in (64_000_000, 34_000_000):
        tokens, logits, plan = converse(
            smollm2_quantized, CacheSettings(max_mem=ceiling), tmp_path / str(ceiling), monkeypatch
        )
        reserves[ceiling] = list(RESERVES)
        assert ROWS == rows and tokens == standard, f"{ceiling} B ({plan})"
        for i, (a, b) in enumerate(zip(logits, unbounded)):
            assert torch.equal(a, b), f"{ceiling} B ({plan}): forward call {i} differs"
    assert all(r > 0 for r in reserves[64_000_000])
    assert reserves[34_000_000][0] > 0 and reserves[34_000_000][-1] == 0


def test_the_checkpoint_form_changes_no_bit(smollm2_quantized, tmp_path, monkeypatch):
    """What the cost measurements decide (auto's form per layer) changes no bit either:
    residual checkpoints replayed and K/V read back give the same logits."""
    _, unbounded, _ = reference(smollm2_quantized, "kvdirect", tmp_path, monkeypatch)
    for settings in (
        CacheSettings(max_mem=4_000_000, checkpoint="residual"),
        CacheSettings(max_mem=16_000_000, checkpoint="residual"),
        CacheSettings(max_mem=4_000_000, checkpoint="kv"),
        CacheSettings(hot_window=8, checkpoint="residual"),
    ):
        _, logits, plan = converse(smollm2_quantized, settings, tmp_path / "f", monkeypatch)
        assert all(torch.equal(a, b) for a, b in zip(logits, unbounded)), (settings, plan)


def test_default_model_float_weights_every_ceiling(smollm2_loaded, tmp_path, monkeypatch):
    assert_every_ceiling_exact(smollm2_loaded, [3_000_000, 1_500_000], tmp_path, monkeypatch)


def test_gemma3_270m_every_ceiling(gemma270m_loaded, tmp_path, monkeypatch):
    prompts = (long_text(60), " Note 3 was", " and then")
    assert_every_ceiling_exact(
        gemma270m_loaded, [3_000_000, 1_500_000], tmp_path, monkeypatch, prompts
    )


@pytest.mark.parametrize(("first", "then"), [(None, 1_500_000), (2_000_000, None)])
def test_save_and_resume_under_another_ceiling(
    smollm2_quantized, tmp_path, monkeypatch, first, then
):
    """Two turns saved under one ceiling, the third resumed in a new session under another
    (streamed or none): every forward call of the third turn equals the unbounded run's."""
    from kvchat.engine.chat.conversation import open_session

    _, unbounded, _ = reference(smollm2_quantized, "kvdirect", tmp_path, monkeypatch)
    seen: list[torch.Tensor] = []
    original = generate_module.forward_ids

    def recording(*args, **kwargs):
        logits = original(*args, **kwargs)
        seen.append(logits.detach().clone())
        return logits

    monkeypatch.setattr(generate_module, "forward_ids", recording)
    data = tmp_path / "data"
    session = open_session(smollm2_quantized, data_dir=data, cache=CacheSettings(max_mem=first))
    for prompt in PROMPTS[:2]:
        assert session.send(prompt, REPLY).error is None
    conversation = session.conversation.id
    session.close()
    resumed = open_session(
        smollm2_quantized,
        data_dir=data,
        cache=CacheSettings(max_mem=then),
        conversation_id=conversation,
    )
    assert resumed.send(PROMPTS[2], REPLY).error is None
    resumed.close()
    assert len(seen) == len(unbounded)
    for i, (a, b) in enumerate(zip(seen, unbounded)):
        assert torch.equal(a, b), f"{first} then {then}: forward call {i} differs"


def test_float_weights_give_transformers_generate_tokens(smollm2_loaded, smollm2_dir, monkeypatch):
    """``--weights none --cache standard`` runs kvchat's attention kernel, whose logits differ
    from transformers' SDPA in the last bits; the greedy tokens of long replies still equal
    transformers' own ``generate`` on its own model (SDPA), loaded apart from kvchat."""
    from transformers import DynamicCache

    from kvchat.engine.chat.generate import generate

    reference = transformers_own_model(smollm2_dir, monkeypatch)
    assert reference.config._attn_implementation == "sdpa"
    tok = smollm2_loaded.tokenizer
    compared = 0
    for question in PROMPTS:
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            return_dict=True,
        )
        ids = list(rendered["input_ids"])
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                cache=DynamicCache(config=reference.config),
                do_sample=False,
                max_new_tokens=64,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        expected = out[0, len(ids) :].tolist()
        ours = generate(
            smollm2_loaded.model,
            DynamicCache(config=smollm2_loaded.model.config),
            ids,
            device=smollm2_loaded.device,
            settings=SamplingSettings(max_new_tokens=64),
            stop_ids={tok.eos_token_id},
        )
        assert ours.tokens == expected
        compared += len(expected)
    assert compared >= 60


def test_a_bf16_checkpoint_under_the_defaults_every_ceiling(
    smollm2_bf16_default, tmp_path, monkeypatch
):
    """What a downloaded bf16 checkpoint runs by default (int4 weights, bf16 compute and
    state) gives the unbounded run's bits under every ceiling."""
    assert smollm2_bf16_default.dtype == "bfloat16"
    assert smollm2_bf16_default.weights_mode == "int4"
    assert_every_ceiling_exact(
        smollm2_bf16_default, [2_000_000, 1_000_000, 500_000], tmp_path, monkeypatch
    )
