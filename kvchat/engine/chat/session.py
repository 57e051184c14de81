"""A chat conversation held by the engine: messages, token ids and the cache, across turns.

Each turn feeds only what is new since the last one (the user's message in the chat
template, plus the last generated token that the decode loop had not fed yet), so the
conversation state carries over instead of the whole history being prefilled again.
This is what the UI and the CLI drive; they get plain Python values back, never tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.engine.chat import prompt
from kvchat.engine.chat.memory_snapshot import MemorySnapshot
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings
from kvchat.engine.chat.turn_log import TurnLog
from kvchat.engine.models.loaded import LoadedModel
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.engine.kvdirect.costs import DeviceCosts
    from kvchat.engine.kvdirect.interface import ConversationCache
    from kvchat.engine.kvdirect.planner import Plan
    from kvchat.storage import Conversation


@dataclass
class TurnResult:
    reply: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str
    memory: MemorySnapshot
    prefill_seconds: float
    decode_seconds: float
    fell_back_to_full_prefill: bool = False
    error: str | None = None  # why the reply ended early (e.g. the ceiling was reached)
    save_error: str | None = None  # why the turn is not on disk (a later save retries it)

    @property
    def cancelled(self) -> bool:
        return self.finish_reason == "cancelled"

    @property
    def decode_tokens_per_second(self) -> float:
        return len(self.tokens) / self.decode_seconds if self.decode_seconds > 0 else 0.0


class ChatSession:
    """One conversation. Not thread-safe: one ``send`` at a time."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        system: str | None = None,
        cache: CacheSettings | None = None,
        spill_root: Path | None = None,
        forms: list[str] | None = None,
    ) -> None:
        self.loaded = loaded
        self.system = system
        self.cache_settings = cache or CacheSettings()
        self.messages: list[dict[str, str]] = []
        self.token_ids: list[int] = []  # every token of the conversation, in order
        self._rendered = ""  # text the token ids stand for, in the template's terms
        self._compute_seconds = 0.0
        self.conversation: Conversation | None = None  # when saving
        # Makes the conversation at the first save (no empty ones are left behind).
        self._create_conversation: Callable[[], Conversation] | None = None
        self._stop_ids: set[int] | None = None
        self.turn_log = TurnLog()  # what the next save writes
        self._cache_broken = False  # a forward call failed half way: rebuild before reuse
        self.spill_root: Path | None = spill_root  # where the disk tier spills (data dir)
        self._state_peak_bytes = 0  # the most resident state held at once (see memory.py)
        self._build_cache(forms)

    # -- cache ---------------------------------------------------------------------------
    def _build_cache(self, forms: list[str] | None = None) -> None:
        """``forms``: per-layer cold forms of a resumed conversation (kept as saved)."""
        from kvchat.engine.chat.settings import kv_dtype_for

        loaded = self.loaded
        kv_dtype = kv_dtype_for(self.cache_settings.kv_dtype, loaded.dtype)
        # Saves record the resolved dtype, so that a resumed conversation keeps it.
        self.cache_settings = settings = replace(self.cache_settings, kv_dtype=kv_dtype)
        self.footprint = footprint = loaded.footprint.with_kv_dtype(kv_dtype)
        self.cache: ConversationCache
        self.forms: list[str] | None
        if settings.kind == "standard":
            from kvchat.engine.kvdirect.standard import StandardCache

            self.cache = StandardCache(loaded.model.config, footprint, settings.max_mem)
            self.forms = None
        elif settings.kind == "kvdirect":
            from kvchat.engine.kvdirect.cache import KVDirectCache
            from kvchat.engine.kvdirect.planner import Planner, choose_forms

            if forms is None and settings.max_mem is None and settings.hot_window is None:
                # Nothing can ever be evicted: checkpoints would be pure overhead.
                forms = ["kv"] * footprint.num_layers
            elif forms is None:
                forms = choose_forms(footprint, settings.checkpoint, self._costs())
            self.forms = forms
            planner = Planner(footprint, forms, settings.max_mem, settings.prefill_chunk)
            self.cache = KVDirectCache(
                loaded.adapter(), forms, settings.hot_window, planner,
                kv_dtype=footprint.kv_dtype or None,
            )  # fmt: skip
            self.cache.spill_root = self.spill_root
            self.cache.attach()
        else:
            raise KvchatError(f"unknown cache kind {settings.kind!r}; use kvdirect or standard")

    def _costs(self) -> DeviceCosts | None:
        """Measured read and recompute costs (``auto`` only; cached after the first run)."""
        if self.cache_settings.checkpoint != "auto":
            return None
        from kvchat.engine.kvdirect.costs import device_costs
        from kvchat.paths import data_dir

        root = self.spill_root or data_dir()
        loaded = self.loaded
        return device_costs(self.footprint, loaded.device, loaded.dtype, root)

    def _detach_cache(self) -> None:
        self.cache.close()

    def close(self) -> None:
        """Unhook the cache from the model and release the conversation's lock."""
        self._detach_cache()
        if self.conversation is not None:
            self.conversation.close()

    def _prepare(self, n_new: int) -> None:
        """Before a turn feeds anything: the cache plans for its ``n_new`` tokens, or
        refuses them (nothing is fed). The turn's forward calls then prepare themselves."""
        try:
            self.cache.prepare(n_new)
        finally:
            # The check (and any call made outside a turn) counts toward the peak, not as
            # one of the turn's calls.
            self._note_state_peak(self.cache.calls.take().peak_resident_bytes)

    @property
    def plan(self) -> Plan | None:
        """The plan the cache follows (None: the standard cache, or nothing planned yet)."""
        return self.cache.plan

    def _release_reserve(self) -> None:
        """The rows decode reserved ahead go back once the reply is done (see
        ``KVDirectCache.hot_reserve``), and so does the heap they leave free."""
        if self.cache.release_reserve():
            from kvchat.engine.models.heap import return_freed_memory

            return_freed_memory()

    def _note_state_peak(self, resident_bytes: int) -> None:
        """Resident state as a forward call found it, held all at once (hot K/V, resident
        checkpoints, token ids and the last call's scratch): the peak the ceiling bounds."""
        now = resident_bytes + 8 * len(self.token_ids)
        self._state_peak_bytes = max(self._state_peak_bytes, now)

    @property
    def state_peak_bytes(self) -> int:
        """The most resident state held at once, the calls since the last turn included
        (a benchmark may drive ``generate`` on this session's cache directly)."""
        pending = self.cache.calls.peak_resident_bytes
        return max(self._state_peak_bytes, pending + 8 * len(self.token_ids) if pending else 0)

    def _fit_context(self, n_tokens: int, sampling: SamplingSettings) -> SamplingSettings:
        """Refuse a conversation longer than the model's positions; let the reply use only
        the positions left."""
        import dataclasses

        limit = prompt.context_length(self.loaded.model.config)
        room = prompt.fit_reply(limit, n_tokens, sampling.max_new_tokens, self.loaded.name)
        if room != sampling.max_new_tokens:
            sampling = dataclasses.replace(sampling, max_new_tokens=room)
        return sampling

    # -- prompt rendering ----------------------------------------------------------------
    def _conversation(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def _render(self, messages: list[dict[str, str]]) -> str:
        return prompt.render(self.loaded.tokenizer, self.loaded.has_chat_template, messages)

    def _tokenize(self, text: str) -> list[int]:
        return prompt.tokenize(self.loaded.tokenizer, text)

    def stop_ids(self) -> set[int]:
        """EOS and end-of-turn ids; computed once (building the vocab dict is not free)."""
        if self._stop_ids is None:
            loaded = self.loaded
            self._stop_ids = prompt.stop_ids(
                loaded.tokenizer, loaded.has_chat_template, loaded.model.generation_config
            )
        return self._stop_ids

    # -- a turn --------------------------------------------------------------------------
    def send(
        self,
        text: str,
        sampling: SamplingSettings | None = None,
        *,
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnResult:
        """Add a user message, generate the reply, stream it through ``on_text``."""
        from kvchat.engine.chat.generate import generate

        sampling = sampling or SamplingSettings()
        self.messages.append({"role": "user", "content": text})
        full = self._render(self._conversation())
        fell_back = False
        if self._rendered and full.startswith(self._rendered) and not self._cache_broken:
            new_ids = self._tokenize(full[len(self._rendered) :])
        else:
            if self._rendered:
                # The template rewrote earlier turns (or a forward call failed half way):
                # start the state again from the text.
                fell_back = True
                self._detach_cache()
                self._build_cache()
                self.token_ids = []
                self.turn_log.restart_from_text()
                self._cache_broken = False
            new_ids = self._tokenize(full)
        to_feed = (self.token_ids + new_ids)[self.cache.get_seq_length() :]
        try:
            sampling = self._fit_context(len(self.token_ids) + len(new_ids), sampling)
            self._prepare(len(to_feed))  # refuse a prompt that cannot fit, feed nothing
            prefill_chunk = self.cache_settings.prefill_chunk
        except KvchatError:
            self.messages.pop()
            raise
        self.token_ids.extend(new_ids)
        self._rendered = full

        from kvchat.engine.chat.detokenizer import IncrementalDecoder, StopStrings

        tok = self.loaded.tokenizer
        plain = not self.loaded.has_chat_template
        decoder = IncrementalDecoder(tok)
        stops = StopStrings(prompt.PLAIN_STOP_STRINGS if plain else ())

        def show(text: str) -> bool:
            """Stream ``text`` (minus any stop string); True once a stop string appeared."""
            text, stopped = stops.feed(text)
            if text and on_text is not None:
                on_text(text)
            return stopped

        def on_token(token_id: int) -> bool:
            return show(decoder.push(token_id))

        start = time.perf_counter()
        try:
            outcome = generate(
                self.loaded.model,
                self.cache,
                to_feed,
                device=self.loaded.device,
                settings=sampling,
                stop_ids=self.stop_ids(),
                prefill_chunk=prefill_chunk,
                on_token=on_token,
                should_stop=should_stop,
                on_progress=on_progress,
            )
        except BaseException:
            # A forward call may have stopped half way (layers disagree on what they hold):
            # the next turn rebuilds the state from the text instead of trusting it.
            self._cache_broken = True
            raise
        finally:
            calls = self.cache.calls.take()
            self._note_state_peak(calls.peak_resident_bytes)
            self.turn_log.calls += calls.rows
        self._compute_seconds += time.perf_counter() - start
        self._release_reserve()
        show(decoder.flush())  # a reply cut by length may end inside a held-back tail
        tail = stops.flush()
        if tail and on_text is not None:
            on_text(tail)
        reply_ids = outcome.tokens
        reply = tok.decode(reply_ids, skip_special_tokens=True)
        if plain:
            cuts = [reply.find(s) for s in prompt.PLAIN_STOP_STRINGS if s in reply]
            if cuts:
                reply = reply[: min(cuts)]
        self.token_ids.extend(reply_ids)
        self.messages.append({"role": "assistant", "content": reply})
        # The text the ids stand for: the template's prefix plus the reply as generated,
        # special tokens included (an end-of-turn id renders as its marker).
        self._rendered = full + tok.decode(reply_ids, skip_special_tokens=False)
        self.turn_log.note_turn(self.messages[-2:], new_ids + reply_ids)
        error = outcome.error
        save_error = None
        if self.conversation is not None or self._create_conversation is not None:
            save_error = self.save()
            error = save_error or error
        return TurnResult(
            reply=reply,
            tokens=reply_ids,
            prompt_tokens=len(to_feed),
            finish_reason=outcome.finish_reason,
            memory=self.memory(),
            prefill_seconds=outcome.prefill_seconds,
            decode_seconds=outcome.decode_seconds,
            fell_back_to_full_prefill=fell_back,
            error=error,
            save_error=save_error,
        )

    def seed_history(self, messages: list[dict[str, str]]) -> None:
        """Start from earlier turns known only as text (a client's own history): they are
        prefilled with the next message and saved with it, so a new saved conversation
        holds them all."""
        if self.messages or self.token_ids:
            raise KvchatError("a history can only seed a session that has not spoken yet")
        self.messages = [dict(m) for m in messages]
        self.turn_log.seed(messages)

    # -- persistence ---------------------------------------------------------------------
    def attach_conversation(self, conversation: Conversation) -> None:
        """Save every turn from now on into ``conversation`` (an open, locked store entry)."""
        self.conversation = conversation

    def save_on_first_turn(self, create: Callable[[], Conversation]) -> None:
        """Save every turn, into a conversation ``create()`` makes at the first save."""
        self._create_conversation = create

    def save(self) -> str | None:
        """Write what changed since the last save as one turn; returns an error message or
        None. On failure the conversation stays in memory and the next save retries."""
        from kvchat.engine.chat.persist import encode_calls, note_saved
        from kvchat.errors import StorageError

        n_cached = self.cache.get_seq_length()
        log = self.turn_log
        try:
            if self.conversation is None:
                self.conversation = self._create_conversation()
                self._create_conversation = None
            # A rebase turn (the template rewrote history, so the state was rebuilt from
            # text) carries the whole state and all token ids; resume starts from it.
            since = log.since
            ids_from = self.conversation.manifest.engine_state.get("ids_from", 0)
            if log.rebase:
                ids_from = len(self.conversation.manifest.token_ids)
            self.conversation.append_turn(
                messages=log.messages,
                token_ids=list(self.token_ids) if log.rebase else log.token_ids,
                tensors=self.cache.state(since),
                extra={
                    "n_cached": n_cached,
                    "memory": self.memory().to_dict(),
                    "rebase": log.rebase,
                    "calls": encode_calls(log.calls),
                },
                engine_state={
                    "rendered": self._rendered,
                    "system": self.system,
                    "forms": self.forms,
                    "cache": self.cache_settings.as_dict(),
                    "n_cached": n_cached,
                    "ids_from": ids_from,
                },
            )
        except StorageError as exc:
            return str(exc)
        log.saved(n_cached)
        try:
            note_saved(self.cache, self.conversation, len(self.conversation.manifest.turns), since)
        except (KvchatError, OSError) as exc:
            # The turn is saved; only re-pointing checkpoints at it failed, so they stay in
            # the spill files, which are kept.
            return f"turn saved, but its checkpoints stay in the spill files ({exc})"
        return None

    @classmethod
    def resume(
        cls,
        loaded: LoadedModel,
        conversation: Conversation,
        cache: CacheSettings | None = None,
        spill_root: Path | None = None,
    ) -> ChatSession:
        """Rebuild a saved conversation exactly: messages, token ids and the cache state.

        ``cache`` may change the ceiling, the hot window and the checkpoint form: saved
        pieces keep the form they were saved in, new tokens take the one chosen now.
        """
        manifest = conversation.manifest
        state = manifest.engine_state
        if not manifest.turns:  # a fork at turn 0: only what the conversation was made with
            known = {f.name for f in fields(CacheSettings)}
            made_with = manifest.settings
            state = {
                "system": made_with.get("system"),
                "cache": {k: v for k, v in made_with.items() if k in known},
            }
        saved = CacheSettings(**state.get("cache", {}))
        if cache is not None:
            saved.max_mem, saved.hot_window = cache.max_mem, cache.hot_window
            saved.checkpoint = cache.checkpoint
        session = cls(loaded, system=state.get("system"), cache=saved, spill_root=spill_root)
        try:
            session._restore_from(conversation, state)
        except BaseException:
            session._detach_cache()  # unhook from the model; the caller closes the conversation
            raise
        return session

    def _restore_from(self, conversation: Conversation, state: dict) -> None:
        from kvchat.engine.chat.persist import restore

        manifest = conversation.manifest
        n_cached = int(state.get("n_cached", 0))
        restore(self.cache, conversation, n_cached, self.loaded.device)
        self.messages = [dict(m) for m in manifest.messages]
        self.token_ids = list(manifest.token_ids[int(state.get("ids_from", 0)) :])
        self._rendered = state.get("rendered", "")
        self.turn_log = TurnLog(saved_upto=n_cached)
        self.conversation = conversation

    @property
    def cached_tokens(self) -> int:
        """Tokens whose state the cache holds: what the next turn reuses instead of feeding."""
        return self.cache.get_seq_length()

    def disk_bytes(self) -> int:
        """Saved segments plus checkpoints spilled since the last save."""
        spilled = self.cache.disk_bytes()
        if self.conversation is None:
            return spilled
        return spilled + sum(t.segment.nbytes for t in self.conversation.manifest.turns)

    # -- accounting ----------------------------------------------------------------------
    def memory(self) -> MemorySnapshot:
        from kvchat.engine.chat.memory import snapshot

        return snapshot(self)

    @property
    def compute_seconds(self) -> float:
        return self._compute_seconds
