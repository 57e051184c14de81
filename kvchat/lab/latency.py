"""Latency per operation: recomputing K/V from residual checkpoints against reading cached K/V.

For one full-attention layer of each model (the first at or past the middle of the stack),
at each context length, and for each batch size (the tokens one operation fetches), the
median time of one operation:

* ``read K/V (memory)``: materialize the cached K/V rows for attention, i.e. copy the slice
  of the cache layer's ``keys``/``values`` (``.clone()``) on ``ctx.device``;
* ``read K/V (disk, warm)``: ``safe_open(...).get_slice`` of the rows from a safetensors file
  kept open, then ``.to(device, copy=True)`` (a slice is a view of the memory map until
  copied). Files are token-major, as a disk tier would write them: K/V ``[tokens, 2, heads,
  head_dim]`` in one file, residuals ``[tokens, d]`` in another. The file was just written,
  so the OS page cache holds it: this is a read from RAM through the page cache, the best
  case for a disk tier;
* ``read K/V (disk, cold)``: the same from a second copy of the file whose pages are dropped
  from the page cache before every operation (``fsync`` at write, then
  ``posix_fadvise(DONTNEED)``; not timed), opened per operation: a real device read;
* ``recompute (memory)``: the engine's own ``KVDirectLayer.cold_kv(begin, end)`` over
  residuals held in memory: input norm, k/v projection, k-norm, RoPE, replayed per original
  forward call (here one call of exactly ``batch`` rows, as a prefill chunk of that size
  leaves it);
* ``read residuals (disk, warm|cold) + recompute``: the residual rows read as above, then
  the same stages through the engine's ``ArchAdapter`` (``normalize`` -> ``project`` ->
  ``finish``), which is what ``_replay`` runs for one call;
* ``recompute (decoded tokens)``: ``cold_kv`` over ``batch`` tokens that were decoded one
  at a time (batch <= the decoded tail): the engine replays one projection row per original
  call to stay bit-identical, so this is the cost of exactness for decoded tokens.

The cache is filled by the model itself: the context (seeded random token ids) is fed in
forward calls with a ``KVDirectCache`` attached (the studied layer in residual form, every
other layer in K/V form, nothing evicted), ending with one call of each batch size and a tail
of single decoded tokens, and the forward stops after the studied layer. The recomputed K/V
are checked ``torch.equal`` against the K/V the model cached (and the disk path against the
memory path), outside the timings.

Timing follows ``kvchat.lab.harness``: repeats are interleaved (each repeat measures every
cell once, in an order rotating from repeat to repeat), one measurement averages a few
operations (cold disk operations: each timed alone), CUDA is synchronized before a clock is
read, and medians over repeats are reported; ratios are taken per repeat between
neighbouring measurements, then the median.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.lab import harness
from kvchat.lab.context import LabContext
from kvchat.lab.prompts import seeded_ids
from kvchat.lab.report import Claim, Section, Table

OPS = (
    "read K/V (memory)",
    "read K/V (disk, warm)",
    "read K/V (disk, cold)",
    "recompute (memory)",
    "read residuals (disk, warm) + recompute",
    "read residuals (disk, cold) + recompute",
    "recompute (decoded tokens)",
)
MEM_READ, DISK_WARM, DISK_COLD, RECOMPUTE, DISK_WARM_RE, DISK_COLD_RE, DECODED = OPS
# (name, slower-if-recompute op, read op): ratio = recompute-side time / read-side time.
RATIOS = (
    ("recompute / read, memory", RECOMPUTE, MEM_READ),
    ("recompute / read, disk warm", DISK_WARM_RE, DISK_WARM),
    ("recompute / read, disk cold", DISK_COLD_RE, DISK_COLD),
    ("recompute (memory) / read (disk cold)", RECOMPUTE, DISK_COLD),
)
SAME_TIER = RATIOS[:3]
SHORT = ("mem", "disk warm", "disk cold", "re", "disk warm h+re", "disk cold h+re", "re decoded")
SHORT_RATIOS = ("re/mem", "h+re/kv warm", "h+re/kv cold", "re/kv cold")
BATCHES = (1, 16, 64, 256, 1024)
PAPER_SPEEDUP = 5.0
CAN_DROP_PAGES = harness.CAN_DROP_PAGES  # Linux; not macOS: no cold-disk figures there


@dataclass
class Plan:
    model: str
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    decoded_tail: int
    repeats: int
    target_seconds: float  # per measurement (several operations averaged)


def _plan(ctx: LabContext) -> list[Plan]:
    if ctx.quick:
        models = [m for m in ctx.models if m == "smollm2-135m"] or list(ctx.models[:1])
        return [Plan(m, (512,), BATCHES, 16, 7, 0.004) for m in models]
    return [Plan(m, (1024, 4096), BATCHES, 64, 9, 0.005) for m in ctx.models]


class _StopForward(Exception):
    """Raised by a pre-hook on the layer after the studied one: the rest is not needed."""


@dataclass
class Layout:
    """One way the context was fed: forward calls ending in the calls that are timed."""

    chunks: list[int]  # rows per forward call, in order
    spans: dict[int, tuple[int, int]]  # batch -> [start, end) of its own call
    decoded: tuple[int, int] | None  # [start, end) of the single-token tail
    cache: Any = None
    residual: Any = None  # [1, context, d]: what entered the layer, all calls concatenated
    files: dict[str, Path] = field(default_factory=dict)  # "kv-warm", "h-cold", ...
    handles: dict[str, Any] = field(default_factory=dict)  # the warm files, kept open


def _layouts(context: int, batches: tuple[int, ...], tail: int) -> list[Layout]:
    """Calls that give every batch size a call of its own near the end of the context."""
    main: list[int] = []
    solo: list[int] = []
    room = context - tail - 1  # keep a head call in front
    for b in sorted(b for b in batches if b <= context):
        if b <= room - sum(main):
            main.append(b)
        else:
            solo.append(b)
    out = []
    for sizes, decoded in [(main, tail), *[([b], 0) for b in solo]]:
        head = context - sum(sizes) - decoded
        chunks = ([head] if head > 0 else []) + sizes + [1] * decoded
        spans, pos = {}, max(head, 0)
        for b in sizes:
            spans[b] = (pos, pos + b)
            pos += b
        out.append(Layout(chunks, spans, (pos, pos + decoded) if decoded else None))
    return out


def _study_layer(adapter: Any) -> int:
    """First full-attention layer at or past the middle of the stack."""
    n = adapter.num_layers
    for spec in list(adapter.layers[n // 2 :]) + list(adapter.layers[: n // 2]):
        if spec.sliding_window is None:
            return spec.index
    return n // 2


def _fill(loaded: Any, layer: int, layout: Layout, ids: list[int]) -> None:
    """Feed ``ids`` in ``layout.chunks`` calls through a KV-Direct cache, up to ``layer``."""
    import torch

    from kvchat.engine.chat.generate import forward
    from kvchat.engine.kvdirect.cache import KVDirectCache

    adapter = loaded.adapter()
    forms = ["kv"] * adapter.num_layers
    forms[layer] = "residual"
    cache = KVDirectCache(adapter, forms, hot_window=None)
    captured: list[torch.Tensor] = []

    def capture(_module: Any, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        captured.append(hidden.detach().clone())

    def stop(_module: Any, _args: tuple, _kwargs: dict) -> None:
        raise _StopForward

    hooks = [adapter.decoder_layers[layer].register_forward_pre_hook(capture, with_kwargs=True)]
    if layer + 1 < adapter.num_layers:
        hooks.append(
            adapter.decoder_layers[layer + 1].register_forward_pre_hook(stop, with_kwargs=True)
        )
    cache.attach()
    pos = 0
    try:
        with torch.no_grad():
            for rows in layout.chunks:
                try:
                    forward(loaded.model, cache, ids[pos : pos + rows], loaded.device)
                except _StopForward:
                    pass
                pos += rows
    finally:
        cache.detach()
        for hook in hooks:
            hook.remove()
    layout.cache = cache
    layout.residual = torch.cat(captured, dim=1)


def _write_files(layout: Layout, layer: int, folder: Path) -> None:
    """Token-major safetensors files, one row per token, as a disk tier would lay them out:
    ``kv`` ([tokens, 2, heads, head_dim]: a token's K and V side by side) and ``h``
    ([tokens, d]), each in its own file so a read touches only what it needs; each written
    twice (a warm copy kept open, a cold copy whose pages are dropped)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    kv_layer = layout.cache.layers[layer]
    kv = torch.stack([kv_layer.keys[0], kv_layer.values[0]], dim=0)  # [2, H, T, D]
    tensors = {
        "kv": {"kv": kv.permute(2, 0, 1, 3).contiguous().cpu()},
        "h": {"h": layout.residual[0].contiguous().cpu()},
    }
    tag = f"{len(layout.chunks)}-{layout.chunks[-1]}-{id(layout)}"
    for name, content in tensors.items():
        for kind in ("warm", "cold"):
            path = folder / f"layer{layer}-{tag}-{name}-{kind}.safetensors"
            save_file(content, str(path))
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            layout.files[f"{name}-{kind}"] = path
            if kind == "warm":
                layout.handles[name] = safe_open(str(path), framework="pt", device="cpu")


def _ops(
    loaded: Any, layer: int, layout: Layout, batch: int, start: int, end: int
) -> dict[str, tuple[Callable[[], Any], Callable[[], None] | None]]:
    """name -> (operation, untimed preparation) for the rows [start, end)."""
    import torch
    from safetensors import safe_open

    device = loaded.device
    adapter = loaded.adapter()
    kv_layer = layout.cache.layers[layer]
    cold_kv, cold_h = layout.files["kv-cold"], layout.files["h-cold"]

    def recompute_rows(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # One original call of ``batch`` rows, as KVDirectLayer._replay recomputes it.
        key, value = adapter.project(layer, adapter.normalize(layer, hidden))
        positions = torch.arange(start, end, device=device).unsqueeze(0)
        return adapter.finish(layer, key, value, hidden, positions)

    def mem_read():
        return kv_layer.keys[..., start:end, :].clone(), kv_layer.values[..., start:end, :].clone()

    # get_slice returns a view into the file's memory map: nothing is read until the
    # rows are copied, so every disk operation copies them (``copy=True``) onto the device.
    # K and V come out as [rows, 2, heads, head_dim]; the [1, heads, rows, head_dim] views
    # attention takes cost nothing more.
    def split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rows[:, 0].transpose(0, 1).unsqueeze(0), rows[:, 1].transpose(0, 1).unsqueeze(0)

    def disk_warm():
        return split(layout.handles["kv"].get_slice("kv")[start:end].to(device, copy=True))

    def disk_cold():
        with safe_open(str(cold_kv), framework="pt", device="cpu") as f:
            rows = f.get_slice("kv")[start:end].to(device, copy=True)
        return split(rows)

    def recompute():
        return kv_layer.cold_kv(start, end)

    def disk_warm_re():
        hidden = layout.handles["h"].get_slice("h")[start:end].to(device, copy=True)
        return recompute_rows(hidden.unsqueeze(0))

    def disk_cold_re():
        with safe_open(str(cold_h), framework="pt", device="cpu") as f:
            hidden = f.get_slice("h")[start:end].to(device, copy=True)
        return recompute_rows(hidden.unsqueeze(0))

    ops = {
        MEM_READ: (mem_read, None),
        DISK_WARM: (disk_warm, None),
        RECOMPUTE: (recompute, None),
        DISK_WARM_RE: (disk_warm_re, None),
    }
    if CAN_DROP_PAGES:
        ops[DISK_COLD] = (disk_cold, lambda: harness.drop_pages(cold_kv))
        ops[DISK_COLD_RE] = (disk_cold_re, lambda: harness.drop_pages(cold_h))
    return ops


def _measure_context(
    ctx: LabContext, loaded: Any, plan: Plan, context: int, folder: Path
) -> dict[str, Any]:
    import torch

    adapter = loaded.adapter()
    layer = _study_layer(adapter)
    ids = seeded_ids(loaded, context)
    layouts = _layouts(context, plan.batches, plan.decoded_tail)
    t0 = time.perf_counter()
    for layout in layouts:
        _fill(loaded, layer, layout, ids)
        _write_files(layout, layer, folder)
    fill_seconds = time.perf_counter() - t0
    sync = harness.synchronizer(loaded.device)

    # Cells: (batch, op) -> (operation, preparation); exactness checked once, untimed.
    cells: dict[tuple[int, str], tuple[Callable, Callable | None]] = {}
    exact: dict[str, bool] = {}
    for layout in layouts:
        kv_layer = layout.cache.layers[layer]
        for batch, (start, end) in layout.spans.items():
            ops = _ops(loaded, layer, layout, batch, start, end)
            for name, entry in ops.items():
                cells[(batch, name)] = entry
            with torch.no_grad():
                k, v = ops[RECOMPUTE][0]()
                k2, v2 = ops[DISK_WARM_RE][0]()
            cached_k = kv_layer.keys[..., start:end, :]
            cached_v = kv_layer.values[..., start:end, :]
            exact[f"batch {batch}: recompute == cached"] = bool(
                torch.equal(k, cached_k) and torch.equal(v, cached_v)
            )
            exact[f"batch {batch}: disk residuals + recompute == recompute"] = bool(
                torch.equal(k, k2) and torch.equal(v, v2)
            )
        if layout.decoded is not None:
            lo, hi = layout.decoded
            for batch in plan.batches:
                if batch <= hi - lo:
                    start = hi - batch

                    def op(start: int = start, hi: int = hi, kv_layer: Any = kv_layer) -> Any:
                        return kv_layer.cold_kv(start, hi)

                    cells[(batch, DECODED)] = (op, None)
                    with torch.no_grad():
                        k, v = op()
                    exact[f"batch {batch}: decoded-token recompute == cached"] = bool(
                        torch.equal(k, kv_layer.keys[..., start:hi, :])
                        and torch.equal(v, kv_layer.values[..., start:hi, :])
                    )

    # Calibrate how many operations one measurement averages.
    inner: dict[tuple[int, str], int] = {}
    with torch.no_grad():
        for key, (op, prepare) in cells.items():
            harness.seconds_per_op(op, prepare, 1, sync)  # warm-up
            once = harness.seconds_per_op(op, prepare, 1, sync)
            n = max(1, min(200, math.ceil(plan.target_seconds / max(once, 1e-7))))
            inner[key] = min(n, 5) if prepare is not None else n

    def measure(key: tuple[int, str], _rep: int) -> float:
        op, prepare = cells[key]
        return harness.seconds_per_op(op, prepare, inner[key], sync)

    elapsed = harness.stopwatch()
    with torch.no_grad():
        times = harness.interleaved(
            cells, plan.repeats, measure, stride=max(1, len(cells) // plan.repeats + 1), settle=None
        )
    timing_seconds = elapsed()

    file_bytes = {name: layouts[0].files[f"{name}-warm"].stat().st_size for name in ("kv", "h")}
    for layout in layouts:
        layout.handles.clear()
        for path in layout.files.values():
            path.unlink(missing_ok=True)
        layout.cache = layout.residual = None

    batches = sorted({b for b, _ in cells})
    per_batch: dict[int, Any] = {}
    for batch in batches:
        med = {op: harness.median(times[(batch, op)]) for op in OPS if (batch, op) in times}
        ratios = {}
        for name, num, den in RATIOS:
            if (batch, num) in times and (batch, den) in times:
                ratios[name] = harness.median_ratio(times[(batch, num)], times[(batch, den)])
        per_batch[batch] = {
            "median_seconds": med,
            "seconds": {op: times[(batch, op)] for op in OPS if (batch, op) in times},
            "inner": {op: inner[(batch, op)] for op in OPS if (batch, op) in inner},
            "ratios": ratios,
        }
    spec = loaded.footprint.layers[layer]
    return {
        "context": context,
        "layer": layer,
        "kv_bytes_per_token": spec.kv_bytes,
        "residual_bytes_per_token": spec.residual_bytes,
        "layouts": [
            {
                "calls": [n for n in layout.chunks if n > 1 or layout.decoded is None],
                "decoded_tail": (layout.decoded[1] - layout.decoded[0]) if layout.decoded else 0,
            }
            for layout in layouts
        ],
        "file_bytes": file_bytes,
        "fill_seconds": fill_seconds,
        "timing_seconds": timing_seconds,
        "exact": exact,
        "batches": per_batch,
    }


def _us(seconds: float | None) -> float | int | None:
    """Microseconds for the table: whole numbers from 100 up."""
    if seconds is None or math.isnan(seconds):
        return None
    us = 1e6 * seconds
    return round(us) if us >= 100 else round(us, 1)


def _ratio(value: float | None) -> float | None:
    if value is None or math.isnan(value):
        return None
    return round(value, 2) if value < 100 else round(value)


def run(ctx: LabContext) -> Section:
    dtype = "float32" if ctx.device == "cpu" else "bfloat16"
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvchat-latency-") as tmp:
        for plan in _plan(ctx):
            loaded = ctx.load(plan.model, dtype)
            per_context = []
            for context in plan.contexts:
                ctx.say(f"  latency: {plan.model} context {context} ...")
                per_context.append(_measure_context(ctx, loaded, plan, context, Path(tmp)))
            results[plan.model] = {
                "dtype": loaded.dtype,
                "device": str(loaded.device),
                "repeats": plan.repeats,
                "decoded_tail": plan.decoded_tail,
                "contexts": per_context,
            }

    # -- table -------------------------------------------------------------------------------
    rows = []
    for model, res in results.items():
        for c in res["contexts"]:
            for batch, b in c["batches"].items():
                med = b["median_seconds"]
                rows.append(
                    [model, c["context"], batch]
                    + [_us(med.get(op)) for op in OPS]
                    + [_ratio(b["ratios"].get(name)) for name, _, _ in RATIOS]
                )
    legend = "; ".join(f"{short} = {op}" for short, op in zip(SHORT, OPS))
    table = Table(
        ["model", "context", "batch"] + list(SHORT) + list(SHORT_RATIOS),
        rows,
        caption=(
            f"Median µs per operation on {ctx.device} (one layer, K and V, "
            f"{'fp32' if ctx.device == 'cpu' else 'bf16'}): {legend}. Ratios (median of "
            "per-repeat ratios) > 1: recomputing is slower than reading; "
            + "; ".join(f"{short} = {r[0]}" for short, r in zip(SHORT_RATIOS, RATIOS))
            + ". Disk warm = page cache; disk cold = pages dropped before each operation. "
            "Decoded tokens: only batches within the decoded tail."
        ),
    )

    # -- claims ------------------------------------------------------------------------------
    def best(num: str, den: str) -> tuple[float, str]:
        """Largest read/recompute speed-up over all cells, and where."""
        found = (0.0, "no cell")
        for model, res in results.items():
            for c in res["contexts"]:
                for batch, b in c["batches"].items():
                    r = b["ratios"].get(next(n for n, x, y in RATIOS if (x, y) == (num, den)))
                    if r and r > 0 and 1 / r > found[0]:
                        found = (1 / r, f"{model}, context {c['context']}, batch {batch}")
        return found

    same_tier = [(name, *best(num, den)) for name, num, den in SAME_TIER]
    top_same = max(same_tier, key=lambda x: x[1])
    resident = best(RECOMPUTE, DISK_COLD)
    exact_all = {
        f"{model} ctx {c['context']} {k}": v
        for model, res in results.items()
        for c in res["contexts"]
        for k, v in c["exact"].items()
    }
    claims = [
        Claim(
            "recompute is up to 5x faster than reading cached tensors (paper), same tier",
            top_same[1] >= PAPER_SPEEDUP,
            "largest speed-up of recomputing over reading (read time / recompute time) per tier: "
            + "; ".join(f"{n.split(', ')[1]} {s:.2f}x ({w})" for n, s, w in same_tier)
            + f"; on {ctx.device}",
        ),
        Claim(
            "recomputing from resident residuals beats reading the K/V back from disk (cold)",
            resident[0] > 1.0,
            f"best speed-up {resident[0]:.2f}x ({resident[1]})",
        ),
        Claim(
            "recomputed K/V equal the cached K/V bit for bit (timed paths)",
            all(exact_all.values()),
            f"{sum(exact_all.values())}/{len(exact_all)} checks torch.equal"
            + (
                ""
                if all(exact_all.values())
                else "; not equal: " + ", ".join(k for k, v in exact_all.items() if not v)
            ),
        ),
    ]

    figures = []
    plotted = _plot(ctx, results)
    if plotted:
        figures.append(plotted)
    summary = _summary(ctx, results)
    return Section(
        key="latency",
        title="Latency per operation: recompute K/V vs read cached K/V"
        + (" (quick)" if ctx.quick else ""),
        summary=summary,
        tables=[table],
        figures=figures,
        claims=claims,
        data={"device": ctx.device, "ops": list(OPS), "ratios": [r[0] for r in RATIOS], **results},
    )


def _summary(ctx: LabContext, results: dict[str, Any]) -> str:
    parts = []
    for model, res in results.items():
        c0 = res["contexts"][0]
        parts.append(
            f"{model} layer {c0['layer']} ({res['dtype']}): K+V {c0['kv_bytes_per_token']} B "
            f"vs residual {c0['residual_bytes_per_token']} B per token"
        )
    return (
        f"One layer per model on {ctx.device}; "
        + "; ".join(parts)
        + ". Batch = tokens fetched per operation; recompute replays one forward call of "
        "exactly that many rows (the engine's bit-exact path); 'decoded tokens' replays one "
        "row per call. Reading K/V from disk reads fewer bytes than reading residuals wherever "
        "K+V is smaller than the residual (grouped-query attention), so recompute from disk "
        "pays more I/O as well as the projection. Warm disk reads come from the OS page cache "
        "(the files were just written): a memory copy through a memory map. " + _cold_line(results)
    )


def _cold_line(results: dict[str, Any]) -> str:
    """Cold reads against file size."""
    if not CAN_DROP_PAGES:
        return "No cold-disk figures: this OS has no posix_fadvise to drop a file's pages."
    parts = []
    for model, res in results.items():
        for c in res["contexts"]:
            med = c["batches"].get(1, {}).get("median_seconds", {})
            if DISK_COLD in med:
                parts.append(
                    f"{model} {c['context']} tokens: K/V file "
                    f"{c['file_bytes']['kv'] / 2**20:.1f} MiB, one token's K/V in "
                    f"{1e3 * med[DISK_COLD]:.2f} ms; residual file "
                    f"{c['file_bytes']['h'] / 2**20:.1f} MiB"
                )
    return (
        "Cold reads open the file per operation after its pages were dropped "
        "(posix_fadvise DONTNEED), so they include safe_open and whatever the OS reads ahead "
        "around the rows: " + "; ".join(parts) + "."
    )


def _plot(ctx: LabContext, results: dict[str, Any]) -> str | None:
    if ctx.pyplot("latency") is None:
        return None
    from matplotlib.figure import Figure

    panels = [(m, c) for m, res in results.items() for c in res["contexts"]]
    cols = max(len(res["contexts"]) for res in results.values())
    rows = len(results)
    fig = Figure(figsize=(max(7.0, 5.5 * cols), 4.2 * rows + 1.2), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    styles = {
        MEM_READ: ("tab:blue", "-", "o"),
        DISK_WARM: ("tab:cyan", "-", "s"),
        DISK_COLD: ("tab:gray", "-", "D"),
        RECOMPUTE: ("tab:red", "--", "o"),
        DISK_WARM_RE: ("tab:orange", "--", "s"),
        DISK_COLD_RE: ("tab:brown", "--", "D"),
        DECODED: ("tab:purple", ":", "^"),
    }
    models = list(results)
    for model, c in panels:
        ax = axes[models.index(model)][results[model]["contexts"].index(c)]
        for op in OPS:
            pts = [
                (b, 1e6 * v["median_seconds"][op])
                for b, v in c["batches"].items()
                if op in v["median_seconds"]
            ]
            if not pts:
                continue
            color, ls, marker = styles[op]
            ax.plot(*zip(*pts), ls=ls, marker=marker, color=color, label=op)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted(c["batches"])
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("batch (tokens per operation)")
        ax.set_ylabel("µs per operation")
        ax.set_title(f"{model}, layer {c['layer']}, context {c['context']}")
        ax.grid(alpha=0.3, which="both")
    for r in range(rows):
        for col in range(cols):
            if not axes[r][col].has_data():
                axes[r][col].set_visible(False)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=8)
    fig.suptitle(f"Latency per operation on {ctx.device}: recompute K/V vs read cached K/V")
    return ctx.save_figure(fig, "latency")
