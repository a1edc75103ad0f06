"""How a process of the service exits: threads still waiting on a database that stopped answering are
reported and left behind instead of joined (``serve``, ``worker``, and each worker process of ``serve
--workers N``)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

logger = logging.getLogger("reducing_saver.service")

#: How long an idle worker thread may take to end at exit before it counts as stuck on the database.
THREAD_END_SECONDS = 1.0


def _stuck_threads() -> list[threading.Thread]:
    """Threads that would keep the process alive at exit, after a moment for idle pool threads (told to
    stop with the service) to end."""
    me = threading.current_thread()
    alive = [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
    deadline = time.monotonic() + THREAD_END_SECONDS
    for thread in alive:
        thread.join(max(deadline - time.monotonic(), 0.0))
    return [t for t in alive if t.is_alive()]


def _exit_without(stuck: list[threading.Thread], code: int) -> None:
    logger.warning("%d thread(s) still wait on the database; exiting without them", len(stuck))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_threads_stuck_on_the_database() -> None:
    """Exit now if threads still wait on a database that stopped answering.

    The service has shut down (the grace is over, the backend closed or left behind), but a saver call
    cancelled with its request still waits in its worker thread, and Python joins executor threads at
    exit: the process would live on for as long as the database keeps silent. Their work is moot; exit
    with the code the process was about to exit with.
    """
    stuck = _stuck_threads()
    if not stuck:
        return
    error = sys.exc_info()[1]
    if error is None:
        code = 0
    elif isinstance(error, SystemExit):
        code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    else:
        code = 1
    _exit_without(stuck, code)


def exit_now_if_threads_stuck(code: int) -> None:
    """Exit with ``code`` at once (logged) when threads still wait on the database; else return."""
    stuck = _stuck_threads()
    if stuck:
        _exit_without(stuck, code)
