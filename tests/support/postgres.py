"""Where the tests' PostgreSQL answers (``REDUCING_SAVER_TEST_PG*`` override it) and a database's URL there."""

from __future__ import annotations

import os

PG_HOST = os.environ.get("REDUCING_SAVER_TEST_PGHOST", "127.0.0.1")
PG_PORT = os.environ.get("REDUCING_SAVER_TEST_PGPORT", "5432")
PG_USER = os.environ.get("REDUCING_SAVER_TEST_PGUSER", "postgres")


def pg_url(database: str) -> str:
    return f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{database}"
