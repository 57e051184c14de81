"""The tokenizer of a GGUF's directory: the generic fast class, the same behaviour as the
model's own class, and a fraction of its memory (measured with psutil in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.engine.models.load import load_tokenizer
from kvchat.engine.models.resolve import resolve_model
from kvchat.lab.texts import STORY

pytestmark = pytest.mark.slow

TEXTS = [
    STORY,
    "  leading   spaces\n\n\ttabs and trailing  ",
    "emoji 🤖🎉, café, naïve, 日本語, हिन्दी",
    "<start_of_turn>user\nhi<end_of_turn>\n<bos><eos><|im_start|>",
    "def f(x):\n    return x**2  # a comment\n",
    "a" * 300,
]
CHAT = [
    {"role": "user", "content": "Which shelf holds note 7?"},
    {"role": "assistant", "content": "Shelf 7, beside the kettle."},
    {"role": "user", "content": "And note 12? 🤔"},
]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma-3-270m"])
def model_dir(request) -> Path:
    return resolve_model(request.param).path


def test_a_gguf_directorys_tokenizer_encodes_decodes_and_renders_as_the_models_own(model_dir):
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(model_dir)
    lean = load_tokenizer(model_dir, from_gguf=True)
    for text in TEXTS:
        ids = own(text).input_ids
        assert lean(text).input_ids == ids, text[:40]
        assert (
            lean(text, add_special_tokens=False).input_ids
            == own(text, add_special_tokens=False).input_ids
        )
        assert lean.decode(ids) == own.decode(ids)
        assert lean.decode(ids, skip_special_tokens=True) == own.decode(
            ids, skip_special_tokens=True
        )
    every_97th = range(0, len(own), 97)
    assert [lean.decode([i]) for i in every_97th] == [own.decode([i]) for i in every_97th]
    assert len(lean) == len(own)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "all_special_ids"):
        assert getattr(lean, name) == getattr(own, name), name
    assert lean.chat_template == own.chat_template
    if own.chat_template:
        rendered = own.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        assert lean.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == (
            rendered
        )


MEASURE = """
import gc, json, sys
from transformers import AutoTokenizer
from kvchat.engine.models.heap import return_freed_memory
from kvchat.engine.models.load import load_tokenizer
from kvchat.units import process_rss

def held():
    gc.collect()
    return_freed_memory()
    return process_rss()

start = held()
lean = load_tokenizer(sys.argv[1], from_gguf=True)
after_lean = held()
own = AutoTokenizer.from_pretrained(sys.argv[1])
after_own = held()
print(json.dumps({"lean": after_lean - start, "own": after_own - after_lean}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS via glibc malloc_trim")
def test_gemma_3s_tokenizer_holds_at_least_100_mb_less_than_its_own_class():
    model_dir = resolve_model("gemma-3-270m").path
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    growth = json.loads(out.stdout.strip().splitlines()[-1])
    assert growth["lean"] + 100 * 2**20 <= growth["own"], growth
