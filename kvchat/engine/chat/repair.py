"""Rebuilding a conversation's damaged segments from its saved token ids.

A segment that fails its checksum is not lost: the manifest still holds every token id,
and each turn's record holds the sizes of the forward calls that turn made. Feeding the
same ids in the same calls, from the same start, under the same settings gives the same
bits (a row fed in another chunk would not: the matmuls block differently), so the state
is rebuilt exactly, turn by turn, and each damaged turn's segment is written again.

The proof is in the files: every *undamaged* segment is rebuilt too and must hold exactly
the saved one's tensors, bit for bit (``segments.content_digest``). If one does not, the
rebuild is not exact (the conversation was continued under other settings, or by another
engine), and nothing is changed.

Only the turns from the last rebase on make up the state (see persist.restore); earlier
segments are never read again, so they are left alone. The rebuild holds staged copies of
those turns' segments until it ends (disk: up to the conversation's size again) and keeps
the resident state under the conversation's own ceiling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.errors import KvchatError, StorageError

if TYPE_CHECKING:
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.models.loaded import LoadedModel
    from kvchat.storage import Conversation, SegmentInfo, Turn


class RepairError(KvchatError):
    """The conversation cannot be rebuilt exactly; nothing was changed."""


@dataclasses.dataclass(frozen=True)
class RepairOutcome:
    rebuilt: tuple[int, ...]  # turns whose damaged segment was written again
    verified: tuple[int, ...]  # undamaged turns rebuilt byte for byte equal to their file


def damaged_turns(conversation: Conversation) -> list[int]:
    """The turns of the state (from the last rebase on) whose segment fails its checks."""
    from kvchat.engine.chat.persist import turns_from_last_rebase

    out = []
    for turn in turns_from_last_rebase(conversation):
        try:
            conversation.tensor_layout(turn.index)
        except StorageError:
            out.append(turn.index)
    return out


def repair(
    loaded: LoadedModel,
    conversation: Conversation,
    *,
    spill_root: Path | None = None,
    on_turn: Callable[[int, int], None] | None = None,
) -> RepairOutcome:
    """Rebuild ``conversation``'s damaged segments (an open, locked store entry).

    ``on_turn(done, total)`` after each turn is replayed. Raises RepairError (nothing
    changed) when the turns do not say how they were fed, or the rebuild is not exact.
    """
    from kvchat.engine.chat.persist import turns_from_last_rebase

    damaged = set(damaged_turns(conversation))
    if not damaged:
        return RepairOutcome((), ())
    turns = turns_from_last_rebase(conversation)
    manifest = conversation.manifest
    ids = manifest.token_ids[int(manifest.engine_state.get("ids_from", 0)) :]
    calls = _calls_per_turn(conversation.id, turns, len(ids))
    staged: dict[int, SegmentInfo] = {}
    try:
        verified = _replay(
            loaded, conversation, ids, turns, calls, damaged, staged, spill_root, on_turn
        )
        conversation.replace_segments({i: staged[i] for i in sorted(damaged)})
    finally:
        for index in staged:  # the damaged ones are in place by now, unless this failed
            _unlink(conversation.staging_path(index))
    return RepairOutcome(tuple(sorted(damaged)), tuple(verified))


def _calls_per_turn(cid: str, turns: list[Turn], held: int) -> list[list[int]]:
    """Each turn's forward-call sizes, checked against the positions it added and the
    ``held`` token ids the state is made of."""
    from kvchat.engine.chat.persist import decode_calls

    out, before = [], 0
    for turn in turns:
        if "calls" not in turn.extra:
            raise RepairError(
                f"turn {turn.index} of conversation {cid} was saved by an older kvchat that "
                "did not record how it was fed, so it cannot be rebuilt exactly; "
                f"`kvchat export {cid}` saves its text"
            )
        n_cached = turn.extra.get("n_cached")
        rows = n_cached - before if type(n_cached) is int else -1
        try:
            if rows < 0:
                raise ValueError("its cached position count is missing or goes backwards")
            out.append(decode_calls(turn.extra["calls"], rows))
        except ValueError as exc:
            raise RepairError(
                f"turn {turn.index} of conversation {cid} cannot be replayed ({exc}); "
                f"`kvchat export {cid}` saves its text"
            ) from None
        before = n_cached
    if before > held:
        raise RepairError(
            f"conversation {cid} holds {held} token ids but its turns fed {before}, so it "
            f"cannot be replayed; `kvchat export {cid}` saves its text"
        )
    return out


def _replay(
    loaded: LoadedModel,
    conversation: Conversation,
    ids: list[int],
    turns: list[Turn],
    calls: list[list[int]],
    damaged: set[int],
    staged: dict[int, SegmentInfo],
    spill_root: Path | None,
    on_turn: Callable[[int, int], None] | None,
) -> list[int]:
    """Feed every turn as it was fed, writing each turn's segment to its staging path;
    returns the undamaged turns that came out equal to their saved file."""
    from kvchat.engine.chat.generate import forward
    from kvchat.engine.kvdirect.interface import SavedSegment
    from kvchat.engine.models.quantize import inference_context
    from kvchat.storage import segments

    cid = conversation.id
    session = _replay_session(loaded, conversation, spill_root)
    verified = []
    try:
        position = 0
        with inference_context(loaded.model):
            for done, (turn, sizes) in enumerate(zip(turns, calls), start=1):
                since = position
                for rows in sizes:
                    chunk = ids[position : position + rows]
                    forward(loaded.model, session.cache, chunk, loaded.device)
                    position += rows
                path = conversation.staging_path(turn.index)
                staged[turn.index] = segments.write_segment_stream(path, session.cache.state(since))
                if turn.index not in damaged:
                    saved = conversation.segment_path(turn.index)
                    if segments.content_digest(path) != segments.content_digest(saved, cid):
                        raise RepairError(
                            f"turn {turn.index} of conversation {cid} rebuilds differently "
                            "from its saved copy (it was continued under other settings), so "
                            f"the rebuild would not be exact; nothing was changed — `kvchat "
                            f"export {cid}` saves its text"
                        )
                    verified.append(turn.index)
                written = SavedSegment(path, lambda p=path: segments.tensor_layout(p), dict)
                session.cache.bind_saved(written, since)
                if on_turn is not None:
                    on_turn(done, len(turns))
    finally:
        session.close()
    return verified


def _replay_session(
    loaded: LoadedModel, conversation: Conversation, spill_root: Path | None
) -> ChatSession:
    """A session fed nothing yet, with the conversation's saved settings and forms."""
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.chat.settings import CacheSettings

    state = conversation.manifest.engine_state
    try:
        settings = CacheSettings(**state.get("cache", {}))
        forms = state.get("forms")
        if forms is not None and (
            not isinstance(forms, list) or len(forms) != loaded.footprint.num_layers
        ):
            raise TypeError("forms")
    except TypeError:
        raise RepairError(
            f"conversation {conversation.id} does not record the settings it was saved "
            f"with, so it cannot be rebuilt exactly; `kvchat export {conversation.id}` saves "
            "its text"
        ) from None
    return ChatSession(
        loaded, system=state.get("system"), cache=settings, spill_root=spill_root, forms=forms
    )


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
