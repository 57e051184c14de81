"""The ``kvchat`` command.

``kvchat`` alone opens the chat app; ``kvchat run`` is the scriptable headless contract
(documented in README.md, relied on by tests and benchmarks); ``models`` and ``inspect``
answer questions without loading weights. torch and transformers are imported inside the
commands, so ``kvchat --help`` stays instant.

Exit codes (the headless contract in README.md): 0 done; 1 an error, said in one line;
2 a usage error (bad option or input), found before any model is loaded; 3 the replies were
given but at least one turn could not be saved (the line says which, and why); 130
interrupted by Ctrl-C; 128+N ended by signal N (SIGTERM 143, SIGHUP 129), after the normal
cleanup (spill files removed, locks released).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import click

from kvchat.commands.terminal import fail
from kvchat.engine.chat.settings import KV_DTYPES, CacheSettings
from kvchat.engine.models.settings import ModelSettings
from kvchat.errors import KvchatError

DEVICES = ["auto", "cpu", "cuda", "mps"]
DTYPES = ["float32", "bfloat16", "float16", "auto"]

# Sizes outside these are typos ("64" for 64MB), not machines; ceilings inside them that are
# still too small for the model are refused by the planner, with its numbers.
MIN_MAX_MEM = 64 * 1024
MAX_MAX_MEM = 2**50  # 1 PiB


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from kvchat.units import human_bytes, parse_size

    try:
        size = parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    except OverflowError:  # "1e999GB": a float that is infinite
        raise click.BadParameter(
            f"cannot read size {value!r}; write it like 64MB, 512KiB or 1.5GB"
        ) from None
    if size is None:
        return None
    if size < MIN_MAX_MEM:
        raise click.BadParameter(
            f"{value!r} is {human_bytes(size)}, below the smallest ceiling kvchat can work in "
            f"({human_bytes(MIN_MAX_MEM)}); give at least 64KiB, e.g. 8MB"
        )
    if size > MAX_MAX_MEM:
        raise click.BadParameter(
            f"{value!r} is {human_bytes(size)}, more than any machine holds (limit "
            f"{human_bytes(MAX_MAX_MEM)}); leave --max-mem out for no ceiling"
        )
    return size


def _temperature(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and (not math.isfinite(value) or value < 0):
        raise click.BadParameter(
            f"{value} is not a temperature; give 0 (greedy) or a positive number such as 0.7"
        )
    return value


def _top_p(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not (math.isfinite(value) and 0 < value <= 1):
        raise click.BadParameter(
            f"{value} is outside (0, 1]; give a probability mass such as 0.9 (1 keeps every token)"
        )
    return value


def model_options(fn: Callable) -> Callable:
    """Options shared by every command that loads a model."""
    options = [
        click.option("--model", "-m", default=None, help="Alias, HF repo id, model dir or .gguf file (default: smollm2-135m)."),
        click.option("--device", type=click.Choice(DEVICES), default=ModelSettings.device, show_default=True),
        click.option("--dtype", type=click.Choice(DTYPES), default=ModelSettings.dtype, show_default=True, help="auto: the checkpoint's own dtype on CPU (bfloat16 stays bfloat16; float16 runs as float32), bfloat16 on CUDA/MPS."),
        click.option("--weights", type=click.Choice(["auto", "none", "int8", "int4"]), default=ModelSettings.weights, show_default=True, help="auto: int4 on CPU for any safetensors checkpoint or GGUF, else none; none: full precision in --dtype; int8 / int4: weight-only quantized (torch's native CPU kernels)."),
        click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: physical cores, or OMP_NUM_THREADS)."),
        click.option("--decode-threads", type=click.IntRange(min=1), default=None, help="CPU threads for torch's kernels in one-token decode steps (default: 1 for weights up to 192 MiB, where it measured faster, else --threads; kvchat's int4 kernel always uses --threads)."),
        click.option("--cache", "cache_kind", type=click.Choice(["kvdirect", "standard"]), default=CacheSettings.kind, show_default=True, help="KV-Direct, or transformers' own DynamicCache for comparison."),
        click.option("--max-mem", callback=_size, default=None, help="Ceiling on resident conversation state, e.g. 64MB, 512KiB, 1.5GB."),
        click.option("--hot-window", type=click.IntRange(min=0), default=None, help="Tokens whose K/V stay hot (default: derived from --max-mem)."),
        click.option("--checkpoint", type=click.Choice(["residual", "kv", "auto"]), default=CacheSettings.checkpoint, show_default=True, help="What a cold token leaves behind per layer: its residual (recomputed), its K/V (read back), or auto (the cheaper exact form per layer)."),
        click.option("--prefill-chunk", type=click.IntRange(min=1), default=CacheSettings.prefill_chunk, show_default=True),
        click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default=CacheSettings.kv_dtype, show_default=True, help="What the conversation's K/V are held in: auto (as the model computes them), or bfloat16 for a float32 model (half the state and disk; see the README for its quality). A resumed conversation keeps its own."),
    ]  # fmt: skip
    for option in reversed(options):
        fn = option(fn)
    return fn


data_dir_option = click.option(
    "--data-dir",
    default=None,
    help="Conversation store (default: $KVCHAT_DATA_DIR or the XDG data dir).",
)


@click.group(invoke_without_command=True)
@click.version_option(package_name="kvchat")
@model_options
@click.option("--system", default=None, help="System prompt.")
@data_dir_option
@click.pass_context
def cli(ctx: click.Context, **opts: Any) -> None:
    """Local chat with a bounded KV-Direct cache. Without a command: the chat app."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(chat, **opts)


