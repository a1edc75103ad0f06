"""The ``reducing-saver`` command line."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from importlib import metadata as importlib_metadata
from typing import Literal, get_args, get_origin

from pydantic import ValidationError

from reducing_saver.service.config import Settings
from reducing_saver.service.storage import StorageError

ENV_PREFIX = "REDUCING_SAVER_"

#: CLI flag -> settings field, for every flag of ``serve``.
SERVE_FLAGS: dict[str, str] = {
    "--database": "database",
    "--host": "host",
    "--port": "port",
    "--workers": "workers",
    "--pool-size": "pool_size",
    "--max-messages": "max_messages",
    "--min-messages": "min_messages",
    "--max-tokens": "max_tokens",
    "--target-tokens": "target_tokens",
    "--allow-message-class": "allowed_message_classes",
    "--allow-state-type": "allowed_state_types",
    "--on-prune": "on_prune",
    "--max-body-bytes": "max_body_bytes",
    # No flag for api_keys: a key on a command line is visible to every user of the host (ps).
    "--api-keys-file": "api_keys_file",
    "--insecure": "insecure",
    "--log-level": "log_level",
    "--log-format": "log_format",
    "--shutdown-grace-seconds": "shutdown_grace_seconds",
    "--keep-alive-seconds": "keep_alive_seconds",
    "--db-timeout-seconds": "db_timeout_seconds",
    "--extract": "extract",
    "--extractor": "extractor",
    "--extraction-batch-size": "extraction_batch_size",
    "--extraction-max-attempts": "extraction_max_attempts",
    "--extraction-lease-seconds": "extraction_lease_seconds",
    "--extraction-linger-seconds": "extraction_linger_seconds",
    "--outbox-retention": "outbox_retention",
    "--ttl-strategy": "ttl_strategy",
    "--default-ttl": "default_ttl",
    "--sweep-interval": "sweep_interval",
    "--sweep": "sweep",
    "--extract-on-delete": "extract_on_delete",
    "--keep-checkpoints": "keep_checkpoints",
    "--store-index": "store_index",
    "--store-ttl": "store_ttl",
}
#: The flags of ``worker``: where the outbox is, how to deliver, how to log.
WORKER_FLAGS: dict[str, str] = {
    flag: SERVE_FLAGS[flag]
    for flag in (
        "--database",
        "--extractor",
        "--extraction-batch-size",
        "--extraction-max-attempts",
        "--extraction-lease-seconds",
        "--store-index",
        "--store-ttl",
        "--log-level",
        "--log-format",
    )
}
EXTRACTION_FLAGS: dict[str, str] = {"--database": "database"}
#: The flags of ``sweep`` (one TTL sweep, for cron); ``--dry-run`` is its own.
SWEEP_FLAGS: dict[str, str] = {
    flag: SERVE_FLAGS[flag]
    for flag in (
        "--database",
        "--ttl-strategy",
        "--default-ttl",
        "--outbox-retention",
        "--allow-message-class",
        "--log-level",
        "--log-format",
    )
}
ALL_FLAGS = {**SERVE_FLAGS, **WORKER_FLAGS, **EXTRACTION_FLAGS, **SWEEP_FLAGS}

logger = logging.getLogger("reducing_saver.service")

#: PostgreSQL connections of a ``reducing-saver worker``: claims and renewals, and the store.
WORKER_POOL_SIZE = 4


def _version() -> str:
    try:
        return importlib_metadata.version("reducing-saver")
    except importlib_metadata.PackageNotFoundError:  # a source tree that is not installed
        return "0.0.0"


def _help(field: str) -> str:
    info = Settings.model_fields[field]
    default = info.get_default(call_default_factory=True)
    shown = ",".join(default) if isinstance(default, list) else default
    return f"{info.description} [env {ENV_PREFIX}{field.upper()}; default: {shown}]"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reducing-saver",
        description="A LangGraph checkpoint service that keeps every stored checkpoint to a window of messages.",
    )
    parser.add_argument("--version", action="version", version=f"reducing-saver {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the HTTP service",
        description="Run the HTTP service. Every option can also be set by its environment variable "
        f"({ENV_PREFIX}<NAME>) or in a .env file; options given here win.",
    )
    _add_flags(serve, SERVE_FLAGS)
    worker = commands.add_parser(
        "worker",
        help="deliver pruned messages to long-term memory (no HTTP)",
        description="Claim pruned messages from the service database's outbox and hand them to the "
        "extractor until SIGTERM or SIGINT. Run any number of these; each message is delivered once. "
        "Serve with --no-extract when only workers should deliver.",
    )
    _add_flags(worker, WORKER_FLAGS)
    extraction = commands.add_parser("extraction", help="inspect or re-drive the extraction outbox")
    actions = extraction.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (
        ("status", "print pending, in flight, delivered, dead-lettered and the oldest pending age (JSON)"),
        ("retry-dead", "put every dead letter back in the queue"),
    ):
        _add_flags(actions.add_parser(action, help=text, description=text), EXTRACTION_FLAGS)
    sweep_parser = commands.add_parser(
        "sweep",
        help="apply the TTL strategy to expired threads once (for cron)",
        description="Prune (keep_latest) or delete every thread idle for longer than its TTL, and delete "
        "delivered outbox rows older than --outbox-retention, once, and print what was done as JSON. Safe "
        "while services sweep the same database.",
    )
    _add_flags(sweep_parser, SWEEP_FLAGS)
    sweep_parser.add_argument(
        "--dry-run", action="store_true", help="change nothing; print the expired threads and the bytes each would free"
    )
    return parser


def _add_flags(parser: argparse.ArgumentParser, flags: dict[str, str]) -> None:
    for flag, field in flags.items():
        annotation = Settings.model_fields[field].annotation
        if annotation is bool:
            parser.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction, help=_help(field))
        elif get_origin(annotation) is Literal:
            # --help lists the values, and a wrong one is refused before any setting is read.
            parser.add_argument(flag, dest=field, choices=get_args(annotation), help=_help(field))
        else:
            parser.add_argument(flag, dest=field, metavar=field.upper(), help=_help(field))


#: The flags given to ``serve``, for its worker processes (JSON); the environment and ``.env`` they read
#: themselves. Never a secret: no flag takes a key.
FLAGS_ENV = "REDUCING_SAVER_SERVE_FLAGS"


def flag_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The settings given as flags on the command line."""
    return {field: getattr(args, field) for field in ALL_FLAGS.values() if getattr(args, field, None) is not None}


