"""The one private call into helm-python-sdk (`reconciler.drivers.helm._post_rendered`, for
Helm's post-render step, issue 30) is checked against the installed SDK, both ways:

* still needed: the public `Config.install` / `Config.upgrade` take no post-renderer. When a
  release adds one, this test fails, and `_post_rendered` should give way to the public
  method (the issue asks for the public API only);
* still valid: the C ABI function it calls has the argument list it passes (three handles,
  four strings, two out-pointers), so an SDK that changed it fails here, not on a device.
"""

from __future__ import annotations

import inspect

import helm_python as helm
import pytest
from helm_python import _native

POST_RENDER_WORDS = ("post_render", "postrender", "post-render")


@pytest.mark.parametrize("method", ["install", "upgrade"])
def test_the_public_methods_still_take_no_post_renderer(method: str) -> None:
    parameters = inspect.signature(getattr(helm.Config, method)).parameters
    named = [p for p in parameters if any(w in p.lower() for w in POST_RENDER_WORDS)]
    assert named == [], (f"helm-python-sdk's Config.{method} now takes {named}: replace "
                         "reconciler.drivers.helm._post_rendered with it")


@pytest.mark.parametrize("function", ["helm_install", "helm_upgrade"])
def test_the_abi_function_called_still_has_the_arguments_passed(function: str) -> None:
    _, arguments = _native.SIGNATURES[function]
    handles, strings, outputs = arguments[:3], arguments[3:7], arguments[7:]
    assert all(a is _native.HANDLE for a in handles)
    assert len(strings) == 4 and len(outputs) == 2 and len(arguments) == 9
