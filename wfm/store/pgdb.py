"""The fleet server's store on PostgreSQL (psycopg 3, a connection pool).

The record functions are written once, with `?` placeholders; `PgConnection` hands psycopg
the same statements with `%s` (and a literal `%` doubled). Reads borrow a pooled connection
in autocommit mode; durable writes go through the group-commit writer of `wfm.store.database` on a
connection of their own, reconnecting after the server was lost. While PostgreSQL cannot be
reached every read and write raises `DatabaseUnavailable` (503 with `Retry-After` for the
caller), and the pool reconnects by itself once it is back; until a write succeeds again,
readiness probes the server through the pool (and asks whether it is a standby). Pooled
connections are not checked at every checkout (that was a second query per read, and most
of the time a replica's event loop spent blocked under load): one that broke while
PostgreSQL was away fails its next read with a 503 and the pool replaces it.

Every connection detects a link that went silent (packets dropped, not refused: a
partition, a firewall, a host gone without a word): TCP keepalives for an idle one (the
lease's session, the listening session of `wfm.fleet.news`), and `tcp_user_timeout` for one
whose statement is unanswered. Without them a read in flight waits for TCP's own give-up,
about fifteen minutes, and a replica's coordination loop waits with it. Settings the
database URL names itself win.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

from wfm.store.database import Database, DatabaseUnavailable
from wfm.store.schema import migrate

__all__ = ["LINK_TIMEOUT", "PgConnection", "PostgresDatabase", "link_settings", "translate",
           "url_problem"]

T = TypeVar("T")
log = logging.getLogger("margo.wfm.db")
_CONNECT_TIMEOUT = 5
#: Readiness probes answer within this (Kubernetes' default probe timeout is 1 s).
_PROBE_TIMEOUT = 2
#: Seconds a connection may go unanswered before it counts as lost (see the module's doc).
LINK_TIMEOUT = 10.0


@functools.lru_cache(maxsize=1024)
def translate(statement: str) -> str:
    """`?` placeholders outside quoted text become `%s`; a literal `%` becomes `%%`."""
    out: list[str] = []
    quote: str | None = None
    for char in statement:
        if quote is not None:
            out.append("%%" if char == "%" else char)
            if char == quote:
                quote = None
        elif char in ("'", '"'):
            quote = char
            out.append(char)
        elif char == "?":
            out.append("%s")
        elif char == "%":
            out.append("%%")
        else:
            out.append(char)
    return "".join(out)


def url_problem(url: str) -> str | None:
    """What libpq finds wrong with a database URL before connecting (a malformed option,
    an unknown parameter), its password masked; None when it reads it."""
    try:
        conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        message = str(exc).strip()
        password = _credentials(url)[2]
        return message.replace(password, "***") if password else message
    return None


def _credentials(url: str) -> tuple[str, str | None, str | None, str]:
    """A URL as (scheme with its ``://``, user, password, the rest after the ``@``)."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return scheme + sep, None, None, rest
    credentials, _, host = rest.rpartition("@")
    user, colon, password = credentials.partition(":")
    return scheme + sep, user, password if colon else None, host


def link_settings(url: str, link_timeout: float = LINK_TIMEOUT) -> dict[str, Any]:
    """The connection settings that bound how long a silent link goes unnoticed: about
    `link_timeout` seconds whether a statement is in flight (`tcp_user_timeout`) or the
    connection idles (keepalives: first probe after a third of it, then three more), and
    `connect_timeout`; any of them the URL sets is left to the URL."""
    idle = max(1, round(link_timeout / 3))
    wanted: dict[str, Any] = {
        "connect_timeout": _CONNECT_TIMEOUT, "keepalives": 1, "keepalives_idle": idle,
        "keepalives_interval": max(1, round((link_timeout - idle) / 3)),
        "keepalives_count": 3, "tcp_user_timeout": round(link_timeout * 1000)}
    named = conninfo_to_dict(url)
    return {key: value for key, value in wanted.items() if key not in named}


class PgConnection:
    """A psycopg connection that speaks the record functions' SQL."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.raw = conn
        self._pipeline: psycopg.Pipeline | None = None
        self._mode: contextlib.AbstractContextManager[psycopg.Pipeline] | None = None
        #: Whether statements were sent in pipeline mode since the pipeline was last waited for.
        self._unanswered = False

    def execute(self, sql: str, parameters: Any = ()) -> psycopg.Cursor[Any] | _Pending:
        return self._sent(lambda: self.raw.execute(translate(sql), tuple(parameters)))

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """`sql` once for each of `rows` (psycopg sends them pipelined: one round trip)."""
        statement, cursor = translate(sql), self.raw.cursor()
        values = [tuple(row) for row in rows]

        def send() -> psycopg.Cursor[Any]:
            cursor.executemany(statement, values)
            return cursor

        self._sent(send)

    def _sent(self, send: Callable[[], psycopg.Cursor[Any]]) -> psycopg.Cursor[Any] | _Pending:
        """`send()`'s cursor; in pipeline mode, one whose answers are waited for on use."""
        if self._pipeline is None:
            return send()
        try:
            cursor = send()
        except psycopg.Error:  # (an earlier statement's answer, read while sending this)
            self._restart_pipeline()
            raise
        self._unanswered = True
        return _Pending(cursor, self)

    @contextlib.contextmanager
    def pipelined(self) -> Iterator[Callable[[], None]]:
        """Statements sent without waiting for each answer (PostgreSQL's pipeline mode):
        a status report's write was four round trips in turn, the writer's whole cost. A
        fetch or a row count waits for everything sent (`_Pending`), and so does the
        callable yielded, raising the first error among it (then the statements after it
        were skipped). Leaving waits for the rest."""
        self._enter_pipeline()
        try:
            yield self.answered
        except BaseException as exc:
            self._leave_pipeline(exc)
            raise
        self._leave_pipeline(None)

    def answered(self) -> None:
        """Wait until every statement sent is answered (at once when none is on its way:
        outside pipeline mode, or nothing sent since the last wait)."""
        if self._pipeline is None or not self._unanswered:
            return
        try:
            self._pipeline.sync()
        except psycopg.Error:
            self._restart_pipeline()
            raise
        self._unanswered = False

    def _restart_pipeline(self) -> None:
        """Leave pipeline mode and enter it again, after a statement failed. psycopg raises
        a pipeline's first error as soon as it reads it (a wait, a fetch, or sending a
        later statement), possibly before PostgreSQL was sent the sync that ends the
        failed segment: until then it skips every statement ("pipeline aborted"), the
        caller's `ROLLBACK TO SAVEPOINT` too, and the answers still to come would be raised
        at the next wait, as an error of whatever write waits then. Leaving sends that sync
        and reads every answer (raising the skipped ones: expected here, the caller raises
        the first error). A connection that broke stays out of pipeline mode; its next
        statement says so."""
        with contextlib.suppress(psycopg.Error):
            self._leave_pipeline(None)
        with contextlib.suppress(psycopg.Error):
            self._enter_pipeline()

    def _enter_pipeline(self) -> None:
        mode = self.raw.pipeline()
        self._pipeline = mode.__enter__()
        self._mode = mode

    def _leave_pipeline(self, exc: BaseException | None) -> None:
        mode, self._mode, self._pipeline = self._mode, None, None
        self._unanswered = False  # (leaving waits for every answer)
        if mode is not None:
            mode.__exit__(type(exc) if exc is not None else None, exc,
                          exc.__traceback__ if exc is not None else None)

    def copy_rows(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], *,
                  types: Sequence[str] | None = None) -> None:
        """`rows` into `table` through one `COPY ... FROM STDIN`: a bulk load in a single
        round trip (record functions that write hundreds of thousands of rows use it where
        the connection has it; a statement per few hundred rows is the portable way). With
        `types` (each column's PostgreSQL type) in the binary format: bytes go as they are,
        not as text (`wfm.store.pack_rows`' parts)."""
        binary = " WITH (FORMAT BINARY)" if types is not None else ""
        if self._pipeline is None:
            self._copy(table, columns, rows, types, binary)
            return
        self._leave_pipeline(None)  # (COPY cannot run in pipeline mode)
        try:
            self._copy(table, columns, rows, types, binary)
        finally:
            self._enter_pipeline()

    def _copy(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]],
              types: Sequence[str] | None, binary: str) -> None:
        with self.raw.cursor().copy(
                f"COPY {table} ({', '.join(columns)}) FROM STDIN{binary}") as copy:
            if types is not None:
                copy.set_types(list(types))
            for row in rows:
                copy.write_row(row)

    def execute_binary(self, sql: str, parameters: Any = ()) -> psycopg.Cursor[Any] | _Pending:
        """`execute`, with the results in PostgreSQL's binary format: a bytea column comes
        as its bytes instead of twice as many hex digits to decode."""
        return self._sent(lambda: self.raw.cursor(binary=True).execute(translate(sql),
                                                                       tuple(parameters)))

    def close(self) -> None:
        self.raw.close()


