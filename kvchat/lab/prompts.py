"""Short task prompts for the verify experiments, and how they become token ids.

The Markov experiment (``markov.py``) patches the residual stream of one prompt into the run
of another, so the prompts come from unrelated tasks (arithmetic, translation, a story), as in
the paper. Real models tokenize them with their own tokenizer; the tiny random models of
``tiny_models.py`` have a 256-token vocabulary, so for them a prompt's UTF-8 bytes are its
token ids.
"""

from __future__ import annotations

from typing import Any

TASKS: dict[str, str] = {
    "arithmetic": (
        "Compute step by step. 17 plus 25 is 42. 42 times 3 is 126. 126 minus 48 is 78. "
        "78 divided by 6 is 13. 13 squared is 169. Now 169 plus 231 is"
    ),
    "translation": (
        "Translate from English to French. English: The cat is sleeping on the warm kitchen "
        "floor. French: Le chat dort sur le sol chaud de la cuisine. English: We will take the "
        "early train to Lyon tomorrow. French:"
    ),
    "story": (
        "Once upon a time, in a small village at the edge of a dark forest, there lived an old "
        "clockmaker who could hear the heartbeat of every clock in town. One winter night, "
        "all of them stopped at once, and"
    ),
}

# A longer text for the identity experiment: several calls' worth of prompt tokens.
PASSAGE = " ".join(TASKS.values()) + (
    " The next morning the clockmaker opened his shop, wound the great clock on the square, "
    "and listened. Somewhere beneath the floorboards a faint ticking answered him, slower than "
    "any clock he had ever built, patient as a river that had been waiting for a long time."
)

# A real question for a chat model (SmolLM2-Instruct, through its chat template).
CHAT_QUESTION = "Why is the sky blue? Explain it to a curious ten-year-old in a few sentences."

# Plain completion for a base model (Gemma 3 270M has no chat template).
COMPLETION = "The history of the printing press begins in the fifteenth century, when"


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as the model would see it as a plain prompt (with BOS if any)."""
    return list(tokenizer(text)["input_ids"])


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    """Token ids of a one-message chat, with the generation prompt appended."""
    from kvchat.engine.chat import prompt

    messages = [{"role": "user", "content": question}]
    return [int(i) for i in prompt.tokenize(tokenizer, prompt.render(tokenizer, True, messages))]


def byte_ids(text: str) -> list[int]:
    """Token ids for a tiny model with a 256-token vocabulary: the text's UTF-8 bytes."""
    return list(text.encode("utf-8"))


def task_ids(tokenizer: Any | None) -> dict[str, list[int]]:
    """Every task prompt as token ids (bytes when ``tokenizer`` is None)."""
    if tokenizer is None:
        return {name: byte_ids(text) for name, text in TASKS.items()}
    return {name: text_ids(tokenizer, text) for name, text in TASKS.items()}


def passage_ids(tokenizer: Any | None, length: int) -> list[int]:
    """The first ``length`` tokens of ``PASSAGE`` (repeated if it is too short)."""
    ids = byte_ids(PASSAGE) if tokenizer is None else text_ids(tokenizer, PASSAGE)
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def seeded_ids(loaded: Any, n_tokens: int, seed: int = 0) -> list[int]:
    """Exactly ``n_tokens`` token ids drawn at random (seeded), no special tokens.

    Random ids keep the length exact and the content identical from run to run; a speed
    measurement does not need the model to make sense of them.
    """
    import torch

    tok = loaded.tokenizer
    vocab = min(int(loaded.model.config.vocab_size), len(tok))
    special = set(tok.all_special_ids)
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    while len(ids) < n_tokens:
        drawn = torch.randint(0, vocab, (n_tokens,), generator=gen).tolist()
        ids += [t for t in drawn if t not in special]
    return ids[:n_tokens]
