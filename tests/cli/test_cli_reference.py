"""docs/cli.md lists every `margo` command and subcommand with its options, as the parser
has them (`tools.cli_reference`): a command added, renamed or given an option without the
page following fails here."""

from __future__ import annotations

from tools.cli_reference import BEGIN, END, PAGE, commands, render, replace_section


def test_the_page_lists_every_command_as_the_parser_has_it() -> None:
    page = PAGE.read_text()
    missing = [path for path, _, _ in commands() if f"### `{path}`" not in page]
    assert not missing, (f"docs/cli.md lacks {', '.join(missing)}: run "
                         "`python -m tools.cli_reference --write`")
    generated = page.partition(BEGIN + "\n")[2].partition(END)[0]
    assert generated == render(), ("docs/cli.md is out of date: run "
                                   "`python -m tools.cli_reference --write`")


def test_the_new_commands_are_there_with_their_main_options() -> None:
    page = PAGE.read_text()
    for expected in ("### `margo get`", "### `margo describe`", "### `margo completion`",
                     "- `-l, --selector SELECTOR`", "- `-w, --watch`",
                     "eval \"$(margo completion bash)\""):
        assert expected in page


def test_rewriting_keeps_the_hand_written_parts() -> None:
    page = f"intro\n{BEGIN}\nold\n{END}\noutro\n"
    assert replace_section(page, "new\n") == f"intro\n{BEGIN}\nnew\n{END}\noutro\n"
