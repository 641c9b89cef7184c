"""The official Margo conformance kit's WFM runner, in Python: runs the kit's declarative
scenario files (and its Postman collections, converted by `conformance.postman`) against any
WFM and says, per step, PASS, FAIL or SKIP and why.

The kit's own runner is JavaScript plus the `openssl` and `oras` binaries; vendors and our
CI need the same verdicts without them. This module implements the step schema of the kit
README section 2.3 with the same semantics:

* a request per step (`method`, `endpoint` under the base URL, `headers`, `request_body`),
  `{name}` placeholders filled from context that earlier steps extracted (`extract_context`),
  with the kit's fallbacks for ids never extracted;
* pass when the status is `expected_status` or one of `accepted_statuses`; `validations`
  are checked only on the expected status (an accepted alternative has another body);
  context is extracted only from a fully passing step;
* `poll` re-sends until its `until` validations hold or its timeout passes;
* identity per step: `mtls` presents the X.509-SVID (`svid-cert.pem`/`svid-key.pem`),
  `svid_source: "refreshed"` a rotated one (`svid-refreshed-cert.pem`/`-key.pem`; the
  kit's runner has no such source and reuses the current SVID, and so do we, saying so, when
  the files are absent); every other HTTP step is signed the rc.2 way (RFC 9421,
  `conformance.signing` over `reconciler.signing`) with the negative-case knobs
  `skip_signing`, `skip_content_digest`, `tamper_signature`, `fresh_cert`,
  `skip_certificate_injection`;
* `expect_transport_error`: the step passes only when the connection fails (a WFM must
  refuse a TLS handshake without a client certificate);
* `oras` steps read the OCI registry named by `oras.ref`, `RunnerOptions.registry_ref` or
  `REGISTRY_REF` (`conformance.registry`); without any, they are skipped, not failed.

Like the kit, the runner does not verify the WFM's server certificate (a conformance run
tests the WFM, it does not authenticate it), and each scenario starts with empty context.
The rc.2 identity is `device.key` + `device-cert.pem` from the cert dir when present (so an
operator can import it into a WFM whose onboarding is closed); otherwise each scenario
onboards a freshly generated EC P-256 identity, as the kit's runner always does.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conformance.checks import Response, field_value, substitute, validate
from conformance.registry import RegistryClient, RegistryError, RegistryRef
from conformance.signing import apply_rc2_signing
from margo.rfc9421 import key_id
from reconciler.signing import (
    DeviceKey,
    SigningError,
    load_device_key,
)

__all__ = [
    "CERTIFICATE_PLACEHOLDER",
    "CertDir",
    "Rc2Identity",
    "Runner",
    "RunnerOptions",
    "StepResult",
    "Suite",
    "SuiteError",
    "SuiteReport",
    "load_suite",
]

CERTIFICATE_PLACEHOLDER = "./certs/device-cert.pem"
DEFAULT_POLL_INTERVAL = 5.0
DEFAULT_POLL_TIMEOUT = 120.0
USER_AGENT = "margo-gitops-conformance"
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class SuiteError(Exception):
    """The suite, group or cert dir cannot be used (a usage problem, not a WFM verdict)."""


# --- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Suite:
    """Scenarios ready to run: `[{id, name, steps: [...]}, ...]`."""

    name: str
    scenarios: list[dict[str, Any]]

    @property
    def step_count(self) -> int:
        return sum(len(s.get("steps") or []) for s in self.scenarios)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SuiteError(f"cannot read the {what} {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise SuiteError(f"the {what} {path} is not JSON: {exc}") from None


def find_group(group: str, suite_path: Path) -> dict[str, Any]:
    """A group definition (`{name, testCases[]}`): `group` is its file, or a name looked up
    as `groups/<name>/group.json` beside the suite or in the directories above it (the kit
    keeps groups apart from the test files they select from)."""
    candidate = Path(group)
    if candidate.is_file():
        doc = _read_json(candidate, "group definition")
    else:
        for directory in [suite_path.parent, *suite_path.parent.parents][:4]:
            found = directory / "groups" / group / "group.json"
            if found.is_file():
                doc = _read_json(found, "group definition")
                break
        else:
            raise SuiteError(f"no group {group!r}: not a file, and no groups/{group}/group.json "
                             f"beside {suite_path} or above it")
    if not isinstance(doc, dict) or not isinstance(doc.get("testCases", []), list):
        raise SuiteError(f"group {group!r} is not a {{name, testCases: [...]}} object")
    return doc


def _select_steps(scenarios: list[dict[str, Any]], cases: set[str]) -> list[dict[str, Any]]:
    """A group's `testCases` name scenarios or steps; an empty list selects everything."""
    if not cases:
        return scenarios
    kept = []
    for scenario in scenarios:
        if scenario.get("id") in cases:
            kept.append(scenario)
            continue
        steps = [s for s in scenario.get("steps") or [] if s.get("id") in cases]
        if steps:
            kept.append({**scenario, "steps": steps})
    return kept


