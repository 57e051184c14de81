"""int4 weights alone: kvchat's kernel against torch's ``_weight_int4pack_mm_for_cpu``.

Both multiply the same int4 weights (group 32, random codes and scales) by the same
activations: kvchat's kernel (``engine/models/int4_kernel.c``) in float32, torch's with the
activations cast to bf16 as kvchat called it before. Shapes: Gemma 3 4B's stacked q/k/v,
o_proj, stacked gate/up and down_proj, and its 262K-row vocabulary (the tied head of a 4-bit
GGUF); then the default model's four (small enough to stay in the CPU's caches between
steps, so they show the kernel's own speed rather than memory's), at one row (a decode
step) and 64 rows (a prefill chunk). Interleaved runs in this
process on the same thread count; ratio = torch's time / the kernel's (above 1: the kernel
is faster). GB/s counts the weight bytes one call reads (codes and group scales).

A second table, where the CPU has AMX tiles: the kernel's tiled path (what a prefill chunk of
the layers that may tile runs, ``int4_kernel``'s docstring) against its vector path, at 64
and 256 rows (a prefill chunk's default), the vocabulary left out; ratio = the vector
path's time / the tiled path's.

A third table puts a decode step's weights against the memory's speed: one row through
every matrix of ``--layers`` of Gemma 3 4B's layers (about 50 MB a layer, so together far
more than a CPU cache holds and each call reads its weights from memory), against a plain
read of as many bytes (``torch.sum`` over float32, the fastest a one-row product of them
could go); ratio = the kernel's GB/s / the read's (near 1: the kernel runs at the memory's
speed; well below: it is bound by its own arithmetic).

``--against REV`` adds a fourth table: this checkout's kernel against the kernel as it was at
git revision REV (both built here with kvchat's flags), the same calls interleaved, at one
row and 64, with the same bits required; speedup = REV's time / this checkout's.

Run from the repository root: ``python benchmarks/bench_int4_kernel.py [--repeats 5]
[--against REV]``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (this checkout's kvchat first on sys.path)

from kvchat.lab import harness  # noqa: E402

# (name, out_features, in_features) of Gemma 3 4B's int4 matrices, then SmolLM2-135M's
SHAPES = [
    ("q/k/v stacked", 4096, 2560),
    ("o_proj", 2560, 2048),
    ("gate/up stacked", 20480, 2560),
    ("down_proj", 2560, 10240),
    ("vocabulary (tied head)", 262208, 2560),
    ("default model q/k/v stacked", 960, 576),
    ("default model o_proj", 576, 576),
    ("default model gate/up stacked", 3072, 576),
    ("default model down_proj", 576, 1536),
]


def random_int4(n: int, k: int, g: Any) -> dict[str, Any]:
    """kvchat's stored int4 form (group 32) of random codes, scales and zeros."""
    import torch

    return {
        "qweight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
        "scales": torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3,
        "zeros": torch.randn(n, k // 32, generator=g) * 0.01,
    }


def main() -> None:
    import torch

    from kvchat.engine.models import int4_kernel, qlinear

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8, help="4B layers in the memory table")
    parser.add_argument("--against", help="a git revision whose kernel to time beside this one")
    parser.add_argument("--out", default="docs/results/bench_int4_kernel/run.json")
    args = parser.parse_args()
    if not int4_kernel.available():
        sys.exit("kvchat's int4 kernel is not built here (no C compiler?): nothing to compare")
    wall = harness.stopwatch()
    env = harness.environment(threads=torch.get_num_threads())
    rows = []
    print(f"{torch.get_num_threads()} threads")
    print("| matrix | rows | kernel ms | GB/s | torch ms | ratio |")
    print("|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        g = torch.Generator().manual_seed(0)
        parts = random_int4(n, k, g)
        codes, scale_min = int4_kernel.kernel_form(parts)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.stack([parts["qweight"] & 15, parts["qweight"] >> 4], -1).reshape(n, k).int(),
            qlinear.INT4_INNER_K_TILES,
        )
        scales_and_zeros = (
            torch.stack([parts["scales"], parts["zeros"]], -1).transpose(0, 1).contiguous()
        ).to(torch.bfloat16)
        del parts
        weight_bytes = codes.nbytes + scale_min.nbytes
        for m in (1, 64):
            x = torch.randn(m, k, generator=g)
            calls = 1 if n > 100_000 else (10 if m == 1 else 2) * (20 if n * k < 2e6 else 1)
            ours = functools.partial(int4_kernel.matmul, x, codes, scale_min, n)
            theirs = functools.partial(qlinear.int4_mm, x, packed, scales_and_zeros)
            ours_s, theirs_s = common.alternating_timings(ours, theirs, args.repeats, calls)
            k_ms, t_ms = harness.median(ours_s) * 1e3, harness.median(theirs_s) * 1e3
            ratio = harness.median_ratio(theirs_s, ours_s)
            gbs = weight_bytes / (k_ms / 1e3) / 1e9
            rows.append(
                {"matrix": name, "out": n, "in": k, "rows": m, "kernel_ms": k_ms,
                 "kernel_gb_per_s": gbs, "torch_ms": t_ms, "ratio": ratio}
            )  # fmt: skip
            print(f"| {name} ({n}x{k}) | {m} | {k_ms:.2f} | {gbs:.1f} | {t_ms:.2f} | {ratio:.2f} |")
    memory_row = memory_table(args.repeats, args.layers)
    tiled_rows = tiled_table(args.repeats) if int4_kernel.tiles_available() else []
    if not tiled_rows:
        print("\nno AMX tiles here: the tiled path is not measured")
    fields = {"args": vars(args), "rows": rows, "memory": memory_row, "tiled": tiled_rows}
    if args.against:
        fields["against"] = against(args.against, args.repeats)
    harness.save_run(args.out, "bench_int4_kernel", fields, env, wall())


