"""A `--database` URL that libpq cannot read is refused before the server starts: one line
naming the option and what is wrong, its password masked, no traceback (it had been a
psycopg exception through the application's start-up)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kits.serverkit import margo

from wfm.store.pgdb import url_problem


@pytest.mark.parametrize(("url", "wrong"), [
    ("postgresql://fleet:s3cret@127.0.0.1:1/wfm?bogus=1", 'invalid URI query parameter: "bogus"'),
    ("postgresql://fleet:s3cr%zzet@127.0.0.1:1/wfm", "invalid percent-encoded token"),
])
def test_a_malformed_database_url_is_refused_in_one_line(tmp_path: Path, url: str,
                                                         wrong: str) -> None:
    result = margo("serve", "--port", "1", "--data", str(tmp_path / "data"), "--database", url,
                   check=False)
    assert result.returncode != 0
    assert "--database is not a usable PostgreSQL URL" in result.stderr and wrong in result.stderr
    assert "Traceback" not in result.stderr and "s3cr" not in result.stderr, result.stderr


def test_a_well_formed_url_has_no_problem() -> None:
    assert url_problem("postgresql://fleet:s3cret@db.example:5432/wfm?sslmode=require") is None