def load_suite(path: Path, group: str | None = None) -> Suite:
    """A declarative scenario file, or a Postman collection converted to steps; narrowed to
    the group's test cases when a group is given."""
    from conformance.postman import convert_collection, is_postman_collection

    doc = _read_json(path, "suite")
    definition = find_group(group, path) if group else None
    cases = {str(c) for c in (definition or {}).get("testCases", [])}
    if is_postman_collection(doc):
        scenarios = convert_collection(doc, cases)
    elif isinstance(doc, list) and all(isinstance(s, dict) and isinstance(
            s.get("steps", []), list) for s in doc):
        scenarios = _select_steps(doc, cases)
    else:
        raise SuiteError(f"{path} is neither a scenario list ([{{id, steps: [...]}}]) nor a "
                         "Postman collection")
    name = str((definition or {}).get("name") or path.name)
    return Suite(name, scenarios)


@dataclass(frozen=True)
class Rc2Identity:
    """An rc.2 device identity: the signing key and the certificate onboarding sends."""

    key: DeviceKey
    certificate_pem: bytes

    @property
    def certificate_base64(self) -> str:
        """As the kit sends it: base64 of the PEM file's bytes."""
        return base64.b64encode(self.certificate_pem).decode("ascii")

    @classmethod
    def generate(cls, common_name: str | None = None) -> Rc2Identity:
        """A fresh EC P-256 key and self-signed certificate, as the kit's
        `openssl req -x509` makes them."""
        private_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Margo"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "Conformance"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name or f"device-{time.time_ns()}")])
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(private_key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=365))
                .sign(private_key, hashes.SHA256()))
        key = DeviceKey(private_key, "ecdsa-p256-sha256", key_id(private_key.public_key()))
        return cls(key, cert.public_bytes(serialization.Encoding.PEM))

    @classmethod
    def load(cls, key_file: Path, cert_file: Path) -> Rc2Identity:
        try:
            key = load_device_key(key_file)
            pem = cert_file.read_bytes()
            cert = x509.load_pem_x509_certificate(pem)
        except SigningError as exc:
            raise SuiteError(str(exc)) from None
        except OSError as exc:
            raise SuiteError(f"cannot read {cert_file}: {exc.strerror}") from None
        except ValueError as exc:
            raise SuiteError(f"{cert_file} is not a PEM certificate: {exc}") from None
        if key_id(cert.public_key()) != key.key_id:
            raise SuiteError(f"{cert_file} does not hold the public key of {key_file}")
        return cls(key, pem)