@cli.command()
@model_options
@click.option("--system", default=None, help="System prompt.")
@data_dir_option
def chat(**opts: Any) -> None:
    """Open the terminal chat app."""
    _run_app(opts)


def _run_app(opts: dict[str, Any]) -> None:
    from kvchat.ui.app import run_app

    code = run_app(opts)
    if code:
        sys.exit(code)


@cli.command()
@model_options
@click.option("--system", default=None, help="System prompt.")
@click.option("--prompt", "prompts", multiple=True, help="A user turn; repeat for more turns.")
@click.option(
    "--prompt-file",
    type=click.File("rb"),
    default=None,
    help="A user turn read from a UTF-8 file ('-' for stdin).",
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option(
    "--temperature",
    type=float,
    default=None,
    callback=_temperature,
    help="Sample at this temperature (default and 0: greedy).",
)
@click.option("--top-p", type=float, default=1.0, callback=_top_p, show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=None)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per turn on stdout.")
@click.option(
    "--conversation",
    "conversation_id",
    default=None,
    help="Resume this saved conversation (id or prefix).",
)
@click.option("--no-save", is_flag=True, help="Do not save the conversation.")
@click.option(
    "--regenerate",
    is_flag=True,
    help="Answer --conversation's last prompt again from the turn before it, as a fork "
    "(samples at temperature 0.7 unless --temperature is given).",
)
@click.option(
    "--in-place", is_flag=True, help="With --regenerate: replace the last reply, no fork."
)
@data_dir_option
def run(**opts: Any) -> None:
    """Headless: answer each --prompt in turn, streaming, then print a memory line.

    Exit status: 0 done, 1 error, 2 usage error, 3 a turn could not be saved, 130 Ctrl-C,
    143/129 SIGTERM/SIGHUP (see README, "The headless contract").
    """
    from kvchat.commands.run import run_prompts

    if opts["in_place"] and not opts["regenerate"]:
        raise click.UsageError("--in-place only goes with --regenerate")
    if opts["regenerate"] and not opts["conversation_id"]:
        raise click.UsageError("--regenerate needs --conversation ID: the reply to answer again")
    if opts["regenerate"] and opts["no_save"]:
        raise click.UsageError("--regenerate saves the new reply; drop --no-save")
    run_prompts(opts, _read_prompts(opts, optional=opts["regenerate"]))


def _read_prompts(opts: dict[str, Any], optional: bool = False) -> list[str]:
    """The turns to answer, refused (usage error) if empty (unless ``optional``: --regenerate
    brings its own) or not UTF-8 text."""
    prompts = list(opts["prompts"])
    for prompt in prompts:
        if not prompt.strip():
            raise click.BadParameter("a prompt is empty; give some text", param_hint="'--prompt'")
    source = opts.get("prompt_file")
    if source is not None:
        name = getattr(source, "name", "-")
        try:
            text = source.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise click.BadParameter(
                f"{name} is not UTF-8 text (byte {exc.start}); convert it, e.g. with "
                "`iconv -t utf-8`",
                param_hint="'--prompt-file'",
            ) from None
        except OSError as exc:
            raise click.BadParameter(
                f"cannot read {name} ({exc.strerror or exc})", param_hint="'--prompt-file'"
            ) from None
        if not text.strip():
            raise click.BadParameter(f"{name} is empty", param_hint="'--prompt-file'")
        prompts.append(text)
    if not prompts and not optional:
        raise click.UsageError("nothing to answer; pass --prompt TEXT or --prompt-file FILE")
    return prompts


@cli.command()
@click.option("--json", "as_json", is_flag=True)
def models(as_json: bool) -> None:
    """List model aliases and which are available locally."""
    from kvchat.commands.inspect import show_models

    show_models(as_json)


@cli.command()
@click.argument("model")
@click.option(
    "--dtype", default="bfloat16", show_default=True, help="Bytes per element to count with."
)
@click.option(
    "--tokens",
    "n_tokens",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="Context length for the standard-cache figure.",
)
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--costs",
    "show_costs",
    is_flag=True,
    help="Also measure (once, then cached) read and recompute costs here, and what auto picks.",
)
@data_dir_option
def inspect(
    model: str, dtype: str, n_tokens: int, as_json: bool, show_costs: bool, data_dir: str | None
) -> None:
    """Bytes per token per layer: K/V, residual checkpoint, standard-cache equivalent."""
    from kvchat.commands.inspect import show_inspect
    from kvchat.engine.kvdirect.footprint import dtype_itemsize

    try:
        dtype_itemsize(dtype)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--dtype'") from None
    show_inspect(model, dtype, n_tokens, as_json, show_costs, data_dir)


