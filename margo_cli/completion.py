"""Shell completion of `margo` (argcomplete): `margo completion bash|zsh|fish` prints the
script a shell sources, and the completers that fill in device ids and intent names.

Completion runs the real `margo` with the shell's command line in its environment
(argcomplete's protocol); `margo_cli.main` hands the parser to argcomplete before
parsing. The names come from the server of `--url` (or `$MARGO_URL`) with `--token-file`
(or `$MARGO_TOKEN_FILE`), asked with a short timeout: a server that is down, slow or
refuses costs the user a moment and no message (a completion must never print into the
command line being edited).

argcomplete itself is imported only when a shell asks (or for the script): most runs of
`margo`, the device client's above all, never need it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from typing import Any

from margo_cli.fleetclient import DEFAULT_URL, call
from margo_cli.resources import kind_named

__all__ = ["SHELLS", "choices", "complete_with", "completed_words", "device_ids", "enable",
           "intent_names", "names_of_kind", "register"]

SHELLS = ("bash", "zsh", "fish")
#: Seconds a completion waits for the server.
TIMEOUT = 2.0

Completer = Callable[..., Iterable[str]]


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "completion", help="print the shell completion script (bash, zsh or fish)",
        description="Print the script that makes SHELL complete margo's commands, options, "
                    "device ids and intent names (these from the server of --url or "
                    "$MARGO_URL). Install: see docs/cli.md.")
    parser.add_argument("shell", choices=SHELLS, metavar="SHELL", help=" | ".join(SHELLS))
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from argcomplete.shell_integration import shellcode

    print(shellcode(["margo"], shell=args.shell), end="")
    return 0


def enable(parser: argparse.ArgumentParser) -> None:
    """Answer a completion request (and exit) when the shell made one; else return.
    Options are offered once a `-` is typed (else they would bury the names)."""
    if "_ARGCOMPLETE" not in os.environ:  # argcomplete's own test, before importing it
        return
    import argcomplete

    argcomplete.autocomplete(parser, always_complete_options=False)


def completed_words() -> list[str] | None:
    """The words after `margo` a shell asking for completions has finished typing (the one
    being typed excluded), split as argcomplete splits them; None when no shell asks or the
    line cannot be read. `margo_cli.main` builds the parser of their command only."""
    if "_ARGCOMPLETE" not in os.environ:
        return None
    from argcomplete.lexers import split_line

    try:
        words = split_line(os.environ["COMP_LINE"], int(os.environ["COMP_POINT"]))[3]
        start = int(os.environ["_ARGCOMPLETE"])  # 1: `margo ...`, 2: `python margo ...`
    except (KeyError, ValueError):
        return None
    return list(words[start:])


def complete_with(action: argparse.Action, completer: Completer) -> None:
    """Complete `action`'s value with `completer` (argcomplete reads the attribute)."""
    setattr(action, "completer", completer)  # noqa: B010 (argparse.Action has no such field)


def choices(names: Iterable[str]) -> Completer:
    """Complete with fixed words only (argparse's `choices` may hold aliases too)."""
    words = list(names)

    def complete(prefix: str, **_: Any) -> list[str]:
        return [w for w in words if w.startswith(prefix)]
    return complete


def _names(parsed_args: argparse.Namespace, kind_name: str) -> list[str]:
    """The keys of the server's objects of one kind; nothing on any failure. The server:
    the command's `--url` (`margo explain`'s has no default), else `$MARGO_URL`."""
    kind = kind_named(kind_name)
    if kind is None:
        return []
    url = getattr(parsed_args, "url", None) or os.environ.get("MARGO_URL") or DEFAULT_URL
    token_file = (getattr(parsed_args, "token_file", None)
                  or os.environ.get("MARGO_TOKEN_FILE") or None)
    try:
        answer = call(url, kind.path, token_file=token_file, timeout=TIMEOUT)
        return sorted(kind.key(item) for item in answer[kind.items])
    except Exception:  # a completion says nothing about a server it could not ask
        return []


def device_ids(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    return [n for n in _names(parsed_args, "devices") if n.startswith(prefix)]


def intent_names(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    return [n for n in _names(parsed_args, "intents") if n.startswith(prefix)]


def names_of_kind(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    """Names of the kind the command line named before (`get devices <TAB>`)."""
    kind = getattr(parsed_args, "kind", None)
    return [n for n in _names(parsed_args, str(kind)) if n.startswith(prefix)] if kind else []
