"""`margo secrets`: the fleet key and the secrets of the fleet source (compiler.secrets).

- `keygen --out FILE [--force]`: a new fleet key (an age identity file, mode 600, to keep
  outside every repository); prints its recipient (`age1...`), what secrets are encrypted to.
- `recipient --key FILE`: the key's current recipient.
- `encrypt (--recipient age1... | --key FILE) [--from-file PATH]`: a secret, ready to paste
  under a parameter (`secret: |` and the armored age file; `--armor-only` for the armor).
  The plaintext comes from stdin (exactly one trailing newline is dropped, so
  `echo pw | margo secrets encrypt ...` encrypts `pw`; a terminal is asked without echo)
  or, verbatim, from `--from-file`. It is never printed.
- `rotate-key --key FILE --source DIR [--dry-run]`: a new identity; every secret of every
  intent (`DIR/deployments/*.yaml`) re-encrypted to it, each file rewritten in place with
  every other byte kept and each secret in its own style (a `|` block stays a block, a
  quoted scalar stays quoted). All or nothing: a secret the key does not open, or a file
  that would not load to the same document, changes nothing. The key file is written first (the new
  identity, then the old ones, which the server still needs for the source it has), then
  the intents. `rotate-key --finish --key FILE [--source DIR]` drops every identity but the
  first, once the source is pushed (with `--source`, only if every secret opens without them).
- `check --source DIR [--key FILE]`: every secret's shape, without a key (CI, the pre-receive
  hook); with `--key`, also that each opens. `file:line:col: path: message`, exit 1 on any.
"""

from __future__ import annotations

import argparse
import copy
import getpass
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from compiler.secrets import (
    SECRET,
    FleetKey,
    SecretError,
    encrypt_secret,
    is_secret,
    new_identity_text,
    secret_problem,
    write_identity_file,
)
from margo.errors import DocumentError, Problem
from margo.files import write_atomically
from margo.loading import LoadedDocument, load_document
from margo_cli import progress
from margo_cli.usage import EXIT_FAILED, EXIT_OK, UsageError

__all__ = ["register"]

_KEY_HELP = "the fleet key: an age identity file, mode 600 (margo secrets keygen)"


def register(commands: Any) -> None:
    secrets = commands.add_parser(
        "secrets", help="the fleet key, and the encrypted parameters of intents",
        description="Create and rotate the fleet key, encrypt secret parameters, check them.")
    verbs = secrets.add_subparsers(dest="verb", metavar="VERB", required=True)
    keygen = verbs.add_parser("keygen", help="a new fleet key; prints its recipient")
    keygen.add_argument("--out", required=True, metavar="FILE",
                        help="the identity file to write (mode 600; keep it out of every "
                             "repository)")
    keygen.add_argument("--force", action="store_true", help="replace an existing FILE")
    keygen.set_defaults(run=run_keygen)

    recipient = verbs.add_parser("recipient", help="the fleet key's current recipient")
    recipient.add_argument("--key", required=True, metavar="FILE", help=_KEY_HELP)
    recipient.set_defaults(run=run_recipient)

    encrypt = verbs.add_parser(
        "encrypt", help="encrypt a parameter value from stdin; prints the YAML to paste",
        description="Encrypt a secret read from stdin (exactly one trailing newline is "
                    "dropped, so `echo pw |` works; a terminal is asked without echo) or, "
                    "verbatim, from --from-file. The plaintext is never printed.")
    to = encrypt.add_mutually_exclusive_group(required=True)
    to.add_argument("--recipient", action="append", metavar="AGE1",
                    help="the fleet key's recipient, age1... (repeatable)")
    to.add_argument("--key", metavar="FILE", help="encrypt to this key's current recipient")
    encrypt.add_argument("--from-file", metavar="PATH", help="read the plaintext from PATH")
    encrypt.add_argument("--name", metavar="PARAMETER",
                         help="print the whole parameter entry (`NAME:` above `secret: |`)")
    encrypt.add_argument("--armor-only", action="store_true",
                         help="print only the armored age file")
    encrypt.set_defaults(run=run_encrypt)

    rotate = verbs.add_parser(
        "rotate-key", help="a new fleet key; re-encrypt every intent's secrets in place",
        description="Generate a new identity and re-encrypt every secret under "
                    "DIR/deployments to it, in place. The key file then holds the new "
                    "identity first and the old ones after it: push the source, then run "
                    "`margo secrets rotate-key --finish --key FILE`.")
    rotate.add_argument("--key", required=True, metavar="FILE", help=_KEY_HELP)
    rotate.add_argument("--source", metavar="DIR", help="the fleet source's working tree")
    rotate.add_argument("--dry-run", action="store_true", help="say what would change")
    rotate.add_argument("--finish", action="store_true",
                        help="drop every identity but the first (after the push); with "
                             "--source, only if every secret opens without them")
    rotate.set_defaults(run=run_rotate)

    check = verbs.add_parser("check", help="check the shape of every secret (no key needed)")
    check.add_argument("--source", required=True, metavar="DIR",
                       help="the fleet source (its deployments/ directory)")
    check.add_argument("--key", metavar="FILE", help="also check that each secret opens")
    check.set_defaults(run=run_check)


