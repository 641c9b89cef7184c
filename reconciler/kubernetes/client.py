"""A small, read-only Kubernetes API client over httpx.

Capability discovery needs GET and paginated LIST and nothing else, so this client is a few
hundred lines instead of the 126 MB official package, and it cannot change the cluster by
mistake. It reads kubeconfig files (current or named context; server, CA, TLS skip, client
certificate, bearer token or token file) and the in-cluster service account. Exec and
auth-provider credential plugins are refused with a clear error: running arbitrary programs
named in a kubeconfig is not something a device agent should do silently.

Every failure is a `KubeError` with the HTTP status (None when the server could not be
reached), the Kubernetes `reason` and its message; 401 and 403 have their own subclasses
because they mean "fix the credentials or the RBAC rules", not "try again".
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

__all__ = ["SERVICE_ACCOUNT_DIR", "ClusterAccess", "Forbidden", "KubeClient", "KubeConfigError",
           "KubeError", "Unauthorized", "default_access", "default_kubeconfig",
           "in_cluster_access", "load_kubeconfig"]

#: Where Kubernetes mounts a pod's service account token and CA.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_DEFAULT_PAGE = 500


#: What a metadata-only list asks for, falling back to full JSON on a server without it.
_METADATA_LIST = ("application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,"
                  "application/json")


class KubeError(OSError):
    """A request to the API server failed: `status` is the HTTP status, or None when the
    server could not be reached at all. An OSError, like other I/O failures, so callers that
    survive unreadable files and dead networks survive this too."""

    def __init__(self, status: int | None, reason: str, message: str) -> None:
        super().__init__(f"{status or 'unreachable'} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def unreachable(self) -> bool:
        return self.status is None

    def describe(self) -> str:
        """Why a read failed, for a report or a check: RBAC refusals say so."""
        if isinstance(self, Forbidden):
            return f"forbidden by RBAC: {self.message}"
        return f"HTTP {self.status} {self.reason}: {self.message}"

    @staticmethod
    def from_response(response: httpx.Response) -> KubeError:
        """The error for a non-2xx answer, from its Kubernetes `Status` body when it has one."""
        reason, message = response.reason_phrase or "Error", response.text[:500]
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, Mapping):
            reason = str(body.get("reason") or reason)
            message = str(body.get("message") or message)
        kind = {401: Unauthorized, 403: Forbidden}.get(response.status_code, KubeError)
        return kind(response.status_code, reason, message)


class Unauthorized(KubeError):
    """401: the server does not accept the credentials."""


class Forbidden(KubeError):
    """403: the credentials are fine, but RBAC does not allow this read."""


class KubeConfigError(ValueError):
    """The kubeconfig or service account cannot be used (missing context, exec plugin, ...)."""


@dataclass(frozen=True)
class ClusterAccess:
    """Everything needed to reach one API server. Certificates and keys are PEM bytes;
    `token_file` is re-read for every request because service account tokens rotate."""

    server: str
    ca_pem: bytes | None = None
    insecure: bool = False
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    token: str | None = None
    token_file: Path | None = None
    tls_server_name: str | None = None

    def __repr__(self) -> str:  # never show credentials in logs or tracebacks
        return f"ClusterAccess(server={self.server!r})"


def _named(entries: Any, name: str, what: str, source: str) -> dict[str, Any]:
    for entry in entries or []:
        if isinstance(entry, Mapping) and entry.get("name") == name:
            value = entry.get(what)
            return dict(value) if isinstance(value, Mapping) else {}
    raise KubeConfigError(f"{source}: no {what} named {name!r}")


def _pem(section: Mapping[str, Any], data_key: str, file_key: str, base: Path,
         source: str) -> bytes | None:
    """Inline base64 `*-data` wins over a file path (relative to the kubeconfig's folder)."""
    if section.get(data_key):
        try:
            return base64.b64decode(section[data_key], validate=True)
        except ValueError as exc:
            raise KubeConfigError(f"{source}: {data_key} is not base64: {exc}") from exc
    if section.get(file_key):
        return (base / str(section[file_key])).read_bytes()
    return None


def _credentials(user: Mapping[str, Any], base: Path, source: str) -> dict[str, Any]:
    if "exec" in user:
        command = (user.get("exec") or {}).get("command", "?")
        raise KubeConfigError(
            f"{source}: the user runs an exec credential plugin ({command!r}); margo does not "
            "run programs named in a kubeconfig: use a token, a client certificate or the "
            "in-cluster service account")
    if "auth-provider" in user:
        raise KubeConfigError(f"{source}: auth-provider plugins are not supported; use a "
                              "token, a client certificate or the in-cluster service account")
    token_file = user.get("tokenFile")
    return {"cert_pem": _pem(user, "client-certificate-data", "client-certificate", base,
                             source),
            "key_pem": _pem(user, "client-key-data", "client-key", base, source),
            "token": user.get("token") or None,
            "token_file": base / str(token_file) if token_file else None}


def load_kubeconfig(path: Path, context: str | None = None) -> ClusterAccess:
    """The access a kubeconfig gives for `context` (default: its current-context)."""
    source = str(path)
    try:
        config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise KubeConfigError(f"{source}: not YAML: {exc}") from exc
    if not isinstance(config, Mapping):
        raise KubeConfigError(f"{source}: not a kubeconfig (expected a mapping)")
    name = context or config.get("current-context")
    if not name:
        raise KubeConfigError(f"{source}: no context given and no current-context set")
    ctx = _named(config.get("contexts"), name, "context", source)
    cluster = _named(config.get("clusters"), str(ctx.get("cluster")), "cluster", source)
    user = (_named(config.get("users"), str(ctx["user"]), "user", source)
            if ctx.get("user") else {})
    if not cluster.get("server"):
        raise KubeConfigError(f"{source}: cluster {ctx.get('cluster')!r} has no server")
    base = Path(path).resolve().parent
    return ClusterAccess(
        server=str(cluster["server"]).rstrip("/"),
        ca_pem=_pem(cluster, "certificate-authority-data", "certificate-authority", base,
                    source),
        insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
        tls_server_name=cluster.get("tls-server-name"),
        **_credentials(user, base, source))


def in_cluster_access(environ: Mapping[str, str] | None = None,
                      account_dir: Path = SERVICE_ACCOUNT_DIR) -> ClusterAccess:
    """The pod's own service account, as client-go's in-cluster config finds it."""
    env = os.environ if environ is None else environ
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise KubeConfigError("not running in a cluster: KUBERNETES_SERVICE_HOST and "
                              "KUBERNETES_SERVICE_PORT are not set")
    token_file = account_dir / "token"
    if not token_file.is_file():
        raise KubeConfigError(f"no service account token at {token_file}")
    host = f"[{host}]" if ":" in host else host
    ca = account_dir / "ca.crt"
    return ClusterAccess(server=f"https://{host}:{port}", token_file=token_file,
                         ca_pem=ca.read_bytes() if ca.is_file() else None)


def default_kubeconfig(environ: Mapping[str, str] | None = None,
                       home: Path | None = None) -> Path | None:
    """The kubeconfig kubectl would read: the first existing file of $KUBECONFIG, else
    ~/.kube/config; None when there is none. (kubectl merges several $KUBECONFIG files;
    the read-only client reads one.)"""
    env = os.environ if environ is None else environ
    for entry in filter(None, env.get("KUBECONFIG", "").split(os.pathsep)):
        if Path(entry).expanduser().is_file():
            return Path(entry).expanduser()
    fallback = (Path.home() if home is None else home) / ".kube" / "config"
    return fallback if fallback.is_file() else None


def default_access(kubeconfig: Path | None = None, context: str | None = None) -> ClusterAccess:
    """The cluster Helm (client-go's loading rules) would use: `kubeconfig` when given, else
    kubectl's default file, else the pod's service account."""
    found = kubeconfig or default_kubeconfig()
    if found is not None:
        return load_kubeconfig(found, context)
    return in_cluster_access()


def _ssl_context(access: ClusterAccess) -> ssl.SSLContext | bool:
    """TLS settings; client certificates go through a private temporary folder because
    Python's ssl module loads them only from files (removed as soon as they are loaded)."""
    if not access.server.startswith("https://"):
        return True
    if access.insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif access.ca_pem is not None:
        context = ssl.create_default_context(cadata=access.ca_pem.decode("ascii"))
    else:
        context = ssl.create_default_context()
    if access.cert_pem is not None and access.key_pem is not None:
        with tempfile.TemporaryDirectory(prefix="margo-kube-") as folder:
            cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
            for target, data in ((cert, access.cert_pem), (key, access.key_pem)):
                descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(descriptor, "wb") as handle:
                    handle.write(data)
            context.load_cert_chain(cert, key)
    return context


class _BearerAuth(httpx.Auth):
    """Adds the bearer token; a token file is read per request (tokens rotate)."""

    def __init__(self, token: str | None, token_file: Path | None) -> None:
        self.token, self.token_file = token, token_file

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self.token
        if self.token_file is not None:
            token = self.token_file.read_text(encoding="utf-8").strip()
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        yield request


class KubeClient:
    """GET and paginated LIST against one API server; use as a context manager (or call
    close()) so the connection pool is released."""

    def __init__(self, access: ClusterAccess, *, timeout: float = 10.0,
                 page_size: int = _DEFAULT_PAGE) -> None:
        self.access, self.page_size = access, page_size
        extensions = ({"sni_hostname": access.tls_server_name}
                      if access.tls_server_name else None)
        self._extensions = extensions
        self._http = httpx.Client(
            base_url=access.server, verify=_ssl_context(access), timeout=timeout,
            auth=_BearerAuth(access.token, access.token_file),
            headers={"Accept": "application/json", "User-Agent": "margo-gitops-reconciler"})

    @classmethod
    def from_kubeconfig(cls, path: Path, context: str | None = None,
                        **options: Any) -> KubeClient:
        return cls(load_kubeconfig(path, context), **options)

    @classmethod
    def in_cluster(cls, **options: Any) -> KubeClient:
        return cls(in_cluster_access(), **options)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> KubeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, path: str, params: Mapping[str, str] | None = None, *,
            metadata_only: bool = False) -> dict[str, Any]:
        """The JSON object at `path` (with `metadata_only`, a list's items carry only their
        metadata: `PartialObjectMetadataList`); `KubeError` for any failure."""
        response = self._send(path, params, metadata_only=metadata_only)
        if not response.is_success:
            raise KubeError.from_response(response)
        try:
            body = response.json()
        except ValueError as exc:
            raise KubeError(response.status_code, "BadResponse",
                            f"{path}: not JSON ({exc})") from exc
        if not isinstance(body, dict):
            raise KubeError(response.status_code, "BadResponse", f"{path}: not a JSON object")
        return body

    def _send(self, path: str, params: Mapping[str, str] | None, *,
              metadata_only: bool = False) -> httpx.Response:
        """One GET; `KubeError` (status None) when the server cannot be reached at all."""
        headers = {"Accept": _METADATA_LIST} if metadata_only else None
        try:
            return self._http.get(path, params=dict(params or {}), headers=headers,
                                  extensions=self._extensions)
        except httpx.TransportError as exc:
            raise KubeError(None, "Unreachable", f"{self.access.server}{path}: {exc}") from exc
        except OSError as exc:  # an unreadable token file
            raise KubeError(None, "NoCredentials", str(exc)) from exc

    def get_text(self, path: str, params: Mapping[str, str] | None = None) -> tuple[int, str]:
        """Status and text of a plain-text endpoint (`/livez`, `/readyz`): any status is an
        answer here; `KubeError` only when the server cannot be reached."""
        response = self._send(path, params)
        return response.status_code, response.text

    def list(self, path: str, params: Mapping[str, str] | None = None, *,
             metadata_only: bool = False) -> list[dict[str, Any]]:
        """Every item of a collection, following `continue` tokens page by page. When a
        token has expired (410) the listing starts over in one piece, as client-go does.
        `metadata_only` asks for the items' metadata alone (what ownership tracing needs,
        a fraction of the bytes)."""
        items: list[dict[str, Any]] = []
        query = {**(params or {}), "limit": str(self.page_size)}
        while True:
            try:
                page = self.get(path, query, metadata_only=metadata_only)
            except KubeError as exc:
                if exc.status != 410 or "continue" not in query:
                    raise
                items, query = [], {k: v for k, v in (params or {}).items()}
                continue
            found = page.get("items")
            if found is None and "items" in page:  # an empty PartialObjectMetadataList
                found = []  # says `"items": null`
            if not isinstance(found, list):
                raise KubeError(200, "BadResponse", f"{path}: no items list")
            items += [item for item in found if isinstance(item, dict)]
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            query = {**query, "continue": str(token)}
