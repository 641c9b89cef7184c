"""A batch of status reports (`records.store_statuses`, how the status intake writes the
reports that arrive together) stores exactly what the same reports stored one at a time
store, in a few statements for the whole batch: a deployment reported twice in the batch,
a report that changes nothing, one that only refreshes, two clients' reports of one
deployment id, and a history trimmed inside the batch. On SQLite and on a real PostgreSQL
server (where one upsert may not touch a row twice)."""

from __future__ import annotations

from typing import Any

from wfm.identity.clients import ClientRegistry
from wfm.store import records
from wfm.store.database import Database


class Counting:
    """A real connection that counts the statements sent through it."""

    def __init__(self, conn: Any) -> None:
        self._conn, self.statements = conn, 0

    def execute(self, sql: str, parameters: Any = ()) -> Any:
        self.statements += 1
        return self._conn.execute(sql, parameters)

    def executemany(self, sql: str, rows: Any) -> Any:
        self.statements += 1
        return self._conn.executemany(sql, rows)


def report(client_id: str, deployment_id: str, state: str, adopted: int = 1,
           index: int = 0) -> records.StatusReport:
    document = {"deploymentId": deployment_id, "adoptedManifestVersion": adopted,
                "status": {"state": state}, "components": [{"name": "web", "state": state}],
                "x-margo-gitops-extensions": {"index": index}}
    return records.StatusReport(client_id, deployment_id, "edge-1", state, document,
                                f"sha256:{state}:{adopted}:{index}", adopted,
                                records.Applied("sha256:bytes", "test"))


def reports(prefix: str, a: str, b: str) -> list[records.StatusReport]:
    batch = [report(a, f"{prefix}1", "installing"), report(a, f"{prefix}2", "installing"),
             report(a, f"{prefix}1", "installed"),
             report(a, f"{prefix}1", "installed"),  # the same report again: nothing
             report(a, f"{prefix}2", "installing", adopted=2),  # the same meaning: refreshed
             report(b, f"{prefix}3", "installing"), report(a, f"{prefix}3", "installed")]
    # 130 changes of one deployment: its history is trimmed inside the batch
    batch += [report(a, f"{prefix}4", ("installing", "installed")[i % 2], index=i)
              for i in range(130)]
    return batch


def stored(db: Database, prefix: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The statuses and the history of the deployments under `prefix`, the prefix and the
    client names' own parts left out, without the times."""
    def rows(conn: Any) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        statuses = conn.execute(
            "SELECT deployment_id, client_id, device_id, state, document, digest, "
            "adopted_manifest_version, applied_digest, applied_via, meaning, history_count "
            "FROM statuses WHERE deployment_id LIKE ? ORDER BY deployment_id",
            (prefix + "%",)).fetchall()
        history = conn.execute(
            "SELECT deployment_id, client_id, state, document FROM status_reports "
            "WHERE deployment_id LIKE ? ORDER BY id", (prefix + "%",)).fetchall()
        return [tuple(r) for r in statuses], [tuple(r) for r in history]

    statuses, history = db.read(rows)
    return ([_plain(r, prefix) for r in statuses], [_plain(r, prefix) for r in history])


def _plain(row: tuple[Any, ...], prefix: str) -> tuple[Any, ...]:
    return tuple(v.replace(prefix, "").replace("-one", "").replace("-batch", "")
                 if isinstance(v, str) else v for v in row)


def test_a_batch_stores_what_one_report_at_a_time_stores(store: Database) -> None:
    clients = ClientRegistry(store)
    one_a, one_b = clients.add("a-one")[0], clients.add("b-one")[0]
    batch_a, batch_b = clients.add("a-batch")[0], clients.add("b-batch")[0]
    singly = [store.write_sync(lambda c, r=r: records.store_statuses(c, [r])[0])
              for r in reports("one-", one_a, one_b)]
    together = store.write_sync(lambda c: records.store_statuses(
        c, reports("all-", batch_a, batch_b)))
    assert together == singly
    assert [w.changed for w in together[:7]] == [True, True, True, False, False, True, True]
    assert stored(store, "all-") == stored(store, "one-")
    history = stored(store, "all-")[1]
    assert records.STATUS_HISTORY <= sum(1 for r in history if r[0] == "4") < 130


def test_a_batch_is_a_few_statements_not_a_few_per_report(store: Database) -> None:
    client_id = ClientRegistry(store).add("plant-a")[0]
    batch = [report(client_id, f"d-{n}", "installing") for n in range(300)]
    counted: list[int] = []

    def write(conn: Any) -> list[records.StatusWrite]:
        counting = Counting(conn)
        written = records.store_statuses(counting, batch)  # type: ignore[arg-type]
        counted.append(counting.statements)
        return written

    assert all(w.created and w.changed for w in store.write_sync(write))
    assert counted == [1 + 2 + 2]  # one read; statuses and history, 200 rows a statement
    assert len(stored(store, "d-")[1]) == 300
