"""A fake engine for the UI tests: canned words, fixed memory figures, no torch.

Memory figures follow the token count only (no clock, no real RSS), so snapshots are
reproducible; ``process_rss`` is a fixed number.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kvchat.engine.chat.settings import SamplingSettings
from kvchat.errors import KvchatError
from kvchat.ui.backend import (
    LaunchOptions,
    MemorySnapshot,
    ModelView,
    ResumedConversation,
    TurnView,
)

REPLY = (
    "Here is a **short** answer. KV-Direct keeps the *recent* keys and values hot and "
    "recomputes the older ones from residual checkpoints, so the output stays exact."
)
MIB = 1024 * 1024


def fake_memory(tokens: int, ceiling: int | None, turns: int = 0) -> MemorySnapshot:
    hot_window = 64
    hot = min(tokens, hot_window)
    ckpt = tokens - hot
    hot_bytes = hot * 23040  # SmolLM2-like K/V bytes per token, all layers
    ckpt_bytes = ckpt * 34560  # one residual per layer per token
    scratch = 2 * 23040 * 8 if ckpt else 0
    token_bytes = tokens * 8
    state = hot_bytes + ckpt_bytes + scratch + token_bytes
    compute = 0.5 * turns + 0.01 * tokens
    recompute = 0.004 * ckpt
    return MemorySnapshot(
        cache="kvdirect",
        checkpoint="residual",
        tokens=tokens,
        hot_tokens=hot,
        checkpointed_tokens=ckpt,
        hot_window=hot_window,
        hot_kv_bytes=hot_bytes,
        checkpoint_bytes=ckpt_bytes,
        scratch_peak_bytes=scratch,
        token_id_bytes=token_bytes,
        state_bytes=state,
        standard_equivalent_bytes=tokens * 23040,
        ceiling_bytes=ceiling,
        disk_bytes=0,
        weights_bytes=513 * MIB,
        rss_bytes=945 * MIB,
        recompute_seconds=round(recompute, 4),
        compute_seconds=round(compute, 4),
        recompute_share=round(recompute / compute, 4) if compute else 0.0,
    )


CORRUPTED = (
    "segment turn-0002.safetensors of conversation 20261130-101500-beef is corrupted "
    "(checksum mismatch); export the text with `kvchat export 20261130-101500-beef`"
)
SAMPLE_CONVERSATIONS = [
    {
        "id": "20261130-120000-abcd",
        "title": "Capital cities",
        "model": "smollm2-135m",
        "turns": 2,
        "tokens": 120,
        "bytes_on_disk": 300_000,
        "last_used": "2026-11-30T12:05+00:00",
        "error": None,
    },
    {
        "id": "20261130-101500-beef",
        "title": "Broken one",
        "model": "smollm2-135m",
        "turns": 3,
        "tokens": 200,
        "bytes_on_disk": 500_000,
        "last_used": "2026-11-30T10:20+00:00",
        "error": CORRUPTED,
    },
]
SAMPLE_SAVED = {
    "20261130-120000-abcd": ResumedConversation(
        id="20261130-120000-abcd",
        title="Capital cities",
        messages=[
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
            {"role": "user", "content": "And of Italy?"},
            {"role": "assistant", "content": "Rome."},
        ],
        memory_history=[fake_memory(50, 64 * 10**6, 1), fake_memory(120, 64 * 10**6, 2)],
        system="Be brief.",
    )
}


class FakeBackend:
    """Implements :class:`kvchat.ui.backend.Backend` with canned words and fixed figures."""

    def __init__(
        self,
        *,
        reply: str = REPLY,
        delay: float = 0.0,
        load_delay: float = 0.0,
        hold_load: bool = False,
        load_error: str | None = None,
        send_error: str | None = None,
        resume_error: str | None = None,
        save_error: str | None = None,
        conversations: list[dict[str, Any]] | None = None,
        saved: dict[str, ResumedConversation] | None = None,
        max_mem: int | None = 64 * 10**6,
        model: str = "smollm2-135m",
    ) -> None:
        self.launch = LaunchOptions(model=model, cache_kind="kvdirect", max_mem=max_mem)
        self.reply = reply
        self.delay = delay
        self.load_delay = load_delay
        # A load waits for this gate: cleared (``hold_load``), a test sees the loading phase
        # for as long as it likes, and sets it to let the load finish.
        self.load_gate = threading.Event()
        if not hold_load:
            self.load_gate.set()
        self.load_error = load_error
        self.send_error = send_error
        self.resume_error = resume_error
        self.save_error = save_error  # every turn reports it while set (a full disk, say)
        self.conversations = conversations or []
        self.saved = saved or {}
        self.tokens = 0
        self.turns = 0
        self.loaded = False
        self.sent: list[tuple[str, SamplingSettings]] = []
        self.systems: list[str | None] = []
        self.stopped = False
        self.new_count = 0
        self.memory_calls = 0
        self.threads: set[str] = set()
        self.release = threading.Event()  # set it to let a ``hold`` send finish
        self.hold = False
        self.messages: list[dict[str, str]] = []  # the conversation, as a store would hold it
        self.branched: list[int] = []  # each ``branch(user_message)`` asked for
        self.branch_error: str | None = None

    def _thread(self) -> None:
        self.threads.add(threading.current_thread().name)

    def load(self, progress: Callable[[str], None], spec: str | None = None) -> ModelView:
        self._thread()
        if spec:
            self.launch.model = spec
        progress(f"resolving {self.launch.model}")
        if self.load_delay:
            time.sleep(self.load_delay)
        self.load_gate.wait()
        if self.load_error:
            raise KvchatError(self.load_error)
        progress("loading weights")
        self.loaded = True
        self.tokens = self.turns = 0
        return ModelView(self.launch.model, "float32", "cpu", 513 * MIB, True)

    def send(
        self,
        text: str,
        sampling: SamplingSettings,
        *,
        on_text: Callable[[str], None],
        should_stop: Callable[[], bool],
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnView:
        self._thread()
        if on_progress is not None and len(text) > 2000:  # a long prompt: report its reading
            on_progress(len(text) // 2, len(text))
        self.sent.append((text, sampling))
        if self.send_error:
            raise KvchatError(self.send_error)
        self.tokens += len(text.split()) + 12  # the template around the message
        words = self.reply.split(" ")
        said: list[str] = []
        reason = "eos"
        for i, word in enumerate(words):
            if should_stop():
                reason = "cancelled"
                self.stopped = True
                break
            piece = word if i == 0 else " " + word
            said.append(piece)
            self.tokens += 1
            on_text(piece)
            if self.delay:
                time.sleep(self.delay)
        while self.hold and not self.release.wait(0.01):
            pass
        self.turns += 1
        self.messages += [
            {"role": "user", "content": text},
            {"role": "assistant", "content": "".join(said)},
        ]
        n = len(said)
        return TurnView(
            reply="".join(said),
            finish_reason=reason,
            memory=self.memory(),
            tokens=n,
            tokens_per_second=25.0,
            save_error=self.save_error,
        )

    def memory(self) -> MemorySnapshot:
        self.memory_calls += 1
        return fake_memory(self.tokens, self.launch.max_mem, self.turns)

    def process_rss(self) -> int | None:
        return 945 * MIB

    def set_system(self, system: str | None) -> None:
        self.systems.append(system)

    def new_conversation(self, system: str | None) -> None:
        self._thread()
        self.new_count += 1
        self.tokens = self.turns = 0

    def list_conversations(self) -> list[dict[str, Any]]:
        return list(self.conversations)

    def open_conversation(self, conv_id: str) -> ResumedConversation:
        self._thread()
        if self.resume_error:
            raise KvchatError(self.resume_error)
        if conv_id not in self.saved:
            raise KvchatError(f"no conversation {conv_id!r}; `kvchat list` shows the ids")
        resumed = self.saved[conv_id]
        self.messages = list(resumed.messages)
        if resumed.memory_history:
            self.tokens = resumed.memory_history[-1].tokens
            self.turns = len(resumed.memory_history)
        return resumed

    def branch(self, user_message: int) -> ResumedConversation:
        self._thread()
        self.branched.append(user_message)
        if self.branch_error:
            raise KvchatError(self.branch_error)
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        self.messages = self.messages[: users[user_message - 1]]
        self.turns = len(self.messages) // 2
        return ResumedConversation(
            id=f"fork-{len(self.branched)}",
            title="a branch",
            messages=list(self.messages),
            forked_from="parent-id",
        )

    def close(self) -> None:
        pass
