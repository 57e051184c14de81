"""The disk tier: checkpoints beyond the ceiling live in files, output stays the same.

Two paths, one promise: logits ``torch.equal`` to the standard cache's.
* one layer's K/V fits under the ceiling: cold K/V are rebuilt whole from disk-backed
  checkpoints and handed to attention whole;
* it does not (2 MB for 8K SmolLM2 tokens): attention is streamed over chunks
  (kvchat/engine/kvdirect/streamed_attention.py), each folded into kvchat's exact attention.
Resident state is measured by the engine's own accounting at every forward call.
"""

from __future__ import annotations

import gc
import os
import threading

import psutil
import pytest
import torch
from transformers import DynamicCache

from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings
from kvchat.engine.kvdirect import exact_attention
from kvchat.engine.kvdirect.arch import ArchAdapter
from kvchat.engine.kvdirect.cache import KVDirectCache
from kvchat.lab.tiny_models import FAMILIES
from kvchat.units import process_rss
from tests.engine.chat.test_memory import RSS_ALLOWANCE
from tests.engine.kvdirect.test_cache_exact import run_conversation, tiny_model

GREEDY = SamplingSettings(max_new_tokens=12)


def disk_cache(model, tmp_path, stream_chunk):
    adapter = ArchAdapter(model)
    cache = KVDirectCache(adapter, ["residual"] * adapter.num_layers, hot_window=4)
    cache.spill_root = tmp_path
    cache.checkpoint_budget = 0  # every checkpoint goes to disk as soon as it is made
    cache.attach()
    cache.enable_streaming(stream_chunk)
    return cache


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoints_on_disk_give_bit_identical_logits(family, tmp_path):
    model = tiny_model(family)
    ref_tokens, ref_logits = run_conversation(model, DynamicCache(config=model.config))
    cache = disk_cache(model, tmp_path, stream_chunk=None)
    tokens, logits = run_conversation(model, cache)
    assert cache.checkpoint_bytes() == 0 and cache.stats.spilled_bytes > 0
    assert cache.stats.disk_read_bytes > 0 and cache.disk_bytes() > 0
    cache.close()
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(ref_logits, logits))
    assert not list((tmp_path / "spill").iterdir())  # spill files go with the session


@pytest.mark.skipif(
    not exact_attention.available(os.environ.get("KVCHAT_TEST_DEVICE", "cpu")),
    reason="no exact attention kernel here (no C compiler, or not the CPU): torch's attention",
)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("stream_chunk", "weights", "dtype"),
    [(8, "none", torch.float32), (16, "none", torch.float32), (8, "int4", torch.float32),
     (16, "int8", torch.float32), (8, "none", torch.bfloat16), (16, "int4", torch.bfloat16)],
)  # fmt: skip
@pytest.mark.slow
def test_streamed_attention_gives_bit_identical_logits(
    family, stream_chunk, weights, dtype, tmp_path
):
    from kvchat.engine.models.quantize import quantize_weights

    model = quantize_weights(tiny_model(family, dtype), weights)
    ref_tokens, ref_logits = run_conversation(model, DynamicCache(config=model.config))
    cache = disk_cache(model, tmp_path, stream_chunk=stream_chunk)
    tokens, logits = run_conversation(model, cache)
    assert cache.stats.disk_read_bytes > 0
    cache.close()
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(ref_logits, logits))


def watch_resident(session: ChatSession) -> list[int]:
    """Resident state (hot K/V + resident checkpoints + token ids + the step's scratch) at
    the end of every forward call, from the engine's own accounting."""
    seen: list[int] = []
    cache = session.cache
    original = cache.prepare

    def measured(n_new: int):
        seen.append(
            cache.hot_bytes()
            + cache.checkpoint_bytes()
            + 8 * len(session.token_ids)
            + cache.stats.step_scratch_bytes
        )
        plan = original(n_new)
        seen.append(cache.hot_bytes() + cache.checkpoint_bytes() + 8 * len(session.token_ids))
        return plan

    cache.prepare = measured  # the one call before every forward call
    return seen


class RssPeak:
    """Peak process RSS over a block, sampled every 5 ms, as growth over its start."""

    def __enter__(self) -> RssPeak:
        self.baseline = self.peak = process_rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._done.is_set():
            self.peak = max(self.peak, proc.memory_info().rss)
            self._done.wait(0.005)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


