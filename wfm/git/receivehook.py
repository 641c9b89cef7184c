"""The hosted fleet source's `pre-receive` hook: a push the compiler could not use is refused.

`git receive-pack` runs this (`python -m wfm.git.receivehook REF`) with the pushed ref updates on
stdin, before any ref moves. For the compiled branch it loads the pushed tree as the compiler
would (`compiler.source.load_source`) and checks it as `margo validate` and `margo compile` do
(`compiler.context.source_problems`: broken files, intents naming no application or unknown
parameters, literal values that break the application's configuration rules). When that finds
problems, it prints them with `file:line:col: path: message` and exits 1. Git shows each line to
the pusher as `remote: …` and refuses the push; the previous source stays in force. Without
this hook, a broken push would be accepted and the server would keep the old desired state
in silence, with the errors only in its log.

The hook reads the pushed commit with the `git` command line, which sees the push's
quarantined objects (`GIT_QUARANTINE_PATH`), and extracts its tree into a temporary
directory (regular files and directories only: no links out, no absolute paths).
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from compiler.context import source_problems
from compiler.source import SourceError, load_source

__all__ = ["HOOK_NAME", "hook_script", "problems_in_commit"]

HOOK_NAME = "pre-receive"
_ZERO = "0" * 40
#: Shown at most; the rest is counted (a push that breaks everything should stay readable).
MAX_SHOWN = 50


def hook_script(ref: str, python: str = sys.executable) -> str:
    """The hook file's text: this module, run by the server's own interpreter."""
    return f'#!/bin/sh\nexec "{python}" -m wfm.git.receivehook "{ref}"\n'


def problems_in_commit(commit: str) -> list[str]:
    """The problems `source_problems` finds in `commit`'s tree (formatted), or why it cannot
    be read at all."""
    archive = subprocess.run(["git", "archive", "--format=tar", commit], capture_output=True,
                             check=False)
    if archive.returncode != 0:
        return [f"cannot read the pushed commit {commit}: "
                f"{archive.stderr.decode(errors='replace').strip()}"]
    with tempfile.TemporaryDirectory(prefix="margo-push-") as tmp:
        _extract(archive.stdout, Path(tmp))
        try:
            source = load_source(Path(tmp))
        except SourceError as exc:
            return [str(exc).replace(tmp, ".")]
        return [problem.format() for problem in source_problems(source)]


def _extract(tar_bytes: bytes, target: Path) -> None:
    """Regular files and directories only, at relative paths inside `target` (a fleet
    source needs nothing else; links could point out of it)."""
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if member.name.startswith("/") or ".." in parts:
                continue
            if member.isdir():
                (target / member.name).mkdir(parents=True, exist_ok=True)
            elif member.isfile():
                extracted = tar.extractfile(member)
                if extracted is not None:
                    path = target / member.name
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(extracted.read())


def check_updates(lines: list[str], ref: str) -> list[str]:
    """What to tell the pusher about the updates on stdin (nothing: accept)."""
    for line in lines:
        parts = line.split()
        if len(parts) != 3 or parts[2] != ref:
            continue
        _old, new, _ = parts
        if new == _ZERO:
            return [f"margo: {ref} is the fleet source the server compiles; it cannot be "
                    "deleted (push an empty fleet to remove every deployment)"]
        problems = problems_in_commit(new)
        if problems:
            shown = problems[:MAX_SHOWN]
            more = len(problems) - len(shown)
            return [f"margo: refusing {ref} at {new[:12]}: {len(problems)} problem(s); the "
                    "previous fleet source stays in force", *shown,
                    *([f"… and {more} more"] if more else [])]
    return []


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m wfm.git.receivehook REF", file=sys.stderr)
        return 2
    messages = check_updates(sys.stdin.read().splitlines(), argv[1])
    for message in messages:
        print(message, file=sys.stderr)
    return 1 if messages else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
