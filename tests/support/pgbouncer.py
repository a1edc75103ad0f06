"""A PgBouncer of the test's own in front of a PostgreSQL server: Debian's package, a config file in a
temporary folder, a free port, stopped afterwards (never the system's service).

:func:`ensure_pgbouncer` installs the package when it is missing (``apt-get install -y pgbouncer``, as
root; Debian's policy keeps the system service from starting); CI runs the tests as root on Debian 12,
whose PgBouncer is 1.18: no ``max_prepared_statements``, so in transaction mode a client's prepared
statements are not its own.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from tests.support.server import free_port

PGBOUNCER = "/usr/sbin/pgbouncer"


def ensure_pgbouncer() -> str:
    """The pgbouncer binary, installed from Debian's package first when it is missing."""
    if not Path(PGBOUNCER).exists():
        if os.geteuid() != 0:
            raise RuntimeError(
                "pgbouncer is not installed, and only root may install it: apt-get install -y pgbouncer"
            )
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "pgbouncer"]
        if subprocess.run(install, env=env, capture_output=True, check=False).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
            subprocess.run(install, env=env, capture_output=True, check=True)
    return PGBOUNCER


class PgBouncer:
    """A running PgBouncer forwarding every database to ``target``.

    Args:
        target: ``(host, port)`` of the PostgreSQL server (trust authentication).
        mode: ``pool_mode``: ``transaction`` (a client's transactions may each run on another server
            connection) or ``session``.
        server_connections: ``default_pool_size``, server connections per database and user: fewer than
            the clients' connections, so that they share them.
    """

    def __init__(
        self, target: tuple[str, int], *, mode: str = "transaction", server_connections: int = 6
    ) -> None:
        binary = ensure_pgbouncer()
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="reducing-saver-pgbouncer-"))
        self.log = self.folder / "pgbouncer.log"
        users = self.folder / "userlist.txt"
        users.write_text('"postgres" ""\n')
        config = self.folder / "pgbouncer.ini"
        config.write_text(
            "[databases]\n"
            f"* = host={target[0]} port={target[1]}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            f"pool_mode = {mode}\n"
            "max_client_conn = 1000\n"
            f"default_pool_size = {server_connections}\n"
            f"logfile = {self.log}\n"
            f"pidfile = {self.folder / 'pgbouncer.pid'}\n"
        )
        command = [binary, str(config)]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            user = pwd.getpwnam("postgres")
            os.chown(self.folder, user.pw_uid, user.pw_gid)
            for path in (users, config):
                os.chown(path, user.pw_uid, user.pw_gid)
            command = [binary, "-u", "postgres", str(config)]
        self.version = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, check=True
        ).stdout.split("\n")[0]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer did not start: {self.output()}") from None
                time.sleep(0.05)

    def url(self, database_url: str) -> str:
        """``database_url`` (a ``postgresql://`` URL) through this PgBouncer."""
        parts = urlsplit(database_url)
        user = parts.netloc.rpartition("@")[0]
        return urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{self.port}"))

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


@contextmanager
def pgbouncer(target: tuple[str, int], **options: object) -> Iterator[PgBouncer]:
    bouncer = PgBouncer(target, **options)  # type: ignore[arg-type]
    try:
        yield bouncer
    finally:
        bouncer.close()
