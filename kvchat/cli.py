"""The ``kvchat`` command.

``kvchat`` alone opens the chat app; ``kvchat run`` is the scriptable headless contract
(documented in README.md, relied on by tests and benchmarks); ``models`` and ``inspect``
answer questions without loading weights. torch and transformers are imported inside the
commands, so ``kvchat --help`` stays instant.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from typing import Any

import click

from kvchat.errors import KvchatError

DEVICES = ["auto", "cpu", "cuda", "mps"]
DTYPES = ["float32", "bfloat16", "float16", "auto"]


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from kvchat.engine.planner import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _fail(exc: BaseException) -> None:
    click.echo(f"kvchat: error: {exc}", err=True)
    sys.exit(1)


def model_options(fn: Callable) -> Callable:
    """Options shared by every command that loads a model."""
    options = [
        click.option("--model", "-m", default=None, help="Alias, HF repo id, model dir or .gguf file (default: smollm2-135m)."),
        click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True),
        click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True),
        click.option("--weights", type=click.Choice(["auto", "none", "int8", "int4"]), default="auto", show_default=True, help="auto: int4 for a model converted from a GGUF on CPU, else none; none: full precision in --dtype; int8 / int4: weight-only quantized (torch's native CPU kernels)."),
        click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: physical cores, or OMP_NUM_THREADS)."),
        click.option("--cache", "cache_kind", type=click.Choice(["kvdirect", "standard"]), default="kvdirect", show_default=True, help="KV-Direct, or transformers' own DynamicCache for comparison."),
        click.option("--max-mem", callback=_size, default=None, help="Ceiling on resident conversation state, e.g. 64MB, 512KiB, 1.5GB."),
        click.option("--hot-window", type=click.IntRange(min=0), default=None, help="Tokens whose K/V stay hot (default: derived from --max-mem)."),
        click.option("--checkpoint", type=click.Choice(["residual", "kv", "auto"]), default="residual", show_default=True, help="What an evicted token leaves behind per layer."),
        click.option("--prefill-chunk", type=click.IntRange(min=1), default=256, show_default=True),
    ]  # fmt: skip
    for option in reversed(options):
        fn = option(fn)
    return fn


data_dir_option = click.option(
    "--data-dir",
    default=None,
    help="Conversation store (default: $KVCHAT_DATA_DIR or the XDG data dir).",
)


def _store(opts: dict[str, Any]):
    from kvchat.paths import data_dir
    from kvchat.storage import ConversationStore

    return ConversationStore(data_dir(opts.get("data_dir")))


def _load(opts: dict[str, Any], quiet: bool = False):
    from kvchat.engine.loader import load
    from kvchat.engine.models import DEFAULT_MODEL

    say = (lambda _m: None) if quiet else (lambda m: click.echo(f"kvchat: {m}", err=True))
    return load(
        opts["model"] or DEFAULT_MODEL,
        device=opts["device"],
        dtype=opts["dtype"],
        weights=opts["weights"],
        threads=opts.get("threads"),
        progress=say,
    )


def _cache_settings(opts: dict[str, Any]):
    from kvchat.engine.settings import CacheSettings

    return CacheSettings(
        kind=opts["cache_kind"],
        max_mem=opts["max_mem"],
        hot_window=opts["hot_window"],
        checkpoint=opts["checkpoint"],
        prefill_chunk=opts["prefill_chunk"],
    )


@click.group(invoke_without_command=True)
@click.version_option(package_name="kvchat")
@model_options
@click.option("--system", default=None, help="System prompt.")
@click.pass_context
def cli(ctx: click.Context, **opts: Any) -> None:
    """Local chat with a bounded KV-Direct cache. Without a command: the chat app."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(chat, **opts)


@cli.command()
@model_options
@click.option("--system", default=None, help="System prompt.")
def chat(**opts: Any) -> None:
    """Open the terminal chat app."""
    try:
        from kvchat.ui.app import run_app
    except ImportError:
        _fail(KvchatError("the chat app is not built yet; use `kvchat run --prompt ...`"))
    run_app(opts)


class _CancelOnSigint:
    """First Ctrl-C ends the reply cleanly; a second one interrupts for real."""

    def __init__(self) -> None:
        self.cancelled = False

    def __enter__(self) -> _CancelOnSigint:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.cancelled:
            raise KeyboardInterrupt
        self.cancelled = True

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)


