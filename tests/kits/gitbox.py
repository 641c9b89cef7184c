"""Test kit: a whole device client whose fleet server is a bare Git repository on disk.

`git_box(root, kind, device=..., model=...)` writes the device's directory (`root/box`):
device.yaml with the Git source reading `root/desired.git` over `file://`, the render
driver writing to `out/`, the data directory `data/`, and the capabilities file and token
it names; the server URL is a free port nobody listens on, so status reports stay in the
journal. `kind` is `Box` or a test's subclass of it (its own fields passed on as keywords);
`Box.commit` puts the desired state on the repository's `main`.

`found_anywhere` and `tampered` are the two checks the sealed-secret tests make of such a
device: where a plaintext is kept, and an envelope damaged in transit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pygit2
import yaml

from kits.serverkit import free_port
from reconciler.releases import release_name

__all__ = ["Box", "found_anywhere", "git_box", "tampered"]


@dataclass
class Box:
    """The device's directory, and the repository standing in for its fleet server."""

    home: Path
    repo: pygit2.Repository

    @property
    def config(self) -> Path:
        return self.home / "device.yaml"

    def rendered(self, deployment_id: str, component: str = "greeter") -> Path:
        """The ConfigMap the render driver wrote for the greeter chart (namespace `edge`)."""
        return (self.home / "out" / "edge" / release_name(deployment_id, component)
                / component / "templates" / "configmap.yaml")

    def commit(self, files: dict[str, bytes]) -> None:
        """One commit on `main` whose tree is exactly `files` (name: content)."""
        builder = self.repo.TreeBuilder()
        for name, data in files.items():
            builder.insert(name, self.repo.create_blob(data), pygit2.enums.FileMode.BLOB)
        author = pygit2.Signature("fleet", "fleet@example.com")
        parents = [] if self.repo.head_is_unborn else [self.repo.head.target]
        self.repo.create_commit("refs/heads/main", author, author, "desired state",
                                builder.write(), parents)


BoxT = TypeVar("BoxT", bound=Box)


def git_box(root: Path, kind: type[BoxT], *, device: str, model: str,
            registries: dict[str, Any] | None = None, **fields: Any) -> BoxT:
    """A Helm-capable render-driver device under `root/box`, its source `root/desired.git`
    (empty); `registries` goes into device.yaml as given, `fields` to `kind`."""
    home = root / "box"
    home.mkdir(parents=True)
    repo = pygit2.init_repository(str(root / "desired.git"), bare=True, initial_head="main")
    (home / "token").write_text("device-token\n")
    (home / "caps.yaml").write_text(yaml.safe_dump({"properties": {
        "id": device, "vendor": "Acme", "modelNumber": model, "serialNumber": "1",
        "supportedDeploymentTypes": ["helm"]}}))
    (home / "device.yaml").write_text(yaml.safe_dump({
        "device": {"id": device},
        # Nobody listens there: status reports stay in the journal, where they are searched.
        "server": {"url": f"http://127.0.0.1:{free_port()}", "clientId": device,
                   "tokenFile": "token", "timeout": "2s"},
        "source": {"type": "git", "url": f"file://{repo.path.rstrip('/')}",
                   "depth": 0},  # libgit2 fetches a local repository whole
        "driver": {"type": "render", "outputDir": "out"},
        "dataDir": "data", "capabilities": {"file": "caps.yaml"},
        **({"registries": registries} if registries else {})}))
    return kind(home, repo, **fields)


def found_anywhere(root: Path, texts: list[str]) -> list[str]:
    """`path: text` for every file under `root` holding one of `texts` (raw bytes)."""
    hits = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        hits += [f"{path}: {text}" for text in texts if text.encode() in data]
    return hits


def tampered(envelope: str) -> str:
    """The envelope with one ciphertext byte changed (still valid base64)."""
    head, _, body = envelope.rpartition(":")
    middle = len(body) // 2
    swapped = "B" if body[middle] != "B" else "C"
    return f"{head}:{body[:middle]}{swapped}{body[middle + 1:]}"