def long_text(n_sentences: int) -> str:
    colours = ["red", "green", "blue", "amber", "violet", "grey", "white"]
    things = ["lantern", "kettle", "harbour", "orchard", "ledger", "violin", "bridge"]
    return " ".join(
        f"Note {i}: the {colours[i % 7]} {things[(i * 3) % 7]} was moved to shelf {i % 13}."
        for i in range(n_sentences)
    )


@pytest.mark.slow
def test_smollm2_grows_past_a_2mb_ceiling_with_the_same_replies(smollm2_loaded, tmp_path):
    ceiling = 2_000_000
    prompts = [long_text(40) + " Which shelf holds note 7?", "And note 12?"]
    standard = ChatSession(smollm2_loaded, cache=CacheSettings(kind="standard"))
    ref = [standard.send(p, GREEDY).tokens for p in prompts]
    settings = CacheSettings(max_mem=ceiling)
    session = ChatSession(smollm2_loaded, cache=settings, spill_root=tmp_path)
    seen = watch_resident(session)
    got = [session.send(p, GREEDY) for p in prompts]
    tokens = session.cache.get_seq_length()
    assert [r.tokens for r in got] == ref
    assert session.plan.disk_tier and session.plan.stream_chunk is not None
    assert max(seen) <= ceiling, f"resident state reached {max(seen)} bytes"
    mem = got[-1].memory
    assert mem.state_bytes <= ceiling < mem.standard_equivalent_bytes
    assert mem.disk_bytes > 30_000 * tokens  # ~69 KB of residuals per token, mostly on disk
    session.close()


@pytest.mark.slow
def test_8k_token_conversation_resumed_under_2mb_continues_identically(smollm2_loaded, tmp_path):
    """8K tokens saved with a roomy ceiling, resumed under 2 MB (100x below the standard
    cache's 188 MB); the continuation matches a standard cache that saw the same text."""
    from kvchat.engine.chat.conversation import open_session

    text = long_text(505) + " Which shelf holds note 7?"
    question = "And note 12?"
    roomy = CacheSettings(max_mem=4 * 10**9)
    first = open_session(smollm2_loaded, data_dir=tmp_path, cache=roomy)
    first.send(text, SamplingSettings(max_new_tokens=4))
    conv_id, n_tokens = first.conversation.id, first.cache.get_seq_length()
    first.close()
    assert 8000 <= n_tokens <= 8400

    tight = CacheSettings(max_mem=2_000_000)
    gc.collect()
    with RssPeak() as rss:
        resumed = open_session(
            smollm2_loaded, data_dir=tmp_path, cache=tight, conversation_id=conv_id
        )
        assert resumed.cache.checkpoint_bytes() < 2_000_000  # nothing loaded whole
        seen = watch_resident(resumed)
        reply = resumed.send(question, SamplingSettings(max_new_tokens=6))
    resumed.close()
    assert max(seen) <= 2_000_000, f"resident state reached {max(seen)} bytes"
    assert reply.memory.standard_equivalent_bytes > 90 * 2_000_000
    assert reply.memory.disk_bytes > 350 * 2**20  # the 8K tokens' K/V, on disk
    # Loading the checkpoints would take 560 MB; RSS stays within ceiling + allowance.
    assert rss.growth <= 2_000_000 + RSS_ALLOWANCE, f"RSS grew {rss.growth / 2**20:.0f} MiB"

    standard = ChatSession(smollm2_loaded, cache=CacheSettings(kind="standard"))
    standard.send(text, SamplingSettings(max_new_tokens=4))
    ref = standard.send(question, SamplingSettings(max_new_tokens=6))
    assert reply.tokens == ref.tokens

    # RSS growth does not grow with context: a 1K-token conversation resumed the same way
    # grows RSS by at most 16 MiB less than the 8K one.
    small = open_session(smollm2_loaded, data_dir=tmp_path, cache=roomy)
    small.send(long_text(60) + " Which shelf holds note 7?", SamplingSettings(max_new_tokens=4))
    small_id, small_tokens = small.conversation.id, small.cache.get_seq_length()
    small.close()
    assert 900 <= small_tokens <= 1300
    gc.collect()
    with RssPeak() as rss_small:
        again = open_session(
            smollm2_loaded, data_dir=tmp_path, cache=tight, conversation_id=small_id
        )
        again.send(question, SamplingSettings(max_new_tokens=6))
    again.close()
    assert rss.growth <= rss_small.growth + 16 * 2**20, (
        f"RSS grew {rss.growth / 2**20:.1f} MiB at 8K vs {rss_small.growth / 2**20:.1f} at 1K"
    )