@cli.command()
@model_options
@click.option("--system", default=None, help="System prompt.")
@click.option("--prompt", "prompts", multiple=True, help="A user turn; repeat for more turns.")
@click.option(
    "--prompt-file",
    type=click.File("r"),
    default=None,
    help="A user turn read from a file ('-' for stdin).",
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option(
    "--temperature", type=float, default=None, help="Sample at this temperature (default: greedy)."
)
@click.option(
    "--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True
)
@click.option("--seed", type=int, default=None)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per turn on stdout.")
@click.option(
    "--conversation",
    "conversation_id",
    default=None,
    help="Resume this saved conversation (id or prefix).",
)
@click.option("--no-save", is_flag=True, help="Do not save the conversation.")
@data_dir_option
def run(**opts: Any) -> None:
    """Headless: answer each --prompt in turn, streaming, then print a memory line."""
    from kvchat.engine.settings import SamplingSettings

    prompts = list(opts["prompts"])
    if opts["prompt_file"] is not None:
        prompts.append(opts["prompt_file"].read())
    if not prompts:
        _fail(KvchatError("nothing to answer; pass --prompt TEXT or --prompt-file FILE"))
    as_json = opts["as_json"]
    sampling = SamplingSettings(
        temperature=opts["temperature"],
        top_p=opts["top_p"],
        seed=opts["seed"],
        max_new_tokens=opts["max_new_tokens"],
    )
    try:
        if opts["conversation_id"]:  # fail fast, before loading any weights
            opts["conversation_id"] = _store(opts).check_not_open(opts["conversation_id"])
        loaded = _load(opts, quiet=as_json)
        from kvchat.engine.memory import format_memory_line

        say = (lambda _m: None) if as_json else (lambda m: click.echo(f"kvchat: {m}", err=True))
        from kvchat.engine.conversation import open_session

        session = open_session(
            loaded,
            data_dir=opts["data_dir"],
            cache=_cache_settings(opts),
            system=opts["system"],
            conversation_id=opts["conversation_id"],
            save=not opts["no_save"],
            say=say,
        )
        try:
            for turn, prompt in enumerate(prompts, start=1):
                with _CancelOnSigint() as sigint:
                    on_text = None if as_json else _stream_to_stdout
                    result = session.send(
                        prompt, sampling, on_text=on_text, should_stop=lambda: sigint.cancelled
                    )
                if as_json:
                    conversation_id = session.conversation.id if session.conversation else None
                    click.echo(json.dumps(_turn_json(turn, prompt, result, conversation_id)))
                else:
                    if result.cancelled:
                        click.echo(" [stopped]", nl=False)
                    click.echo()
                    click.echo(format_memory_line(result.memory), err=True)
                if result.error:
                    click.echo(f"kvchat: reply ended early: {result.error}", err=True)
                # A Ctrl-C that landed after the reply (while saving) still means stop.
                if result.cancelled or sigint.cancelled:
                    session.close()
                    sys.exit(130)
        except KeyboardInterrupt:
            click.echo(f"\nkvchat: interrupted; {_saved_note(session)}", err=True)
            session.close()
            sys.exit(130)
        session.close()
    except KvchatError as exc:
        _fail(exc)


def _saved_note(session: Any) -> str:
    conversation = session.conversation
    if conversation is None:
        return "nothing was saved"
    turns = len(conversation.manifest.turns)
    return (
        f"conversation {conversation.id} keeps its {turns} saved turn(s); the turn in progress "
        f"was not saved (resume with `kvchat resume {conversation.id}`)"
    )


def _stream_to_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _turn_json(turn: int, prompt: str, result: Any, conversation: str | None) -> dict[str, Any]:
    return {
        "conversation": conversation,
        "turn": turn,
        "prompt": prompt,
        "reply": result.reply,
        "tokens": result.tokens,
        "finish_reason": result.finish_reason,
        "error": result.error,
        "prompt_tokens": result.prompt_tokens,
        "prefill_seconds": round(result.prefill_seconds, 4),
        "decode_seconds": round(result.decode_seconds, 4),
        "decode_tokens_per_second": round(result.decode_tokens_per_second, 2),
        "memory": result.memory,
    }


@cli.command()
@click.option("--json", "as_json", is_flag=True)
def models(as_json: bool) -> None:
    """List model aliases and which are available locally."""
    from kvchat.engine.models import list_models

    rows = list_models()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'alias':<14} {'local':<6} {'repo':<38} description")
    for row in rows:
        local = "yes" if row.get("available") else "no"
        click.echo(
            f"{row['alias']:<14} {local:<6} {row['repo_id']:<38} {row.get('description', '')}"
        )


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
def inspect(model: str, dtype: str, n_tokens: int, as_json: bool) -> None:
    """Bytes per token per layer: K/V, residual checkpoint, standard-cache equivalent."""
    from kvchat.engine.footprint import footprint_from_config, load_config
    from kvchat.engine.inspect_report import inspect_as_dict, render_inspect

    try:
        fp = footprint_from_config(load_config(model), dtype)
    except KvchatError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(inspect_as_dict(fp, n_tokens), indent=2))
    else:
        click.echo(render_inspect(fp, n_tokens))