def load_settings(args: argparse.Namespace) -> Settings:
    """Settings from flags given on the command line, then the environment, then defaults."""
    return Settings(**flag_overrides(args))


#: What pydantic puts before the text of a ValueError or AssertionError raised by a validator.
_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def _where(field: str) -> str:
    """How an operator sets ``field``: its flag and variable, or the variable alone."""
    flag = next((f for f, name in ALL_FLAGS.items() if name == field), None)
    variable = f"{ENV_PREFIX}{field.upper()}"
    return f"{flag} / {variable}" if flag else variable


def _describe(error: ValidationError) -> str:
    """One line per error, naming the flag and variable of every setting involved.

    A check across settings (min_messages against max_messages) has no field of its own: the settings
    its message names are the ones to change. The value is shown once: not when the message already
    quotes it, never for API keys, never for a check across settings (its input is every setting).
    """
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"])
        message = item["msg"]
        for prefix in _PYDANTIC_PREFIXES:
            message = message.removeprefix(prefix)
        if field:
            involved = [field]
        else:
            found = {name: re.search(rf"\b{name}\b", message) for name in Settings.model_fields}
            involved = sorted((name for name, match in found.items() if match), key=lambda n: found[n].start())
        where = ", ".join(_where(name) for name in involved) or "settings"
        shown = ""
        if field and "api_keys" not in field:
            value = item.get("input")
            if repr(value) not in message and str(value) not in message:
                shown = f" (got {value!r})"
        lines.append(f"  {where}: {message}{shown}")
    return "invalid settings:\n" + "\n".join(lines)


