"""A compile killed anywhere in the branch write never stops the next one (issue 29, item 1).

In 14 real SIGKILLs around compiles one left `fleet-state.git/packed-refs.lock` behind, and
from then on every compile on that server failed. Here a compile runs in its own process
and SIGKILLs itself at one point of the write after another: while commits are written
into the pack (`compiler.packwriter`) and device rows into the state's open transaction,
before the pack or its index is renamed into place, before the refs move, with
`packed-refs.lock` created and empty, with the lock written but not yet renamed, and after
the refs moved but before the compiler's state recorded it. (The process kills itself
from inside the step: a test double of the timing only, since an outside SIGKILL cannot be
aimed at a window of microseconds; everything else is the real compiler, Git and file
system.) The next compile, in a fresh process, must succeed and leave exactly the trees
of a compile that was never interrupted.

Recovery removes only a lock nobody holds open that is a few seconds old
(`compiler.stalelocks.GRACE`): the test ages what the killed process left by that much,
as the seconds passing would; a lock a live process holds open is never removed.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kits.fleetkit import Fleet, app, device, intent

from compiler import writing
from compiler.gitstore import GitStoreError
from compiler.packwriter import PackWriter
from compiler.stalelocks import GRACE, lock_files

ROOT = Path(__file__).resolve().parents[2]
DEVICES = [f"d{i:02d}" for i in range(12)]

#: Point name -> the code that makes the compiling process kill itself there.
POINTS = {
    "writing commits into the pack": """
        import compiler.packwriter as w
        real, calls = w.PackWriter.add_packed, []
        def add_packed(*args, **kwargs):
            calls.append(1)
            if len(calls) == 5:
                die()
            return real(*args, **kwargs)
        w.PackWriter.add_packed = add_packed
    """,
    "device rows written into the state's open transaction": """
        import compiler.state as s
        import compiler.writing as wr
        wr._BATCH = 2  # (12 devices: the rows go in six batches while the pack fills)
        real, calls = s.StagingSave.write_devices, []
        def write_devices(*args, **kwargs):
            real(*args, **kwargs)
            calls.append(1)
            if len(calls) == 3:
                die()
        s.StagingSave.write_devices = write_devices
    """,
    "pack and index written, neither renamed": """
        import compiler.packwriter as w
        w.os.rename = lambda *args: die()
    """,
    "pack renamed, its index not": """
        import compiler.packwriter as w
        real, calls = w.os.rename, []
        def rename(*args):
            calls.append(1)
            if len(calls) == 2:
                die()
            return real(*args)
        w.os.rename = rename
    """,
    "objects written, refs not moved": """
        import compiler.gitstore as g
        g.DeviceStore.move_branches = lambda *args, **kwargs: die()
    """,
    "packed-refs.lock created, nothing written": """
        import compiler.packedrefs as p
        p._render = lambda *args: die()
    """,
    "packed-refs.lock written, not renamed": """
        import compiler.packedrefs as p
        real = p.os.fsync
        def fsync(fd):
            real(fd)
            die()
        p.os.fsync = fsync
    """,
    "refs moved, state not recorded": """
        import compiler.state as s
        s.StagedSave.commit = lambda self: die()
    """,
}

CHILD = """
import os, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
def die():
    os.killpg(os.getpid(), signal.SIGKILL)  # with any git it started
{point}
from kits.fleetkit import Fleet
fleet = Fleet.__new__(Fleet)
from pathlib import Path
import pickle
fleet = pickle.loads(Path({fleet!r}).read_bytes())
fleet.compile(now=2_000_000.0)
print("not killed")
"""


def make_fleet(root: Path, greeting: str) -> Fleet:
    fleet = Fleet(root)
    fleet.apps["com-example-app"] = app()
    for name in ("web", "api"):
        fleet.intents[name] = intent(name, profile={"type": "helm"},
                                     parameters={"greeting": f"{greeting}-{name}"},
                                     targets={"devices": DEVICES})
    for device_id in DEVICES:
        fleet.devices[device_id] = device(device_id)
    return fleet


def trees(fleet: Fleet) -> dict[str, dict[str, bytes]]:
    return {device_id: fleet.tree(device_id) for device_id in DEVICES}


def compile_killed_at(fleet: Fleet, point: str, tmp_path: Path) -> None:
    """Compile `fleet` in its own process, which SIGKILLs itself at `point`."""
    import pickle

    fleet.write()
    saved = tmp_path / "fleet.pickle"
    saved.write_bytes(pickle.dumps(fleet))
    script = CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"), fleet=str(saved),
                          point=textwrap.dedent(POINTS[point]))
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False, start_new_session=True)
    assert run.returncode == -signal.SIGKILL, (run.returncode, run.stdout, run.stderr)


def age_locks(repository: Path) -> list[str]:
    """Make what a killed writer left as old as `GRACE` seconds passing would."""
    left = list(lock_files(repository))
    past = time.time() - GRACE - 1
    for lock in left:
        os.utime(lock, (past, past))
    return [lock.name for lock in left]


@pytest.mark.parametrize("point", sorted(POINTS))
def test_the_compile_after_a_killed_one_always_succeeds(point: str, tmp_path: Path) -> None:
    fleet = make_fleet(tmp_path / "fleet", "hello")
    assert not fleet.compile().errors
    wanted = make_fleet(tmp_path / "wanted", "bonjour")  # never interrupted
    assert not wanted.compile().errors

    changed = make_fleet(tmp_path / "fleet", "bonjour")
    compile_killed_at(changed, point, tmp_path)
    age_locks(changed.repos / "fleet-state.git")
    report = changed.compile(now=2_000_001.0)
    assert not report.errors, report.errors
    assert trees(changed) == trees(wanted)
    assert list(lock_files(changed.repos / "fleet-state.git")) == []
    again = changed.compile(now=2_000_002.0)  # and the state agrees with the branches
    assert (again.commits, again.errors) == (0, [])


def test_a_lock_a_live_process_holds_is_never_taken(tmp_path: Path) -> None:
    """A `packed-refs.lock` held open by a running process (a `git` the operator runs) is
    that writer's, however old: the compile fails without moving a branch, and succeeds
    once the writer is done."""
    fleet = make_fleet(tmp_path / "fleet", "hello")
    assert not fleet.compile().errors
    before = trees(fleet)
    lock = fleet.repos / "fleet-state.git" / "packed-refs.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               f"f = open({str(lock)!r}, 'w'); print('held', flush=True)\n"
                               "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        age_locks(fleet.repos / "fleet-state.git")
        changed = make_fleet(tmp_path / "fleet", "bonjour")
        with pytest.raises(GitStoreError, match=r"packed-refs\.lock exists"):
            changed.compile(now=2_000_001.0)
        assert trees(changed) == before and lock.exists()
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    lock.unlink()  # the writer finishes: its lock goes with the rename
    assert not changed.compile(now=2_000_002.0).errors
    assert trees(changed) != before


def state_rows(fleet: Fleet) -> dict[str, list[tuple[object, ...]]]:
    db = sqlite3.connect(fleet.repos / "compiler-state.sqlite")
    try:
        tables = [t for (t,) in db.execute("SELECT name FROM sqlite_master "
                                           "WHERE type = 'table' ORDER BY name")]
        return {t: sorted(db.execute(f"SELECT * FROM {t}").fetchall(), key=repr)
                for t in tables}
    finally:
        db.close()


def test_a_write_failing_after_rows_were_staged_leaves_the_state_as_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Device rows go into the state's transaction while the pack still fills
    (`compiler.writing`): a write that fails after some did must roll them back with
    everything else. (The pack's failure is a test double: a disk that fails on the
    eighth object of a write cannot be had on demand.)"""
    fleet = make_fleet(tmp_path / "fleet", "hello")
    assert not fleet.compile().errors
    before_rows, before_trees = state_rows(fleet), trees(fleet)
    monkeypatch.setattr(writing, "_BATCH", 2)
    real, calls = PackWriter.add_packed, []

    def add_packed(self: PackWriter, packed: object) -> None:
        calls.append(1)
        if len(calls) == 8:
            raise OSError(28, "No space left on device")
        real(self, packed)  # type: ignore[arg-type]

    monkeypatch.setattr(PackWriter, "add_packed", add_packed)
    changed = make_fleet(tmp_path / "fleet", "bonjour")
    with pytest.raises(GitStoreError, match="No space left"):
        changed.compile(now=2_000_001.0)
    assert len(calls) == 8
    assert state_rows(changed) == before_rows and trees(changed) == before_trees
    monkeypatch.setattr(PackWriter, "add_packed", real)
    assert not changed.compile(now=2_000_002.0).errors
    assert trees(changed) != before_trees
    again = changed.compile(now=2_000_003.0)
    assert (again.commits, again.errors) == (0, [])
