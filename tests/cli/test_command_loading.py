"""`margo` imports the module of the command it runs, not every command's: the table
`margo_cli.main.COMMANDS` says which module adds which command, and a parser built for one
command parses it exactly as the parser of every command does."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from margo_cli.main import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]


def command_names(parser: argparse.ArgumentParser) -> list[str]:
    found = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(found[0].choices)


def test_the_table_names_every_command_in_the_order_help_lists_them() -> None:
    assert command_names(build_parser()) == list(COMMANDS)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_comes_from_its_module_alone(name: str) -> None:
    alone = command_names(build_parser([name]))
    assert name in alone
    assert set(alone) == {other for other, module in COMMANDS.items()
                          if module == COMMANDS[name]}


def test_a_command_parses_alike_alone_and_among_all() -> None:
    argv = ["device", "run", "--config", "device.yaml", "--json", "--log-level", "debug"]
    alone, among_all = build_parser(argv).parse_args(argv), build_parser().parse_args(argv)
    assert vars(alone) == vars(among_all)


def test_no_command_word_first_registers_them_all() -> None:
    for argv in ([], ["--help"], ["-h", "device"], ["devcie", "run"]):
        assert command_names(build_parser(argv)) == list(COMMANDS)


def test_the_device_command_imports_neither_the_fleet_side_nor_other_commands() -> None:
    """What `margo device run --help` loads, in a process of its own."""
    probe = ("import json, sys\nfrom margo_cli.main import build_parser\n"
             "build_parser(['device', 'run', '--help'])\nprint(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=60)
    modules = json.loads(done.stdout)
    assert "margo_cli.device_command" in modules
    # margo_cli.completion is the entry point's own: it answers a shell asking to complete.
    others = {module for name, module in COMMANDS.items()
              if name not in ("device", "completion")}
    heavy = ("compiler", "wfm", "authoring", "conformance", "pygit2", "helm_python",
             "cryptography", "argcomplete", "reconciler.kubernetes")
    assert [m for m in modules
            if m in others or m.split(".")[0] in heavy or m.startswith(heavy)] == []
