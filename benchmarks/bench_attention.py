"""Attention alone: kvchat's kernel against torch's SDPA on the same tensors.

kvchat sums attention in one order on every path (``engine/kvdirect/exact_attention.c``),
which is what makes every ceiling, chunking and row count give the same bits; this measures
what that costs per call, at the shapes of a decode step (one query row) and of a prefill
chunk (256 rows), for the default model's heads (9 query, 3 K/V heads of 64) and Gemma 3
4B's (8 query, 4 K/V heads of 256), over 1K and 4K keys, float32. SDPA gets the K/V heads
repeated for its groups, as transformers hands them over. Both run in this process on the
same thread count, interleaved; ratio = SDPA's time / the kernel's (above 1: the kernel is
faster). The line ``kernel build:`` says which code the CPU runs (AVX-512, AVX2 or plain C).

``--against REV`` also builds the kernel as it was at git revision REV (same flags; a
revision with the same C interface) and times the two on the same tensors, interleaved,
checking they give the same bits: what a change to the kernel bought, rerunnable.
``--build avx2`` runs the kernel built for CPUs without AVX-512 (both kernels, with
``--against``), on this CPU: how that code path moves, measured on this machine (SDPA is
still torch's build for this CPU, so that column flatters SDPA on an AVX-512 machine).
``--decode-step`` (with ``--against``, native build) then times the default model's whole
decode step, its C++ layers calling one kernel or the other, after ~500 and ~2,000 tokens
of context: blocks of steps on one session, the kernels taking turns, the median step of
each; and a 64-token greedy reply with each, which must give the same tokens.

Run from the repository root: ``python benchmarks/bench_attention.py [--repeats 5]
[--against REV] [--build avx2] [--decode-step]``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (this checkout's kvchat first on sys.path)

from kvchat.lab import harness  # noqa: E402

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Gemma-3-4B": (8, 4, 256)}


def kernel_build() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    if " avx512f" in flags:
        return "AVX-512"
    if " avx2" in flags and " fma" in flags:
        return "AVX2"
    return "plain C"


def cases() -> Iterator[tuple[str, int, int, Any, Any, Any]]:
    """(shape, query rows, keys, query, key, value) for every row of the tables: seeded
    float32 tensors, the K/V heads as many as the shape has."""
    import torch

    for name, (heads, kv_heads, dim) in SHAPES.items():
        for q_len in (1, 256):
            for n in (1024, 4096):
                g = torch.Generator().manual_seed(0)
                query = torch.randn(1, heads, q_len, dim, generator=g)
                key = torch.randn(1, kv_heads, n, dim, generator=g)
                value = torch.randn(1, kv_heads, n, dim, generator=g)
                yield name, q_len, n, query, key, value


def main() -> None:
    import torch

    from kvchat.engine.kvdirect.exact_attention import available

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="docs/results/bench_attention/run.json")
    parser.add_argument("--against", help="a git revision whose kernel to time beside this one")
    parser.add_argument("--build", choices=["native", "avx2"], default="native")
    parser.add_argument(
        "--decode-step",
        action="store_true",
        help="with --against: the default model's decode step with each kernel",
    )
    args = parser.parse_args()
    if args.decode_step and (not args.against or args.build != "native"):
        parser.error("--decode-step needs --against and the native build")
    if not available():
        sys.exit("kvchat's attention kernel is not built here (no C compiler?): nothing to compare")
    wall = harness.stopwatch()
    env = harness.environment(threads=torch.get_num_threads())
    rows = []
    flags = build_flags(args.build)
    build = kernel_build() if args.build == "native" else "AVX2 (built for CPUs without AVX-512)"
    scratch = tempfile.TemporaryDirectory()
    kernel = None if flags is None else kernel_at(None, Path(scratch.name), flags)
    print(f"kernel build: {build}, {torch.get_num_threads()} threads")
    print("| shape | query rows | keys | kernel ms | SDPA ms | ratio |")
    print("|---|---|---|---|---|---|")
    for name, q_len, n, query, key, value in cases():
        groups = query.shape[1] // key.shape[1]
        key_rep, value_rep = (t.repeat_interleave(groups, 1) for t in (key, value))
        mask = torch.ones(q_len, n, dtype=torch.bool).tril(n - q_len)
        scale = query.shape[-1] ** -0.5
        calls = 20 if q_len == 1 else 3
        ours = functools.partial(attend, kernel, query, key, value, scale)
        sdpa = functools.partial(
            torch.nn.functional.scaled_dot_product_attention,
            query, key_rep, value_rep, attn_mask=mask, scale=scale,
        )  # fmt: skip
        ours_s, sdpa_s = common.alternating_timings(ours, sdpa, args.repeats, calls)
        k_ms, s_ms = harness.median(ours_s) * 1e3, harness.median(sdpa_s) * 1e3
        ratio = harness.median_ratio(sdpa_s, ours_s)
        rows.append(
            {"shape": name, "q_len": q_len, "keys": n, "kernel_ms": k_ms,
             "sdpa_ms": s_ms, "ratio": ratio}
        )  # fmt: skip
        print(f"| {name} | {q_len} | {n} | {k_ms:.2f} | {s_ms:.2f} | {ratio:.2f} |")
    fields = {"args": vars(args), "kernel_build": build, "rows": rows}
    if args.against:
        then = kernel_at(args.against, Path(scratch.name), flags)
        fields["against"] = against(args.against, args.repeats, kernel, then)
        if args.decode_step:
            fields["decode_step"] = decode_steps_against(args.against, args.repeats, then)
    scratch.cleanup()
    harness.save_run(args.out, "bench_attention", fields, env, wall())


def build_flags(build: str) -> list[str] | None:
    """The compiler flags of ``--build`` (None: the kernel kvchat itself builds here)."""
    from kvchat.engine.kvdirect.exact_attention import AVX2_FLAGS

    return None if build == "native" else AVX2_FLAGS


def kernel_at(revision: str | None, directory: Path, flags: list[str] | None) -> Any:
    """The attention kernel's source at git ``revision`` (None: this checkout's), built into
    ``directory`` with ``flags`` (None: kvchat's own)."""
    from kvchat.engine.kvdirect.exact_attention import SOURCE, compile_kernel, compiler, load_kernel

    source = common.source_at(revision, SOURCE, directory)
    target = source.with_suffix(".so")
    if not compile_kernel(compiler(), target, flags, source=source):
        sys.exit(f"the kernel at {revision or 'this checkout'} does not build here")
    return load_kernel(target)


def attend(kernel: Any, query: Any, key: Any, value: Any, scale: float) -> Any:
    """One attention call through ``kernel`` (None: kvchat's own build)."""
    from kvchat.engine.kvdirect.exact_attention import AttentionState

    state = AttentionState(query, scale, key.shape[-2] - query.shape[-2], kernel=kernel)
    state.fold(key, value, 0)
    return state.finish()


def against(revision: str, repeats: int, kernel: Any, then: Any) -> list[dict[str, Any]]:
    """This kernel against ``then``, the one at ``revision`` (built alike): the same calls,
    interleaved, and the same bits required."""
    import torch

    rows = []
    print(f"\nagainst the kernel at {revision}:")
    print("| shape | query rows | keys | kernel ms | then ms | speedup | same bits |")
    print("|---|---|---|---|---|---|---|")
    for name, q_len, n, query, key, value in cases():
        scale = query.shape[-1] ** -0.5
        now_call = functools.partial(attend, kernel, query, key, value, scale)
        then_call = functools.partial(attend, then, query, key, value, scale)
        same = bool(torch.equal(now_call(), then_call()))
        calls = 20 if q_len == 1 else 3
        now_s, then_s = common.alternating_timings(now_call, then_call, repeats, calls)
        k_ms, t_ms = harness.median(now_s) * 1e3, harness.median(then_s) * 1e3
        ratio = harness.median_ratio(then_s, now_s)
        rows.append(
            {"shape": name, "q_len": q_len, "keys": n, "kernel_ms": k_ms,
             "then_ms": t_ms, "speedup": ratio, "same_bits": same}
        )  # fmt: skip
        print(
            f"| {name} | {q_len} | {n} | {k_ms:.2f} | {t_ms:.2f} | {ratio:.2f} "
            f"| {'yes' if same else 'NO'} |"
        )
    return rows


CONTEXTS = (500, 2000)
STEPS_PER_TURN = 8  # a kernel's turn: this many steps, the first two not counted


def decode_steps_against(revision: str, repeats: int, then: Any) -> list[dict[str, Any]]:
    """The default model's decode step (int4 weights, C++ layers) with this kernel and with
    ``then``: per context, one prefilled session stepped in turns of ``STEPS_PER_TURN``,
    the kernels alternating (``4 * repeats`` turns each), the median step time of each; and
    one 64-token greedy reply per kernel, whose tokens must agree."""
    import torch
    from transformers import AutoTokenizer

    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.kvdirect.exact_attention import symbol_address
    from kvchat.engine.models.decode_step import decode_step_for
    from kvchat.engine.models.load import load
    from kvchat.engine.models.resolve import resolve_model
    from kvchat.lab.texts import NOTES, STORY

    path = str(resolve_model(common.DEFAULT_MODEL).path)
    loaded = load(path, device="cpu", dtype="auto", weights="auto")
    step = decode_step_for(loaded.model)
    if step is None or not step.wait_for_native(600) or not step.native.attention_kernel:
        sys.exit("the default model's decode step has no C++ layers calling the kernel here")
    kernels = {"now": step.native.attention_kernel,
               "then": symbol_address(then, "kvchat_attention")}  # fmt: skip
    text = (STORY + NOTES) * 4
    every = AutoTokenizer.from_pretrained(path)(text, add_special_tokens=False)["input_ids"]
    rows = []
    print(f"\nthe default model's decode step, its C++ layers calling each kernel ({revision}):")
    print("| context | step ms | then ms | speedup | same tokens |")
    print("|---|---|---|---|---|")
    for context in CONTEXTS:
        ids = every[:context]
        replies = {}
        for name, address in kernels.items():
            step.native.attention_kernel = address
            replies[name] = common.decode_rate(loaded, ids, 64)["tokens"]
        session = ChatSession(loaded)
        _stamps, tokens = common.greedy_run(loaded, session.cache, ids, 1)
        token, times = tokens[-1], {name: [] for name in kernels}
        with torch.inference_mode():
            for turn in range(8 * repeats):
                name = ("now", "then")[turn % 2]
                step.native.attention_kernel = kernels[name]
                for i in range(STEPS_PER_TURN):
                    token, seconds = common.timed_step(loaded, session, token)
                    if i >= 2:
                        times[name].append(seconds)
        session.close()
        step.native.attention_kernel = kernels["now"]
        now_ms, then_ms = (harness.median(times[n]) * 1e3 for n in ("now", "then"))
        same = replies["now"] == replies["then"]
        rows.append({"context": context, "step_ms": now_ms, "then_ms": then_ms,
                     "speedup": then_ms / now_ms, "same_tokens": same})  # fmt: skip
        print(f"| {context} | {now_ms:.2f} | {then_ms:.2f} | {then_ms / now_ms:.2f} "
              f"| {'yes' if same else 'NO'} |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
