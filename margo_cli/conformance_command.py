"""`margo conformance wfm`: the official Margo conformance kit's WFM suites against any WFM.

    margo conformance wfm --base-url URL --suite FILE --cert-dir DIR [--group NAME] [--json]

One line per step, `PASS|FAIL|SKIP <scenario>/<step>: why`, as each finishes (a run that
polls for an operator can take minutes, and a person watching wants progress), then a
summary line. `--json` prints one document instead. Exit codes: 0 only when every step
passed, 1 when any failed or was skipped, 2 when the suite, group or cert dir is unusable.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from margo_cli import progress
from margo_cli.usage import UsageError

__all__ = ["register"]


def register(commands: Any) -> None:
    conformance = commands.add_parser(
        "conformance", help="run the official Margo conformance kit's suites")
    targets = conformance.add_subparsers(dest="target", metavar="TARGET", required=True)
    wfm = targets.add_parser(
        "wfm", help="test a Workload Fleet Manager with the kit's scenario files or Postman "
                    "collections",
        description="Runs the kit's declarative scenarios (or a Postman collection, converted "
                    "as the kit does) against a WFM and prints PASS/FAIL/SKIP per step.")
    wfm.add_argument("--base-url", required=True, metavar="URL",
                     help="the WFM's API base, including any prefix "
                          "(e.g. https://wfm:8443/v1alpha2/margo)")
    wfm.add_argument("--suite", required=True, metavar="FILE",
                     help="a scenario JSON file or a Postman collection")
    wfm.add_argument("--cert-dir", required=True, metavar="DIR",
                     help="svid-cert.pem + svid-key.pem (rc.3 mTLS), optionally "
                          "svid-refreshed-cert.pem + -key.pem (a rotated SVID) and "
                          "device.key + device-cert.pem (rc.2; generated per scenario when "
                          "absent)")
    wfm.add_argument("--group", metavar="NAME",
                     help="run only a group's test cases: a group.json file, or a name found "
                          "as groups/NAME/group.json beside the suite or above it")
    wfm.add_argument("--registry-ref", metavar="REF",
                     help="the application package for oras steps, host/repo:tag "
                          "(default: $REGISTRY_REF)")
    wfm.add_argument("--registry-plain-http", action="store_true", default=None,
                     help="talk plain HTTP to the registry (default: only to loopback ones)")
    wfm.add_argument("--poll-interval", type=float, metavar="SECONDS",
                     help="poll at most this long apart (the kit's steps wait up to 10 s)")
    wfm.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                     help="per request (default 30)")
    wfm.add_argument("--json", action="store_true", help="one JSON document")
    wfm.set_defaults(run=run_wfm)


def run_wfm(args: argparse.Namespace) -> int:
    from conformance.runner import (
        CertDir,
        Runner,
        RunnerOptions,
        StepResult,
        SuiteError,
        load_suite,
    )

    try:
        suite = load_suite(Path(args.suite), args.group)
        cert_dir = CertDir.load(Path(args.cert_dir))
    except SuiteError as exc:
        raise UsageError(f"margo conformance: {exc}") from None
    if not args.base_url.startswith(("http://", "https://")):
        raise UsageError(f"margo conformance: --base-url must be an http(s) URL, not "
                         f"{args.base_url!r}")
    options = RunnerOptions(registry_ref=args.registry_ref,
                            registry_plain_http=args.registry_plain_http,
                            poll_interval=args.poll_interval, timeout=args.timeout)

    with progress.bar(suite.step_count, "conformance", enabled=not args.json,
                      unit="step") as steps:
        def stepped(result: StepResult) -> None:
            steps.update()
            steps.write(result.line())

        with Runner(args.base_url, cert_dir, options,
                    on_result=None if args.json else stepped) as runner:
            report = runner.run_suite(suite)
    if args.json:
        print(json.dumps({"baseUrl": args.base_url, **report.as_dict()}, indent=2))
    else:
        print(report.summary())
    return 0 if report.passed else 1