def _exit_after_shutdown(signum: int, frame: object) -> None:
    # uvicorn re-raises SIGTERM once it has shut down gracefully; exit 0 instead of dying by the signal.
    raise SystemExit(0)


def _leave_threads_stuck_on_the_database() -> None:
    """Exit now if threads still wait on a database that stopped answering.

    The service has shut down (the grace is over, the backend closed or left behind), but a saver call
    cancelled with its request still waits in its worker thread, and Python joins executor threads at
    exit: the process would live on for as long as the database keeps silent. Their work is moot; exit
    with the code the process was about to exit with.
    """
    me = threading.current_thread()
    stuck = [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
    if not stuck:
        return
    error = sys.exc_info()[1]
    if error is None:
        code = 0
    elif isinstance(error, SystemExit):
        code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    else:
        code = 1
    logger.warning("%d thread(s) still wait on the database; exiting without them", len(stuck))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class CommandError(Exception):
    """A command cannot run: :func:`main` prints the message as one line and exits with ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything else starts (uvicorn's workers inherit it).

    Binding here, rather than inside uvicorn, lets a port in use end the command with one line before
    the database is opened, and the "listening" line come only once it is true.

    Raises:
        CommandError: If the address cannot be bound, naming it and the reason.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As uvicorn does: a restart must not wait for the previous process's connections in TIME_WAIT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = "; another process listens there (choose another --port)" if exc.errno == errno.EADDRINUSE else ""
        raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    sock.set_inheritable(True)
    return sock


def _check_backend(settings: Settings) -> None:
    """Open the backend once and close it, so a database that is unreachable, missing or not UTF-8 ends
    ``serve`` with one line (``StorageError``) instead of a traceback from the app's start-up."""
    from reducing_saver.service.storage import open_backend

    open_backend(settings.database, pool_size=1, timeout=settings.db_timeout_seconds).close()


def serve(settings: Settings, flags: dict[str, object] | None = None) -> None:
    """Check the exposure, bind the port, check the database, then run uvicorn on the bound socket.

    Raises:
        CommandError: If the service may not or cannot start (exit 2 for the exposure refusal).
        StorageError: If the database cannot be opened.
    """
    # The commands import what they run only when they run: `--help` stays quick and light.
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from reducing_saver.service import store_config
    from reducing_saver.service.app import create_app
    from reducing_saver.service.observability import configure_logging
    from reducing_saver.service.security import check_exposure

    flags = flags or {}
    configure_logging(settings)

    if refusal := check_exposure(settings):
        raise CommandError(refusal, code=2)
    if refusal := store_config.refusal(settings):
        raise CommandError(refusal)
    sock = _bind(settings.host, settings.port)
    try:
        _check_backend(settings)
    except BaseException:
        sock.close()
        raise
    logger.info(
        "reducing-saver listening on http://%s:%d (backend %s: %s, %d worker(s))",
        settings.host,
        sock.getsockname()[1],
        settings.backend,
        settings.database_for_display(),
        settings.workers,
    )
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_after_shutdown)
    common = {
        "log_level": settings.log_level,
        # Every line goes through the handler configure_logging installed; the middleware logs access.
        "log_config": None,
        "access_log": False,
        "timeout_graceful_shutdown": settings.shutdown_grace_seconds,
        "timeout_keep_alive": settings.keep_alive_seconds,
    }
    if settings.workers == 1:
        server = uvicorn.Server(uvicorn.Config(create_app(settings), **common))
        try:
            server.run(sockets=[sock])
        finally:
            _leave_threads_stuck_on_the_database()
        if not server.started:
            raise CommandError("the service did not start (the log above says why)")
        return
    # Worker processes build their own app: from the environment (and .env) as this process did, plus
    # the flags given here. Nothing else, and no secret, goes into their environment.
    os.environ[FLAGS_ENV] = json.dumps(flags)
    config = uvicorn.Config(
        "reducing_saver.service.app:app_from_env", factory=True, workers=settings.workers, **common
    )
    Multiprocess(config, sockets=[sock]).run()


