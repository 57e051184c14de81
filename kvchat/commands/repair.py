"""``kvchat repair``: rebuild a conversation's damaged segments from its saved token ids."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import click

from kvchat.commands.run import load_from_options
from kvchat.commands.store_commands import open_store
from kvchat.commands.terminal import EXIT_INTERRUPTED, exit_on_termination, fail, note
from kvchat.errors import KvchatError
from kvchat.threads import resolve_threads


def repair_conversation(conversation_id: str, opts: dict[str, Any]) -> None:
    """Check, load the model the conversation names, rebuild exactly, say what was done."""
    from kvchat.engine.chat.repair import damaged_turns
    from kvchat.engine.chat.repair import repair as rebuild

    store = open_store(opts)
    try:
        cid = store.check_not_open(conversation_id)
        with store.open(cid) as conversation:  # which model, before loading one
            manifest = conversation.manifest
            if not damaged_turns(conversation):
                click.echo(f"conversation {cid} has no damaged segment; nothing to repair")
                return
        # The thread counts its turns were computed with (they change bits); a conversation
        # that did not record them decoded on its prefill count, as kvchat did then.
        threads = opts.get("threads") or manifest.settings.get("threads")
        decode_threads = manifest.settings.get("decode_threads") or resolve_threads(threads)
        loaded = load_from_options(
            {
                **opts,
                "model": opts["model"] or manifest.model.name,
                "dtype": manifest.model.dtype,
                "weights": manifest.settings.get("weights", "auto"),
                "threads": threads,
                "decode_threads": decode_threads,
            }
        )
        with (
            exit_on_termination(),
            store.open(
                cid,
                fingerprint=loaded.fingerprint,
                dtype=loaded.dtype,
                model_name=loaded.name,
                weights=loaded.weights_mode,
            ) as conversation,
        ):
            turns = damaged_turns(conversation)
            note(f"rebuilding {_numbered('turn', turns)} of {cid} from its token ids")
            outcome = rebuild(
                loaded,
                conversation,
                spill_root=store.root,
                on_turn=lambda done, total: note(f"replayed turn {done} of {total}"),
            )
    except KeyboardInterrupt:
        note("interrupted; nothing was changed")
        sys.exit(EXIT_INTERRUPTED)
    except KvchatError as exc:
        fail(exc)
    checked = ""
    if outcome.verified:
        checked = f"; checked against the intact {_numbered('turn', outcome.verified)}: identical"
    click.echo(
        f"repaired conversation {cid}: rebuilt {_numbered('turn', outcome.rebuilt)}{checked}"
    )


def _numbered(noun: str, numbers: Sequence[int]) -> str:
    """``turn 2``, ``turns 1, 3``."""
    return f"{noun}{'s' if len(numbers) > 1 else ''} {', '.join(str(n) for n in numbers)}"
