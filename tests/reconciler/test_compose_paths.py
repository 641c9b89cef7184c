"""Path resolution inside a Compose package: `resolve_inside` against the kernel's own answer
(a real directory tree with real symbolic links, resolved by `os.path.realpath`), and a
package whose include leaves it refused end to end, as the deployment's failure."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kits.chartkit import converge

from margo.archive import deterministic_targz
from reconciler.charts import ChartCache
from reconciler.compose_paths import MAX_LINK_HOPS, resolve_inside
from reconciler.desired import DesiredDeployment, parse_deployment
from reconciler.drivers.render import RenderDriver
from reconciler.errors import ApplyError
from reconciler.oci import OciClient

# The package tree the property runs in: directories, and links inside, up and out.
LINKS = {"l_in": "a", "a/l_up": "..", "a/l_sib": "../b", "l_out": "../outside",
         "b/l_deep_out": "../../outside/x", "l_abs": "/"}
DIRECTORIES = ("a", "b", "a/c")


@pytest.fixture(scope="module")
def package_root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(os.path.realpath(temporary))
        (root / "outside" / "x").mkdir(parents=True)
        package = root / "pkg"
        for directory in DIRECTORIES:
            (package / directory).mkdir(parents=True, exist_ok=True)
        for link, target in LINKS.items():
            (package / link).symlink_to(target)
        yield package


SEGMENTS = st.sampled_from([".", "..", "", "a", "b", "c", "new", *sorted(
    {name.rsplit("/", 1)[-1] for name in LINKS})])


@settings(max_examples=400, deadline=None)
@given(segments=st.lists(SEGMENTS, max_size=8), absolute=st.booleans(),
       base=st.sampled_from(["", "a", "a/c", "b"]))
def test_a_path_is_accepted_iff_the_kernel_resolves_it_inside(
        package_root: Path, segments: list[str], absolute: bool, base: str) -> None:
    path = ("/" if absolute else "") + "/".join(segments)
    real = Path(os.path.realpath(os.path.join(package_root, base, path)))
    inside = real == package_root or package_root in real.parents
    resolved = resolve_inside(path, base, LINKS)
    assert (resolved is not None) == inside, (path, base, real)
    if resolved is not None:
        assert resolved == ("" if real == package_root else str(real.relative_to(package_root)))


def test_links_are_followed_before_dot_dot_climbs() -> None:
    assert resolve_inside("a/../x.yaml", "") == "x.yaml"  # lexically inside
    assert resolve_inside("l_in/x.yaml", "", LINKS) == "a/x.yaml"
    assert resolve_inside("l_in/../x.yaml", "", LINKS) == "x.yaml"
    assert resolve_inside("l_out/x.yaml", "", LINKS) is None
    assert resolve_inside("l_abs", "", LINKS) is None
    assert resolve_inside("../pkg/x.yaml", "") is None  # out and back in is still out
    assert resolve_inside("..", "a") == ""


def test_a_link_loop_leaves_the_package() -> None:
    assert resolve_inside("loop/x", "", {"loop": "loop"}) is None
    chain = {f"l{n}": f"l{n + 1}" for n in range(MAX_LINK_HOPS + 1)}
    assert resolve_inside("l0", "", chain) is None
    assert resolve_inside("l0", "", {**chain, f"l{MAX_LINK_HOPS + 1}": "a"}) is None


# --------------------------------------------------------------------------- end to end


def deployment(repository: str) -> DesiredDeployment:
    document = {
        "id": "7a1c0e52-0000-4c1e-9d43-0b5a1d9e2a15",
        "metadata": {"name": "hello", "namespace": "compose", "deviceId": "box-1"},
        "spec": {"applicationId": "com-example-hello", "deploymentProfile": {
            "type": "compose", "components": [{"name": "hello", "properties": {
                "repository": repository, "revision": "1.0.0"}}]}}}
    return parse_deployment(yaml.safe_dump(document).encode())


def test_a_package_including_a_device_file_fails_with_the_location(
        registry: str, tmp_path: Path) -> None:
    repository = f"oci://{registry}/compose/include-escape"
    with OciClient() as oci:
        oci.push_artifact(repository, "1.0.0", deterministic_targz({
            "hello/compose.yaml": b"include: [lib/more.yaml]\nservices: {web: {image: x}}\n",
            "hello/lib/more.yaml": b"include: [{path: ../../../../etc/app/compose.yaml}]\n"}))
    with OciClient() as oci, ChartCache(tmp_path / "charts") as charts:
        driver = RenderDriver(tmp_path / "out", charts, oci=oci)
        with pytest.raises(ApplyError) as caught:
            converge(driver, [deployment(repository)])
        assert driver.installed() == []
    assert (caught.value.code, caught.value.retryable) == ("UNSAFE_PACKAGE", False)
    assert caught.value.message == (
        "member 'hello/lib/more.yaml': include[0].path '../../../../etc/app/compose.yaml' "
        "leaves the package directory [referenced-file]")
    assert not (tmp_path / "out" / "compose").exists() or \
        not any((tmp_path / "out" / "compose").iterdir())
