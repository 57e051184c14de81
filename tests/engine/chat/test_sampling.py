"""Greedy choice is torch's argmax, to the index: the first of tied maxima, a NaN before any
number, in float32 and bf16 logits of a real vocabulary's size."""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.chat.sampling import next_token
from kvchat.engine.chat.settings import SamplingSettings

GREEDY = SamplingSettings(max_new_tokens=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_picks_the_index_torch_argmax_picks(dtype):
    generator = torch.Generator().manual_seed(0)
    cases = [torch.randn(262_144, generator=generator) for _ in range(20)]
    tied = torch.zeros(49_152)
    tied[[7, 300, 49_000]] = 5.0  # the first of tied maxima
    nan = torch.randn(1_000, generator=generator)
    nan[[40, 900]] = float("nan")  # torch's argmax takes the first NaN
    cases += [tied, nan, torch.full((10,), float("-inf")), torch.randn(1, 512)[0, ::2]]
    for logits in cases:
        logits = logits.to(dtype)
        assert next_token(logits, GREEDY, None) == int(torch.argmax(logits))
