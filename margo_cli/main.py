"""`margo` entry point: one command, one subcommand module per verb.

Exit codes are part of the interface other tools rely on: 0 success, 1 a negative answer
(invalid document, not eligible, a device had errors), 2 unusable input or usage.

Only the module of the command being run is imported (`COMMANDS`): the device client
(`margo device run`) loads neither the compiler nor the fleet server, which would be
resident memory for as long as the device runs (docs/device.md, "What a device loads").
Without a command word first (`margo --help`, a typo), every command is registered, so
the listing and argparse's "invalid choice" name them all.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# httpx imports its own command-line client when click, rich and pygments are installed
# (about 6 MiB resident); margo never runs it, so that import fails quietly (a None in
# sys.modules makes it an ImportError, which httpx catches). Before anything imports httpx.
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]

from margo_cli import completion  # noqa: E402
from margo_cli.usage import EXIT_UNUSABLE, UsageError  # noqa: E402

__all__ = ["COMMANDS", "build_parser", "main"]

#: Every command, and the module whose `register(commands)` adds it (a module may add
#: several), in the order `margo --help` lists them.
COMMANDS: dict[str, str] = {
    "init": "margo_cli.init_command",
    "validate": "margo_cli.validate_command",
    "match": "margo_cli.match_command",
    "compile": "margo_cli.compile_command",
    "plan": "margo_cli.compile_command",
    "explain": "margo_cli.compile_command",
    "serve": "margo_cli.serve_command",
    "clients": "margo_cli.identity_command",
    "trust": "margo_cli.identity_command",
    "operators": "margo_cli.operators_command",
    "audit": "margo_cli.audit_command",
    "status": "margo_cli.status_command",
    "get": "margo_cli.get_command",
    "describe": "margo_cli.describe_command",
    "rollout": "margo_cli.rollout_command",
    "device": "margo_cli.device_command",
    "lint-chart": "margo_cli.lint_chart_command",
    "conformance": "margo_cli.conformance_command",
    "secrets": "margo_cli.secrets_command",
    "completion": "margo_cli.completion",
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or, when `argv` starts with a command's name, of that
    command's module alone (what it parses is the same either way)."""
    parser = argparse.ArgumentParser(
        prog="margo",
        description="margo-gitops: Margo documents, fleet compiler, fleet server and device "
                    "reconciler.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    first = argv[0] if argv else None
    modules = ([COMMANDS[first]] if first in COMMANDS
               else list(dict.fromkeys(COMMANDS.values())))
    for module in modules:
        importlib.import_module(module).register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = completion.completed_words()
    parser = build_parser(words if words is not None
                          else sys.argv[1:] if argv is None else argv)
    completion.enable(parser)  # a shell asking for completions is answered here, and exits
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_UNUSABLE
    except BrokenPipeError:  # e.g. `margo validate ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
