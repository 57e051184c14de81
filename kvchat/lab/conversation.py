"""A 20-turn conversation: resident conversation state per turn, KV-Direct vs the standard cache.

The same chat (SmolLM2-135M-Instruct, its chat template, greedy, replies capped) runs twice
in one process through ``ChatSession.send``, the path the CLI and the UI drive:

1. ``--cache standard`` (transformers' ``DynamicCache``): the reference replies and the
   standard cache's bytes per turn;
2. KV-Direct (``CacheSettings(kind="kvdirect", max_mem=..., checkpoint=FORM)``) under a
   ceiling.

The ceiling is first set well below the standard cache: ``TARGET_FRACTION`` of what the
standard cache holds at the last turn (``TARGET_FRACTION_QUICK`` for ``--quick``). With the
engine's disk tier, checkpoints beyond a resident budget are spilled to files (a temporary
folder passed as ``spill_root``) and the target is expected to hold. Where the engine refuses
it (``NeedsDiskTierError`` before a turn, or a reply ending with ``finish_reason ==
"ceiling"``, as an engine without the disk tier does), the refusal is recorded (turn,
message) and the run is repeated under the smallest ceiling the in-memory tiers can honour
with some room for hot K/V (``_fallback_ceiling``: every checkpoint, one layer's recompute
scratch, the token ids, and hot K/V for ``HOT_FRACTION`` of the tokens). Both outcomes are
reported in the verdict.

After every turn ``session.memory()`` is recorded (resident state, hot K/V, checkpoints,
recompute scratch, disk bytes, tokens, psutil RSS), and during the turn the same snapshot is
sampled from the streaming callback, so the table also shows the peak within each turn
(``state_bytes`` includes the recompute scratch as the engine accounts it).

Honesty note for SmolLM2 (GQA, 3 KV heads x 64 against a 576-wide residual): one token's
residual checkpoint (2304 B per layer in fp32) is larger than its K+V (1536 B), so with the
paper's residual form the checkpoints alone outgrow the standard cache: without a disk tier no
in-memory ceiling below the standard cache can hold a long conversation, and with it the bytes
on disk grow faster than the standard cache would. The ``auto`` form picks K/V at every layer
of SmolLM2 (nothing left to evict). The experiment reports what it sees, disk bytes included.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.lab.context import LabContext
from kvchat.lab.report import Claim, Section, Table

MODEL = "smollm2-135m"
FORM = "residual"  # the paper's checkpoint form
# First ceiling tried: this share of what the standard cache holds at the last turn (quick: a
# milder share, which keeps the few-hundred-token run off the streamed-attention path).
TARGET_FRACTION = 0.25
TARGET_FRACTION_QUICK = 0.5
HOT_FRACTION = 0.25  # room for hot K/V in the fallback ceiling, as a share of the tokens
MAX_ATTEMPTS = 3  # target, fallback, fallback x 1.5
MIB = 2**20

MESSAGES = (
    "Hi! Who are you?",
    "What is the capital of France?",
    "Tell me one interesting fact about the Moon.",
    "Write a haiku about rain.",
    "How do I boil an egg?",
    "What is 17 times 3?",
    "Name three colors of the rainbow.",
    "Why is the sky blue?",
    "Give me a tip for learning a new language.",
    "What does a computer's CPU do?",
    "Suggest a name for a pet goldfish.",
    "Summarize the story of Cinderella in two sentences.",
    "What is the boiling point of water at sea level?",
    "Translate 'good morning' into Spanish.",
    "What are the benefits of regular exercise?",
    "Write a short limerick about a cat.",
    "Explain what photosynthesis is, briefly.",
    "Which planet is the largest in our solar system?",
    "Recommend a good habit for a productive morning.",
    "Thanks for the chat! Can you say goodbye in French?",
)


@dataclass
class Run:
    """One pass of the conversation under one cache setting."""

    label: str
    ceiling: int | None
    turns: list[dict[str, Any]] = field(default_factory=list)
    replies: list[list[int]] = field(default_factory=list)
    refused: dict[str, Any] | None = None  # turn, message, when the engine refused
    seconds: float = 0.0
    rss: dict[str, int] = field(default_factory=dict)  # start, end, end after malloc_trim

    @property
    def completed(self) -> bool:
        return self.refused is None


def _run(
    loaded: Any,
    messages: tuple[str, ...],
    settings: Any,
    max_new_tokens: int,
    label: str,
    say: Any,
    spill_dir: Path | None = None,
) -> Run:
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.chat.settings import SamplingSettings
    from kvchat.errors import NeedsDiskTierError
    from kvchat.units import process_rss

    run = Run(label=label, ceiling=settings.max_mem)
    _release_heap()  # each run starts from a trimmed heap, not from the last run's leftovers
    session = ChatSession(loaded, cache=settings, **_spill_kwargs(spill_dir))
    sampling = SamplingSettings(max_new_tokens=max_new_tokens)
    t0 = time.perf_counter()
    try:
        rss_start = run.rss["start"] = process_rss()
        for turn, text in enumerate(messages, start=1):
            peak = {"state_bytes": 0, "rss_bytes": 0}

            def sample(_piece: str, peak: dict[str, int] = peak) -> None:
                mem = session.memory()
                peak["state_bytes"] = max(peak["state_bytes"], mem.state_bytes)
                peak["rss_bytes"] = max(peak["rss_bytes"], mem.rss_bytes)

            try:
                result = session.send(text, sampling, on_text=sample)
            except NeedsDiskTierError as exc:
                run.refused = {"turn": turn, "message": str(exc), "when": "before the turn"}
                break
            mem = result.memory
            record = {
                "turn": turn,
                "tokens": mem.tokens,
                "reply_tokens": len(result.tokens),
                "finish_reason": result.finish_reason,
                "state_bytes": mem.state_bytes,
                "peak_state_bytes": max(peak["state_bytes"], mem.state_bytes),
                "standard_equivalent_bytes": mem.standard_equivalent_bytes,
                "hot_kv_bytes": mem.hot_kv_bytes,
                "checkpoint_bytes": mem.checkpoint_bytes,
                "scratch_peak_bytes": mem.scratch_peak_bytes,
                "token_id_bytes": mem.token_id_bytes,
                "disk_bytes": mem.disk_bytes,
                "hot_window": mem.hot_window,
                "hot_tokens": mem.hot_tokens,
                "rss_bytes": mem.rss_bytes,
                "peak_rss_bytes": max(peak["rss_bytes"], mem.rss_bytes),
                "rss_growth_bytes": mem.rss_bytes - rss_start,
                "recompute_seconds": mem.recompute_seconds,
                "seconds": result.prefill_seconds + result.decode_seconds,
                "reply": result.reply,
            }
            run.turns.append(record)
            run.replies.append(list(result.tokens))
            say(
                f"  {label} turn {turn}: {mem.tokens} tokens, state "
                f"{mem.state_bytes / MIB:.1f} MiB, hot window {mem.hot_window}"
            )
            if result.finish_reason == "ceiling":
                run.refused = {
                    "turn": turn,
                    "message": result.error or "the reply reached the ceiling",
                    "when": "during the reply",
                }
                break
    finally:
        session.close()
        run.seconds = time.perf_counter() - t0
    # Still holding the conversation: how much of the RSS growth is freed heap not returned.
    run.rss["end"] = process_rss()
    _release_heap()
    run.rss["end_trimmed"] = process_rss()
    return run


def _warm_up(loaded: Any) -> None:
    """One short reply first, so that paging the weights in is not counted as run RSS."""
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.chat.settings import CacheSettings, SamplingSettings

    session = ChatSession(loaded, cache=CacheSettings(kind="standard"))
    try:
        session.send("Hello!", SamplingSettings(max_new_tokens=2))
    finally:
        session.close()


def _spill_kwargs(spill_dir: Path | None) -> dict[str, Any]:
    """Where a disk tier may spill checkpoints: a temporary folder, never the user's data dir.

    Passed only to a ``ChatSession`` that takes ``spill_root`` (the engine's disk tier).
    """
    import inspect

    from kvchat.engine.chat.session import ChatSession

    if spill_dir is None or "spill_root" not in inspect.signature(ChatSession).parameters:
        return {}
    return {"spill_root": spill_dir}


def _release_heap() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc ``malloc_trim``)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _residual_layers(loaded: Any, form: str) -> list[Any]:
    layers = loaded.footprint.layers
    if form == "residual":
        return list(layers)
    if form == "auto":
        return [layer for layer in layers if layer.smaller_exact_form == "residual"]
    return []


def _fallback_ceiling(loaded: Any, form: str, n_tokens: int) -> int:
    """Smallest ceiling the in-memory tiers honour at ``n_tokens``, plus hot-window room.

    Every token's checkpoint in ``form`` at every layer, one layer's recompute scratch (its
    cold K/V and the full copy handed to attention), 8 bytes per token id, and hot K/V for
    ``HOT_FRACTION`` of the tokens at the residual-form layers; rounded up to 0.1 MiB.
    Sliding windows are ignored, which only errs on the generous side.
    """
    fp = loaded.footprint
    checkpoints = n_tokens * fp.cold_bytes_per_token(form)
    kv_layers = max(layer.kv_bytes for layer in fp.layers)
    scratch = 2 * n_tokens * kv_layers
    ids = 8 * n_tokens
    hot = int(HOT_FRACTION * n_tokens) * sum(
        layer.kv_bytes for layer in _residual_layers(loaded, form)
    )
    total = checkpoints + scratch + ids + hot
    step = MIB // 10
    return -(-total // step) * step


def _token_match(reference: list[list[int]], other: list[list[int]]) -> tuple[int, int, bool]:
    """(tokens equal at the same place, reference tokens, every reply identical)."""
    same = total = 0
    for ref, got in zip(reference, other):
        total += len(ref)
        same += sum(a == b for a, b in zip(ref, got))
    total += sum(len(r) for r in reference[len(other) :])
    identical = len(reference) == len(other) and all(a == b for a, b in zip(reference, other))
    return same, total, identical


def run(ctx: LabContext) -> Section:
    import torch

    messages = MESSAGES[:4] if ctx.quick else MESSAGES
    max_new_tokens = 24 if ctx.quick else 40
    loaded = ctx.load(MODEL)
    fp = loaded.footprint
    from kvchat.engine.chat.settings import CacheSettings

    fraction = TARGET_FRACTION_QUICK if ctx.quick else TARGET_FRACTION
    with torch.no_grad():
        _warm_up(loaded)
        standard = _run(
            loaded,
            messages,
            CacheSettings(kind="standard"),
            max_new_tokens,
            "standard",
            ctx.say,
        )
        if not standard.completed:
            raise RuntimeError(f"the standard cache run stopped: {standard.refused}")
        last = standard.turns[-1]
        n_final = last["tokens"]
        target = int(fraction * last["standard_equivalent_bytes"])
        target -= target % (MIB // 10)
        attempts: list[Run] = []
        ceiling = target
        for attempt in range(MAX_ATTEMPTS):
            label = "kvdirect" if attempt == 0 else f"kvdirect (retry {attempt})"
            settings = CacheSettings(kind="kvdirect", max_mem=ceiling, checkpoint=FORM)
            ctx.say(f"  {label}: ceiling {ceiling / MIB:.1f} MiB, checkpoint form {FORM}")
            with tempfile.TemporaryDirectory(prefix="kvchat-spill-") as spill:
                kv = _run(loaded, messages, settings, max_new_tokens, label, ctx.say, Path(spill))
            attempts.append(kv)
            if kv.completed:
                break
            fallback = _fallback_ceiling(loaded, FORM, n_final)
            ceiling = max(fallback, int(ceiling * 1.5))
            ceiling += -ceiling % (MIB // 10)
    kv = attempts[-1]

    # -- outcomes ----------------------------------------------------------------------------
    same, total, identical = _token_match(standard.replies, kv.replies)
    turns = kv.turns
    under = [t["state_bytes"] <= kv.ceiling and t["peak_state_bytes"] <= kv.ceiling for t in turns]
    max_peak = max((t["peak_state_bytes"] for t in turns), default=0)
    std_by_turn = {t["turn"]: t for t in standard.turns}
    kv_last = turns[-1] if turns else None

    claims = [
        Claim(
            f"a ceiling at {fraction:.0%} of the standard cache "
            f"({target / MIB:.1f} MiB) holds the conversation",
            attempts[0].completed,
            (
                f"accepted at all {len(messages)} turns"
                if attempts[0].completed
                else f"refused at turn {attempts[0].refused['turn']} "
                f"({attempts[0].refused['when']}): {attempts[0].refused['message']}; "
                f"rerun under {kv.ceiling / MIB:.1f} MiB"
            ),
        ),
        Claim(
            "KV-Direct resident state stays under the ceiling at every turn",
            bool(kv.completed and under and all(under)),
            f"peak {max_peak / MIB:.2f} MiB (sampled while streaming) against a "
            f"{kv.ceiling / MIB:.1f} MiB ceiling over {len(turns)} turns"
            + ("" if kv.completed else f"; the run stopped at turn {kv.refused['turn']}"),
        ),
        Claim(
            "replies identical to the standard cache",
            identical,
            f"{same}/{total} greedy tokens equal ({100 * same / max(total, 1):.1f} %), "
            f"{sum(a == b for a, b in zip(standard.replies, kv.replies))}/{len(messages)} "
            "replies identical",
        ),
    ]
    if kv_last is not None:
        std_last = std_by_turn[kv_last["turn"]]
        kv_first, std_first = turns[0], std_by_turn[turns[0]["turn"]]
        span = max(kv_last["tokens"] - kv_first["tokens"], 1)
        kv_slope = (kv_last["state_bytes"] - kv_first["state_bytes"]) / span
        std_slope = (std_last["state_bytes"] - std_first["state_bytes"]) / span
        disk_slope = (kv_last["disk_bytes"] - kv_first["disk_bytes"]) / span
        claims.append(
            Claim(
                "state grows slower than the standard cache",
                kv_slope < std_slope,
                f"from turn {kv_first['turn']} to {kv_last['turn']} the resident state grew "
                f"{kv_slope / 1024:.1f} KiB per token, the standard cache "
                f"{std_slope / 1024:.1f} KiB per token"
                + (f" (disk grew {disk_slope / 1024:.1f} KiB per token)" if disk_slope else "")
                + f"; per layer a {FORM} checkpoint is {fp.layers[0].cold_bytes(FORM)} B "
                f"against {fp.layers[0].kv_bytes} B of K+V ({fp.dtype}, {fp.model_type})",
            )
        )
        claims.append(
            Claim(
                "resident state is below the standard cache at the last turn",
                kv_last["state_bytes"] < std_last["state_bytes"],
                f"turn {kv_last['turn']}, {kv_last['tokens']} tokens: KV-Direct "
                f"{kv_last['state_bytes'] / MIB:.2f} MiB, standard cache "
                f"{std_last['state_bytes'] / MIB:.2f} MiB "
                f"({kv_last['state_bytes'] / max(std_last['state_bytes'], 1):.2f}x)",
            )
        )

    # -- table -------------------------------------------------------------------------------
    rows = []
    for t in turns:
        s = std_by_turn[t["turn"]]
        rows.append(
            [
                t["turn"],
                t["tokens"],
                s["state_bytes"] / MIB,
                t["state_bytes"] / MIB,
                t["peak_state_bytes"] / MIB,
                kv.ceiling / MIB,
                t["hot_window"] if t["hot_window"] is not None else "all",
                t["hot_kv_bytes"] / MIB,
                t["checkpoint_bytes"] / MIB,
                t["scratch_peak_bytes"] / MIB,
                t["disk_bytes"] / MIB,
                round(s["rss_bytes"] / MIB),
                round(t["rss_bytes"] / MIB),
                kv.replies[t["turn"] - 1] == standard.replies[t["turn"] - 1],
            ]
        )
    table = Table(
        [
            "turn",
            "tokens",
            "standard MiB",
            "KV-Direct MiB",
            "KV-Direct peak in turn MiB",
            "ceiling MiB",
            "hot window",
            "hot K/V MiB",
            "checkpoints MiB",
            "scratch MiB",
            "disk MiB",
            "RSS standard MiB",
            "RSS KV-Direct MiB",
            "same reply",
        ],
        rows,
        caption=(
            f"{loaded.name} ({fp.dtype}), greedy, replies of at most {max_new_tokens} tokens, "
            f"KV-Direct checkpoint form `{FORM}` under a {kv.ceiling / MIB:.1f} MiB ceiling. "
            "State = hot K/V + checkpoints + peak recompute scratch + token ids "
            "(`session.memory()` after the turn); the peak column is sampled while streaming. "
            "RSS is the whole process (weights included)."
        ),
    )
    attempts_rows = [
        [
            a.label,
            a.ceiling / MIB,
            "completed" if a.completed else f"refused at turn {a.refused['turn']}",
            round(a.seconds, 1),
        ]
        for a in attempts
    ]
    attempts_table = Table(
        ["run", "ceiling MiB", "outcome", "seconds"],
        [["standard", "-", "completed", round(standard.seconds, 1)], *attempts_rows],
        caption="Runs, in order (one process, one model load).",
    )

    figures = []
    plotted = _plot(ctx, standard, attempts, target)
    if plotted:
        figures.append(plotted)

    summary = (
        f"{len(messages)}-turn chat with {loaded.name}: the standard cache reaches "
        f"{last['state_bytes'] / MIB:.2f} MiB at {n_final} tokens. "
        + (
            f"KV-Direct ({FORM} checkpoints) under a {kv.ceiling / MIB:.1f} MiB ceiling ends at "
            f"{kv_last['state_bytes'] / MIB:.2f} MiB with a hot window of "
            f"{kv_last['hot_window']} tokens. "
            if kv_last
            else ""
        )
        + (
            ""
            if attempts[0].completed
            else f"The target ceiling ({fraction:.0%} of the standard cache, "
            f"{target / MIB:.1f} MiB) was refused at turn {attempts[0].refused['turn']}: "
            "the checkpoints alone would not fit in memory and no disk tier took them. "
        )
        + _disk_line(kv_last, std_by_turn)
        + f"Per token and layer a {FORM} checkpoint costs {fp.layers[0].cold_bytes(FORM)} B "
        f"against {fp.layers[0].kv_bytes} B of K+V here ({fp.model_type}, {fp.dtype}). "
        + _rss_line(standard, kv)
    )
    data = {
        "model": loaded.name,
        "dtype": fp.dtype,
        "form": FORM,
        "max_new_tokens": max_new_tokens,
        "messages": list(messages),
        "target_ceiling_bytes": target,
        "ceiling_bytes": kv.ceiling,
        "token_match": {"same": same, "total": total, "identical": identical},
        "runs": [
            {
                "label": r.label,
                "ceiling_bytes": r.ceiling,
                "completed": r.completed,
                "refused": r.refused,
                "seconds": r.seconds,
                "rss": r.rss,
                "turns": r.turns,
                "reply_tokens": r.replies,
            }
            for r in (standard, *attempts)
        ],
    }
    return Section(
        key="conversation",
        title=f"{len(messages)}-turn conversation: resident state per turn"
        + (" (quick)" if ctx.quick else ""),
        summary=summary,
        tables=[table, attempts_table],
        figures=figures,
        claims=claims,
        data=data,
    )


def _disk_line(kv_last: dict[str, Any] | None, std_by_turn: dict[int, Any]) -> str:
    if not kv_last or not kv_last["disk_bytes"]:
        return ""
    std = std_by_turn[kv_last["turn"]]["state_bytes"]
    total = kv_last["state_bytes"] + kv_last["disk_bytes"]
    return (
        f"The disk tier holds {kv_last['disk_bytes'] / MIB:.2f} MiB of checkpoints at the last "
        f"turn: resident + disk = {total / MIB:.2f} MiB, {total / max(std, 1):.2f}x the "
        "standard cache. "
    )


def _rss_line(standard: Run, kv: Run) -> str:
    parts = []
    for r in (standard, kv):
        state = r.turns[-1]["state_bytes"] if r.turns else 0
        parts.append(
            f"{r.label}: +{(r.rss['end'] - r.rss['start']) / MIB:.0f} MiB "
            f"(+{(r.rss['end_trimmed'] - r.rss['start']) / MIB:.0f} MiB after malloc_trim) "
            f"for {state / MIB:.1f} MiB of state"
        )
    return (
        "Process RSS growth over each run, the heap trimmed before it: "
        + "; ".join(parts)
        + ". RSS counts the whole process (weights, allocator caches), not just the state."
    )


def _plot(ctx: LabContext, standard: Run, attempts: list[Run], target: int) -> str | None:
    """Bytes per turn (standard, KV-Direct, ceiling) above, process RSS below."""
    if ctx.pyplot("conversation") is None:
        return None
    from matplotlib.figure import Figure

    kv = attempts[-1]
    fig = Figure(figsize=(8, 7.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])

    def xs(run: Run) -> list[int]:
        return [t["turn"] for t in run.turns]

    def ys(run: Run, key: str) -> list[float]:
        return [t[key] / MIB for t in run.turns]

    top.plot(
        xs(standard), ys(standard, "state_bytes"), "o-", color="tab:red", label="standard cache"
    )
    top.plot(
        xs(kv), ys(kv, "state_bytes"), "o-", color="tab:blue", label="KV-Direct resident state"
    )
    top.plot(
        xs(kv),
        ys(kv, "peak_state_bytes"),
        "^",
        color="tab:blue",
        alpha=0.6,
        label="KV-Direct peak within the turn",
    )
    top.plot(
        xs(kv), ys(kv, "checkpoint_bytes"), "--", color="tab:green", label="checkpoints in memory"
    )
    top.plot(xs(kv), ys(kv, "hot_kv_bytes"), ":", color="tab:purple", label="hot K/V")
    if any(t["disk_bytes"] for t in kv.turns):
        top.plot(
            xs(kv),
            ys(kv, "disk_bytes"),
            "-.",
            color="tab:brown",
            label="on disk (spilled checkpoints)",
        )
    top.axhline(kv.ceiling / MIB, color="black", ls="--", lw=1, label="ceiling (--max-mem)")
    first = attempts[0]
    if not first.completed:
        top.axhline(target / MIB, color="grey", ls=":", lw=1, label="target ceiling (refused)")
        refused_at = first.refused["turn"]
        label = f"refused at turn {refused_at}"
        top.plot([refused_at], [target / MIB], "x", color="grey", ms=10, label=label)
    top.set_ylabel("conversation state (MiB)")
    top.set_title(f"Resident conversation state per turn ({standard.turns[-1]['tokens']} tokens)")
    top.grid(alpha=0.3)
    top.legend(fontsize=8, loc="upper left")

    bottom.plot(xs(standard), ys(standard, "rss_bytes"), "o-", color="tab:red", label="standard")
    bottom.plot(xs(kv), ys(kv, "rss_bytes"), "o-", color="tab:blue", label="KV-Direct")
    peak_label = "KV-Direct peak within the turn"
    bottom.plot(
        xs(kv), ys(kv, "peak_rss_bytes"), "^", color="tab:blue", alpha=0.6, label=peak_label
    )
    bottom.set_ylabel("process RSS (MiB)")
    bottom.set_xlabel("turn")
    top.set_ylim(bottom=0)
    bottom.xaxis.get_major_locator().set_params(integer=True)
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8, loc="upper left")
    return ctx.save_figure(fig, "conversation_memory")
