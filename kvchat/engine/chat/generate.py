"""Chunked prefill and the decode loop, as plain functions over (model, cache).

The cache is any transformers ``Cache``. Before each forward call, kvchat's own caches
(``KVDirectCache``, ``StandardCache``) are asked to ``prepare`` for it: they meet the
ceiling (the KV-Direct planner shrinks the hot window as the context grows) or refuse the
call before anything is fed, and log its rows. Nothing calls back into the caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvchat.engine.chat.sampling import make_generator, next_token
from kvchat.engine.chat.settings import SamplingSettings
from kvchat.engine.kvdirect.attention import route
from kvchat.engine.kvdirect.interface import prepare_call
from kvchat.engine.models.decode_step import decode_step_for
from kvchat.errors import NeedsDiskTierError
from kvchat.threads import rows_threads


@dataclass
class DecodeOutcome:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "eos" | "length" | "cancelled" | "stop" | "ceiling"
    error: str | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    last_logits: torch.Tensor | None = None


def forward(
    model: torch.nn.Module,
    cache: object,
    ids: Sequence[int],
    device: torch.device,
) -> torch.Tensor:
    """One forward call over ``ids``; returns the logits of the last position ([vocab])."""
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
    return forward_ids(model, cache, input_ids)


def forward_ids(
    model: torch.nn.Module,
    cache: object,
    input_ids: torch.Tensor,
) -> torch.Tensor:
    """:func:`forward` over a ``[1, n]`` id tensor the caller owns (the decode loop reuses
    one for every step instead of building a tensor per token). One-token calls of models
    it knows go through ``kvchat.engine.models.decode_step`` (fewer Python frames, the model's own
    bits)."""
    # Whichever cache the call uses, it sums attention in kvchat's one order (a model
    # loaded by kvchat is routed already; this covers models built elsewhere).
    route(model)
    prepare_call(cache, input_ids.shape[1])
    rows = input_ids.shape[1]
    step = decode_step_for(model) if rows == 1 and input_ids.shape[0] == 1 else None
    with rows_threads(rows):
        if step is not None:
            return step(input_ids, cache)
        out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def prefill(
    model: torch.nn.Module,
    cache: object,
    ids: Sequence[int],
    device: torch.device,
    chunk: int,
    on_progress: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """Feed ``ids`` in chunks of at most ``chunk`` tokens; logits of the last one.
    ``on_progress(done, total)`` after each chunk (long prompts show a bar)."""
    if not ids:
        raise ValueError("nothing to prefill")
    logits = None
    for start in range(0, len(ids), chunk):
        logits = forward(model, cache, ids[start : start + chunk], device)
        if on_progress is not None:
            on_progress(min(len(ids), start + chunk), len(ids))
    return logits


def generate(
    model: torch.nn.Module,
    cache: object,
    prompt_ids: Sequence[int],
    *,
    device: torch.device,
    settings: SamplingSettings,
    stop_ids: set[int],
    prefill_chunk: int = 256,
    on_token: Callable[[int], bool | None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> DecodeOutcome:
    """Prefill ``prompt_ids`` then decode until a stop id, ``max_new_tokens`` or cancel.

    ``on_token(id)`` may return True to stop (stop strings). A stop id is kept in
    ``tokens`` and fed to the cache, so the cache always holds every token in ``tokens``
    except the very last one generated (which the next turn's prefill feeds first).
    Cancelling never interrupts a forward call, so the cache is always consistent.
    """
    outcome = DecodeOutcome()
    from kvchat.engine.models.quantize import inference_context

    generator = make_generator(settings, device)
    with inference_context(model):
        t0 = time.perf_counter()
        try:
            logits = prefill(
                model, cache, prompt_ids, device, prefill_chunk, on_progress=on_progress
            )
        except NeedsDiskTierError as exc:
            # Raised before a chunk is fed (never inside a forward call): what was fed stays
            # consistent, and the next turn feeds the rest from the token ids.
            outcome.finish_reason = "ceiling"
            outcome.error = str(exc)
            outcome.prefill_seconds = time.perf_counter() - t0
            return outcome
        outcome.prefill_seconds = time.perf_counter() - t0
        step_ids = torch.empty((1, 1), dtype=torch.long, device=device)
        t0 = time.perf_counter()
        while True:
            if should_stop is not None and should_stop():
                outcome.finish_reason = "cancelled"
                break
            token = next_token(logits, settings, generator)
            outcome.tokens.append(token)
            if token in stop_ids:
                outcome.finish_reason = "eos"
                break
            if on_token is not None and on_token(token):
                outcome.finish_reason = "stop"
                break
            if len(outcome.tokens) >= settings.max_new_tokens:
                outcome.finish_reason = "length"
                break
            try:
                step_ids.fill_(token)
                logits = forward_ids(model, cache, step_ids)
            except NeedsDiskTierError as exc:
                # The ceiling is reached mid-reply: end the reply here, keep what was said.
                outcome.finish_reason = "ceiling"
                outcome.error = str(exc)
                break
        outcome.decode_seconds = time.perf_counter() - t0
        outcome.last_logits = logits
    # The reply's transient buffers (prefill activations, the K/V tensors each step's cat
    # replaced) would otherwise sit in glibc's free heap, counted in RSS between turns.
    from kvchat.engine.models.heap import return_freed_memory

    return_freed_memory()
    return outcome