@dataclass(frozen=True)
class CertDir:
    """The kit's cert dir: `device.key` + `device-cert.pem` (rc.2, optional),
    `svid-cert.pem` + `svid-key.pem` (rc.3 mTLS), `svid-refreshed-cert.pem` +
    `svid-refreshed-key.pem` (a rotated SVID, optional). `svid-ca.pem` and `ca-cert.pem`
    are accepted and unused: like the kit, the runner does not verify the WFM."""

    directory: Path
    rc2: Rc2Identity | None = None
    svid: tuple[Path, Path] | None = None
    refreshed_svid: tuple[Path, Path] | None = None

    @classmethod
    def load(cls, directory: Path) -> CertDir:
        if not directory.is_dir():
            raise SuiteError(f"the cert dir {directory} is not a directory")
        key, cert = directory / "device.key", directory / "device-cert.pem"
        rc2 = Rc2Identity.load(key, cert) if key.exists() and cert.exists() else None
        return cls(directory, rc2, cls._pair(directory, "svid"),
                   cls._pair(directory, "svid-refreshed"))

    @staticmethod
    def _pair(directory: Path, stem: str) -> tuple[Path, Path] | None:
        cert, key = directory / f"{stem}-cert.pem", directory / f"{stem}-key.pem"
        if not (cert.exists() and key.exists()):
            return None
        try:  # fail here, with the file named, not as a transport error in every step
            ssl.create_default_context().load_cert_chain(str(cert), str(key))
        except (OSError, ssl.SSLError) as exc:
            raise SuiteError(f"{cert} / {key}: not a usable certificate and key: {exc}") from None
        return cert, key


@dataclass(frozen=True)
class RunnerOptions:
    """`registry_ref` for `oras` steps (default: `REGISTRY_REF`); `registry_plain_http`
    None means plain HTTP for loopback registries only; `poll_interval` caps every poll's
    interval (the kit waits 10 s for an operator; a scripted assignment is faster);
    `timeout` bounds each request."""

    registry_ref: str | None = None
    registry_plain_http: bool | None = None
    poll_interval: float | None = None
    timeout: float = 30.0


# --- outputs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepResult:
    scenario: str
    step: str
    name: str
    verdict: str  # PASS | FAIL | SKIP
    reason: str
    method: str = ""
    endpoint: str = ""
    expected: int = 0
    actual: int = 0
    cr_ids: tuple[str, ...] = ()

    def line(self) -> str:
        """`PASS|FAIL|SKIP <scenario>/<step>: why`."""
        return f"{self.verdict} {self.scenario}/{self.step}: {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "step": self.step, "name": self.name,
                "verdict": self.verdict, "reason": self.reason, "method": self.method,
                "endpoint": self.endpoint, "expected": self.expected, "actual": self.actual,
                "crIds": list(self.cr_ids)}


@dataclass
class SuiteReport:
    suite: str
    results: list[StepResult] = field(default_factory=list)

    def count(self, verdict: str) -> int:
        return sum(1 for r in self.results if r.verdict == verdict)

    @property
    def passed(self) -> bool:
        """True only when every step passed (a skipped step did not)."""
        return all(r.verdict == PASS for r in self.results)

    def summary(self) -> str:
        return (f"{self.suite}: {len(self.results)} steps run, {self.count(PASS)} passed, "
                f"{self.count(FAIL)} failed, {self.count(SKIP)} skipped")

    def as_dict(self) -> dict[str, Any]:
        scenarios: dict[str, dict[str, int]] = {}
        for r in self.results:
            entry = scenarios.setdefault(r.scenario, {"steps": 0, "passed": 0})
            entry["steps"] += 1
            entry["passed"] += r.verdict == PASS
        return {"suite": self.suite, "passed": self.passed,
                "summary": {"steps": len(self.results), "passed": self.count(PASS),
                            "failed": self.count(FAIL), "skipped": self.count(SKIP)},
                "scenarios": scenarios, "results": [r.as_dict() for r in self.results]}


# --- running -----------------------------------------------------------------------------------


@dataclass
class _ScenarioState:
    context: dict[str, Any]
    identity: Rc2Identity


