"""A conversation's state on disk, orchestrated: which turn's segment a save writes, which
segments a resume reads, and the forward-call sizes a turn record keeps.

The cache saves and restores itself (``cache.state(since)``, ``cache.bind_saved(...)``,
``cache.restore(segments, ...)``; the formats are in ``kvchat.engine.kvdirect.saved_state``),
so nothing here asks which kind of cache it holds. The manifest (storage) holds messages,
token ids, the model fingerprint and dtype; ``engine_state`` holds the template text the
token ids stand for and the per-layer forms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvchat.engine.kvdirect.interface import SavedSegment

if TYPE_CHECKING:
    from kvchat.engine.kvdirect.interface import ConversationCache
    from kvchat.storage import Conversation, Turn


def encode_calls(calls: list[int]) -> list[list[int]]:
    """Forward-call sizes as runs ``[[rows, count], ...]`` (a reply's decode steps are one
    run of ones), for a turn's manifest record."""
    runs: list[list[int]] = []
    for rows in calls:
        if runs and runs[-1][0] == rows:
            runs[-1][1] += 1
        else:
            runs.append([rows, 1])
    return runs


def decode_calls(runs: Any, rows: int) -> list[int]:
    """The sizes :func:`encode_calls` wrote, which must add up to ``rows``; ValueError if
    ``runs`` is not such a list (checked before expanding: a hostile count stays a number)."""
    if not isinstance(runs, list) or not all(
        isinstance(run, list) and len(run) == 2 and all(type(x) is int and x > 0 for x in run)
        for run in runs
    ):
        raise ValueError("its forward calls are not a list of [rows, count] pairs")
    total = sum(size * count for size, count in runs)
    if total != rows:
        raise ValueError(f"its forward calls add up to {total} positions, not {rows}")
    return [size for size, count in runs for _ in range(count)]


def note_saved(
    cache: ConversationCache, conversation: Conversation, turn_index: int, since: int
) -> None:
    """After a save: the cache binds what it saved to the turn's segment, so the disk tier
    reads those rows from there (and never writes them again). A save whose binding failed
    leaves its rows in the spill files, which are then kept."""
    cache.bind_saved(saved_segment(conversation, turn_index), since)


def restore(
    cache: ConversationCache, conversation: Conversation, n_cached: int, device: torch.device
) -> None:
    """Rebuild ``cache`` (on ``device``) from the conversation's segments, in turn order:
    those from the last rebase turn on, each read only when the cache comes to it."""
    turns = turns_from_last_rebase(conversation)
    cache.restore((saved_segment(conversation, t.index) for t in turns), n_cached, device)


def saved_segment(conversation: Conversation, index: int) -> SavedSegment:
    return SavedSegment(
        conversation.segment_path(index),
        lambda: conversation.tensor_layout(index),
        lambda: conversation.read_turn_tensors(index),
    )


def turns_from_last_rebase(conversation: Conversation) -> list[Turn]:
    """The turns whose segments make up the state: from the last rebase turn on."""
    turns = conversation.manifest.turns
    rebased = [t.index for t in turns if t.extra.get("rebase")]
    return turns[rebased[-1] - 1 :] if rebased else turns
