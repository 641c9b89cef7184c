"""The Helm post-render step that injects the telemetry variables into every release the
Helm driver installs or upgrades.

Helm 4 runs post-renderers only as plugins (`postrenderer/v1`), found in its plugins
directory. The Helm engine runs in this process (helm_python), and its Go runtime read the
process environment once, when the process started: `HELM_PLUGINS`, `HELM_DATA_HOME`,
`XDG_DATA_HOME` and `HOME` as they were then decide where it looks (`/proc/self/environ`
shows exactly that environment), so setting them later from Python changes nothing.

`ensure_plugin()` writes our plugin there, once per Python installation: a directory
`margo-otel-inject-<hash>` whose `plugin.yaml` runs this interpreter with
`-m reconciler.telemetry.helmplugin`; the hash covers the command, so several
installations (and their test runs) on one machine never share or clash on a plugin.
The Helm driver names it with the injection as the plugin's arguments (JSON), and Helm
pipes the rendered manifests through `main()`, which applies `inject.inject_manifests`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import yaml

from reconciler.telemetry import Injection

__all__ = ["PLUGIN_PREFIX", "ensure_plugin", "injection_argument", "main", "plugins_directory"]

PLUGIN_PREFIX = "margo-otel-inject"


def _start_environment() -> dict[str, str]:
    """The environment this process started with (what a Go runtime loaded in it sees)."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return dict(os.environ)
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def plugins_directory(environ: Mapping[str, str] | None = None) -> Path:
    """Where the in-process Helm engine looks for plugins: `$HELM_PLUGINS`, else
    `$HELM_DATA_HOME/plugins`, else `${XDG_DATA_HOME:-$HOME/.local/share}/helm/plugins`."""
    env = _start_environment() if environ is None else environ
    if env.get("HELM_PLUGINS"):
        return Path(env["HELM_PLUGINS"].split(os.pathsep)[0])
    if env.get("HELM_DATA_HOME"):
        return Path(env["HELM_DATA_HOME"]) / "plugins"
    data = env.get("XDG_DATA_HOME") or str(Path(env.get("HOME") or Path.home()) / ".local"
                                           / "share")
    return Path(data) / "helm" / "plugins"


def _plugin_document(name: str) -> dict[str, object]:
    return {"apiVersion": "v1", "type": "postrenderer/v1", "name": name, "version": "0.1.0",
            "runtime": "subprocess",
            "runtimeConfig": {"platformCommand": [{
                "command": sys.executable, "args": ["-m", "reconciler.telemetry.helmplugin"]}]}}


def ensure_plugin(directory: Path | None = None) -> str:
    """Write our post-renderer plugin into Helm's plugins directory (unless it is there
    already) and return its name. `OSError` when the directory cannot be written."""
    folder = directory or plugins_directory()
    tag = hashlib.sha256(f"{sys.executable}\0reconciler.telemetry.helmplugin".encode())
    name = f"{PLUGIN_PREFIX}-{tag.hexdigest()[:10]}"
    text = ("# Written by margo-gitops (margo device): injects the Margo telemetry variables.\n"
            + yaml.safe_dump(_plugin_document(name), sort_keys=False))
    target = folder / name
    if (target / "plugin.yaml").is_file() and (target / "plugin.yaml").read_text() == text:
        return name
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=folder))
    try:
        (staging / "plugin.yaml").write_text(text)
        staging.chmod(0o755)
        try:
            staging.rename(target)  # atomic; fails when the folder exists
        except OSError:
            current = target / "plugin.yaml"
            if current.is_file() and current.read_text() == text:
                return name  # a concurrent client wrote the same plugin
            shutil.rmtree(target, ignore_errors=True)  # an older version of ours
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return name


def injection_argument(injection: Injection) -> str:
    """The post-renderer's argument: the injection, as JSON."""
    return json.dumps({"http": injection.http_endpoint, "grpc": injection.grpc_endpoint,
                       "certificate": injection.certificate, "protocol": injection.protocol},
                      sort_keys=True)


def _parse_argument(text: str) -> Injection:
    data = json.loads(text)
    return Injection(http_endpoint=data["http"], grpc_endpoint=data.get("grpc"),
                     certificate=data.get("certificate"),
                     protocol=data.get("protocol") or "http/protobuf")


def main(argv: list[str] | None = None) -> int:
    """Helm's post-render protocol: manifests on stdin, the injected manifests on stdout,
    a non-zero exit (with the reason on stderr) to fail the install or upgrade."""
    from reconciler.telemetry.inject import inject_manifests

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m reconciler.telemetry.helmplugin '<injection JSON>'",
              file=sys.stderr)
        return 2
    try:
        injection = _parse_argument(args[0])
        stream, _ = inject_manifests(sys.stdin.read(), injection)
    except (ValueError, KeyError, yaml.YAMLError) as exc:
        print(f"margo telemetry post-renderer: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(stream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
