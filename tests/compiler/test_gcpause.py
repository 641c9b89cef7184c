"""The compiler's pause of the cyclic garbage collector: off during the block, what it
made frozen after it, the caller's own setting kept, and nothing lost for good."""

from __future__ import annotations

import gc
import weakref

import pytest

from compiler.gcpause import collection_paused, release_frozen


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def _restore_collector() -> object:
    was = gc.isenabled()
    yield
    release_frozen()
    gc.enable() if was else gc.disable()


def test_the_collector_is_off_inside_and_on_after() -> None:
    gc.enable()
    with collection_paused():
        assert not gc.isenabled()
        with collection_paused():  # nested: only the outermost acts
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_raising_block_turns_it_back_on() -> None:
    gc.enable()
    with pytest.raises(RuntimeError), collection_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled() -> None:
    release_frozen()
    gc.disable()
    with collection_paused():
        _Node()
    assert not gc.isenabled()
    assert gc.get_freeze_count() == 0  # and nothing was frozen behind the caller's back


def test_what_the_pause_made_is_frozen_until_released() -> None:
    gc.enable()
    release_frozen()
    with collection_paused():
        node = _Node()
    assert gc.get_freeze_count() > 0
    alive = weakref.ref(node)
    del node
    gc.collect()
    assert alive() is not None  # frozen: the collector does not look at it
    release_frozen()
    gc.collect()
    assert alive() is None  # released: collected as usual
