"""One rendering, one stop list and one context check for the session, the server and the
lab (engine/chat/prompt.py)."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest

from kvchat.engine.chat import prompt
from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings, EngineOptions, SamplingSettings
from kvchat.engine.models.settings import ModelSettings
from kvchat.errors import ContextTooLongError


def test_the_reply_gets_the_positions_left_and_a_full_context_is_refused():
    assert prompt.fit_reply(None, 10**6, 256, "m") == 256
    assert prompt.fit_reply(1000, 900, 256, "m") == 100
    assert prompt.fit_reply(1000, 100, 256, "m") == 256
    with pytest.raises(ContextTooLongError) as exc:
        prompt.fit_reply(1000, 1000, 256, "tiny")
    assert "1,000" in str(exc.value) and "tiny" in str(exc.value)


def test_the_context_length_of_a_multimodal_config_is_its_text_models():
    assert prompt.context_length(SimpleNamespace(max_position_embeddings=8192)) == 8192
    nested = SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=131072))
    assert prompt.context_length(nested) == 131072
    assert prompt.context_length(SimpleNamespace()) is None


def test_options_left_out_take_the_one_set_of_defaults():
    options = EngineOptions.from_cli({"model": None, "max_mem": 4096, "cache_kind": "standard"})
    assert options.model == ModelSettings()
    assert options.cache == CacheSettings(kind="standard", max_mem=4096)
    assert EngineOptions.from_cli({}) == EngineOptions()
    assert ModelSettings().weights == "auto" and CacheSettings().checkpoint == "auto"
    # --kv-dtype reaches run, the app and serve through the same options object.
    assert EngineOptions.from_cli({"kv_dtype": "bfloat16"}).cache.kv_dtype == "bfloat16"
    assert CacheSettings().kv_dtype == "auto"


@pytest.mark.slow
@pytest.mark.parametrize("chat", [True, False], ids=["chat model", "base model"])
def test_the_server_counts_a_prompt_as_the_session_feeds_it(smollm2_loaded, tmp_path, chat):
    """The server's context check counts the tokens the session then feeds (it counted a
    made-up "Role: text" layout for base models, which the session never feeds)."""
    from kvchat.serve.protocol import ChatRequest
    from kvchat.serve.worker import EngineWorker

    loaded = smollm2_loaded
    if not chat:
        tokenizer = copy.deepcopy(loaded.tokenizer)
        tokenizer.chat_template = None  # as a base model's tokenizer has none
        loaded = dataclasses.replace(loaded, tokenizer=tokenizer)
    system, history = (
        "Be brief.",
        [
            {"role": "user", "content": "Name a river in France."},
            {"role": "assistant", "content": "The Loire."},
        ],
    )
    session = ChatSession(loaded, system=system)
    session.seed_history(history)
    result = session.send("And one in Spain?", SamplingSettings(max_new_tokens=1))
    session.close()
    worker = EngineWorker(loaded, cache=CacheSettings(), data_dir=tmp_path)
    request = ChatRequest("m", system, history, "And one in Spain?")
    assert worker.count_prompt_tokens(request) == result.prompt_tokens


@pytest.fixture(scope="module")
def template_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def with_template(tokenizer, change: str):
    """A copy of SmolLM2's tokenizer whose template passes each message's content through
    the Jinja filter ``change`` (Gemma 3's template trims every message)."""
    changed = copy.deepcopy(tokenizer)
    assert "message['content']" in changed.chat_template
    changed.chat_template = changed.chat_template.replace(
        "message['content']", f"(message['content'] | {change})"
    )
    return changed


CHAT = [
    {"role": "user", "content": "Name a river."},
    {"role": "assistant", "content": "\nThe Loire.\n\n"},  # as generated: white space around
    {"role": "user", "content": "Another?"},
]


def test_a_template_that_trims_gets_each_reply_back_as_generated(template_tokenizer):
    """Rendered again with the next message, the conversation's text must start with the
    text the cache holds (the reply as the model wrote it), or the next turn reads the whole
    history again."""
    trimming = with_template(template_tokenizer, "trim")
    text = prompt.render(trimming, True, CHAT)
    assert "<|im_start|>assistant\n\nThe Loire.\n\n<|im_end|>" in text
    plain = prompt.render(template_tokenizer, True, CHAT)
    assert text == plain  # a template that keeps content as it is renders the same
    earlier = prompt.render(trimming, True, CHAT[:1])
    assert text.startswith(earlier + CHAT[1]["content"])
    # the template's own text is what it gives where nothing needs trimming
    tidy = [dict(m, content=m["content"].strip()) for m in CHAT]
    assert prompt.render(trimming, True, tidy) == trimming.apply_chat_template(
        tidy, tokenize=False, add_generation_prompt=True
    )


def test_a_template_that_changes_replies_otherwise_is_followed_as_it_is(template_tokenizer):
    shouting = with_template(template_tokenizer, "upper")
    text = prompt.render(shouting, True, CHAT)
    assert text == shouting.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert "THE LOIRE." in text
