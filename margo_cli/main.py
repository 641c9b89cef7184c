"""`margo` entry point: one command, one subcommand module per verb.

Exit codes are part of the interface other tools rely on: 0 success, 1 a negative answer
(invalid document, not eligible, a device had errors), 2 unusable input or usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from margo_cli import (
    audit_command,
    compile_command,
    completion,
    conformance_command,
    describe_command,
    device_command,
    get_command,
    identity_command,
    init_command,
    lint_chart_command,
    match_command,
    operators_command,
    rollout_command,
    secrets_command,
    serve_command,
    status_command,
    validate_command,
)
from margo_cli.usage import EXIT_UNUSABLE, UsageError

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="margo",
        description="margo-gitops: Margo documents, fleet compiler, fleet server and device "
                    "reconciler.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    init_command.register(commands)
    validate_command.register(commands)
    match_command.register(commands)
    compile_command.register(commands)
    serve_command.register(commands)
    identity_command.register(commands)
    operators_command.register(commands)
    audit_command.register(commands)
    status_command.register(commands)
    get_command.register(commands)
    describe_command.register(commands)
    rollout_command.register(commands)
    device_command.register(commands)
    lint_chart_command.register(commands)
    conformance_command.register(commands)
    secrets_command.register(commands)
    completion.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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