@cli.command(name="list")
@data_dir_option
@click.option("--json", "as_json", is_flag=True)
def list_conversations(data_dir: str | None, as_json: bool) -> None:
    """Saved conversations (id, title, model, turns, tokens, disk, last use) and spill files."""
    from kvchat.commands.store_commands import show_conversations

    show_conversations(data_dir, as_json)


@cli.command()
@click.argument("conversation_id")
@click.option(
    "--yes", "-y", is_flag=True, help="Delete without asking (required for an id prefix)."
)
@data_dir_option
def delete(conversation_id: str, yes: bool, data_dir: str | None) -> None:
    """Delete a saved conversation and its residual files (asks first on a terminal)."""
    from kvchat.commands.store_commands import delete_conversation

    delete_conversation(conversation_id, yes, data_dir)


@cli.command()
@click.argument("conversation_id")
@click.option("--format", "fmt", type=click.Choice(["md", "json"]), default="md", show_default=True)
@data_dir_option
def export(conversation_id: str, fmt: str, data_dir: str | None) -> None:
    """Print a conversation's messages as Markdown or JSON (control characters escaped)."""
    from kvchat.commands.store_commands import export_conversation

    export_conversation(conversation_id, fmt, data_dir)


@cli.command()
@click.argument("conversation_id")
@click.option(
    "--turn",
    type=click.IntRange(min=0),
    default=None,
    help="Keep turns 1..N (default: all of them); 0 keeps none.",
)
@click.option("--json", "as_json", is_flag=True, help='Print {"conversation": ID}.')
@data_dir_option
def fork(conversation_id: str, turn: int | None, as_json: bool, data_dir: str | None) -> None:
    """A new conversation holding turns 1..N of a saved one, exactly as it stood after turn
    N (the original is never changed); prints its id. Continue it with `kvchat run
    --conversation NEW --prompt ...`: to edit message N+1, fork at N and send the new text."""
    from kvchat.commands.store_commands import fork_conversation

    fork_conversation(conversation_id, turn, as_json, data_dir)


