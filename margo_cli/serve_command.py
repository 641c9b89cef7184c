"""`margo serve` (the fleet server) and `margo clients` (operator commands for clients)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from wfm.clients import ClientRegistry
from wfm.compiles import SourceConfig
from wfm.db import Database


def register(commands: Any) -> None:
    serve = commands.add_parser("serve", help="run the Workload Fleet Manager server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--data", default="wfm-data", metavar="DIR",
                       help="state directory: wfm.sqlite and repos/ (default: ./wfm-data)")
    serve.add_argument("--source", metavar="SRC", help="fleet source directory or Git repo")
    serve.add_argument("--ref", help="Git ref of the fleet source")
    serve.add_argument("--watch-source", action="store_true",
                       help="recompile when files under --source change (development)")
    serve.add_argument("--source-url", metavar="URL",
                       help="remote fleet source repository, fetched on verified push hooks")
    serve.add_argument("--source-branch", default="main", metavar="BRANCH")
    serve.add_argument("--host-source", action="store_true",
                       help="host the fleet source at /git/source.git (push with the operator "
                            "token); pushes to --source-branch recompile")
    serve.add_argument("--webhook-secret-file", metavar="FILE",
                       help="file holding the shared secret of POST /hooks/git")
    serve.add_argument("--admin-token-file", metavar="FILE",
                       help="file holding the operator token the /api/fleet API requires")
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(run=run_serve)

    clients = commands.add_parser("clients", help="register and retire device clients")
    verbs = clients.add_subparsers(dest="verb", metavar="VERB", required=True)
    add = verbs.add_parser("add", help="register a client and print its credentials")
    add.add_argument("client_id", metavar="CLIENT_ID")
    add.add_argument("--data", default="wfm-data", metavar="DIR")
    add.add_argument("--json", action="store_true")
    add.set_defaults(run=run_clients_add)
    retire = verbs.add_parser("retire", help="refuse a client's requests from now on")
    retire.add_argument("client_id", metavar="CLIENT_ID")
    retire.add_argument("--data", default="wfm-data", metavar="DIR")
    retire.set_defaults(run=run_clients_retire)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from wfm.app import ServerConfig, create_app

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    source = SourceConfig(Path(args.source).resolve() if args.source else None, args.ref)
    app = create_app(ServerConfig(
        Path(args.data).resolve(), source, source_url=args.source_url,
        source_branch=args.source_branch, watch_source=args.watch_source,
        host_source=args.host_source,
        webhook_secret=_secret(args.webhook_secret_file),
        admin_token=_secret(args.admin_token_file)))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                proxy_headers=False, server_header=False)
    return 0


def _secret(path: str | None) -> str | None:
    """Secrets come from files (never the command line, which other users can read)."""
    if path is None:
        return None
    value = Path(path).read_text(encoding="utf-8").strip()
    if not value:
        raise SystemExit(f"margo serve: {path} is empty")
    return value


def run_clients_add(args: argparse.Namespace) -> int:
    db = Database(Path(args.data) / "wfm.sqlite")
    try:
        client_id, token = ClientRegistry(db).add(args.client_id)
    finally:
        db.close()
    if args.json:
        print(json.dumps({"clientId": client_id, "token": token}))
    else:
        print(f"client {client_id}\ntoken  {token}\n(send it as 'Authorization: Bearer <token>'; "
              "for Git, as the password of user <client id>)")
    return 0


def run_clients_retire(args: argparse.Namespace) -> int:
    db = Database(Path(args.data) / "wfm.sqlite")
    try:
        retired = ClientRegistry(db).retire(args.client_id)
    finally:
        db.close()
    if not retired:
        print(f"margo clients: no client {args.client_id!r}", file=sys.stderr)
        return 2
    return 0