class _Pending:
    """A cursor whose statement may still be on its way (`PgConnection.pipelined`). Its
    row count and rows are read once the whole pipeline is answered (the same round trip
    a fetch of its own makes): a count read early would be -1, and a fetch of its own after
    a statement that failed would raise psycopg's `PipelineAborted` (an `OperationalError`,
    taken for "the database is gone") instead of that statement's error."""

    __slots__ = ("_connection", "_cursor")

    def __init__(self, cursor: psycopg.Cursor[Any], connection: PgConnection) -> None:
        self._cursor, self._connection = cursor, connection

    @property
    def rowcount(self) -> int:
        self._connection.answered()
        return self._cursor.rowcount

    def fetchone(self) -> Any:
        self._connection.answered()
        return self._cursor.fetchone()

    def fetchall(self) -> list[Any]:
        self._connection.answered()
        return self._cursor.fetchall()

    def __iter__(self) -> Iterator[Any]:
        self._connection.answered()
        return iter(self._cursor)


class PostgresDatabase(Database):
    dialect = "postgresql"
    begin = "BEGIN"
    remote_reads = True
    #: ReadOnlySqlTransaction: a standby (after a failover, the old primary): nothing can
    #: be stored here now, the writer reconnects for the next batch.
    unavailable = (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout,
                   psycopg.errors.ReadOnlySqlTransaction)

    def __init__(self, url: str, *, pool_size: int = 8, link_timeout: float = LINK_TIMEOUT):
        """`link_timeout`: seconds a silent link goes unnoticed (`link_settings`)."""
        self.url = url
        self._settings = link_settings(url, link_timeout)
        try:
            with psycopg.connect(url, autocommit=True, **self._settings) as conn:
                migrate(PgConnection(conn), self.dialect)
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(f"cannot open {_redacted(url)}: {exc}") from exc
        self._pool = ConnectionPool(url, min_size=1, max_size=pool_size, open=True,
                                    kwargs={"autocommit": True, **self._settings},
                                    timeout=5,
                                    reconnect_timeout=0, name="margo-wfm")
        super().__init__()

    def _write_connection(self) -> PgConnection:
        return PgConnection(psycopg.connect(self.url, autocommit=True, **self._settings))

    def _pipelined(self, conn: PgConnection) -> contextlib.AbstractContextManager[
            Callable[[], None]]:
        return conn.pipelined()

    def write_apart(self, fn: Callable[[Any], T]) -> T:
        """`fn` in a transaction on a connection of its own (see `Database.write_apart`)."""
        try:
            with psycopg.connect(self.url, autocommit=True, **self._settings) as raw:
                conn = PgConnection(raw)
                conn.execute("BEGIN")
                try:
                    result = fn(conn)
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
                return result
        except self.unavailable as exc:
            raise DatabaseUnavailable(f"the database is unavailable: {exc}") from exc

    def read(self, fn: Callable[[Any], T]) -> T:
        try:
            with self._pool.connection() as conn:
                return fn(PgConnection(conn))
        except self.unavailable as exc:
            raise DatabaseUnavailable(f"the database is unavailable: {exc}") from exc

    def _probe(self) -> None:
        """A pooled connection within a second or two, to a server that takes writes."""
        with self._pool.connection(timeout=_PROBE_TIMEOUT) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
            if row is None or row[0]:
                raise DatabaseUnavailable("PostgreSQL is a standby (read-only)")

    def connect(self) -> PgConnection:
        """A connection of its own (autocommit), for what holds a session: the compile
        lease's advisory lock. The caller closes it."""
        try:
            return PgConnection(psycopg.connect(self.url, autocommit=True, **self._settings))
        except self.unavailable as exc:
            raise DatabaseUnavailable(f"the database is unavailable: {exc}") from exc

    def close(self) -> None:
        super().close()
        self._pool.close()


def _redacted(url: str) -> str:
    """The URL without its password, for messages."""
    scheme, user, _, rest = _credentials(url)
    return f"{scheme}{rest}" if user is None else f"{scheme}{user}@{rest}"
