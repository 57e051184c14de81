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

import contextlib
import json
import math
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click

from kvchat.errors import KvchatError

DEVICES = ["auto", "cpu", "cuda", "mps"]
DTYPES = ["float32", "bfloat16", "float16", "auto"]

EXIT_ERROR = 1
EXIT_NOT_SAVED = 3
EXIT_INTERRUPTED = 130
# Sizes outside these are typos ("64" for 64MB), not machines; ceilings inside them that are
# still too small for the model are refused by the planner, with its numbers.
MIN_MAX_MEM = 64 * 1024
MAX_MAX_MEM = 2**50  # 1 PiB


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from kvchat.kvdirect.planner import human_bytes, parse_size

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


def _fail(exc: BaseException) -> None:
    _end_stdout_line()
    click.echo(f"kvchat: error: {exc}", err=True)
    sys.exit(EXIT_ERROR)


class _Stdout:
    """Whether the reply streamed to stdout ended its line, so a note on stderr that shares
    the terminal starts on a line of its own ("Paris.\nkvchat: saving as ...")."""

    at_line_start = True


def _stream_to_stdout(text: str) -> None:
    if not text:
        return
    sys.stdout.write(text)
    sys.stdout.flush()
    _Stdout.at_line_start = text.endswith("\n")


def _end_stdout_line() -> None:
    if not _Stdout.at_line_start:
        sys.stdout.write("\n")
        sys.stdout.flush()
        _Stdout.at_line_start = True


def _note(message: str) -> None:
    """One ``kvchat: ...`` line on stderr, never glued to a half-printed reply."""
    _end_stdout_line()
    click.echo(f"kvchat: {message}", err=True)


PROGRESS_MIN_TOKENS = 1024  # prompts shorter than this read in about a second: no bar


