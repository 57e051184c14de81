"""The engine's memory accounting: one snapshot per moment, as plain numbers.

Figures come from the bytes of the tensors the cache actually holds (hot K/V, residual
checkpoints), not from a formula; the standard-cache equivalent is what transformers'
``DynamicCache`` would hold for the same tokens (docs/facts.md, section 2); weights and process RSS
(psutil) are reported beside them, never mixed into the conversation state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvchat.engine.chat.memory_snapshot import MemorySnapshot
from kvchat.units import process_rss

if TYPE_CHECKING:
    from kvchat.engine.chat.settings import CacheSettings
    from kvchat.engine.kvdirect.footprint import ModelFootprint
    from kvchat.engine.kvdirect.interface import ConversationCache
    from kvchat.engine.kvdirect.planner import Plan

TOKEN_ID_BYTES = 8


# What the accounting reads of a chat session and its model. The session
# (kvchat.engine.chat.session) calls in here, so it is described rather than imported.
class AccountedModel(Protocol):
    @property
    def footprint(self) -> ModelFootprint: ...

    @property
    def weights_bytes(self) -> int: ...


class AccountedSession(Protocol):
    @property
    def loaded(self) -> AccountedModel: ...

    @property
    def cache(self) -> ConversationCache: ...

    @property
    def cache_settings(self) -> CacheSettings: ...

    @property
    def footprint(self) -> ModelFootprint: ...  # at the dtype the conversation's K/V are in

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def plan(self) -> Plan | None: ...

    @property
    def forms(self) -> list[str] | None: ...

    @property
    def state_peak_bytes(self) -> int: ...

    @property
    def compute_seconds(self) -> float: ...

    def disk_bytes(self) -> int: ...


def _checkpoint_label(session: AccountedSession) -> str | None:
    settings = session.cache_settings
    if settings.kind != "kvdirect":
        return None
    if settings.max_mem is None and settings.hot_window is None:
        return "none (no --max-mem: nothing is evicted)"
    return settings.checkpoint


def _forms_label(session: AccountedSession) -> str | None:
    forms = session.forms
    if not forms:
        return None
    kinds = sorted(set(forms))
    if len(kinds) == 1:
        return kinds[0]
    return ", ".join(f"{forms.count(k)} {k}" for k in kinds)


def snapshot(session: AccountedSession) -> MemorySnapshot:
    """Everything the CLI memory line, ``--json`` and the UI gauge show."""
    cache = session.cache
    n_tokens = cache.get_seq_length()
    settings = session.cache_settings
    token_bytes = len(session.token_ids) * TOKEN_ID_BYTES
    plan = session.plan
    held = cache.accounting()
    hot, ckpt = held.hot_bytes, held.checkpoint_bytes
    recompute, read_back = held.recompute_seconds, held.read_seconds
    compute = session.compute_seconds
    # State now: what is held plus the last forward call's scratch, all at the same moment
    # (the session-long scratch peak is reported beside it, not added to a later hot window).
    state = hot + ckpt + held.step_scratch_bytes + token_bytes
    peak = max(state, session.state_peak_bytes)
    return MemorySnapshot(
        cache=settings.kind,
        checkpoint=_checkpoint_label(session),
        tokens=n_tokens,
        hot_tokens=held.hot_tokens,
        checkpointed_tokens=max(0, n_tokens - held.hot_tokens),
        hot_window=held.hot_window,
        hot_kv_bytes=hot,
        checkpoint_bytes=ckpt,
        scratch_peak_bytes=held.scratch_peak_bytes,
        token_id_bytes=token_bytes,
        state_bytes=state,
        state_peak_bytes=peak,
        standard_equivalent_bytes=session.footprint.standard_cache_bytes(n_tokens),
        kv_dtype=session.footprint.kv_dtype,
        ceiling_bytes=settings.max_mem,
        disk_bytes=session.disk_bytes(),
        disk_tier=bool(plan is not None and plan.disk_tier),
        plan=held.plan,
        forms=_forms_label(session),
        streamed_attention=bool(plan is not None and plan.stream_chunk is not None),
        weights_bytes=session.loaded.weights_bytes,
        rss_bytes=process_rss(),
        recompute_seconds=round(recompute, 4),
        compute_seconds=round(compute, 4),
        recompute_share=round(recompute / compute, 4) if compute > 0 else 0.0,
        read_back_seconds=round(read_back, 4),
        read_back_share=round(read_back / compute, 4) if compute > 0 else 0.0,
    )


def format_memory_line(mem: MemorySnapshot) -> str:
    """The one-line summary printed after each reply."""
    from kvchat.units import human_bytes

    ceiling = mem.ceiling_bytes
    state = human_bytes(mem.state_bytes)
    if ceiling:
        state += f" / {human_bytes(ceiling)} ceiling"
    standard = mem.standard_equivalent_bytes
    ratio = f" ({mem.state_bytes / standard:.2f}x)" if standard else ""
    tokens = f"{mem.tokens} token{'' if mem.tokens == 1 else 's'}"
    held = f", K/V in {mem.kv_dtype}" if mem.kv_dtype else ""
    return (
        f"[mem] state {state} vs standard cache {human_bytes(standard)}{ratio}{held} | "
        f"{tokens}: {mem.hot_tokens} hot, {mem.checkpointed_tokens} "
        f"checkpointed{_disk_note(mem)} | recompute {100 * mem.recompute_share:.0f}%, "
        f"read back {100 * mem.read_back_share:.0f}% of time | "
        f"weights {human_bytes(mem.weights_bytes)}, RSS {human_bytes(mem.rss_bytes)}"
    )


def _disk_note(mem: MemorySnapshot) -> str:
    if not mem.disk_bytes:
        return ""
    from kvchat.units import human_bytes

    if mem.disk_tier:
        forms = f" ({mem.forms})" if mem.forms else ""
        return f" | disk tier{forms}: {human_bytes(mem.disk_bytes)} on disk"
    return f" | on disk: {human_bytes(mem.disk_bytes)}"
