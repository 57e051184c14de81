"""What a session does with input it cannot answer well: a conversation past the model's
positions is refused before any forward call; a base model gets plain completion."""

from __future__ import annotations

import copy
import dataclasses
import time

import pytest

import kvchat.engine.chat.generate as generate_module
from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import SamplingSettings
from kvchat.errors import ContextTooLongError

pytestmark = pytest.mark.slow

GREEDY = SamplingSettings(max_new_tokens=8)


def rows_of_forward_calls(monkeypatch) -> list[int]:
    """A list that gets the rows of every forward call the engine makes from now on."""
    rows: list[int] = []
    original = generate_module.forward_ids

    def counting(model, cache, input_ids, *args, **kwargs):
        rows.append(input_ids.shape[1])
        return original(model, cache, input_ids, *args, **kwargs)

    monkeypatch.setattr(generate_module, "forward_ids", counting)
    return rows


def test_a_conversation_past_the_context_length_is_refused_before_the_model_runs(
    smollm2_loaded,
):
    session = ChatSession(smollm2_loaded)
    calls = []
    hook = smollm2_loaded.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        started = time.monotonic()
        with pytest.raises(ContextTooLongError) as exc:
            session.send("the sea " * 9000, GREEDY)
        assert time.monotonic() - started < 10
    finally:
        hook.remove()
    message = str(exc.value)
    assert "8,192" in message and "tokens" in message and "\n" not in message
    assert calls == [] and session.messages == [] and session.cache.get_seq_length() == 0
    # The session is still usable for a prompt that fits.
    assert session.send("What is the capital of France?", GREEDY).tokens
    session.close()


def test_a_base_model_continues_the_prompt_as_written(smollm2_loaded):
    tokenizer = copy.deepcopy(smollm2_loaded.tokenizer)
    tokenizer.chat_template = None  # as a base model's tokenizer has none
    base = dataclasses.replace(smollm2_loaded, tokenizer=tokenizer)
    assert not base.has_chat_template
    session = ChatSession(base)
    prompt = "The capital of France is"
    result = session.send(prompt, GREEDY)
    assert result.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False).input_ids)
    assert "Assistant" not in result.reply and "User" not in result.reply
    second = session.send("The capital of Italy is", GREEDY)
    assert "Assistant" not in second.reply
    session.close()


@pytest.mark.parametrize(
    ("prompt", "reply_tokens"),
    [
        ("Note 1: the lantern.", 6),  # the reply starts on a new line
        ("List three rivers:", 10),  # ... after a blank line
        ("Once upon a time", 1),  # ... with a comma, no space before it
    ],
)
def test_a_base_models_next_turn_reads_only_the_new_text(
    smollm2_loaded, prompt, reply_tokens, monkeypatch
):
    """A base model's reply is kept as it was generated, so the next turn continues the text
    the model read and wrote: only the new message is fed, never the whole history again
    (a stripped reply made the conversation's text differ from the cache's, and every
    such turn re-read everything)."""
    tokenizer = copy.deepcopy(smollm2_loaded.tokenizer)
    tokenizer.chat_template = None
    base = dataclasses.replace(smollm2_loaded, tokenizer=tokenizer)
    session = ChatSession(base)
    first = session.send(prompt, SamplingSettings(max_new_tokens=reply_tokens))
    generated = tokenizer.decode(first.tokens, skip_special_tokens=True)
    assert first.reply == generated
    assert session.messages[-1] == {"role": "assistant", "content": generated}
    history = session.cache.get_seq_length() + 1  # the reply's last token is fed next turn
    rows = rows_of_forward_calls(monkeypatch)
    second = session.send("And then", SamplingSettings(max_new_tokens=2))
    session.close()
    # What the model read this turn, counted at the forward calls: the new line's tokens and
    # the reply's last token, not the history again.
    new_text = len(tokenizer("\nAnd then", add_special_tokens=False).input_ids)
    assert rows[0] <= new_text + 1 < history, (rows, history)
    assert not second.fell_back_to_full_prefill


def test_a_template_that_trims_replies_still_reads_only_the_new_text(smollm2_loaded, monkeypatch):
    """Gemma 3's template trims every message; a reply that ended on a new line then
    rendered otherwise than the text the cache held, and the next turn read the whole
    conversation again. Here SmolLM2's template is made to trim the same way."""
    tokenizer = copy.deepcopy(smollm2_loaded.tokenizer)
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "message['content']", "(message['content'] | trim)"
    )
    trimming = dataclasses.replace(smollm2_loaded, tokenizer=tokenizer)
    session = ChatSession(trimming)
    first = session.send("Write a haiku about the sea.", SamplingSettings(max_new_tokens=11))
    assert first.reply.endswith("\n")  # what the template trims
    history = session.cache.get_seq_length() + 1
    rows = rows_of_forward_calls(monkeypatch)
    second = session.send("Another one?", SamplingSettings(max_new_tokens=2))
    session.close()
    assert not second.fell_back_to_full_prefill
    assert rows[0] < 20 < history, (rows, history)  # the new message, not the history