@cli.command()
@data_dir_option
@click.option("--json", "as_json", is_flag=True)
def gc(data_dir: str | None, as_json: bool) -> None:
    """Free disk space: spill files of kvchat processes that are gone, and leftovers of
    interrupted deletes. Never touches a running session or a saved conversation."""
    from kvchat.commands.store_commands import collect_garbage

    collect_garbage(data_dir, as_json)


@cli.command()
@click.argument("conversation_id")
@model_options
@click.option("--prompt", "prompts", multiple=True, help="Continue headless with these turns.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@data_dir_option
@click.pass_context
def resume(ctx: click.Context, conversation_id: str, **opts: Any) -> None:
    """Resume a saved conversation: in the chat app, or headless with --prompt."""
    if opts["prompts"]:
        ctx.invoke(
            run,
            conversation_id=conversation_id,
            temperature=None,
            top_p=1.0,
            seed=None,
            prompt_file=None,
            system=None,
            no_save=False,
            **opts,
        )
        return
    from kvchat.commands.store_commands import check_conversation

    app_opts = {**opts, "system": None, "conversation_id": conversation_id}
    check_conversation(app_opts)  # a bad id fails here, not after the model loads
    _run_app(app_opts)


@cli.command()
@click.argument("conversation_id")
@click.option(
    "--model",
    "-m",
    default=None,
    help="The model it was saved with (default: the one its file names).",
)
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="CPU threads (default: physical cores).",
)
@data_dir_option
def repair(conversation_id: str, **opts: Any) -> None:  # fmt: skip
    """Rebuild a conversation's damaged segments from its saved token ids, exactly."""
    from kvchat.commands.repair import repair_conversation

    repair_conversation(conversation_id, opts)


@cli.command()
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on; anything but loopback needs --api-key.",
)
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True)
@click.option(
    "--api-key",
    envvar="KVCHAT_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' (or set KVCHAT_API_KEY).",
)
@model_options
@data_dir_option
def serve(**opts: Any) -> None:
    """Serve an OpenAI-compatible API whose conversations continue from their saved files."""
    from kvchat.commands.run import cache_settings, load_from_options
    from kvchat.paths import data_dir
    from kvchat.serve.auth import check_bind

    try:
        check_bind(opts["host"], opts["api_key"])  # before spending seconds on the model
        loaded = load_from_options(opts)
        from kvchat.serve.server import serve as run_server

        run_server(
            loaded,
            cache=cache_settings(opts),
            data_dir=data_dir(opts["data_dir"]),
            host=opts["host"],
            port=opts["port"],
            api_key=opts["api_key"],
            say=lambda m: click.echo(f"kvchat: {m}", err=True),
        )
    except KvchatError as exc:
        fail(exc)


def _lab_command(kind: str, help_text: str) -> None:
    from kvchat.lab.suites import SUITES

    @cli.command(name=kind, help=help_text)
    @click.option("--quick", is_flag=True, help="Small sizes, for CI (a few minutes).")
    @click.option(
        "--out", "out_dir", default=None, help=f"Results directory (default: results/{kind})."
    )
    @click.option(
        "--device", type=click.Choice(["cpu", "cuda", "mps"]), default="cpu", show_default=True
    )
    @click.option(
        "--only",
        multiple=True,
        type=click.Choice(list(SUITES[kind])),
        help="Run just these experiments (repeatable).",
    )
    def command(quick: bool, out_dir: str | None, device: str, only: tuple[str, ...]) -> None:
        from kvchat.commands.lab import run_lab

        run_lab(kind, quick, out_dir, device, only)


_lab_command(
    "verify", "Check the claims KV-Direct rests on; writes JSON, PNG plots and a Markdown report."
)
_lab_command(
    "bench",
    "Eviction baselines, a 20-turn conversation, latency per operation; JSON, PNG, Markdown.",
)


def main() -> None:
    from kvchat.threads import prefer_passive_wait

    prefer_passive_wait()  # before anything imports torch: see kvchat.threads
    cli(prog_name="kvchat")


if __name__ == "__main__":
    main()
