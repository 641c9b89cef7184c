"""The read-back's one error: every difference named with what was expected and what was
found, a missing key found as "nothing", long lists cut (the drivers' read-backs on the
real engines: test_helm_driver.py, test_compose_driver.py, test_render_driver.py)."""

from __future__ import annotations

import pytest

from reconciler.drivers.readback import require_match
from reconciler.errors import ApplyError


def test_equal_views_pass_and_keys_only_found_are_not_compared() -> None:
    require_match("release r", {"status": "deployed"}, {"status": "deployed", "extra": "x"})


def test_each_difference_is_named_and_the_error_is_retryable() -> None:
    with pytest.raises(ApplyError) as caught:
        require_match("release r", {"status": "deployed", "revision": "1", "chart": "g 1"},
                      {"status": "failed", "revision": "1"})
    assert caught.value.code == "READBACK_MISMATCH"
    assert caught.value.retryable
    assert caught.value.message == ("release r is not what was applied: status: expected "
                                    "deployed, found failed; chart: expected g 1, found nothing")


def test_a_long_list_of_differences_is_cut_after_six() -> None:
    expected = {f"file {n}": "a" for n in range(9)}
    with pytest.raises(ApplyError) as caught:
        require_match("release r", expected, {})
    assert caught.value.message.endswith("file 5: expected a, found nothing; and 3 more")
