"""Next-token choice: greedy, or temperature + top-p with a seeded generator."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvchat.engine.chat.settings import SamplingSettings


def make_generator(settings: SamplingSettings, device: torch.device) -> torch.Generator | None:
    if settings.greedy:
        return None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(settings.seed if settings.seed is not None else torch.seed())
    return gen


def next_token(
    logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator | None
) -> int:
    """``logits``: [vocab] for the last position."""
    if settings.greedy:
        return greedy_choice(logits)
    # Sampling runs on CPU in fp32 so a seed gives the same draw on every device.
    probs = torch.softmax(logits.float().cpu() / settings.temperature, dim=-1)
    if settings.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = cumulative - sorted_probs >= settings.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def greedy_choice(logits: torch.Tensor) -> int:
    """``torch.argmax``'s index of ``logits`` ([vocab]): the first of tied maxima, a NaN
    above every number. On the CPU it is NumPy's argmax, which picks the same index
    (``tests/engine/chat/test_sampling.py``): torch's CPU argmax over a large vocabulary is a
    visible share of a small model's decode step, NumPy's a small fraction of that."""
    if logits.device.type == "cpu" and logits.dim() == 1:
        values = logits.detach()
        if values.dtype != torch.float32:
            values = values.float()  # NumPy has no bf16; widening keeps every value
        return int(values.numpy().argmax())
    return int(torch.argmax(logits).item())