def worker(settings: Settings) -> None:
    """Deliver until SIGTERM/SIGINT; rows in hand are handed back on the way out.

    The deliverer runs in a thread of its own, so a signal is acted on whatever it waits for: it gets
    ``shutdown_grace_seconds`` to finish the group in hand, then handing back rows and closing the
    database get ``db_timeout_seconds``. A database that does not answer is left behind; the rows come
    back when their lease ends.
    """
    import time

    from reducing_saver.service import store_config
    from reducing_saver.service.extraction.memory import Memory
    from reducing_saver.service.observability import configure_logging
    from reducing_saver.service.state import finish_within
    from reducing_saver.service.storage import open_backend

    configure_logging(settings)
    if refusal := store_config.refusal(settings):
        raise CommandError(refusal)
    stop = threading.Event()
    # Claims, renewals, completions and the store share one small pool.
    backend = open_backend(settings.database, pool_size=WORKER_POOL_SIZE, timeout=settings.db_timeout_seconds)
    backend.store_options = store_config.store_options(settings)
    memory = Memory(settings, backend, tenant_mode=settings.api_key_set is not None)
    deliverer = memory.deliverer_for()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: (stop.set(), deliverer.wake()))
    logger.info(
        "reducing-saver worker %s delivering from %s", deliverer.worker_id, settings.database_for_display()
    )
    deliverer.start()
    while not stop.wait(1.0):
        pass
    deliverer.stop(settings.shutdown_grace_seconds)
    deadline = time.monotonic() + settings.db_timeout_seconds

    def close() -> None:
        memory.close(0)
        backend.close(timeout=max(deadline - time.monotonic(), 0.0))

    if finish_within(deadline, "handing back rows and closing the database", close):
        logger.info("worker %s stopped", deliverer.worker_id)
    _leave_threads_stuck_on_the_database()


def extraction(settings: Settings, action: str) -> None:
    from reducing_saver.service.storage import open_backend

    backend = open_backend(settings.database, pool_size=1, timeout=settings.db_timeout_seconds, create=False)
    try:
        outbox = backend.outbox()
        if action == "status":
            print(json.dumps(outbox.status()))
        else:
            print(json.dumps({"requeued": outbox.retry_dead()}))
    finally:
        backend.close()


def sweep(settings: Settings, *, dry_run: bool) -> int:
    """One TTL sweep; prints its report as JSON. Exit 1 when a thread failed (the next sweep retries it)."""
    from reducing_saver.service.observability import configure_logging
    from reducing_saver.service.storage import open_backend
    from reducing_saver.service.ttl.sweeper import open_sweeper

    configure_logging(settings)
    if settings.backend == "memory":
        print("reducing-saver: memory:// keeps its threads inside the service process: nothing to sweep", file=sys.stderr)
        return 2
    backend = open_backend(settings.database, pool_size=2, timeout=settings.db_timeout_seconds, create=False)
    try:
        # Deleted threads' windows go to the outbox (PostgreSQL: in the sweep's own transaction); the
        # service or a worker delivers them.
        outbox = None if dry_run else backend.outbox()
        tenant_mode = settings.api_key_set is not None
        sweeper = open_sweeper(settings, backend, outbox=outbox, tenant_mode=tenant_mode)
        try:
            report = sweeper.sweep(dry_run=dry_run)
        finally:
            sweeper.close()
    finally:
        backend.close()
    print(json.dumps(report.as_dict()))
    return 1 if report.errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings(args)
    except ValidationError as error:
        print(f"reducing-saver: {_describe(error)}", file=sys.stderr)
        return 2
    try:
        if args.command == "serve":
            serve(settings, flag_overrides(args))
        elif args.command == "worker":
            worker(settings)
        elif args.command == "sweep":
            return sweep(settings, dry_run=args.dry_run)
        else:
            extraction(settings, args.action)
    except CommandError as error:
        print(f"reducing-saver: {error}", file=sys.stderr)
        return error.code
    except StorageError as error:  # unreachable, missing or unfit database: one line, no traceback
        print(f"reducing-saver: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
