"""ConversationMatcher on real store files (no model): which conversation a request's
history continues, and from which turn it branches."""

from __future__ import annotations

import torch

from kvchat.serve.matcher import ConversationMatcher, Match
from kvchat.storage import ConversationStore

FP = "sha256:" + "ab" * 32


def conversation(store: ConversationStore, system: str | None, turns: list[tuple[str, str]]):
    conv = store.create(
        model_name="m", fingerprint=FP, dtype="float32", settings={"system": system}
    )
    for asked, answered in turns:
        conv.append_turn(
            messages=[
                {"role": "user", "content": asked},
                {"role": "assistant", "content": answered},
            ],
            token_ids=[1, 2],
            tensors={"h": torch.zeros(2)},
        )
    conv.close()
    return conv.id


def history(*turns: tuple[str, str]) -> list[dict[str, str]]:
    out = []
    for asked, answered in turns:
        out += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    return out


def test_the_whole_history_continues_and_a_shorter_one_branches(tmp_path):
    store = ConversationStore(tmp_path)
    cid = conversation(store, None, [("a", "A"), ("b", "B"), ("c", "C")])
    matcher = ConversationMatcher(store, "m")
    assert matcher.find(None, history(("a", "A"), ("b", "B"), ("c", "C"))) == Match(cid, 3, 3)
    assert matcher.find(None, history(("a", "A"), ("b", "B"))) == Match(cid, 2, 3)
    assert matcher.find(None, history(("a", "A"))) == Match(cid, 1, 3)
    assert not matcher.find(None, history(("a", "A"))).continues


def test_a_history_that_differs_inside_a_turn_or_in_the_system_matches_nothing(tmp_path):
    store = ConversationStore(tmp_path)
    conversation(store, "be brief", [("a", "A"), ("b", "B")])
    matcher = ConversationMatcher(store, "m")
    assert matcher.find("be brief", history(("a", "edited"))) is None
    assert matcher.find("be long", history(("a", "A"))) is None
    assert matcher.find("be brief", history(("a", "A"))[:1]) is None  # half a turn
    assert ConversationMatcher(store, "other model").find("be brief", history(("a", "A"))) is None
    assert matcher.find("be brief", []) is None


def test_a_conversation_that_continues_is_preferred_to_one_to_branch(tmp_path):
    store = ConversationStore(tmp_path)
    short = conversation(store, None, [("a", "A")])
    conversation(store, None, [("a", "A"), ("b", "B")])  # more recent, but would need a fork
    assert ConversationMatcher(store, "m").find(None, history(("a", "A"))) == Match(short, 1, 1)


def test_message_counts_follow_each_turn_and_a_fork(tmp_path):
    store = ConversationStore(tmp_path)
    cid = conversation(store, None, [("a", "A"), ("b", "B"), ("c", "C")])
    assert store.message_counts(cid) == [2, 4, 6]
    assert store.message_counts(store.fork(cid, turn=2)) == [2, 4]
