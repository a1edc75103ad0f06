"""``reducing-saver serve --workers N``: uvicorn's workers, each ending as the one-worker service does.

uvicorn's supervisor starts the workers (``spawn``), forwards SIGTERM to them and waits for them. Two things
differ from its defaults, and one is added:

* A worker ends like ``serve`` with one worker: after uvicorn's graceful shutdown it exits with code 0,
  and threads still waiting on a database that stopped answering are reported and left behind
  (:func:`~reducing_saver.service.exits.exit_now_if_threads_stuck`) instead of joined, which could
  take as long as the database keeps silent.
* The supervisor waits for its workers at most ``shutdown_grace_seconds + db_timeout_seconds`` plus a
  margin, then kills the ones left: a worker's shutdown is bounded like the one-worker service's.
* The workers' metrics are added up at every scrape (prometheus_client's multiprocess mode), in a folder
  made for the run and removed after it.
* A worker whose supervisor is gone (``kill -9``, a crash: nothing forwarded a signal) stops as on SIGTERM
  and removes the run's key folder (``configuration.settings.KEYS_FOLDER_ENV``): it notices at once,
  through the pipe multiprocessing keeps open to its parent, and exits within the same bound as the
  supervisor would give it.

Imported only by ``serve`` with several workers (it imports uvicorn).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from socket import socket
from typing import Any, TypedDict

import uvicorn
from prometheus_client.multiprocess import mark_process_dead
from uvicorn.supervisors import Multiprocess

from reducing_saver.service.configuration.settings import KEYS_FOLDER_ENV
from reducing_saver.service.exits import THREAD_END_SECONDS, exit_now_if_threads_stuck
from reducing_saver.service.http.observability import MULTIPROCESS_ENV

logger = logging.getLogger("reducing_saver.service")

#: How long a worker may take to answer the supervisor's first health check: importing the service in a
#: new process takes seconds on a busy host, and uvicorn kills (then restarts) a worker that is late.
WORKER_HEALTHCHECK_SECONDS = 30
#: Beyond the grace and the database timeout, what a worker's exit may take (its stuck-thread check,
#: the interpreter's own exit) before the supervisor kills it.
EXIT_MARGIN_SECONDS = THREAD_END_SECONDS + 2.0


class ServerOptions(TypedDict):
    """What every uvicorn server of ``serve`` is configured with, one process or several: keyword
    arguments of ``uvicorn.Config``."""

    log_level: str
    log_config: None
    access_log: bool
    timeout_graceful_shutdown: float
    timeout_keep_alive: float


def _exit_with_supervisor(stop_seconds: float) -> None:
    """In a worker: wait until the supervisor is gone, then stop as on SIGTERM; exit regardless once
    ``stop_seconds`` have passed. The run's key folder goes first: no worker will start to read it."""
    supervisor = multiprocessing.parent_process()
    if supervisor is None:
        return
    supervisor.join()  # returns when the supervisor's end of the pipe closes: it has exited
    logger.warning("the supervisor (pid %s) is gone; this worker stops", supervisor.pid)
    if folder := os.environ.get(KEYS_FOLDER_ENV):
        shutil.rmtree(folder, ignore_errors=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(stop_seconds)
    logger.warning("worker %s did not stop within %g s of its supervisor; exiting", os.getpid(), stop_seconds)
    os._exit(1)


def _worker_exit(signum: int, frame: object) -> None:
    # uvicorn re-raises the SIGTERM it handled once the worker has shut down gracefully (its event loop
    # still running). Exit 0; at interpreter exit, before Python joins the threads left (the hook
    # concurrent.futures uses for its own threads), exit at once if some still wait on the database.
    threading._register_atexit(lambda: exit_now_if_threads_stuck(0))  # type: ignore[attr-defined]
    raise SystemExit(0)


class WorkerConfig(uvicorn.Config):
    """uvicorn's config for the workers: each worker, once uvicorn has shut it down, ends as
    :func:`_worker_exit` says.

    uvicorn configures logging in each worker before it runs the server (outside the server's own signal
    handling, which restores the handler found here and re-raises the signal after a graceful
    shutdown): the one moment a worker can install its exit.
    """

    #: The longest a worker's shutdown may take (``Supervisor.stop_seconds``), also once its supervisor
    #: is gone.
    stop_seconds: float = 60.0

    def configure_logging(self) -> None:
        super().configure_logging()
        if multiprocessing.parent_process() is not None:  # a worker, not the supervisor
            signal.signal(signal.SIGTERM, _worker_exit)
            threading.Thread(
                target=_exit_with_supervisor, args=(self.stop_seconds,), name="supervisor-watch", daemon=True
            ).start()


class Supervisor(Multiprocess):
    """uvicorn's supervisor, waiting for its workers at most ``stop_seconds`` after asking them to stop.

    Args:
        config: The workers' config.
        sockets: The bound listening sockets the workers share.
        stop_seconds: The longest a worker's shutdown may take before it is killed.
    """

    def __init__(self, config: uvicorn.Config, sockets: list[socket], stop_seconds: float) -> None:
        super().__init__(config, sockets)
        self.stop_seconds = stop_seconds

    def keep_subprocess_alive(self) -> None:
        before = {process.pid for process in self.processes}
        super().keep_subprocess_alive()
        # A worker replaced: its gauges leave the sums (its counters stay, so totals never go backwards).
        for pid in before - {process.pid for process in self.processes}:
            if pid is not None:
                mark_process_dead(pid)

    def join_all(self) -> None:
        deadline = time.monotonic() + self.stop_seconds
        for process in self.processes:
            process.process.join(max(deadline - time.monotonic(), 0.0))
        for process in self.processes:
            if process.exitcode is None:
                logger.warning(
                    "worker process %s did not stop within %g s; killing it", process.pid, self.stop_seconds
                )
                process.kill()
                process.process.join()


def run_workers(settings: Any, common: ServerOptions, sockets: list[socket]) -> None:
    """Run ``settings.workers`` worker processes of the app ``app_from_env`` builds, until SIGTERM/SIGINT.

    The workers share their metrics through a folder made for this run (``PROMETHEUS_MULTIPROC_DIR`` in
    their environment, before they import prometheus_client), removed when they have stopped.
    """
    folder = tempfile.mkdtemp(prefix="reducing-saver-metrics-")
    os.environ[MULTIPROCESS_ENV] = folder
    try:
        _supervise(settings, common, sockets)
    finally:
        os.environ.pop(MULTIPROCESS_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


def _supervise(settings: Any, common: ServerOptions, sockets: list[socket]) -> None:
    config = WorkerConfig(
        "reducing_saver.service.http.app:app_from_env",
        factory=True,
        workers=settings.workers,
        timeout_worker_healthcheck=WORKER_HEALTHCHECK_SECONDS,
        **common,  # type: ignore[arg-type]  # uvicorn annotates its timeouts int; asyncio's timers take fractions
    )
    stop_seconds = settings.shutdown_grace_seconds + settings.db_timeout_seconds + EXIT_MARGIN_SECONDS
    config.stop_seconds = stop_seconds
    Supervisor(config, sockets, stop_seconds).run()
