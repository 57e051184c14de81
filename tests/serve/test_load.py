"""Bounded load: 50 sequential turns of one conversation, then 8 concurrent new ones.

No crash, no lost or corrupted turn (checked in the store after shutdown), and the
server's RSS grows by at most RSS_ALLOWANCE from after the first turns to the end. The
allowance covers the 50-turn conversation's own state (~1,100 tokens x 22.5 KiB of K/V
for SmolLM2) plus allocator slack; a leak of a session per request would pass it.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvchat.commands.export import export_text
from kvchat.storage import ConversationStore
from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.slow
SEQUENTIAL, CONCURRENT, WARM_UP = 50, 8, 5
RSS_ALLOWANCE = 150 * 1024 * 1024  # documented in README.md ("Serving an OpenAI-compatible API")


def test_sequential_and_concurrent_requests(tmp_path):
    server = ServerProcess(tmp_path / "data").start()
    try:
        client = server.client(max_retries=0, timeout=120)
        messages: list[dict[str, str]] = []
        conversation = None
        rss_after_warm_up = 0
        for i in range(SEQUENTIAL):
            messages.append({"role": "user", "content": f"Turn {i}: say one word."})
            raw = client.chat.completions.with_raw_response.create(
                model="smollm2-135m", messages=messages, max_tokens=2
            )
            reply = raw.parse()
            assert conversation in (None, raw.headers["x-kvchat-conversation"])
            conversation = raw.headers["x-kvchat-conversation"]
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            if i + 1 == WARM_UP:
                rss_after_warm_up = server.rss_bytes()
        last_total = reply.usage.total_tokens

        def new_conversation(i: int) -> tuple[str, str, str]:
            prompt = f"Concurrent request {i}: name a fruit."
            raw = server.client(max_retries=0, timeout=300).chat.completions.with_raw_response
            response = raw.create(
                model="smollm2-135m",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=4,
            )
            return response.headers["x-kvchat-conversation"], prompt, response.parse()

        with ThreadPoolExecutor(CONCURRENT) as pool:
            results = list(pool.map(new_conversation, range(CONCURRENT)))
        growth = server.rss_bytes() - rss_after_warm_up
        assert server.request("GET", "/health")[0] == 200
    finally:
        assert server.stop() in (0, -15)

    print(f"RSS growth after warm-up: {growth / 2**20:.1f} MiB")
    assert growth <= RSS_ALLOWANCE, f"RSS grew {growth / 2**20:.0f} MiB"
    store = ConversationStore(server.data_dir)
    rows = {row.id: row for row in store.list()}
    assert len(rows) == 1 + CONCURRENT and not any(row.error for row in rows.values())
    assert rows[conversation].turns == SEQUENTIAL
    assert rows[conversation].tokens == last_total
    saved = json.loads(export_text(store, conversation, "json"))["messages"]
    assert saved == messages
    assert len({cid for cid, _, _ in results}) == CONCURRENT
    for cid, prompt, reply in results:
        saved = json.loads(export_text(store, cid, "json"))["messages"]
        assert saved == [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": reply.choices[0].message.content},
        ]
        assert rows[cid].turns == 1