def _fail(verb: str, message: object) -> UsageError:
    return UsageError(f"margo secrets {verb}: {message}")


def _load_key(verb: str, path: str) -> FleetKey:
    try:
        return FleetKey.load(Path(path))
    except (OSError, SecretError) as exc:
        raise _fail(verb, exc) from None


# --- keygen, recipient, encrypt ------------------------------------------------------


def run_keygen(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if (out.exists() or out.is_symlink()) and not args.force:
        raise _fail("keygen", f"{out} exists (--force replaces it, and loses the key it holds)")
    text = new_identity_text()
    try:
        write_identity_file(out, text)
    except OSError as exc:
        raise _fail("keygen", exc) from None
    print(_load_key("keygen", args.out).recipient)
    print(f"wrote {out} (mode 600): keep it outside every repository", file=sys.stderr)
    return EXIT_OK


def run_recipient(args: argparse.Namespace) -> int:
    print(_load_key("recipient", args.key).recipient)
    return EXIT_OK


def _plaintext(args: argparse.Namespace) -> str:
    try:
        if args.from_file:
            data = Path(args.from_file).read_bytes()
        elif sys.stdin.isatty():
            data = getpass.getpass("secret (not echoed): ").encode("utf-8")
        else:
            data = sys.stdin.buffer.read()
            data = data.removesuffix(b"\r\n") if data.endswith(b"\r\n") else \
                data.removesuffix(b"\n")
    except OSError as exc:
        raise _fail("encrypt", exc) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail("encrypt", "the plaintext is not UTF-8 text") from None
    if not text:
        raise _fail("encrypt", "the plaintext is empty")
    return text


def run_encrypt(args: argparse.Namespace) -> int:
    recipients = args.recipient or [_load_key("encrypt", args.key).recipient]
    plaintext = _plaintext(args)
    try:
        armored = encrypt_secret(plaintext, recipients)
    except SecretError as exc:
        raise _fail("encrypt", exc) from None
    if args.armor_only:
        sys.stdout.write(armored)
        return EXIT_OK
    indent = "  " if args.name else ""
    lines = [f"{args.name}:"] if args.name else []
    lines.append(f"{indent}{SECRET}: |")
    lines += [f"{indent}  {line}" for line in armored.splitlines()]
    print("\n".join(lines))
    return EXIT_OK


# --- finding and rewriting secrets in intents -----------------------------------------


@dataclass(frozen=True)
class Site:
    """One secret parameter of an intent: where it is and its armored text."""

    file: str
    parameter: str
    armored: Any  # a str when well-formed
    line: int | None
    column: int | None

    def problem(self, message: str) -> Problem:
        return Problem(("spec", "parameters", self.parameter, SECRET), message, self.file,
                       self.line, self.column)


def _intent_files(verb: str, source: str) -> list[Path]:
    deployments = Path(source) / "deployments"
    if not Path(source).is_dir():
        raise _fail(verb, f"{source}: not a directory")
    if not deployments.is_dir():
        return []
    return sorted(p for p in deployments.iterdir()
                  if p.suffix in (".yaml", ".yml") and p.is_file())


def _parameters(loaded: LoadedDocument) -> dict[str, Any]:
    spec = loaded.value.get("spec") if isinstance(loaded.value, dict) else None
    parameters = spec.get("parameters") if isinstance(spec, dict) else None
    return parameters if isinstance(parameters, dict) else {}


def find_sites(loaded: LoadedDocument) -> list[Site]:
    """The secret parameters of a loaded intent, located."""
    sites = []
    for name, value in _parameters(loaded).items():
        if is_secret(value):
            position = loaded.source.value_position(("spec", "parameters", name, SECRET))
            line, column = position or (None, None)
            sites.append(Site(loaded.file or "<input>", name, value[SECRET], line, column))
    return sites


def _load_intents(verb: str, source: str) -> Iterator[tuple[Path, str, LoadedDocument]]:
    """(path, text, document) of every intent file; one that does not load is a problem."""
    problems: list[Problem] = []
    loaded = []
    for path in _intent_files(verb, source):
        try:
            text = path.read_bytes().decode("utf-8")
            loaded.append((path, text, load_document(text, file=str(path))))
        except OSError as exc:
            raise _fail(verb, f"{path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            problems.append(Problem((), "not UTF-8 text", str(path), 1, 1))
        except DocumentError as exc:
            problems.extend(exc.problems)
    if problems:
        raise _Problems(problems)
    yield from progress.iterate(loaded, len(loaded), verb, unit="intent")


class _Problems(Exception):
    def __init__(self, problems: list[Problem]):
        super().__init__(len(problems))
        self.problems = problems


def replace_armor(text: str, site: Site, armored: str) -> str:
    """`text` with the block-scalar lines of `site`'s armored value replaced by `armored`
    (same indentation, same line endings, same block header), every other byte kept.
    Raises `SecretError` when the value is not written as such a block below its line."""
    lines = text.splitlines(keepends=True)
    old = str(site.armored).splitlines()
    start = next((k for k in range((site.line or 1), len(lines)) if lines[k].strip()), None)
    unlike = SecretError("the secret is not written as a block scalar (`secret: |` and the "
                         "armored lines below it): cannot rewrite it in place")
    if start is None or not old or lines[start].strip() != old[0].strip():
        return _replace_flow_scalar(text, site, armored, unlike)
    first = lines[start]
    indent = first[:len(first) - len(first.lstrip(" "))]
    body = lines[start:start + len(old)]
    if len(body) != len(old) or any(line.rstrip("\r\n") != indent + want
                                     for line, want in zip(body, old, strict=True)):
        return _replace_flow_scalar(text, site, armored, unlike)
    ending = "\r\n" if first.endswith("\r\n") else "\n"
    new = [indent + line + ending for line in armored.splitlines()]
    last = body[-1]
    new[-1] = new[-1].removesuffix(ending) + last[len(last.rstrip("\r\n")):]
    return "".join(lines[:start] + new + lines[start + len(old):])


def _replace_flow_scalar(text: str, site: Site, armored: str, unlike: SecretError) -> str:
    """`text` with a secret written on its key's line (quoted, as YAML emitters write a
    multi-line string) replaced by a block scalar of `armored`: PyYAML's composer gives the
    scalar's exact span and its key's column; every other byte is kept."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        raise unlike from None
    found = _secret_nodes(root, site.parameter)
    if found is None or ("\n" in text[found[1].start_mark.index:found[1].end_mark.index] \
            and found[1].style not in ('"', "'")):
        raise unlike
    key, value, in_flow = found
    if in_flow or value.style in ('"', "'"):  # stays a quoted scalar: JSON's escapes are YAML's
        written = json.dumps(armored)
    else:
        indent = " " * (key.start_mark.column + 2)
        written = "|\n" + "\n".join(indent + line for line in armored.splitlines())
    return text[:value.start_mark.index] + written + text[value.end_mark.index:]


def _secret_nodes(root: Any, parameter: str) -> tuple[Any, Any, bool] | None:
    """The key and value nodes of `spec.parameters.<parameter>.secret`, if there, and
    whether it stands in a flow collection (where no block scalar may)."""
    node, in_flow = root, False
    for name in ("spec", "parameters", parameter, SECRET):
        if not isinstance(node, yaml.MappingNode):
            return None
        in_flow = in_flow or bool(node.flow_style)
        pair = next(((k, v) for k, v in node.value if getattr(k, "value", None) == name), None)
        if pair is None:
            return None
        key, node = pair
    return (key, node, in_flow) if isinstance(node, yaml.ScalarNode) else None


def _without_secrets(value: Any) -> Any:
    copied = copy.deepcopy(value)
    for parameter in _parameters(LoadedDocument.unlocated(copied)).values():
        if is_secret(parameter) and isinstance(parameter, dict):  # loaded: always a dict
            parameter[SECRET] = None
    return copied


# --- rotate-key ------------------------------------------------------------------------


@dataclass
class _Rewrite:
    path: Path
    text: str
    count: int


def _rewrite(path: Path, text: str, loaded: LoadedDocument, old: FleetKey,
             new: FleetKey) -> tuple[_Rewrite | None, list[Problem]]:
    """The intent re-encrypted to `new`, checked: the rewritten text loads to the same
    document but for the secrets, and each new secret opens with `new` alone."""
    sites, problems, plaintexts = find_sites(loaded), [], []
    for site in sites:
        try:
            plaintexts.append(old.decrypt(str(site.armored)))
        except SecretError as exc:
            problems.append(site.problem(str(exc)))
    if problems or not sites:
        return None, problems
    # From the last line up, so that a block of another length moves nothing still to do.
    for site, plaintext in sorted(zip(sites, plaintexts, strict=True),
                                  key=lambda pair: -(pair[0].line or 0)):
        try:
            text = replace_armor(text, site, encrypt_secret(plaintext, [new.recipient]))
        except SecretError as exc:
            problems.append(site.problem(str(exc)))
    if problems:
        return None, problems
    if not _same_but_secrets(path, text, loaded, new, plaintexts):
        return None, [Problem((), "rewriting its secrets would change more than them",
                              str(path), 1, 1)]
    return _Rewrite(path, text, len(sites)), []


def _same_but_secrets(path: Path, text: str, loaded: LoadedDocument, new: FleetKey,
                      plaintexts: list[str]) -> bool:
    try:
        again = load_document(text, file=str(path))
        reopened = [new.decrypt(str(site.armored)) for site in find_sites(again)]
    except (DocumentError, SecretError):
        return False
    return reopened == plaintexts and (_without_secrets(again.value)
                                       == _without_secrets(loaded.value))


def _report(problems: list[Problem]) -> None:
    for problem in problems:
        print(problem.format(), file=sys.stderr)


def run_rotate(args: argparse.Namespace) -> int:
    if args.finish:
        return _finish(args)
    if not args.source:
        raise _fail("rotate-key", "--source DIR is required (or --finish)")
    key_path = Path(args.key)
    old = _load_key("rotate-key", args.key)
    identity_text = new_identity_text()
    new = FleetKey.from_text(identity_text, "the new key")
    rewrites, problems = [], []
    try:
        for path, text, loaded in _load_intents("rotate-key", args.source):
            rewrite, found = _rewrite(path, text, loaded, old, new)
            problems += found
            rewrites += [rewrite] if rewrite else []
    except _Problems as exc:
        problems = exc.problems
    if problems:
        _report(problems)
        print("margo secrets rotate-key: changed nothing", file=sys.stderr)
        return EXIT_FAILED
    secrets = sum(r.count for r in rewrites)
    if args.dry_run:
        for rewrite in rewrites:
            print(f"{rewrite.path}: would re-encrypt {rewrite.count} secret(s)")
        print(f"would rotate {key_path} to a new key and re-encrypt {secrets} secret(s)")
        return EXIT_OK
    previous = key_path.read_text("utf-8")
    # The key first: if writing an intent fails, the key still opens old and new secrets.
    write_identity_file(key_path, identity_text + "# previous identities, kept until "
                        "`margo secrets rotate-key --finish`\n" + previous.rstrip("\n") + "\n")
    for rewrite in rewrites:
        try:
            write_atomically(rewrite.path, rewrite.text,
                             mode=rewrite.path.stat().st_mode & 0o777)
        except OSError as exc:
            raise _fail("rotate-key", f"{rewrite.path}: {exc} (the key holds the new and the "
                        "old identities: run rotate-key again once it is writable)") from None
        print(f"{rewrite.path}: re-encrypted {rewrite.count} secret(s)")
    print(f"{key_path}: new recipient {new.recipient} (the old identities kept after it)")
    print(f"next: commit and push the source, let the server compile it, then run "
          f"`margo secrets rotate-key --finish --key {key_path}` (and install the key "
          "wherever the server reads it)", file=sys.stderr)
    return EXIT_OK


def _finish(args: argparse.Namespace) -> int:
    key = _load_key("rotate-key", args.key)
    if len(key.identities) == 1:
        print(f"{args.key}: holds one identity, nothing to drop")
        return EXIT_OK
    if args.source:
        current = FleetKey(key.identities[:1], "the current identity")
        problems, _count = _opening_problems(args.source, current, "rotate-key")
        if problems:
            _report(problems)
            print("margo secrets rotate-key --finish: these secrets need the identities it "
                  "would drop (run rotate-key again first); changed nothing", file=sys.stderr)
            return EXIT_FAILED
    first = key.identities[0]
    write_identity_file(Path(args.key), f"# public key: {key.recipient}\n{first}\n")
    print(f"{args.key}: dropped {len(key.identities) - 1} previous identit"
          f"{'y' if len(key.identities) == 2 else 'ies'}; recipient {key.recipient}")
    return EXIT_OK


# --- check -------------------------------------------------------------------------------


def _opening_problems(source: str, key: FleetKey | None,
                      verb: str) -> tuple[list[Problem], int]:
    """Every secret's shape problem, and with `key`, each secret it does not open; and how
    many secrets there are."""
    problems: list[Problem] = []
    count = 0
    try:
        for _path, _text, loaded in _load_intents(verb, source):
            for site in find_sites(loaded):
                count += 1
                shape = secret_problem({SECRET: site.armored})
                if shape is not None:
                    problems.append(site.problem(shape))
                    continue
                try:
                    if key is not None:
                        key.decrypt(str(site.armored))
                except SecretError as exc:
                    problems.append(site.problem(str(exc)))
    except _Problems as exc:
        problems += exc.problems
    return problems, count


def run_check(args: argparse.Namespace) -> int:
    key = _load_key("check", args.key) if args.key else None
    problems, count = _opening_problems(args.source, key, "check")
    _report(problems)
    if problems:
        return EXIT_FAILED
    opened = " and open with the fleet key" if key else ""
    print(f"{args.source}: {count} secret(s), all well-formed{opened}")
    return EXIT_OK
