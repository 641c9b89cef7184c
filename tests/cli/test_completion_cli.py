"""Shell completion: `margo completion SHELL` prints a script, and the real `margo` entry
point answers argcomplete's protocol (the environment a shell's completion function
sets) with commands, kinds, and device ids and intent names from a live server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kits.clikit import CliFleet

from margo_cli.main import main

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MARGO = BIN / "margo"


def complete(line: str, *, shell: str = "bash", env: dict[str, str] | None = None,
             tmp_path: Path) -> list[str]:
    """What `margo` answers a shell completing at the end of `line`."""
    out = tmp_path / "completions"
    environment = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(tmp_path),
                   "COMP_LINE": line, "COMP_POINT": str(len(line)), "_ARGCOMPLETE": "1",
                   "_ARGCOMPLETE_SHELL": shell, "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
                   **(env or {})}
    done = subprocess.run([str(MARGO)], env=environment, cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "", "a completion prints nothing into the command line"
    text = out.read_text()
    separator = "\n" if shell == "fish" else "\x0b"
    return [word.split("\t")[0].strip() for word in text.split(separator) if word.strip()]


def server_env(cli_fleet: CliFleet) -> dict[str, str]:
    return {"MARGO_URL": cli_fleet.url, "MARGO_TOKEN_FILE": str(cli_fleet.token_file)}


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_the_script_of_each_shell(
        shell: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["completion", shell]) == 0
    script = capsys.readouterr().out
    assert ("complete --command margo" if shell == "fish" else "_python_argcomplete margo"
            ) in script


def test_an_unknown_shell_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exited:
        main(["completion", "tcsh"])
    assert exited.value.code == 2


def test_commands_and_kinds_complete(tmp_path: Path) -> None:
    assert {"get", "describe", "completion", "status"} <= set(
        complete("margo ", tmp_path=tmp_path))
    assert complete("margo get ", tmp_path=tmp_path) == [
        "devices", "deployments", "apps", "intents", "rollouts"]
    assert complete("margo describe d", tmp_path=tmp_path) == ["device"]


def test_device_ids_and_intent_names_complete_from_the_server(
        cli_fleet: CliFleet, tmp_path: Path) -> None:
    env = server_env(cli_fleet)
    assert {"edge-a", "edge-b", "gpu-1"} <= set(
        complete("margo describe device ", env=env, tmp_path=tmp_path))
    assert complete("margo describe device ed", env=env, tmp_path=tmp_path) == [
        "edge-a", "edge-b"]
    assert complete("margo describe intent w", env=env, tmp_path=tmp_path) == ["web"]
    assert complete("margo rollout status g", env=env, tmp_path=tmp_path) == ["gpu"]
    assert complete("margo status --device gp", env=env, tmp_path=tmp_path) == ["gpu-1"]
    assert complete("margo get intents b", env=env, tmp_path=tmp_path) == ["broken"]
    assert complete("margo explain --intent we", env=env, tmp_path=tmp_path) == ["web"]
    # --url and --token-file on the line itself, no environment
    line = (f"margo describe device --url {cli_fleet.url} --token-file "
            f"{cli_fleet.token_file} gpu")
    assert complete(line, tmp_path=tmp_path) == ["gpu-1"]
    assert "gpu-1" in complete("margo describe device gpu", shell="fish", env=env,
                               tmp_path=tmp_path)


def test_an_unreachable_or_refusing_server_completes_nothing_quietly(
        cli_fleet: CliFleet, tmp_path: Path) -> None:
    started = time.monotonic()
    assert complete("margo describe device ", env={"MARGO_URL": "http://127.0.0.1:9"},
                    tmp_path=tmp_path) == []
    assert complete("margo describe device ", env={"MARGO_URL": cli_fleet.url},
                    tmp_path=tmp_path) == []  # no token: refused
    assert time.monotonic() - started < 20


def test_bash_completes_through_the_printed_script(cli_fleet: CliFleet,
                                                   tmp_path: Path) -> None:
    """The script as bash sources it, its function called as bash calls it on TAB."""
    script = tmp_path / "margo.bash"
    script.write_text(subprocess.run([str(MARGO), "completion", "bash"], capture_output=True,
                                     text=True, check=True, timeout=60).stdout)
    line = "margo describe device edge"
    program = (f'source {script}\nCOMP_LINE="{line}"; COMP_POINT=${{#COMP_LINE}}\n'
               'COMP_WORDS=(margo describe device edge); COMP_CWORD=3\n'
               '_python_argcomplete margo\nprintf "%s\\n" "${COMPREPLY[@]}"\n')
    done = subprocess.run(["bash", "--norc", "-c", program], capture_output=True, text=True,
                          check=False, timeout=60, env={
                              **{k: v for k, v in os.environ.items() if k == "HOME"},
                              "PATH": f"{BIN}:/usr/bin:/bin", **server_env(cli_fleet)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["edge-a", "edge-b"]
