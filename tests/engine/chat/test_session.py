"""The chat engine on the real default model: answers, streaming, cancel, multi-turn."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvchat.engine.chat.generate import generate
from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings

pytestmark = pytest.mark.slow

GREEDY = SamplingSettings(max_new_tokens=24)


def test_answers_the_capital_of_france(smollm2_loaded):
    session = ChatSession(smollm2_loaded)
    result = session.send("What is the capital of France?", GREEDY)
    assert "Paris" in result.reply
    assert result.finish_reason in ("eos", "length")


def test_streams_the_reply_in_pieces(smollm2_loaded):
    pieces: list[str] = []
    session = ChatSession(smollm2_loaded, system="You are a helpful assistant.")
    result = session.send("Name three colors.", GREEDY, on_text=pieces.append)
    assert len(pieces) > 3
    assert "".join(pieces).strip() == result.reply.strip()


def test_cancel_keeps_what_was_said_and_the_next_turn_works(smollm2_loaded):
    session = ChatSession(smollm2_loaded)
    seen: list[str] = []
    result = session.send(
        "Write a long story about a dragon.",
        SamplingSettings(max_new_tokens=200),
        on_text=seen.append,
        should_stop=lambda: len(seen) >= 5,
    )
    assert result.finish_reason == "cancelled"
    assert 5 <= len(result.tokens) < 200
    assert session.messages[-1] == {"role": "assistant", "content": result.reply}
    assert result.reply.strip() and result.reply.strip() == "".join(seen).strip()
    assert session.cache.get_seq_length() == len(session.token_ids)
    follow = session.send("What is the capital of France?", GREEDY)
    assert "Paris" in follow.reply


def test_multi_turn_continuation_equals_one_reprefill_of_the_history(smollm2_loaded):
    session = ChatSession(smollm2_loaded)
    for prompt in ("What is the capital of France?", "And of Germany?"):
        first = session.send(prompt, GREEDY)
        assert not first.fell_back_to_full_prefill
    last = session.send("Which of the two is larger?", GREEDY)
    assert not last.fell_back_to_full_prefill
    assert last.prompt_tokens < len(session.token_ids) // 2  # only the new part was fed
    history = session.token_ids[: len(session.token_ids) - len(last.tokens)]
    fresh = generate(
        smollm2_loaded.model,
        DynamicCache(config=smollm2_loaded.model.config),
        history,
        device=torch.device("cpu"),
        settings=GREEDY,
        stop_ids=session.stop_ids(),
        prefill_chunk=len(history),
    )
    assert fresh.tokens == last.tokens


def _three_turns(loaded, cache: CacheSettings, sampling: SamplingSettings):
    session = ChatSession(loaded, cache=cache)
    prompts = (
        "Tell me about the history of Rome in a few sentences.",
        "Now summarise that in one line.",
        "List three Roman emperors.",
    )
    replies = [session.send(p, sampling).tokens for p in prompts]
    session.close()
    return replies, session


@pytest.fixture(scope="module")
def standard_three_turns(smollm2_loaded):
    return _three_turns(
        smollm2_loaded, CacheSettings(kind="standard"), SamplingSettings(max_new_tokens=40)
    )


@pytest.mark.parametrize("hot", [1, 4, 16, 64, "half", "all"])
def test_kvdirect_equals_standard_cache_at_every_budget(smollm2_loaded, standard_three_turns, hot):
    sampling = SamplingSettings(max_new_tokens=40)
    ref, ref_session = standard_three_turns
    total = len(ref_session.token_ids)
    assert sum(map(len, ref)) >= 64
    window = {"half": total // 2, "all": total + 10}.get(hot, hot)
    ours, session = _three_turns(
        smollm2_loaded, CacheSettings(hot_window=window, prefill_chunk=32), sampling
    )
    assert ours == ref
    if window < 64:  # cold K/V were brought back (read from disk, or recomputed)
        stats = session.cache.stats
        assert stats.disk_read_bytes > 0 or stats.recomputed_tokens > 0


def test_bf16_kvdirect_equals_standard_cache(smollm2_loaded_bf16):
    sampling = SamplingSettings(max_new_tokens=24)
    ref, _ = _three_turns(smollm2_loaded_bf16, CacheSettings(kind="standard"), sampling)
    ours, session = _three_turns(smollm2_loaded_bf16, CacheSettings(hot_window=8), sampling)
    stats = session.cache.stats
    assert ours == ref and (stats.disk_read_bytes > 0 or stats.recomputed_tokens > 0)


def test_seeded_sampling_gives_identical_text(smollm2_loaded):
    sampling = SamplingSettings(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=24)
    ref, _ = _three_turns(smollm2_loaded, CacheSettings(kind="standard"), sampling)
    ours, _ = _three_turns(smollm2_loaded, CacheSettings(hot_window=4), sampling)
    assert ours == ref
    other, _ = _three_turns(
        smollm2_loaded,
        CacheSettings(hot_window=4),
        SamplingSettings(temperature=0.9, top_p=0.95, seed=8, max_new_tokens=24),
    )
    assert other != ref  # the seed matters: the test is not vacuous


def smallest_ceiling(loaded, n_tokens: int) -> int:
    """The smallest --max-mem the planner accepts for ``n_tokens`` (K/V form, disk tier)."""
    from kvchat.engine.kvdirect.planner import Planner
    from kvchat.errors import NeedsDiskTierError

    def fits(ceiling: int) -> bool:
        planner = Planner(loaded.footprint, ["kv"] * loaded.footprint.num_layers, ceiling, 256)
        try:
            planner.plan_exact(n_tokens)
        except NeedsDiskTierError:
            return False
        return True

    lo, hi = 1_000, 100_000_000
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def test_prompt_over_the_ceiling_is_refused_and_nothing_is_lost(smollm2_loaded, tmp_path):
    from kvchat.errors import NeedsDiskTierError

    # Even the disk tier has a floor (token ids and the smallest read-back scratch): a
    # ceiling just above a short turn's floor refuses a long prompt before feeding it.
    ceiling = smallest_ceiling(smollm2_loaded, 60)
    settings = CacheSettings(max_mem=ceiling)
    session = ChatSession(smollm2_loaded, cache=settings, spill_root=tmp_path)
    first = session.send("Hi!", SamplingSettings(max_new_tokens=4))
    before = (list(session.messages), list(session.token_ids), session.cache.get_seq_length())
    with pytest.raises(NeedsDiskTierError, match="--max-mem"):
        session.send("word " * 600, GREEDY)
    assert (session.messages, session.token_ids, session.cache.get_seq_length()) == before
    assert first.reply
    session.close()


def test_reply_reaching_the_ceiling_ends_early_and_keeps_what_was_said(smollm2_loaded, tmp_path):
    ceiling = smallest_ceiling(smollm2_loaded, 80)
    session = ChatSession(smollm2_loaded, cache=CacheSettings(max_mem=ceiling), spill_root=tmp_path)
    result = session.send("Write a long story about a cat.", SamplingSettings(max_new_tokens=900))
    assert result.finish_reason == "ceiling" and "--max-mem" in result.error
    assert result.reply and session.messages[-1]["content"] == result.reply
    assert result.memory.state_bytes <= ceiling
    session.close()
