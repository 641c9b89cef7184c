"""Loading a fleet source again in the same process (the fleet server, `--watch`): files
with unchanged bytes are not parsed again, and every load still reports every problem."""

from __future__ import annotations

from pathlib import Path

from kits.fleetkit import Fleet, app, intent

from compiler.source import load_source


def test_unchanged_files_are_parsed_once_and_changed_ones_again(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, apps={"com-example-app": app()},
                  intents={"a": intent("a"), "b": intent("b")})
    fleet.write()
    first = load_source(fleet.source)
    fleet.intents["b"]["spec"]["namespace"] = "changed"
    fleet.write()
    second = load_source(fleet.source)
    assert second.intents["a"] is first.intents["a"]
    assert second.applications == first.applications
    assert second.applications["com-example-app"]["1.0.0"] is (
        first.applications["com-example-app"]["1.0.0"])
    assert first.intents["b"].namespace != "changed" and second.intents["b"].namespace == (
        "changed")
    assert second.revision != first.revision


def test_every_load_reports_the_problems_of_unchanged_files(tmp_path: Path) -> None:
    """Problems of one file (invalid YAML, a wrong id) and across files (a version defined
    twice, an intent defined twice) come back on every load, not only the first."""
    fleet = Fleet(tmp_path, apps={"com-example-app": app(), "wrong-dir": app()},
                  intents={"a": intent("a")},
                  raw_files={"deployments/broken.yaml": "apiVersion: [unclosed\n"})
    fleet.write()
    for original, duplicate in [("apps/com-example-app/margo.yaml",
                                 "apps/com-example-app/v1-copy/margo.yaml"),
                                ("deployments/a.yaml", "deployments/a.yml")]:
        (fleet.source / duplicate).parent.mkdir(exist_ok=True)
        (fleet.source / duplicate).write_bytes((fleet.source / original).read_bytes())
    loads = [load_source(fleet.source) for _ in range(2)]
    for loaded in loads:
        messages = [p.format() for p in loaded.problems]
        assert any("broken.yaml:2" in m and "invalid YAML" in m for m in messages), messages
        assert any("must have id 'wrong-dir'" in m for m in messages), messages
        assert any("is also defined in" in m for m in messages), messages
        assert any("defined twice" in m for m in messages), messages
        assert {"broken", "a"} <= loaded.broken_intents
        assert {"wrong-dir", "com-example-app"} <= loaded.broken_apps
    assert [p.format() for p in loads[0].problems] == [p.format() for p in loads[1].problems]