@cli.command(name="list")
@data_dir_option
@click.option("--json", "as_json", is_flag=True)
def list_conversations(data_dir: str | None, as_json: bool) -> None:
    """Saved conversations: id, title, model, turns, tokens, bytes on disk, last use."""
    from kvchat.engine.planner import human_bytes

    rows = _store({"data_dir": data_dir}).list()
    if as_json:
        click.echo(json.dumps([r.__dict__ for r in rows], indent=2, default=str))
        return
    if not rows:
        click.echo("no saved conversations")
        return
    click.echo(
        f"{'id':<21} {'model':<16} {'turns':>5} {'tokens':>7} {'disk':>10}  last used            title"
    )
    for r in rows:
        title = r.error and f"[{r.error}]" or r.title
        click.echo(
            f"{r.id:<21} {str(r.model)[:16]:<16} {r.turns:>5} {r.tokens:>7} "
            f"{human_bytes(r.bytes_on_disk):>10}  {str(r.last_used)[:19]:<20} {title}"
        )


@cli.command()
@click.argument("conversation_id")
@data_dir_option
def delete(conversation_id: str, data_dir: str | None) -> None:
    """Delete a saved conversation and its residual files."""
    store = _store({"data_dir": data_dir})
    try:
        full = store.resolve(conversation_id)
        store.delete(full)
    except KvchatError as exc:
        _fail(exc)
    click.echo(f"deleted {full}")


@cli.command()
@click.argument("conversation_id")
@click.option("--format", "fmt", type=click.Choice(["md", "json"]), default="md", show_default=True)
@data_dir_option
def export(conversation_id: str, fmt: str, data_dir: str | None) -> None:
    """Print a conversation's messages as Markdown or JSON."""
    try:
        click.echo(_store({"data_dir": data_dir}).export(conversation_id, fmt))
    except KvchatError as exc:
        _fail(exc)


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
    from kvchat.ui.app import run_app

    run_app({**opts, "system": None, "conversation_id": conversation_id})


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
        from pathlib import Path

        from kvchat.lab.context import LabContext
        from kvchat.lab.runner import run_suite
        from kvchat.lab.suites import experiments

        results = Path(out_dir or f"results/{kind}")
        ctx = LabContext(
            results_dir=results, quick=quick, device=device, say=lambda m: click.echo(m, err=True)
        )
        argv = " ".join(["kvchat", kind, *sys.argv[2:]])
        try:
            sections, paths = run_suite(kind, ctx, experiments(kind, only), command=argv)
        except KvchatError as exc:
            _fail(exc)
        failed = [c for s in sections for c in s.claims if c.held is False]
        errors = [s.key for s in sections if s.error]
        click.echo(f"report: {paths['markdown']}  data: {paths['json']}")
        click.echo(
            f"{sum(len(s.claims) for s in sections)} claims checked, {len(failed)} did not hold"
        )
        if errors:
            click.echo(
                f"kvchat: error: experiments failed: {', '.join(errors)} (see {paths['markdown']})",
                err=True,
            )
            sys.exit(1)


_lab_command(
    "verify", "Check the claims KV-Direct rests on; writes JSON, PNG plots and a Markdown report."
)
_lab_command(
    "bench",
    "Eviction baselines, a 20-turn conversation, latency per operation; JSON, PNG, Markdown.",
)


def main() -> None:
    from kvchat.engine.threads import prefer_passive_wait

    prefer_passive_wait()  # before anything imports torch: see kvchat.engine.threads
    cli(prog_name="kvchat")


if __name__ == "__main__":
    main()
