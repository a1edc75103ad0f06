"""On PostgreSQL a put's pruned messages go into the outbox in the checkpoint's own transaction.

The service app in-process (FastAPI TestClient) on a database of the test's own; triggers make one side
of a put fail, to show that the outbox rows and the checkpoint are stored together or not at all.
"""

from __future__ import annotations

import psycopg
import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from reducing_saver.service.storage.outbox import TABLE
from reducing_saver.wire import blob_to_wire
from tests.support.bodies import messages_put_body

SERDE = JsonPlusSerializer()
#: Of 4 turns (8 messages), a window of 4 cut to 2 keeps the last turn.
PRUNED = ["a0", "a1", "a2", "h0", "h1", "h2"]


def _put_body(thread_id: str, turns: int) -> dict:
    messages = []
    for turn in range(turns):
        messages += [HumanMessage(f"q{turn}", id=f"h{turn}"), AIMessage(f"a{turn}", id=f"a{turn}")]
    return messages_put_body(blob_to_wire(*SERDE.dumps_typed(messages)), thread_id)


@pytest.fixture
def database(fresh_pg: str) -> str:
    return fresh_pg


@pytest.fixture
def client(database: str):
    # No deliverer: the rows stay pending, where the test can read them.
    settings = Settings(database=database, max_messages=4, min_messages=2, extract=False, sweep=False)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def _sql(database: str, statement: str, *params) -> list[tuple]:
    with psycopg.connect(database, autocommit=True) as conn:
        cursor = conn.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


def _fail_inserts_into(database: str, table: str) -> None:
    _sql(
        database,
        f"""
        CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
            $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$;
        CREATE TRIGGER refuse BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION refuse();
    """,
    )


def _outbox_keys(database: str, thread_id: str) -> list[str]:
    return [
        key
        for (key,) in _sql(database, f"SELECT key FROM {TABLE} WHERE thread_id = %s ORDER BY key", thread_id)
    ]


def _checkpoints(database: str, thread_id: str) -> int:
    return _sql(database, "SELECT count(*) FROM checkpoints WHERE thread_id = %s", thread_id)[0][0]


def test_the_outbox_rows_and_the_checkpoint_commit_in_one_transaction(client, database):
    response = client.post("/v1/checkpoints/put", json=_put_body("t1", 4))
    assert response.status_code == 200, response.text
    checkpoint_xid = _sql(database, "SELECT xmin::text FROM checkpoints WHERE thread_id = 't1'")
    outbox_xids = _sql(database, f"SELECT DISTINCT xmin::text FROM {TABLE} WHERE thread_id = 't1'")
    assert _outbox_keys(database, "t1") == PRUNED
    assert outbox_xids == checkpoint_xid


def test_a_checkpoint_that_cannot_be_stored_records_nothing(client, database):
    _fail_inserts_into(database, "checkpoints")
    response = client.post("/v1/checkpoints/put", json=_put_body("t1", 4))
    assert response.status_code >= 500, response.text
    assert _outbox_keys(database, "t1") == []
    # Once the database takes checkpoints again, the same put records them: none was taken as recorded.
    _sql(database, "DROP TRIGGER refuse ON checkpoints")
    response = client.post("/v1/checkpoints/put", json=_put_body("t1", 4))
    assert response.status_code == 200, response.text
    assert _outbox_keys(database, "t1") == PRUNED
    assert _checkpoints(database, "t1") == 1


def test_outbox_rows_that_cannot_be_written_store_no_checkpoint(client, database):
    _fail_inserts_into(database, TABLE)
    response = client.post("/v1/checkpoints/put", json=_put_body("t1", 4))
    assert response.status_code >= 500, response.text
    assert _checkpoints(database, "t1") == 0
    assert _sql(database, "SELECT count(*) FROM checkpoint_blobs WHERE thread_id = 't1'") == [(0,)]


def test_a_put_that_prunes_nothing_new_writes_no_outbox_rows(client, database):
    assert client.post("/v1/checkpoints/put", json=_put_body("t1", 4)).status_code == 200
    first = _sql(database, f"SELECT key, xmin::text FROM {TABLE} ORDER BY key")
    body = _put_body("t1", 4)
    body["checkpoint"]["id"] = "1ef00000-0000-6000-8000-000000000002"
    assert client.post("/v1/checkpoints/put", json=body).status_code == 200
    assert _sql(database, f"SELECT key, xmin::text FROM {TABLE} ORDER BY key") == first
    assert _checkpoints(database, "t1") == 2
