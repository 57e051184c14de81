"""The commands on saved conversations: ``list``, ``delete``, ``export`` and ``gc``."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from kvchat.commands.terminal import fail
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.storage import ConversationStore, ConversationSummary


def check_conversation(opts: dict[str, Any]) -> None:
    """Resolve ``opts["conversation_id"]`` and refuse one that is missing or open elsewhere,
    before any weights are loaded (exits with one line)."""
    if not opts.get("conversation_id"):
        return
    try:
        opts["conversation_id"] = open_store(opts).check_not_open(opts["conversation_id"])
    except KvchatError as exc:
        fail(exc)


def open_store(opts: dict[str, Any]) -> ConversationStore:
    from kvchat.paths import data_dir
    from kvchat.storage import ConversationStore

    return ConversationStore(data_dir(opts.get("data_dir")))


def show_conversations(data_dir: str | None, as_json: bool) -> None:
    """``kvchat list``: saved conversations and the spill files' footprint."""
    from dataclasses import asdict

    from kvchat.paths import data_dir as resolve_data_dir
    from kvchat.storage import ConversationStore
    from kvchat.storage.spill import spill_folders, spill_root
    from kvchat.storage.text import safe_terminal_text
    from kvchat.units import human_bytes

    root = resolve_data_dir(data_dir)
    try:
        rows = ConversationStore(root).list()
    except KvchatError as exc:
        fail(exc)
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
            f"{'id':<21} {'model':<16} {'turns':>5} {'tokens':>7} {'disk':>10}  "
            "last used            title"
        )
    for r in rows:
        # Titles, model names and errors come from files anyone can edit: never raw escapes.
        title = safe_terminal_text(r.error and f"[{r.error}]" or r.title, multiline=False)
        model = safe_terminal_text(str(r.model), multiline=False)[:16]
        click.echo(
            f"{r.id:<21} {model:<16} {r.turns:>5} {r.tokens:>7} "
            f"{disk_column(r):>10}  {str(r.last_used)[:19]:<20} "
            f"{describe_origin(r)}{title}"
        )
    if any(r.shared_bytes for r in rows):
        click.echo("* shares saved turns with a fork (hard links): deleting it frees less")
    if spill_bytes:
        line = f"spill files: {human_bytes(spill_bytes)} in {spill_root(root)}"
        if stale_bytes:
            line += (
                f", {human_bytes(stale_bytes)} of it left by kvchat processes that are gone "
                "(`kvchat gc` frees it)"
            )
        click.echo(line)


def delete_conversation(conversation_id: str, yes: bool, data_dir: str | None) -> None:
    """``kvchat delete``: refuse a bare prefix, ask on a terminal, then delete."""
    from kvchat.storage.text import safe_terminal_text
    from kvchat.units import human_bytes

    store = open_store({"data_dir": data_dir})
    try:
        full = store.resolve(conversation_id)
        if not yes and full != conversation_id:
            # A prefix once deleted "c-bitflip" for `delete c-bi`: it must be spelled out.
            fail(
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
        fail(exc)
    if outcome.link_only:
        click.echo(
            f"removed the link {full} (kvchat never follows links: what it pointed to is untouched)"
        )
    elif outcome.leftover is not None:
        click.echo(f"deleted {full} (some files remain in {outcome.leftover}; `kvchat gc` retries)")
    else:
        click.echo(f"deleted {full}")


def fork_conversation(
    conversation_id: str, turn: int | None, as_json: bool, data_dir: str | None
) -> None:
    """``kvchat fork``: branch a saved conversation at a turn; prints the new id."""
    try:
        new_id = open_store({"data_dir": data_dir}).fork(conversation_id, turn=turn)
    except KvchatError as exc:
        fail(exc)
    if as_json:
        click.echo(json.dumps({"conversation": new_id}))
    else:
        click.echo(new_id)


def disk_column(row: ConversationSummary) -> str:
    """Bytes on disk; ``*`` marks a conversation that shares segments with a fork (its own
    bytes are fewer: deleting it frees only those)."""
    from kvchat.units import human_bytes

    return human_bytes(row.bytes_on_disk) + ("*" if row.shared_bytes else "")


def describe_origin(row: ConversationSummary) -> str:
    """What ``kvchat list`` shows of where a fork came from: ``(fork of ID at turn N)``."""
    origin = row.forked_from
    return "" if origin is None else f"(fork of {origin.id} at turn {origin.turn}) "


def export_conversation(conversation_id: str, fmt: str, data_dir: str | None) -> None:
    """``kvchat export``: the messages as Markdown or JSON on stdout."""
    try:
        from kvchat.commands.export import export_text

        click.echo(export_text(open_store({"data_dir": data_dir}), conversation_id, fmt))
    except KvchatError as exc:
        fail(exc)


def collect_garbage(data_dir: str | None, as_json: bool) -> None:
    """``kvchat gc``: free the spill files of dead processes and interrupted deletes' leftovers."""
    from pathlib import Path

    from kvchat.paths import data_dir as resolve_data_dir
    from kvchat.storage import ConversationStore
    from kvchat.storage.spill import spill_usage, sweep_stale_spill
    from kvchat.units import human_bytes

    root = resolve_data_dir(data_dir)
    if Path(root).exists() and not Path(root).is_dir():
        fail(KvchatError(f"{root} is not a folder; pass --data-dir a kvchat data folder"))
    try:
        spill_freed = sweep_stale_spill(root)
        leftovers_freed = ConversationStore(root).sweep_leftovers()
    except KvchatError as exc:
        fail(exc)
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
