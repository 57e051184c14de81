"""``kvchat run`` (and ``resume --prompt``): load the model, open the conversation, answer each
prompt in turn, streaming, with a memory line after each (the headless contract in README.md).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from kvchat.commands.store_commands import check_conversation, open_store
from kvchat.commands.terminal import (
    EXIT_INTERRUPTED,
    EXIT_NOT_SAVED,
    CancelOnSigint,
    PrefillProgress,
    RecordSigint,
    end_stdout_line,
    exit_on_termination,
    fail,
    note,
    stream_to_stdout,
)
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.engine.chat.session import ChatSession, TurnResult
    from kvchat.engine.chat.settings import CacheSettings, SamplingSettings
    from kvchat.engine.models.loaded import LoadedModel


def run_prompts(opts: dict[str, Any], prompts: list[str]) -> None:
    """Answer ``prompts`` in turn; exits with the headless contract's status when not 0."""
    from kvchat.engine.chat.settings import SamplingSettings

    sampling = SamplingSettings(
        temperature=opts["temperature"],
        top_p=opts["top_p"],
        seed=opts["seed"],
        max_new_tokens=opts["max_new_tokens"],
    )
    check_conversation(opts)  # fail fast, before loading any weights
    if opts.get("regenerate"):
        prompts = [regenerated_prompt(opts), *prompts]
        if sampling.temperature is None:
            sampling.temperature = REGENERATE_TEMPERATURE
            if not opts["as_json"]:
                note(
                    f"sampling at temperature {REGENERATE_TEMPERATURE} (--temperature 0 "
                    "gives the greedy reply again)"
                )
    with exit_on_termination():
        session = open_run_session(opts)
        try:
            code = answer(session, prompts, sampling, opts["as_json"])
        except KvchatError as exc:
            fail(exc)
        finally:
            session.close()
    if code:
        sys.exit(code)


REGENERATE_TEMPERATURE = 0.7
"""What ``--regenerate`` samples at without ``--temperature``: greedy would repeat the reply."""


def regenerated_prompt(opts: dict[str, Any]) -> str:
    """The prompt of the conversation's last turn, read before any weights load: the one
    user message that turn added (a turn saved together with an earlier one, after a failed
    save, holds two: refused, with what to do instead)."""
    from kvchat.engine.chat.conversation import regenerable_prompt

    try:
        return regenerable_prompt(open_store(opts), opts["conversation_id"])
    except KvchatError as exc:
        fail(exc)


def branch_for_regenerate(opts: dict[str, Any], say: Any) -> str:
    """Where the regenerated reply goes: a fork at the turn before the last (the original
    keeps its reply), or, with --in-place, the conversation itself, its last turn dropped."""
    store = open_store(opts)
    cid = opts["conversation_id"]
    turns = store.summary(cid).turns
    if opts["in_place"]:
        store.drop_last_turn(cid)
        say(f"regenerating turn {turns} of conversation {cid} in place")
        return cid
    fork = store.fork(cid, turn=turns - 1)
    say(f"regenerating turn {turns} as conversation {fork}, a fork ({cid} keeps its reply)")
    return fork


def load_from_options(opts: dict[str, Any], quiet: bool = False) -> LoadedModel:
    from kvchat.engine.chat.settings import EngineOptions
    from kvchat.engine.models.load import load_with

    say = (lambda _m: None) if quiet else note
    return load_with(EngineOptions.from_cli(opts).model, progress=say)


def cache_settings(opts: dict[str, Any]) -> CacheSettings:
    from kvchat.engine.chat.settings import EngineOptions

    return EngineOptions.from_cli(opts).cache


def open_run_session(opts: dict[str, Any]) -> ChatSession:
    """Load the model and open the conversation; Ctrl-C here exits 130, errors exit 1."""
    session = None
    with RecordSigint() as sigint:
        try:
            session = _load_and_open(opts)
        except KeyboardInterrupt:
            pass  # session stays None
        except KvchatError as exc:
            fail(exc)
    if sigint.hit or session is None:
        if session is not None:  # the Ctrl-C was swallowed on the way: it still means stop
            session.close()
        note("interrupted before the first reply; nothing was saved")
        sys.exit(EXIT_INTERRUPTED)
    return session


def _load_and_open(opts: dict[str, Any]) -> ChatSession:
    as_json = opts["as_json"]
    loaded = load_from_options(opts, quiet=as_json)
    from kvchat.engine.chat.conversation import open_session

    say = (lambda _m: None) if as_json else note
    if opts.get("regenerate"):
        opts["conversation_id"] = branch_for_regenerate(opts, say)
    if not loaded.has_chat_template:
        note(
            f"{loaded.name} is a base model (no chat template): plain completion, each "
            "prompt is continued as written"
        )
    return open_session(
        loaded,
        data_dir=opts["data_dir"],
        cache=cache_settings(opts),
        system=opts["system"],
        conversation_id=opts["conversation_id"],
        save=not opts["no_save"],
        say=say,
    )


def answer(
    session: ChatSession, prompts: list[str], sampling: SamplingSettings, as_json: bool
) -> int:
    """Answer each prompt in turn; returns the exit status."""
    from kvchat.engine.chat.memory import format_memory_line

    unsaved: list[int] = []  # turns answered but not on disk (a later save retries them)
    code = 0
    for turn, prompt in enumerate(prompts, start=1):
        try:
            with CancelOnSigint() as sigint:
                result = session.send(
                    prompt,
                    sampling,
                    on_text=None if as_json else stream_to_stdout,
                    should_stop=lambda: sigint.cancelled,
                    on_progress=PrefillProgress(),
                )
        except KeyboardInterrupt:
            note(f"interrupted; {_saved_note(session)}")
            return EXIT_INTERRUPTED
        if as_json:
            conversation_id = session.conversation.id if session.conversation else None
            click.echo(json.dumps(_turn_json(turn, prompt, result, conversation_id)))
        else:
            if result.cancelled:
                stream_to_stdout(" [stopped]")
            end_stdout_line()
            click.echo(format_memory_line(result.memory), err=True)
        if result.save_error:
            unsaved.append(turn)
            note(f"saving failed: {result.save_error}")
        else:
            unsaved = []  # a successful save writes every turn still pending
            if result.error:
                note(f"reply ended early: {result.error}")
        # A Ctrl-C that landed after the reply (while saving) still means stop.
        if result.cancelled or sigint.cancelled:
            code = EXIT_INTERRUPTED
            break
    if unsaved:
        note(
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


def _saved_note(session: ChatSession) -> str:
    conversation = session.conversation
    if conversation is None:
        return "nothing was saved"
    turns = len(conversation.manifest.turns)
    return (
        f"conversation {conversation.id} keeps its {turns} saved turn(s); the turn in progress "
        f"was not saved (resume with `kvchat resume {conversation.id}`)"
    )


def _turn_json(
    turn: int, prompt: str, result: TurnResult, conversation: str | None
) -> dict[str, Any]:
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
        "memory": result.memory.to_dict(),
    }
