"""An edited or regenerated last message, sent by the official `openai` client to a real
`kvchat serve`: the server branches the saved conversation at the turn the history ends,
feeds only the new message, reports the reused tokens in OpenAI's own field, and gives the
tokens `kvchat run` gives for that history typed from the start, across a restart too."""

from __future__ import annotations

import json

import pytest

from kvchat.storage import ConversationStore, ForkOrigin
from tests.serve.server_process import ServerProcess
from tests.serve.test_restart import MAX_TOKENS, turn

pytestmark = pytest.mark.slow
FIRST, SECOND, EDITED = "What is a cat?", "And a dog?", "And a horse?"


def run_tokens(data_dir, *prompts: str) -> list[int]:
    import subprocess
    import sys

    args = [sys.executable, "-m", "kvchat.cli", "run", "--json", "--no-save"]
    args += ["--max-new-tokens", str(MAX_TOKENS), "--data-dir", str(data_dir)]
    for prompt in prompts:
        args += ["--prompt", prompt]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.splitlines()[-1])["tokens"]


def test_an_edited_last_message_branches_from_the_saved_turn_before_it(tmp_path):
    data = tmp_path / "data"
    server = ServerProcess(data).start()
    try:
        messages = [{"role": "user", "content": FIRST}]
        original, first = turn(server, messages)
        assert first.usage.prompt_tokens_details.cached_tokens == 0  # nothing saved to reuse
        messages.append({"role": "assistant", "content": first.choices[0].message.content})
        history = list(messages)
        same, second = turn(server, [*history, {"role": "user", "content": SECOND}])
        assert same == original
        assert second.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        assert server.stop() in (0, -15)

    store = ConversationStore(data)
    after_turn_1 = store.summary(original)
    with store.open(original) as conv:
        shared = conv.manifest.turns[0].extra["n_cached"]  # the state saved after turn 1
        assert len(conv.manifest.turns) == 2
    assert after_turn_1.turns == 2

    server = ServerProcess(data).start()  # a restart in between changes nothing
    try:
        edited = [*history, {"role": "user", "content": EDITED}]
        branch, reply = turn(server, edited)
        stream = server.client().chat.completions.create(
            model="smollm2-135m",
            messages=[*history, {"role": "user", "content": SECOND}],  # regenerate turn 2
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    finally:
        server.stop()

    assert branch != original
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert cached == shared > 0  # exactly the shared turn's tokens were reused
    assert reply.kvchat["prefilled_tokens"] == reply.usage.prompt_tokens - cached
    assert reply.kvchat["tokens"] == run_tokens(tmp_path / "fresh", FIRST, EDITED)
    assert store.summary(branch).forked_from == ForkOrigin(original, 1)
    with store.open(original) as conv:  # the original keeps both of its turns
        assert [m["content"] for m in conv.manifest.messages][2] == SECOND

    regenerated = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert regenerated[0].kvchat["tokens"] == second.kvchat["tokens"]  # greedy: the same reply
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == shared