def test_a_full_disk_while_spilling_ends_the_reply_cleanly_and_keeps_the_state(
    smollm2_loaded, tmp_path, monkeypatch
):
    from kvchat.engine.kvdirect.disk_tier import SpillArea
    from kvchat.errors import StorageError

    def full(self, layer, rows):
        raise StorageError("moving checkpoints to disk failed (No space left on device)")

    session = ChatSession(
        smollm2_loaded, cache=CacheSettings(max_mem=2_000_000), spill_root=tmp_path
    )
    with monkeypatch.context() as patch:
        patch.setattr(SpillArea, "write", full)
        result = session.send("Name three colours.", GREEDY)
    assert result.finish_reason == "ceiling" and "No space left" in result.error
    assert result.reply and session.messages[-1]["content"] == result.reply
    assert session.cache.get_seq_length() == len(session.token_ids) - 1  # consistent
    # disk space is back: the conversation goes on, and the state meets the ceiling again
    again = session.send("And three animals?", GREEDY)
    assert again.error is None and again.reply
    assert again.memory.state_bytes <= 2_000_000
    session.close()


@pytest.mark.slow
def test_gemma3_past_its_sliding_window_under_the_disk_tier(gemma270m_loaded, tmp_path):
    """Sliding (window 512) and global layers share the resident budget by need; the
    continuation past the window matches the standard cache."""
    text = long_text(45)
    sampling = SamplingSettings(max_new_tokens=10)
    standard = ChatSession(gemma270m_loaded, cache=CacheSettings(kind="standard"))
    ref = [standard.send(p, sampling).tokens for p in (text, "Note 3 was")]
    settings = CacheSettings(max_mem=3_000_000)
    session = ChatSession(gemma270m_loaded, cache=settings, spill_root=tmp_path)
    seen = watch_resident(session)
    got = [session.send(p, sampling) for p in (text, "Note 3 was")]
    assert [r.tokens for r in got] == ref
    assert session.cache.get_seq_length() > 512 and session.plan.disk_tier
    assert max(seen) <= 3_000_000, f"resident state reached {max(seen)} bytes"
    session.close()


def test_streamed_path_refuses_when_its_attention_was_swapped_out(tmp_path):
    """A wrong combination fails loudly instead of attending over the hot K/V alone."""
    model = tiny_model("llama")
    cache = disk_cache(model, tmp_path, stream_chunk=8)
    model.set_attn_implementation("sdpa")  # what lab/eviction does on a shared model
    with pytest.raises(RuntimeError, match="streamed attention is not installed"):
        run_conversation(model, cache)
    cache.close()


@pytest.mark.slow
def test_spill_files_never_hold_more_than_the_standard_cache(gemma270m_loaded, tmp_path):
    """Sliding layers' rows die as the window moves; their spill space is reused, so under
    a ceiling with nothing saved the spill files (their sizes on disk, by stat) stay within
    1.1x the bytes the standard cache (DynamicCache's tensors) holds after the same call."""
    import os

    import kvchat.engine.chat.generate as generate_module

    text = long_text(70)
    prompts = (text, " Note 3 was", " and then")
    sampling = SamplingSettings(max_new_tokens=24)
    original = generate_module.forward_ids
    standard_bytes: list[int] = []
    spill_bytes: list[int] = []

    def standard_recording(model, cache, *args, **kwargs):
        out = original(model, cache, *args, **kwargs)
        standard_bytes.append(
            sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        )
        return out

    def spill_recording(model, cache, *args, **kwargs):
        out = original(model, cache, *args, **kwargs)
        folder = cache.spill.path if cache.spill is not None else None
        sizes = [os.stat(f).st_size for f in folder.iterdir()] if folder else []
        spill_bytes.append(sum(sizes))
        return out

    generate_module.forward_ids = standard_recording
    try:
        standard = ChatSession(gemma270m_loaded, cache=CacheSettings(kind="standard"))
        ref = [standard.send(p, sampling).tokens for p in prompts]
        generate_module.forward_ids = spill_recording
        session = ChatSession(
            gemma270m_loaded, cache=CacheSettings(max_mem=1_500_000), spill_root=tmp_path
        )
        got = [session.send(p, sampling).tokens for p in prompts]
        assert session.plan.disk_tier
        session.close()
    finally:
        generate_module.forward_ids = original
    assert got == ref
    assert len(spill_bytes) == len(standard_bytes) and max(spill_bytes) > 0
    worst = max(s / b for s, b in zip(spill_bytes, standard_bytes))
    assert worst <= 1.1, f"spill reached {worst:.2f}x the standard cache's bytes"
