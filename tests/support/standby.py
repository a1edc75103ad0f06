"""A PostgreSQL primary and its streaming standby, of the test's own: made with the PostgreSQL 15 binaries
(``initdb``, ``pg_ctl``, ``pg_basebackup``) in a temporary folder, on free ports, run as the ``postgres``
user when the tests run as root, and removed afterwards. The shared server the other tests use is never
touched.

The standby replicates synchronously (``synchronous_standby_names``): the primary acknowledges a commit
only once the standby has it, so a primary that dies loses nothing a client was told was stored, which
is what a managed PostgreSQL with a synchronous standby promises. (With asynchronous replication a crash
of the primary may lose its last commits: PostgreSQL's guarantee, not the service's to give.)
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from tests.support.server import free_port

BIN = Path("/usr/lib/postgresql/15/bin")


def _as_postgres(command: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


def _run(command: list[str], timeout: float = 60) -> None:
    result = subprocess.run(
        _as_postgres(command), capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )


class Cluster:
    """One PostgreSQL server of the pair: its data folder, its port, ``pg_ctl`` around it."""

    def __init__(self, name: str, data: Path, port: int) -> None:
        self.name = name
        self.data = data
        self.port = port
        self.log = data.parent / f"{name}.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        _run(
            [str(BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start"],
            timeout=90,
        )

    def stop(self, mode: str = "fast") -> None:
        """``fast``: a clean shutdown (sessions ended, WAL sent to the standby); ``immediate``: a crash."""
        _run([str(BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"], timeout=90)

    def promote(self) -> None:
        _run([str(BIN / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote"], timeout=90)

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def sql(self, statement: str, database: str = "postgres") -> list[tuple]:
        with psycopg.connect(self.url(database), autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(statement)
            return cur.fetchall() if cur.description else []


class Pair:
    """A primary and a synchronous streaming standby of it."""

    def __init__(self, folder: Path, primary: Cluster, standby: Cluster) -> None:
        self.folder = folder
        self.primary = primary
        self.standby = standby

    def multi_host_url(self, database: str, *, standby_first: bool = False, attrs: str | None = None) -> str:
        """A URL listing both servers (the standby first if asked), with ``target_session_attrs`` if given."""
        hosts = [self.primary, self.standby]
        if standby_first:
            hosts.reverse()
        url = "postgresql://postgres@" + ",".join(f"127.0.0.1:{c.port}" for c in hosts) + f"/{database}"
        return url + (f"?target_session_attrs={attrs}" if attrs else "")

    def create_database(self, name: str) -> None:
        """A database on the primary, and wait until the standby has it."""
        self.primary.sql(f'CREATE DATABASE "{name}"')
        self.wait_replayed()

    def wait_replayed(self, timeout: float = 30) -> None:
        """Wait until the standby has replayed everything the primary wrote so far."""
        lsn = self.primary.sql("SELECT pg_current_wal_lsn()")[0][0]
        deadline = time.monotonic() + timeout
        while self.standby.sql(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn")[0][0] is not True:
            assert time.monotonic() < deadline, "the standby did not catch up"
            time.sleep(0.05)

    def close(self) -> None:
        for cluster in (self.standby, self.primary):
            if cluster.running():
                try:
                    cluster.stop("immediate")
                except (RuntimeError, subprocess.TimeoutExpired):
                    pass
        shutil.rmtree(self.folder, ignore_errors=True)


def _owned_folder(prefix: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(folder, user.pw_uid, user.pw_gid)
    return folder


def make_template(folder: Path) -> Path:
    """An initdb'd data folder to copy for each primary (initdb once, copies are quick)."""
    data = folder / "template"
    _run([str(BIN / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync",
          "--locale=C.UTF-8"], timeout=120)  # fmt: skip
    with (data / "postgresql.conf").open("a") as conf:
        conf.write(
            "listen_addresses = '127.0.0.1'\n"
            "wal_level = replica\nmax_wal_senders = 4\nhot_standby = on\nwal_keep_size = '64MB'\n"
            "fsync = off\nfull_page_writes = off\nsynchronous_commit = on\n"
            "synchronous_standby_names = 'standby'\n"
            "max_connections = 100\nshared_buffers = '32MB'\n"
        )
    return data


def make_pair(template: Path) -> Pair:
    """A running primary (a copy of ``template``) and a standby streaming from it synchronously."""
    folder = _owned_folder("reducing-saver-pair-")
    primary = Cluster("primary", folder / "primary", free_port())
    _run(["cp", "-a", str(template), str(primary.data)])
    with (primary.data / "postgresql.conf").open("a") as conf:
        conf.write(f"port = {primary.port}\nunix_socket_directories = '{folder}'\n")
    primary.start()
    standby = Cluster("standby", folder / "standby", free_port())
    _run([str(BIN / "pg_basebackup"), "-D", str(standby.data), "-R", "-X", "stream", "--no-sync",
          "-d", f"host=127.0.0.1 port={primary.port} user=postgres application_name=standby"], timeout=120)  # fmt: skip
    with (standby.data / "postgresql.conf").open("a") as conf:
        # Promoted, it has no standby of its own to wait for.
        conf.write(
            f"port = {standby.port}\nunix_socket_directories = '{folder}'\nsynchronous_standby_names = ''\n"
        )
    standby.start()
    pair = Pair(folder, primary, standby)
    deadline = time.monotonic() + 30
    while primary.sql("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'")[0][0] != 1:
        assert time.monotonic() < deadline, "the standby did not start streaming"
        time.sleep(0.05)
    return pair


@contextmanager
def pair_template() -> Iterator[Path]:
    """An initdb'd template folder for :func:`make_pair`, removed afterwards."""
    folder = _owned_folder("reducing-saver-template-")
    try:
        yield make_template(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
