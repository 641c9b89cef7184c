"""Container images for real nodes, written without any daemon: no image can be pulled on
these machines, so every image a real node runs is a root file system of Debian's static
busybox (`tools.docker.testimages.rootfs_tar`) plus a few files, packed as a `docker save`
archive that each node's containerd imports with `ctr images import` (realnode.py).

`PAUSE` is the pod sandbox ("pause") image containerd's CRI plugin starts first in every
pod. `EXAMPLE_IMAGES` stand in for the images the example fleet's charts name
(`registry.example.com/...`): they log what they were given and serve HTTP where the chart
probes it, so `make cluster --real-nodes` and the demo run the unchanged example charts.
Tests add their own (`Image`). Every archive is deterministic for the same images.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tools.docker.testimages import rootfs_tar

__all__ = ["EXAMPLE_IMAGES", "PAUSE", "Image", "archive", "serve_http", "supervised"]


@dataclass(frozen=True)
class Image:
    """One image: `ref` (name:tag), extra files (path -> content), command and environment."""

    ref: str
    cmd: tuple[str, ...]
    files: Mapping[str, str | bytes] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    #: Files of `files` to be executable.
    executable: tuple[str, ...] = ()


def supervised(command: str) -> tuple[str, ...]:
    """`sh -c` running `command` in the background and stopping it on SIGTERM: a shell as
    PID 1 has no default signal handlers, so without the trap every pod deletion would wait
    out its grace period."""
    return ("sh", "-c", f'trap "kill $child 2>/dev/null; exit 0" TERM INT; {command} & '
                        "child=$!; wait $child")


def serve_http(banner: str, port: int = 8080) -> tuple[str, ...]:
    """Print `banner` (a shell word list, expanded at start), then serve /www on `port`."""
    return supervised(f'echo {banner}; httpd -f -p {port} -h /www')


#: The pod sandbox: it only has to live until the pod is deleted.
PAUSE = Image("margo-gitops.dev/pause:1", supervised("sleep 2147483647"))

EXAMPLE_IMAGES = (
    # hello-world: its config map gives GREETING (the Margo parameter `greeting`).
    Image("registry.example.com/hello-world:1.0.0",
          supervised('echo "hello-world says: ${GREETING:-nothing}"; sleep 2147483647')),
    # ha-web: probed with GET / on 8080; MESSAGE comes from its config map.
    Image("registry.example.com/ha-web:1.0.0",
          serve_http('"ha-web serving: ${MESSAGE:-none}"'), {"www/index.html": "ha-web\n"}),
    Image("registry.example.com/line-monitor:1.4.2",
          supervised('echo "line-monitor watching ${PROTOCOL:-opcua}"; sleep 2147483647')),
)


def _layer(image: Image) -> bytes:
    files = {"www/index.html": "\n", **image.files}
    return rootfs_tar(files, executables=image.executable)


def archive(images: Iterable[Image]) -> bytes:
    """A `docker save` archive holding `images` (manifest.json, one config and one layer
    each), the format `ctr images import` reads."""
    buffer = io.BytesIO()
    manifest: list[dict[str, object]] = []
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))

        for image in images:
            layer = _layer(image)
            layer_id = hashlib.sha256(layer).hexdigest()
            env = ["PATH=/bin", *(f"{k}={v}" for k, v in image.env.items())]
            config = json.dumps({
                "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
                "config": {"Cmd": list(image.cmd), "Env": env, "WorkingDir": "/"},
                "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_id}"]},
                "history": [{"created": "1970-01-01T00:00:00Z",
                             "created_by": "margo-gitops tools/kube/nodeimages.py"}]},
                sort_keys=True).encode()
            config_name = f"{hashlib.sha256(config).hexdigest()}.json"
            add(f"{layer_id}/layer.tar", layer)
            add(config_name, config)
            manifest.append({"Config": config_name, "RepoTags": [image.ref],
                             "Layers": [f"{layer_id}/layer.tar"]})
        add("manifest.json", json.dumps(manifest).encode())
    return buffer.getvalue()
