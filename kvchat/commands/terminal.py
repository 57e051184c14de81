"""How the commands talk to the terminal: replies on stdout, notes and errors on stderr (one
line each), the prefill bar, and signals turned into clean exits.

The exit codes are the headless contract's (README.md; listed in ``kvchat/cli.py``).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any, TypeVar

import click

EXIT_ERROR = 1
EXIT_NOT_SAVED = 3
EXIT_INTERRUPTED = 130


def fail(exc: BaseException) -> None:
    end_stdout_line()
    click.echo(f"kvchat: error: {exc}", err=True)
    sys.exit(EXIT_ERROR)


class _Stdout:
    """Whether the reply streamed to stdout ended its line, so a note on stderr that shares
    the terminal starts on a line of its own ("Paris.\nkvchat: saving as ...")."""

    at_line_start = True


def stream_to_stdout(text: str) -> None:
    if not text:
        return
    sys.stdout.write(text)
    sys.stdout.flush()
    _Stdout.at_line_start = text.endswith("\n")


def end_stdout_line() -> None:
    if not _Stdout.at_line_start:
        sys.stdout.write("\n")
        sys.stdout.flush()
        _Stdout.at_line_start = True


def note(message: str) -> None:
    """One ``kvchat: ...`` line on stderr, never glued to a half-printed reply."""
    end_stdout_line()
    click.echo(f"kvchat: {message}", err=True)


PROGRESS_MIN_TOKENS = 1024  # prompts shorter than this read in about a second: no bar


class PrefillProgress:
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
            note(f"reading the prompt: {done}/{total} tokens ({pct}%)")


@contextlib.contextmanager
def exit_on_termination() -> Iterator[None]:
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


class InterruptedLoad(KeyboardInterrupt):
    """A Ctrl-C before the first reply. A subclass rather than KeyboardInterrupt itself:
    CPython marks a process for death by SIGINT at exit when a KeyboardInterrupt (that exact
    type) ends code it runs through ``PyRun_*``, and with a plain one ``python -m kvchat.cli
    run`` sometimes ended by SIGINT (-2) after printing its note, instead of exiting 130."""


_Scope = TypeVar("_Scope", bound="_SigintScope")


class _SigintScope:
    """Installs ``self._handle`` as the SIGINT handler for a ``with`` block, then puts the
    one before back."""

    def __enter__(self: _Scope) -> _Scope:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)


class RecordSigint(_SigintScope):
    """Ctrl-C raises :class:`InterruptedLoad` and is remembered, so it is not lost when
    library code on the way catches everything (a bare ``except:``), nor ignored when kvchat
    was started with SIGINT ignored (a background job of a shell without job control: Python
    then keeps it ignored, and a Ctrl-C during the load went unseen)."""

    def __init__(self) -> None:
        self.hit = False

    def _handle(self, signum: int, frame: Any) -> None:
        self.hit = True
        raise InterruptedLoad


class CancelOnSigint(_SigintScope):
    """First Ctrl-C ends the reply cleanly; a second one interrupts for real."""

    def __init__(self) -> None:
        self.cancelled = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.cancelled:
            raise KeyboardInterrupt
        self.cancelled = True