def memory_table(repeats: int, layers: int) -> dict:
    """One row through ``layers`` 4B layers' matrices against a plain read of their bytes."""
    import torch

    from kvchat.engine.models import int4_kernel

    g = torch.Generator().manual_seed(2)
    stack = []
    for _ in range(layers):
        for _name, n, k in SHAPES[:4]:
            codes, scale_min = int4_kernel.kernel_form(random_int4(n, k, g))
            stack.append((codes, scale_min, n, torch.randn(1, k, generator=g)))
    weight_bytes = sum(c.nbytes + s.nbytes for c, s, _, _ in stack)
    plain = torch.ones(weight_bytes // 4)

    def step() -> None:
        for codes, scale_min, n, x in stack:
            int4_kernel.matmul(x, codes, scale_min, n)

    kernel_s, read_s = common.alternating_timings(step, plain.sum, repeats, 3)
    kernel_gbs = weight_bytes / harness.median(kernel_s) / 1e9
    read_gbs = weight_bytes / harness.median(read_s) / 1e9
    ratio = harness.median_ratio(read_s, kernel_s)
    title = f"{layers} Gemma 3 4B layers' matrices, one row"
    print(f"\n| {title} | MB | kernel GB/s | read GB/s | ratio |")
    print("|---|---|---|---|---|")
    print(f"| q/k/v, o_proj, gate/up, down | {weight_bytes / 1e6:.0f} | {kernel_gbs:.1f} "
          f"| {read_gbs:.1f} | {ratio:.2f} |")  # fmt: skip
    return {"layers": layers, "weight_bytes": weight_bytes, "kernel_gb_per_s": kernel_gbs,
            "read_gb_per_s": read_gbs, "ratio": ratio}  # fmt: skip


def kernel_at(revision: str | None, directory: Path) -> Any:
    """The int4 kernel's source at git ``revision`` (None: this checkout's), built into
    ``directory`` with kvchat's flags for this machine."""
    from kvchat.engine.kvdirect.exact_attention import compile_kernel, compiler
    from kvchat.engine.models import int4_kernel

    source = common.source_at(revision, int4_kernel.SOURCE, directory)
    target = source.with_suffix(".so")
    if not compile_kernel(compiler(), target, source=source):
        sys.exit(f"the int4 kernel at {revision or 'this checkout'} does not build here")
    return int4_kernel.load(target)


# Gemma 3 270M's matrices, beside SHAPES, in a Q4_0 tensor's symmetric form (the scales
# alone), as the shaped file holds them
SHAPES_270M = [
    ("270M q/k/v stacked", 1536, 640),
    ("270M gate/up stacked", 4096, 640),
    ("270M down_proj", 640, 2048),
    ("270M vocabulary (tied head)", 262144, 640),
]


def against(revision: str, repeats: int) -> list[dict]:
    """This checkout's kernel against the one at ``revision``: the same calls, interleaved,
    and the same bits required."""
    import tempfile

    import torch

    from kvchat.engine.models import int4_kernel

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        now, then = kernel_at(None, Path(scratch)), kernel_at(revision, Path(scratch))
        print(f"\nagainst the kernel at {revision}:")
        print("| matrix | rows | kernel ms | then ms | speedup | same bits |")
        print("|---|---|---|---|---|---|")
        shapes = [(*shape, False) for shape in SHAPES] + [(*s, True) for s in SHAPES_270M]
        for name, n, k, symmetric in shapes:
            g = torch.Generator().manual_seed(3)
            parts = random_int4(n, k, g)
            if symmetric:
                del parts["zeros"]
            codes, scale_min = int4_kernel.kernel_form(parts)
            for m in (1, 64):
                x = torch.randn(m, k, generator=g)
                calls = 1 if n > 100_000 else (10 if m == 1 else 2) * (20 if n * k < 2e6 else 1)
                now_call = functools.partial(
                    int4_kernel.matmul, x, codes, scale_min, n, library=now
                )
                then_call = functools.partial(
                    int4_kernel.matmul, x, codes, scale_min, n, library=then
                )
                same = bool(torch.equal(now_call(), then_call()))
                now_s, then_s = common.alternating_timings(now_call, then_call, repeats, calls)
                k_ms, t_ms = harness.median(now_s) * 1e3, harness.median(then_s) * 1e3
                speedup = harness.median_ratio(then_s, now_s)
                rows.append(
                    {"matrix": name, "out": n, "in": k, "rows": m, "kernel_ms": k_ms,
                     "then_ms": t_ms, "speedup": speedup, "same_bits": same}
                )  # fmt: skip
                print(f"| {name} ({n}x{k}) | {m} | {k_ms:.2f} | {t_ms:.2f} | {speedup:.2f} "
                      f"| {'yes' if same else 'NO'} |")  # fmt: skip
    return rows


def tiled_table(repeats: int) -> list[dict]:
    """The tiled path against the vector path on the same weights and activations."""
    import torch

    from kvchat.engine.models import int4_kernel

    rows = []
    print("\n| matrix | rows | tiled ms | vector ms | ratio |")
    print("|---|---|---|---|---|")
    for name, n, k in SHAPES:
        if n > 100_000:
            continue
        g = torch.Generator().manual_seed(1)
        codes, scale_min = int4_kernel.kernel_form(random_int4(n, k, g))
        for m in (64, 256):
            x = torch.randn(m, k, generator=g)
            calls = 20 if n * k < 2e6 else 2
            tiled = functools.partial(int4_kernel.matmul, x, codes, scale_min, n, tiled=True)
            vector = functools.partial(int4_kernel.matmul, x, codes, scale_min, n)
            tiled_s, vector_s = common.alternating_timings(tiled, vector, repeats, calls)
            t_ms, v_ms = harness.median(tiled_s) * 1e3, harness.median(vector_s) * 1e3
            ratio = harness.median_ratio(vector_s, tiled_s)
            rows.append(
                {"matrix": name, "out": n, "in": k, "rows": m, "tiled_ms": t_ms,
                 "vector_ms": v_ms, "ratio": ratio}
            )  # fmt: skip
            print(f"| {name} ({n}x{k}) | {m} | {t_ms:.2f} | {v_ms:.2f} | {ratio:.2f} |")
    return rows


if __name__ == "__main__":
    main()
