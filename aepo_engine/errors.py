"""Errors a person can act on, and the one way every command reports them.

Each command (``python -m aepo_engine.train``, ``aepo_engine.eval``,
``aepo_engine.experiments.compare``, ``aepo_engine.experiments.trees``,
``aepo_engine.tools.retrieval_server``) decorates its ``main`` with :func:`entry_point`:
- bad input and unavailable parts (:data:`ACTIONABLE`: a config error, a bad value, a missing or
  unreadable file, a package or tool that is not there) end the command with one
  ``error: ...`` message on stderr and exit status 2, no traceback;
- anything else is a bug: one ``error: internal error ...`` line and exit status 1;
- ``--debug`` (anywhere on the command line) or ``AEPO_DEBUG=1`` lets every exception through
  with its traceback;
- Ctrl-C ends with ``interrupted`` and status 130.
Commands that parse with argparse use :class:`ArgumentParser`, whose usage errors take the same
form. The message is the exception's own text: raise with one that says what to change.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Callable, NoReturn, Sequence

DEBUG_FLAG = "--debug"
DEBUG_ENV = "AEPO_DEBUG"
USAGE_STATUS = 2  # bad input or an unavailable part (argparse's status for usage errors too)
BUG_STATUS = 1


class Unavailable(RuntimeError):
    """A part the command needs is not available here (a tool that cannot start, a server that
    does not answer, a device); the message says which and how to get it."""


class ToolUnavailable(Unavailable):
    """A tool cannot start or cannot run where it must (e.g. while writing the warm-start
    demonstrations): reported as that, never as a data error."""


class UsageError(ValueError):
    """A command-line usage error (raised by :class:`ArgumentParser`)."""


# What a person can act on: ConfigError and msgspec's errors are ValueErrors; FileNotFoundError
# and PermissionError are OSErrors; a missing optional package is an ImportError.
ACTIONABLE: tuple[type[BaseException], ...] = (ValueError, OSError, ImportError, Unavailable)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors raise :class:`UsageError` (reported by :func:`entry_point`
    as one ``error:`` line naming ``-h``) instead of printing the usage block and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} -h)")


def require(ok: bool, message: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error(message)`` unless ``ok``: the one check config sections and loaders use.

    Args:
        ok: the condition that must hold.
        message: what is wrong and what to change (a config section's ``__post_init__`` raising
            ``ValueError`` is reported by msgspec with the section's path).
        error: the exception type to raise.
    """
    if not ok:
        raise error(message)


def debug_requested(argv: Sequence[str]) -> bool:
    """Whether tracebacks were asked for (``--debug`` in ``argv`` or ``AEPO_DEBUG=1``)."""
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(exc: BaseException) -> str:
    """The exception's message (its type's name when it has none); kept as written, so a list of
    problems stays a list under its first line."""
    text = str(exc).strip()
    if isinstance(exc, KeyError) and exc.args:  # str(KeyError) quotes its key
        text = str(exc.args[0])
    elif isinstance(exc, OSError) and exc.filename and exc.strerror:  # not "[Errno 2] ..."
        text = f"{exc.filename}: {exc.strerror}"
    return text or type(exc).__name__


def entry_point(main: Callable[[list[str]], Any]) -> Callable[[Sequence[str] | None], Any]:
    """Decorate a command's ``main(argv)`` with the error contract of the module docstring.

    Args:
        main: takes the argument list (without ``--debug``) and returns the command's result
            (an int is an exit status for ``raise SystemExit(main())``).

    Returns:
        ``wrapper(argv=None)``: ``argv`` defaults to ``sys.argv[1:]``; returns what ``main``
        returns, or raises ``SystemExit`` with the status above.
    """

    @functools.wraps(main)
    def wrapper(argv: Sequence[str] | None = None) -> Any:
        args = list(sys.argv[1:] if argv is None else argv)
        if debug_requested(args):
            return main([a for a in args if a != DEBUG_FLAG])
        try:
            return main(args)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise SystemExit(130) from None
        except ACTIONABLE as exc:
            print(f"error: {one_line(exc)}", file=sys.stderr, flush=True)
            raise SystemExit(USAGE_STATUS) from None
        except Exception as exc:  # noqa: BLE001 - the last resort: a bug, said in one line
            print(f"error: internal error ({type(exc).__name__}: {one_line(exc)}); run again with "
                  f"{DEBUG_FLAG} (or {DEBUG_ENV}=1) for the traceback, and please report it",
                  file=sys.stderr, flush=True)
            raise SystemExit(BUG_STATUS) from None

    return wrapper
