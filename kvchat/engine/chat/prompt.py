"""What a model is fed for a conversation, where its reply stops, and whether it fits the
model's positions: one place for the session, the server and the lab.

A chat model gets its own chat template with the generation prompt. A base model (no
template) continues text: the prompt as written, no "User:/Assistant:" wrapper, which a
base model would imitate; each reply as generated; later turns continue the text on a new
line.
"""

from __future__ import annotations

from typing import Any

from kvchat.errors import ContextTooLongError

PLAIN_STOP_STRINGS = ("\nUser:", "\nuser:")
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>")


def render(tokenizer: Any, chat_template: bool, messages: list[dict[str, str]]) -> str:
    """The text a model reads for ``messages`` (the reply's place marked, for a chat)."""
    if chat_template:
        return _chat_text(tokenizer, messages)
    add_bos = getattr(tokenizer, "add_bos_token", False) and tokenizer.bos_token
    text = ""
    for m in messages:
        if m["role"] == "system":
            text += m["content"] + "\n\n"
        elif m["role"] == "user":
            text += ("\n" if text and not text.endswith("\n") else "") + m["content"]
        else:
            # A reply continues the text exactly as the model wrote it (its leading space or
            # new line included), so that the next turn's text extends what the cache holds.
            text += m["content"]
    return (tokenizer.bos_token if add_bos else "") + text


def _chat_text(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The chat template's text for ``messages``, each reply in it as it was generated.

    Some templates trim every message (Gemma 3's does). A reply that began or ended with
    white space would then render otherwise than the text the cache holds, and the next
    turn would read the whole conversation again. Where trimming is all the template does
    to the replies (each reply, put in as a marker, renders as the marker), the replies go
    back in untrimmed: the text stays what the model read and wrote, and the next turn
    reads only its new text. A template that changes replies in other ways (one that drops
    earlier reasoning) is followed as it is.
    """

    def apply(msgs: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    text = apply(messages)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if all(messages[i]["content"] == messages[i]["content"].strip() for i in replies):
        return text  # nothing a trim would change
    marks = {i: f"<<kvchat-reply-{i}>>" for i in replies}
    marked = apply([dict(m, content=marks[i]) if i in marks else m for i, m in enumerate(messages)])
    generated = trimmed = marked
    for i, mark in marks.items():
        if marked.count(mark) != 1:
            return text
        generated = generated.replace(mark, messages[i]["content"])
        trimmed = trimmed.replace(mark, messages[i]["content"].strip())
    return generated if trimmed == text else text


def tokenize(tokenizer: Any, text: str) -> list[int]:
    """Ids of rendered text (its special tokens are in the text already)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_ids(tokenizer: Any, chat_template: bool, generation_config: Any = None) -> set[int]:
    """EOS (the tokenizer's and the generation config's) and, for a chat model, the
    end-of-turn tokens its vocabulary has."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    if chat_template:
        vocab = tokenizer.get_vocab()
        ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return ids


def context_length(config: Any) -> int | None:
    """The positions a model handles (``max_position_embeddings``, its text config's for a
    multimodal one); None when the config does not say."""
    for source in (config, getattr(config, "text_config", None)):
        value = getattr(source, "max_position_embeddings", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def fit_reply(limit: int | None, n_tokens: int, max_new_tokens: int, model_name: str) -> int:
    """The reply length that fits after ``n_tokens`` of conversation: ``max_new_tokens``,
    or what is left of the model's positions. ContextTooLongError when nothing is left (past
    its positions a model says garbage)."""
    if limit is None:
        return max_new_tokens
    if n_tokens >= limit:
        raise ContextTooLongError(
            f"the conversation would be {n_tokens:,} tokens, but {model_name} handles at most "
            f"{limit:,} (max_position_embeddings); shorten the prompt or start a new "
            "conversation"
        )
    return min(max_new_tokens, limit - n_tokens)
