"""EngineBackend: the store listing and, with the real default model, a whole conversation."""

from __future__ import annotations

import pytest

from kvchat.errors import KvchatError
from kvchat.ui.app import KvchatApp
from kvchat.ui.backend import LaunchOptions
from kvchat.ui.engine_backend import EngineBackend
from tests.ui.helpers import wait_until

MEMORY_KEYS = {
    "cache", "checkpoint", "tokens", "hot_tokens", "checkpointed_tokens", "hot_window",
    "hot_kv_bytes", "checkpoint_bytes", "scratch_peak_bytes", "token_id_bytes", "state_bytes",
    "standard_equivalent_bytes", "ceiling_bytes", "disk_bytes", "weights_bytes", "rss_bytes",
    "recompute_seconds", "compute_seconds", "recompute_share",
}  # fmt: skip


def cli_opts(**over):
    opts = {
        "model": None,
        "device": "cpu",
        "dtype": "float32",
        "weights": "none",
        "cache_kind": "kvdirect",
        "max_mem": None,
        "hot_window": None,
        "checkpoint": "residual",
        "prefill_chunk": 256,
        "system": None,
    }
    opts.update(over)
    return opts


def test_launch_options_from_the_cli():
    launch = LaunchOptions.from_cli(cli_opts(max_mem=64 * 10**6, system="Be brief."))
    assert launch == LaunchOptions("smollm2-135m", "kvdirect", 64 * 10**6, "Be brief.")


def test_lists_the_store(tmp_path, monkeypatch):
    import torch

    from kvchat.storage import ConversationStore

    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path))
    store = ConversationStore(tmp_path)
    with store.create(
        model_name="smollm2-135m", fingerprint="f" * 16, dtype="float32", settings={}
    ) as c:
        c.append_turn(
            messages=[
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"},
            ],
            token_ids=[1, 2, 3],
            tensors={"residual": torch.zeros(3, 4)},
        )
    backend = EngineBackend(cli_opts())
    rows = backend.list_conversations()
    assert len(rows) == 1
    row = rows[0]
    assert (row["title"], row["model"], row["turns"], row["tokens"], row["error"]) == (
        "Hi there", "smollm2-135m", 1, 3, None,
    )  # fmt: skip
    assert row["bytes_on_disk"] > 0 and row["last_used"][:2] == "20"
    with pytest.raises(KvchatError, match="not loaded yet"):
        backend.open_conversation(row["id"])


def test_calls_before_loading_are_one_line_errors():
    backend = EngineBackend(cli_opts())
    with pytest.raises(KvchatError, match="not loaded yet"):
        backend.memory()


@pytest.mark.slow
@pytest.mark.anyio
async def test_real_model_answers_in_the_app(smollm2_dir, tmp_path):
    """End to end with SmolLM2-135M-Instruct: load in the background, ask, stream, gauge,
    then a second app resumes the saved conversation from its files and shows its history."""
    opts = cli_opts(model=str(smollm2_dir), max_mem=64 * 10**6, data_dir=str(tmp_path))
    app = KvchatApp(EngineBackend(opts))
    async with app.run_test(size=(100, 30)) as pilot:
        assert app.phase == "loading"  # the window is up before the model
        await wait_until(pilot, lambda: app.phase != "loading", timeout=180)
        assert app.phase == "ready", app.load_error
        app.settings.sampling.max_new_tokens = 24
        app.prompt.load_text("What is the capital of France?")
        await pilot.press("enter")
        await wait_until(pilot, lambda: not app.busy and app.turn_memory, timeout=180)
        await pilot.pause()
        reply = app.chat_log.messages()[-1]
        assert reply.role == "assistant"
        assert "Paris" in reply.text
        memory = app.turn_memory[-1]
        assert set(memory.to_dict()) >= MEMORY_KEYS
        assert memory.tokens > 10
        assert memory.state_bytes > 0 and memory.standard_equivalent_bytes > 0
        assert memory.ceiling_bytes == 64 * 10**6
        assert app.gauge.memory.tokens == memory.tokens
        assert app.gauge.weights and app.gauge.weights > 100 * 2**20

    backend = app.backend
    conv_id = backend.list_conversations()[0]["id"]
    backend.close()  # releases the conversation's lock, as quitting the app does
    second = KvchatApp(EngineBackend(opts))
    async with second.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: second.phase != "loading", timeout=180)
        second.action_resume(conv_id)
        await wait_until(pilot, lambda: len(second.chat_log.messages()) >= 3, timeout=60)
        texts = [m.text for m in second.chat_log.messages()]
        assert any("capital of France" in t for t in texts)
        assert any("Paris" in t for t in texts)
        assert second.turn_memory and second.turn_memory[-1].tokens > 10


@pytest.mark.slow
def test_a_conversation_that_cannot_be_opened_leaves_a_usable_session(smollm2_dir, tmp_path):
    """A conversation that cannot be opened (here: no such id) fails with one line; the
    backend keeps a working session instead of the one it closed to open it."""
    from kvchat.engine.chat.settings import SamplingSettings

    backend = EngineBackend(cli_opts(model=str(smollm2_dir), data_dir=str(tmp_path)))
    backend.load(lambda _m: None)
    backend.send("Hi!", SamplingSettings(max_new_tokens=3), on_text=None, should_stop=None)
    conv_id = backend.list_conversations()[0]["id"]
    backend.new_conversation(None)
    with pytest.raises(KvchatError, match="no conversation"):
        backend.open_conversation("zzzz-not-there")
    turn = backend.send(
        "Hello?", SamplingSettings(max_new_tokens=3), on_text=None, should_stop=None
    )
    assert turn.tokens > 0 and backend.memory().tokens > 0
    assert backend.open_conversation(conv_id).messages
    backend.close()