class _PrefillProgress:
    """A progress bar on stderr while a long prompt is read (prefill): redrawn in place on
    a terminal, a line per quarter otherwise (logs stay readable)."""

    def __init__(self) -> None:
        self.shown = -1
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if total < PROGRESS_MIN_TOKENS:
            return
        pct = 100 * done // total
        if self.tty:
            bar = "#" * (pct // 5)
            sys.stderr.write(f"\rkvchat: reading the prompt [{bar:<20}] {done}/{total} tokens")
            if done >= total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif pct // 25 > self.shown:
            self.shown = pct // 25
            _note(f"reading the prompt: {done}/{total} tokens ({pct}%)")


@contextlib.contextmanager
def _exit_on_termination() -> Iterator[None]:
    """SIGTERM and SIGHUP (``timeout``, a closed terminal) become ``SystemExit(128+N)``, so
    the ``finally`` blocks and atexit hooks run: spill files removed, locks released."""

    def handle(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    wanted = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {sig: signal.signal(sig, handle) for sig in wanted}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
        click.option("--checkpoint", type=click.Choice(["residual", "kv", "auto"]), default="auto", show_default=True, help="What a cold token leaves behind per layer: its residual (recomputed), its K/V (read back), or auto (the cheaper exact form per layer)."),
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


def _check_conversation(opts: dict[str, Any]) -> None:
    """Resolve ``opts["conversation_id"]`` and refuse one that is missing or open elsewhere,
    before any weights are loaded (exits with one line)."""
    if not opts.get("conversation_id"):
        return
    try:
        opts["conversation_id"] = _store(opts).check_not_open(opts["conversation_id"])
    except KvchatError as exc:
        _fail(exc)


def _store(opts: dict[str, Any]):
    from kvchat.paths import data_dir
    from kvchat.storage import ConversationStore

    return ConversationStore(data_dir(opts.get("data_dir")))


def _load(opts: dict[str, Any], quiet: bool = False):
    from kvchat.models.load import load
    from kvchat.models.registry import DEFAULT_MODEL

    say = (lambda _m: None) if quiet else _note
    return load(
        opts["model"] or DEFAULT_MODEL,
        device=opts["device"],
        dtype=opts["dtype"],
        weights=opts["weights"],
        threads=opts.get("threads"),
        progress=say,
    )


def _cache_settings(opts: dict[str, Any]):
    from kvchat.chat.settings import CacheSettings

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
@data_dir_option
def run(**opts: Any) -> None:
    """Headless: answer each --prompt in turn, streaming, then print a memory line.

    Exit status: 0 done, 1 error, 2 usage error, 3 a turn could not be saved, 130 Ctrl-C,
    143/129 SIGTERM/SIGHUP (see README, "The headless contract").
    """
    from kvchat.chat.settings import SamplingSettings

    prompts = _read_prompts(opts)
    sampling = SamplingSettings(
        temperature=opts["temperature"],
        top_p=opts["top_p"],
        seed=opts["seed"],
        max_new_tokens=opts["max_new_tokens"],
    )
    _check_conversation(opts)  # fail fast, before loading any weights
    with _exit_on_termination():
        session = _open_run_session(opts)
        try:
            code = _answer(session, prompts, sampling, opts["as_json"])
        except KvchatError as exc:
            _fail(exc)
        finally:
            session.close()
    if code:
        sys.exit(code)


def _read_prompts(opts: dict[str, Any]) -> list[str]:
    """The turns to answer, refused (usage error) if empty or not UTF-8 text."""
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
    if not prompts:
        raise click.UsageError("nothing to answer; pass --prompt TEXT or --prompt-file FILE")
    return prompts


def _open_run_session(opts: dict[str, Any]) -> Any:
    """Load the model and open the conversation; Ctrl-C here exits 130, errors exit 1."""
    as_json = opts["as_json"]
    try:
        loaded = _load(opts, quiet=as_json)
        from kvchat.chat.conversation import open_session

        if not loaded.has_chat_template:
            _note(
                f"{loaded.name} is a base model (no chat template): plain completion, each "
                "prompt is continued as written"
            )
        return open_session(
            loaded,
            data_dir=opts["data_dir"],
            cache=_cache_settings(opts),
            system=opts["system"],
            conversation_id=opts["conversation_id"],
            save=not opts["no_save"],
            say=(lambda _m: None) if as_json else _note,
        )
    except KeyboardInterrupt:
        _note("interrupted before the first reply; nothing was saved")
        sys.exit(EXIT_INTERRUPTED)
    except KvchatError as exc:
        _fail(exc)


def _answer(session: Any, prompts: list[str], sampling: Any, as_json: bool) -> int:
    """Answer each prompt in turn; returns the exit status."""
    from kvchat.chat.memory import format_memory_line

    unsaved: list[int] = []  # turns answered but not on disk (a later save retries them)
    code = 0
    for turn, prompt in enumerate(prompts, start=1):
        try:
            with _CancelOnSigint() as sigint:
                result = session.send(
                    prompt,
                    sampling,
                    on_text=None if as_json else _stream_to_stdout,
                    should_stop=lambda: sigint.cancelled,
                    on_progress=_PrefillProgress(),
                )
        except KeyboardInterrupt:
            _note(f"interrupted; {_saved_note(session)}")
            return EXIT_INTERRUPTED
        if as_json:
            conversation_id = session.conversation.id if session.conversation else None
            click.echo(json.dumps(_turn_json(turn, prompt, result, conversation_id)))
        else:
            if result.cancelled:
                _stream_to_stdout(" [stopped]")
            _end_stdout_line()
            click.echo(format_memory_line(result.memory), err=True)
        if result.save_error:
            unsaved.append(turn)
            _note(f"saving failed: {result.save_error}")
        else:
            unsaved = []  # a successful save writes every turn still pending
            if result.error:
                _note(f"reply ended early: {result.error}")
        # A Ctrl-C that landed after the reply (while saving) still means stop.
        if result.cancelled or sigint.cancelled:
            code = EXIT_INTERRUPTED
            break
    if unsaved:
        _note(
            f"error: {_turns(unsaved)} not saved; the replies above are all there is of "
            "them. Free disk space or fix the permissions of the data dir (or pass "
            "--data-dir DIR), then run again"
        )
        return code or EXIT_NOT_SAVED
    return code


def _turns(numbers: list[int]) -> str:
    if len(numbers) == 1:
        return f"turn {numbers[0]} is"
    return f"turns {numbers[0]}-{numbers[-1]} are"


def _saved_note(session: Any) -> str:
    conversation = session.conversation
    if conversation is None:
        return "nothing was saved"
    turns = len(conversation.manifest.turns)
    return (
        f"conversation {conversation.id} keeps its {turns} saved turn(s); the turn in progress "
        f"was not saved (resume with `kvchat resume {conversation.id}`)"
    )


def _turn_json(turn: int, prompt: str, result: Any, conversation: str | None) -> dict[str, Any]:
    return {
        "conversation": conversation,
        "turn": turn,
        "prompt": prompt,
        "reply": result.reply,
        "tokens": result.tokens,
        "finish_reason": result.finish_reason,
        "error": result.error,
        "saved": conversation is not None and not result.save_error,
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
    from kvchat.models.resolve import list_models

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
    from kvchat.kvdirect.footprint import dtype_itemsize, footprint_from_config, load_config
    from kvchat.kvdirect.inspect_report import inspect_as_dict, render_inspect

    try:
        dtype_itemsize(dtype)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--dtype'") from None
    try:
        fp = footprint_from_config(load_config(model), dtype)
    except KvchatError as exc:
        _fail(exc)
    costs = None
    if show_costs:
        costs = _measured_costs(fp, dtype, data_dir)
    if as_json:
        report = inspect_as_dict(fp, n_tokens)
        if costs is not None:
            report["costs"] = costs
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render_inspect(fp, n_tokens))
        if costs is not None:
            click.echo(_render_costs(costs))


def _measured_costs(fp: Any, dtype: str, data_dir: str | None) -> dict[str, Any]:
    """Read and recompute costs on this CPU and the data dir's disk (cached after once)."""
    from dataclasses import asdict

    import torch

    from kvchat.kvdirect.costs import device_costs
    from kvchat.paths import data_dir as resolve_data_dir

    dt = "float32" if dtype == "auto" else dtype
    costs = device_costs(fp, torch.device("cpu"), dt, resolve_data_dir(data_dir))
    from kvchat.kvdirect.costs import shape_key

    layer = fp.layers[0]
    shapes = {shape_key(x) for x in fp.layers}
    report = asdict(costs)
    report["recompute_rows_per_s"] = {
        k: v for k, v in report["recompute_rows_per_s"].items() if k in shapes
    }
    return {
        **report,
        "per_cold_token_step_seconds": {
            form: costs.step_cost(layer, form) for form in ("kv", "residual")
        },
        "auto_chooses": sorted({costs.cheaper_form(x) for x in fp.layers}),
    }


def _render_costs(costs: dict[str, Any]) -> str:
    step = costs["per_cold_token_step_seconds"]
    rates = "; ".join(
        f"{shape}: {r['1']:.0f} rows/s one by one, {r['256']:.0f} rows/s in 256-row calls"
        for shape, r in costs["recompute_rows_per_s"].items()
    )
    return (
        f"\nMeasured on this machine ({costs['device']}, {costs['dtype']}): memory read "
        f"{costs['memory_read_gbps']:.1f} GB/s, data-dir disk {costs['disk_warm_read_gbps']:.1f} "
        f"GB/s warm / {costs['disk_cold_read_gbps']:.2f} GB/s cold; recompute {rates}.\n"
        f"Bringing one cold token back per step: K/V {1e6 * step['kv']:.2f} us, residual "
        f"{1e6 * step['residual']:.2f} us -> --checkpoint auto picks {', '.join(costs['auto_chooses'])}."
    )


@cli.command(name="list")
@data_dir_option
@click.option("--json", "as_json", is_flag=True)
def list_conversations(data_dir: str | None, as_json: bool) -> None:
    """Saved conversations (id, title, model, turns, tokens, disk, last use) and spill files."""
    from dataclasses import asdict

    from kvchat.kvdirect.planner import human_bytes
    from kvchat.paths import data_dir as resolve_data_dir
    from kvchat.storage import ConversationStore
    from kvchat.storage.spill import spill_folders, spill_root
    from kvchat.storage.text import safe_terminal_text

    root = resolve_data_dir(data_dir)
    try:
        rows = ConversationStore(root).list()
    except KvchatError as exc:
        _fail(exc)
    spill = spill_folders(root)
    spill_bytes = sum(f.nbytes for f in spill)
    stale_bytes = sum(f.nbytes for f in spill if f.stale)
    if as_json:
        doc = {
            "conversations": [asdict(r) for r in rows],
            "spill": {
                "folder": str(spill_root(root)),
                "bytes": spill_bytes,
                "stale_bytes": stale_bytes,
            },
        }
        click.echo(json.dumps(doc, indent=2, default=str))  # ASCII-only: no raw controls
        return
    if not rows:
        click.echo("no saved conversations")
    else:
        click.echo(
            f"{'id':<21} {'model':<16} {'turns':>5} {'tokens':>7} {'disk':>10}  last used            title"
        )
    for r in rows:
        # Titles, model names and errors come from files anyone can edit: never raw escapes.
        title = safe_terminal_text(r.error and f"[{r.error}]" or r.title, multiline=False)
        model = safe_terminal_text(str(r.model), multiline=False)[:16]
        click.echo(
            f"{r.id:<21} {model:<16} {r.turns:>5} {r.tokens:>7} "
            f"{human_bytes(r.bytes_on_disk):>10}  {str(r.last_used)[:19]:<20} {title}"
        )
    if spill_bytes:
        line = f"spill files: {human_bytes(spill_bytes)} in {spill_root(root)}"
        if stale_bytes:
            line += (
                f", {human_bytes(stale_bytes)} of it left by kvchat processes that are gone "
                "(`kvchat gc` frees it)"
            )
        click.echo(line)


@cli.command()
@click.argument("conversation_id")
@click.option(
    "--yes", "-y", is_flag=True, help="Delete without asking (required for an id prefix)."
)
@data_dir_option
def delete(conversation_id: str, yes: bool, data_dir: str | None) -> None:
    """Delete a saved conversation and its residual files (asks first on a terminal)."""
    from kvchat.kvdirect.planner import human_bytes
    from kvchat.storage.text import safe_terminal_text

    store = _store({"data_dir": data_dir})
    try:
        full = store.resolve(conversation_id)
        if not yes and full != conversation_id:
            # A prefix once deleted "c-bitflip" for `delete c-bi`: it must be spelled out.
            _fail(
                KvchatError(
                    f"{conversation_id!r} is only the start of the id {full}; "
                    f"run `kvchat delete {full}`, or add --yes to delete it by prefix"
                )
            )
        if not yes and sys.stdin.isatty():
            row = store.summary(full)
            what = safe_terminal_text(row.title or row.error or "untitled", multiline=False)
            question = (
                f"delete conversation {full} ({what[:60]}; {row.turns} turn(s), "
                f"{human_bytes(row.bytes_on_disk)})?"
            )
            try:
                confirmed = click.confirm(question, default=False, err=True)
            except click.Abort:
                confirmed = False
            if not confirmed:
                click.echo("kvchat: nothing deleted", err=True)
                sys.exit(1)
        outcome = store.delete(full)
    except KvchatError as exc:
        _fail(exc)
    if outcome.link_only:
        click.echo(
            f"removed the link {full} (kvchat never follows links: what it pointed to is untouched)"
        )
    elif outcome.leftover is not None:
        click.echo(f"deleted {full} (some files remain in {outcome.leftover}; `kvchat gc` retries)")
    else:
        click.echo(f"deleted {full}")


@cli.command()
@click.argument("conversation_id")
@click.option("--format", "fmt", type=click.Choice(["md", "json"]), default="md", show_default=True)
@data_dir_option
def export(conversation_id: str, fmt: str, data_dir: str | None) -> None:
    """Print a conversation's messages as Markdown or JSON (control characters escaped)."""
    try:
        click.echo(_store({"data_dir": data_dir}).export(conversation_id, fmt))
    except KvchatError as exc:
        _fail(exc)


@cli.command()
@data_dir_option
@click.option("--json", "as_json", is_flag=True)
def gc(data_dir: str | None, as_json: bool) -> None:
    """Free disk space: spill files of kvchat processes that are gone, and leftovers of
    interrupted deletes. Never touches a running session or a saved conversation."""
    from pathlib import Path

    from kvchat.kvdirect.planner import human_bytes
    from kvchat.paths import data_dir as resolve_data_dir
    from kvchat.storage import ConversationStore
    from kvchat.storage.spill import spill_usage, sweep_stale_spill

    root = resolve_data_dir(data_dir)
    if Path(root).exists() and not Path(root).is_dir():
        _fail(KvchatError(f"{root} is not a folder; pass --data-dir a kvchat data folder"))
    try:
        spill_freed = sweep_stale_spill(root)
        leftovers_freed = ConversationStore(root).sweep_leftovers()
    except KvchatError as exc:
        _fail(exc)
    in_use = spill_usage(root)
    if as_json:
        doc = {
            "freed_bytes": spill_freed + leftovers_freed,
            "spill_freed_bytes": spill_freed,
            "leftovers_freed_bytes": leftovers_freed,
            "spill_in_use_bytes": in_use,
        }
        click.echo(json.dumps(doc, indent=2))
        return
    if spill_freed or leftovers_freed:
        parts = []
        if spill_freed:
            parts.append(f"{human_bytes(spill_freed)} of spill files of processes that are gone")
        if leftovers_freed:
            parts.append(f"{human_bytes(leftovers_freed)} left by interrupted deletes and creates")
        click.echo(f"freed {human_bytes(spill_freed + leftovers_freed)}: {'; '.join(parts)}")
    else:
        click.echo("nothing to free")
    if in_use:
        click.echo(f"kept {human_bytes(in_use)} of spill files still in use")


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
    app_opts = {**opts, "system": None, "conversation_id": conversation_id}
    _check_conversation(app_opts)  # a bad id fails here, not after the model loads
    _run_app(app_opts)


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
    from kvchat.paths import data_dir
    from kvchat.serve.auth import check_bind

    try:
        check_bind(opts["host"], opts["api_key"])  # before spending seconds on the model
        loaded = _load(opts)
        from kvchat.serve.server import serve as run_server

        run_server(
            loaded,
            cache=_cache_settings(opts),
            data_dir=data_dir(opts["data_dir"]),
            host=opts["host"],
            port=opts["port"],
            api_key=opts["api_key"],
            say=lambda m: click.echo(f"kvchat: {m}", err=True),
        )
    except KvchatError as exc:
        _fail(exc)


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
            with _exit_on_termination():  # atexit hooks and finally blocks still run
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
    from kvchat.models.threads import prefer_passive_wait

    prefer_passive_wait()  # before anything imports torch: see kvchat.models.threads
    cli(prog_name="kvchat")


if __name__ == "__main__":
    main()
