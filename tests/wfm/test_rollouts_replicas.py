"""Staged rollouts (test_rollouts.py: converging, rolling back, pause and resume) against
two replicas on one PostgreSQL database behind a round-robin balancer: reports, operator
actions and the rollout's evaluation may each happen on a different replica. (Supersede and
the offline device add nothing replica-specific and run on SQLite only, to keep the suite
inside its time budget.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kits.serverkit import use_store
from test_rollouts import (  # the same tests, collected again here
    fleet_server,
    test_a_failing_canary_rolls_back_and_the_rest_never_sees_the_bad_version,
    test_a_three_wave_rollout_converges_wave_by_wave,
    test_pause_holds_the_next_wave_and_resume_lets_it_open,
)


@pytest.fixture(scope="module", autouse=True)
def _on_replicas() -> Iterator[None]:
    with use_store("replicas"):
        yield


__all__ = ["fleet_server",
           "test_a_failing_canary_rolls_back_and_the_rest_never_sees_the_bad_version",
           "test_a_three_wave_rollout_converges_wave_by_wave",
           "test_pause_holds_the_next_wave_and_resume_lets_it_open"]