class _Transports:
    """One httpx client per identity a step can present, created when first needed: the
    SVID, the rotated SVID, or no client certificate at all."""

    def __init__(self, cert_dir: CertDir, timeout: float) -> None:
        self._cert_dir, self._timeout = cert_dir, timeout
        self._clients: dict[str, httpx.Client] = {}

    def client(self, which: str) -> httpx.Client:
        if which not in self._clients:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE  # the kit's rejectUnauthorized: false
            pair = {"svid": self._cert_dir.svid,
                    "refreshed": self._cert_dir.refreshed_svid}.get(which)
            if pair is not None:
                context.load_cert_chain(str(pair[0]), str(pair[1]))
            self._clients[which] = httpx.Client(verify=context, timeout=self._timeout,
                                                follow_redirects=False)
        return self._clients[which]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def _status_text(status: int) -> str:
    return f"HTTP {status}" if status else "no response"


class Runner:
    """Runs suites against one WFM base URL (which includes any prefix, e.g.
    `https://host:8443/v1alpha2/margo`). Close it, or use it as a context manager."""

    def __init__(self, base_url: str, cert_dir: CertDir,
                 options: RunnerOptions | None = None,
                 on_result: Callable[[StepResult], None] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.cert_dir = cert_dir
        self.options = options or RunnerOptions()
        self._on_result = on_result
        self._transports = _Transports(cert_dir, self.options.timeout)
        self._registry = RegistryClient(plain_http=self.options.registry_plain_http,
                                        timeout=self.options.timeout)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._transports.close()
        self._registry.close()

    def run_suite(self, suite: Suite) -> SuiteReport:
        report = SuiteReport(suite.name)
        for scenario in suite.scenarios:
            report.results += self.run_scenario(scenario)
        return report

    def run_scenario(self, scenario: Mapping[str, Any]) -> list[StepResult]:
        """Every step in order, sharing context; a fresh context (and, without a cert-dir
        rc.2 identity, a fresh one) per scenario."""
        state = _ScenarioState({}, self.cert_dir.rc2 or Rc2Identity.generate())
        results = []
        for step in scenario.get("steps") or []:
            try:
                result = self._run_step(scenario, step, state)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                # Kit data written by hand: one malformed step fails, the run goes on.
                result = StepResult(str(scenario.get("id", "?")), str(step.get("id", "?")),
                                    str(step.get("name", "")), FAIL,
                                    f"malformed step: {type(exc).__name__}: {exc}")
            results.append(result)
            if self._on_result is not None:
                self._on_result(result)
        return results

    # --- one step ------------------------------------------------------------------------

    def _run_step(self, scenario: Mapping[str, Any], step: Mapping[str, Any],
                  state: _ScenarioState) -> StepResult:
        given = step.get("expected_status")
        expected = 200 if given is None else int(given)
        base: dict[str, Any] = {
            "scenario": str(scenario.get("id", "?")), "step": str(step.get("id", "?")),
            "name": str(step.get("name", "")), "expected": expected,
            "cr_ids": tuple(step.get("crIds") or scenario.get("crIds") or ())}
        problem = self._precondition(step)
        if problem is not None:
            verdict, reason = problem
            return StepResult(**base, verdict=verdict, reason=reason,
                              method="ORAS" if step.get("oras") else str(step.get("method", "")),
                              endpoint=str(step.get("endpoint", "")))
        response, timed_out, attempts = self._perform_polling(step, state, expected)
        failures = self._failures(step, state, response, expected)
        if timed_out:
            failures.append(f"timed out after {step['poll'].get('timeout_seconds', 120)}s "
                            f"waiting for poll.until ({attempts} attempts)")
        primary = response.status == expected
        if not failures and primary:
            for name, path in (step.get("extract_context") or {}).items():
                value = field_value(response, str(path))
                if value is not None:
                    state.context[name] = value
        verdict, reason = self._verdict(step, response, failures, expected)
        return StepResult(**base, verdict=verdict, reason=reason, method=response.method,
                          endpoint=response.endpoint, actual=response.status)

    def _precondition(self, step: Mapping[str, Any]) -> tuple[str, str] | None:
        """Why a step cannot be attempted here, as (verdict, reason), or None."""
        if step.get("oras"):
            if not (step["oras"].get("ref") or self._registry_ref()):
                return SKIP, ("oras step without a registry reference (set REGISTRY_REF or "
                              "--registry-ref, or give the step an oras.ref)")
            return None
        if not step.get("endpoint"):
            return FAIL, "the step has no endpoint"
        if step.get("mtls") and self.base_url.startswith("https:") and self.cert_dir.svid is None:
            return FAIL, (f"an mtls step needs svid-cert.pem and svid-key.pem in "
                          f"{self.cert_dir.directory}")
        return None

    def _failures(self, step: Mapping[str, Any], state: _ScenarioState, response: Response,
                  expected: int) -> list[str]:
        allowed = {expected, *(int(s) for s in step.get("accepted_statuses") or [])}
        failures = []
        if response.status not in allowed:
            failures.append(f"expected HTTP {expected}, got {_status_text(response.status)}"
                            + self._body_hint(response))
        if response.status == expected:
            failures += [f for v in step.get("validations") or []
                         if (f := validate(response, v, state.context))]
        return failures

    @staticmethod
    def _body_hint(response: Response) -> str:
        """What the WFM said, when it is text (a problem's detail usually says why)."""
        if not response.body or response.status == 0:
            return ""
        content_type = response.headers.get("content-type", "")
        if not any(t in content_type for t in ("json", "text", "yaml", "xml")):
            return f" ({len(response.body)} bytes of {content_type or 'unknown type'})"
        text = " ".join(response.text.split())
        return f" ({text[:200]})"

    def _verdict(self, step: Mapping[str, Any], response: Response, failures: list[str],
                 expected: int) -> tuple[str, str]:
        error = response.transport_error
        if step.get("expect_transport_error"):
            if error and not failures:
                return PASS, f"the connection was refused as expected ({error})"
            if not error:
                return FAIL, (f"the connection was expected to fail, but the WFM answered "
                              f"{_status_text(response.status)}")
        elif error:
            return FAIL, "; ".join([error, *failures])
        if failures:
            return FAIL, "; ".join(failures)
        note = "" if response.status == expected else f" (accepted instead of {expected})"
        reason = f"{_status_text(response.status)}{note}"
        if step.get("svid_source") == "refreshed" and self.cert_dir.refreshed_svid is None:
            reason += ("; no svid-refreshed-cert.pem in the cert dir, so the current SVID was "
                       "presented, as the kit's runner does")
        return PASS, reason

    def _perform_polling(self, step: Mapping[str, Any], state: _ScenarioState,
                         expected: int) -> tuple[Response, bool, int]:
        perform = self._perform_oras if step.get("oras") else self._perform_http
        poll = step.get("poll")
        if not poll:
            return perform(step, state), False, 1
        interval = float(poll.get("interval_seconds", DEFAULT_POLL_INTERVAL))
        if self.options.poll_interval is not None:
            interval = min(interval, self.options.poll_interval)
        deadline = time.monotonic() + float(poll.get("timeout_seconds", DEFAULT_POLL_TIMEOUT))
        attempts = 0
        while True:
            attempts += 1
            response = perform(step, state)
            if response.status == expected and not any(
                    validate(response, v, state.context) for v in poll.get("until") or []):
                return response, False, attempts
            if time.monotonic() >= deadline:
                return response, True, attempts
            time.sleep(interval)

    # --- HTTP steps ----------------------------------------------------------------------

    def _perform_http(self, step: Mapping[str, Any], state: _ScenarioState) -> Response:
        method = str(step.get("method") or "GET").upper()
        endpoint = str(substitute(step.get("endpoint") or "", state.context))
        headers = {str(k): str(v) for k, v in
                   substitute(step.get("headers") or {}, state.context).items()}
        identity = Rc2Identity.generate() if step.get("fresh_cert") else state.identity
        content = self._body(step, state, identity)
        if content is not None and not any(k.lower() == "content-type" for k in headers):
            headers["Content-Type"] = "application/json"
        which = "none"
        if step.get("mtls"):
            which = "refreshed" if (step.get("svid_source") == "refreshed"
                                    and self.cert_dir.refreshed_svid) else "svid"
        client = self._transports.client(which)
        request = client.build_request(method, self.base_url + endpoint, headers=headers,
                                       content=content)
        self._strip_default_headers(request, headers)
        if not step.get("mtls"):
            given = next((v for k, v in headers.items() if k.lower() == "content-digest"), None)
            apply_rc2_signing(request, step, identity.key, given)
        return self._send(client, request, endpoint)

    @staticmethod
    def _body(step: Mapping[str, Any], state: _ScenarioState,
              identity: Rc2Identity) -> bytes | None:
        if step.get("request_body") is None:
            return None
        body = substitute(step["request_body"], state.context)
        if (isinstance(body, dict) and body.get("certificate") == CERTIFICATE_PLACEHOLDER
                and not step.get("skip_certificate_injection")):
            body = {**body, "certificate": identity.certificate_base64}
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    @staticmethod
    def _strip_default_headers(request: httpx.Request, asked: Mapping[str, str]) -> None:
        """Send only what the step asks for, like the kit's Node client: httpx's default
        `Accept: */*` would hide a WFM's handling of a request without Accept."""
        named = {k.lower() for k in asked}
        for name in ("accept", "accept-encoding"):
            if name not in named:
                request.headers.pop(name, None)
        request.headers["user-agent"] = USER_AGENT

    @staticmethod
    def _send(client: httpx.Client, request: httpx.Request, endpoint: str) -> Response:
        try:
            answer = client.send(request)
        except httpx.HTTPError as exc:
            return Response(request.method, endpoint, 0, {}, b"",
                            f"{type(exc).__name__}: {exc or 'connection failed'}")
        headers = {k.lower(): v for k, v in answer.headers.items()}
        return Response(request.method, endpoint, answer.status_code, headers, answer.content)

    # --- registry (oras) steps -----------------------------------------------------------

    def _registry_ref(self) -> str | None:
        return self.options.registry_ref or os.environ.get("REGISTRY_REF") or None

    def _perform_oras(self, step: Mapping[str, Any], state: _ScenarioState) -> Response:
        oras = step["oras"]
        text = str(substitute(oras["ref"], state.context)) if oras.get("ref") else str(
            self._registry_ref())
        command = str(oras.get("cmd", ""))
        try:
            ref = RegistryRef.parse(text)
            if command == "tags_raw":
                answer = self._registry.tags_list(ref)
                headers = {k.lower(): v for k, v in answer.headers.items()}
                return Response("GET", f"{ref.repository}/tags/list", answer.status_code,
                                headers, answer.content)
            body = self._oras_body(command, ref)
        except RegistryError as exc:
            return Response("ORAS", text, 0, {}, b"", f"oras {command}: {exc}")
        return Response("ORAS", text, 200, {}, body)

    def _oras_body(self, command: str, ref: RegistryRef) -> bytes:
        if command == "manifest":
            return self._registry.manifest(ref)
        if command == "tags":
            return json.dumps({"tags": self._registry.tags(ref)}).encode()
        if command == "blobs":
            return json.dumps(self._fetch_layers(ref)).encode()
        raise RegistryError(f"unknown oras command {command!r} (manifest, blobs, tags, "
                            "tags_raw)")

    def _fetch_layers(self, ref: RegistryRef) -> dict[str, Any]:
        """Every layer of the manifest, fetched and verified; the digests that failed."""
        try:
            manifest = json.loads(self._registry.manifest(ref))
        except ValueError:
            raise RegistryError(f"manifest {ref} is not JSON") from None
        layers = manifest.get("layers") if isinstance(manifest, dict) else None
        failed = []
        for layer in layers if isinstance(layers, list) else []:
            digest = str(layer.get("digest", "")) if isinstance(layer, dict) else ""
            try:
                self._registry.blob(ref, digest, layer.get("size"))
            except RegistryError:
                failed.append(digest)
        return {"layerCount": len(layers or []), "failedDigests": failed}

