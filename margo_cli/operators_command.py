"""`margo operators add|list|revoke|rotate`: the people and tools of the operator surface,
each with a role (viewer, operator, admin; docs/operations.md, "Operators and roles").

Like `margo clients`, they work on the server's store beside it (`--data`, or `--database`
for replicas on PostgreSQL); the servers notice within a second. A token is printed once,
when it is made (`add`, `rotate`); only its hash is stored, and `list` never shows one.
Every change is recorded in the audit trail as `local:<OS user>`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any

from margo_cli.datastore import audited, data_options, opened_store
from margo_cli.usage import UsageError

__all__ = ["register"]

ROLES = ("viewer", "operator", "admin")


def register(commands: Any) -> None:
    operators = commands.add_parser(
        "operators", help="add, list, revoke and rotate operator credentials (roles)",
        description="Operators call the read API, the dashboard, /metrics, rollout actions "
                    "and the hosted source with a bearer token. viewer: read; operator: also "
                    "pause, resume and abort rollouts and push to the hosted source; admin: "
                    "also the operators and the audit trail through the API.")
    verbs = operators.add_subparsers(dest="verb", metavar="VERB", required=True)
    add = verbs.add_parser("add", help="register an operator; prints its token once")
    add.add_argument("name", metavar="NAME")
    add.add_argument("--role", required=True, type=_role, metavar="|".join(ROLES),
                     help="what the operator may do")
    add.add_argument("--json", action="store_true")
    data_options(add)
    add.set_defaults(run=run_add)

    listing = verbs.add_parser("list", help="every operator and its role (never a token)")
    listing.add_argument("--json", action="store_true")
    data_options(listing)
    listing.set_defaults(run=run_list)

    revoke = verbs.add_parser("revoke", help="refuse an operator's token from now on")
    revoke.add_argument("name", metavar="NAME")
    data_options(revoke)
    revoke.set_defaults(run=run_revoke)

    rotate = verbs.add_parser("rotate", help="a new token; the old one stops working")
    rotate.add_argument("name", metavar="NAME")
    rotate.add_argument("--json", action="store_true")
    data_options(rotate)
    rotate.set_defaults(run=run_rotate)


def _role(text: str) -> Any:
    from wfm.identity.operators import Role

    try:
        return Role.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _change(args: argparse.Namespace, verb: str, change: Any, detail: str | None = None
            ) -> Any:
    """Run `change(registry)` on the store, recorded in the audit trail; a refusal
    (`OperatorError`) is a usage error that says why."""
    from wfm.identity.operatorstore import OperatorError, OperatorRegistry

    with opened_store(args) as db:
        try:
            result = change(OperatorRegistry(db))
        except OperatorError as exc:
            raise UsageError(f"margo: operators {verb}: {exc}") from None
        audited(db, f"operator.{verb}", args.name, detail)
    return result


def _print_token(args: argparse.Namespace, token: str, role: str | None) -> None:
    if args.json:
        print(json.dumps({"name": args.name, **({"role": role} if role else {}),
                          "token": token}))
        return
    print(f"operator {args.name}{f' ({role})' if role else ''}\ntoken    {token}\n"
          "(shown once: send it as 'Authorization: Bearer <token>', or as the password of "
          "the hosted source; margo --token-file takes a file holding it)")


def run_add(args: argparse.Namespace) -> int:
    role = args.role
    token = _change(args, "add", lambda registry: registry.add(args.name, role),
                    f"role {role.label}")
    _print_token(args, token, role.label)
    return 0


def run_rotate(args: argparse.Namespace) -> int:
    token = _change(args, "rotate", lambda registry: registry.rotate(args.name))
    _print_token(args, token, None)
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    _change(args, "revoke", lambda registry: registry.revoke(args.name))
    print(f"revoked {args.name}")
    return 0


def _when(at: float | None) -> str:
    return "-" if at is None else dt.datetime.fromtimestamp(at, dt.UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def run_list(args: argparse.Namespace) -> int:
    from wfm.identity.operatorstore import OperatorRegistry

    with opened_store(args) as db:
        rows = OperatorRegistry(db).describe()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        state = f"revoked {_when(row['revokedAt'])}" if row["revoked"] else "active"
        print(f"{row['name']}\t{row['role']}\t{state}\tcreated {_when(row['createdAt'])}"
              + (f"\trotated {_when(row['rotatedAt'])}" if row["rotatedAt"] else ""))
    return 0
