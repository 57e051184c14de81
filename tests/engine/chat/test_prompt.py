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
