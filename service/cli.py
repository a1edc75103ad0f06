"""The ``reducing-saver`` command line."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, NoReturn, get_args, get_origin

from pydantic import ValidationError

from reducing_saver.service.configuration.flags import (
    ALL_FLAGS,
    ENCRYPT_SWEEP_FLAGS,
    EXTRACTION_FLAGS,
    MIGRATE_FLAGS,
    REPORT_FLAGS,
    SERVE_FLAGS,
    SWEEP_FLAGS,
    WORKER_FLAGS,
)
from reducing_saver.service.configuration.settings import FLAGS_ENV, KEYS_FOLDER_ENV, Settings
from reducing_saver.service.exits import leave_threads_stuck_on_the_database
from reducing_saver.service.security.environ import blank_initial_value
from reducing_saver.service.storage import StorageError

if TYPE_CHECKING:
    from reducing_saver.service.processes import ServerOptions

ENV_PREFIX = "REDUCING_SAVER_"
#: The key ring's variable: JSON, or the path of a file holding it.
ENCRYPTION_KEYS_ENV = ENV_PREFIX + "ENCRYPTION_KEYS"
#: Where a ``--workers`` run keeps that folder: ``reducing-saver-<supervisor pid>-<random>``.
_KEYS_FOLDER_PREFIX = "reducing-saver-"

#: Passes of ``encrypt-sweep`` at most, while rows are left (changed concurrently meanwhile).
ENCRYPT_SWEEP_PASSES = 5

logger = logging.getLogger("reducing_saver.service")

#: PostgreSQL connections of a ``reducing-saver worker``: claims and renewals, and the store.
WORKER_POOL_SIZE = 4


def _version() -> str:
    from reducing_saver.service.version import __version__

    return __version__


def _help(field: str) -> str:
    info = Settings.model_fields[field]
    default = info.get_default(call_default_factory=True)
    shown = ",".join(default) if isinstance(default, list) else default
    return f"{info.description} [env {ENV_PREFIX}{field.upper()}; default: {shown}]"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line saying where the help is (serve's usage alone is
    thirty lines, which buried the one that matters)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="reducing-saver",
        description="A LangGraph checkpoint service that keeps every stored checkpoint to a window of messages.",
    )
    parser.add_argument("--version", action="version", version=f"reducing-saver {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        usage="reducing-saver serve [OPTIONS]",
        help="run the HTTP service",
        description="Run the HTTP service. Every option can also be set by its environment variable "
        f"({ENV_PREFIX}<NAME>) or in a .env file; options given here win.",
    )
    _add_flags(serve, SERVE_FLAGS)
    worker = commands.add_parser(
        "worker",
        usage="reducing-saver worker [OPTIONS]",
        help="deliver pruned messages to long-term memory (no HTTP)",
        description="Claim pruned messages from the service database's outbox and hand them to the "
        "extractor until SIGTERM or SIGINT. Run any number of these; each message is delivered once. "
        "Serve with --no-extract when only workers should deliver.",
    )
    _add_flags(worker, WORKER_FLAGS)
    migrate_parser = commands.add_parser(
        "migrate",
        help="bring the database's tables up to date, then exit",
        description="Apply the migrations the database lacks (the service's own tables, then langgraph's "
        "checkpoint and store tables), each once, and print each one applied, or that the schema is "
        "current. Safe while services start or run on the same database. Serve and worker do the same "
        "at start unless given --no-migrate. A database migrated by a later reducing-saver is refused.",
    )
    _add_flags(migrate_parser, MIGRATE_FLAGS)
    extraction = commands.add_parser("extraction", help="inspect or re-drive the extraction outbox")
    actions = extraction.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (
        (
            "status",
            "print pending, in flight, delivered, dead-lettered and the oldest pending age, and the "
            "running summaries' (JSON)",
        ),
        ("retry-dead", "put every dead letter back in the queue (summary batches included)"),
    ):
        _add_flags(actions.add_parser(action, help=text, description=text), EXTRACTION_FLAGS)
    sweep_parser = commands.add_parser(
        "sweep",
        usage="reducing-saver sweep [OPTIONS]",
        help="apply the TTL strategy to expired threads once (for cron)",
        description="Prune (keep_latest) or delete every thread idle for longer than its TTL, and delete "
        "delivered outbox rows older than --outbox-retention, once, and print what was done as JSON. Safe "
        "while services sweep the same database.",
    )
    _add_flags(sweep_parser, SWEEP_FLAGS)
    sweep_parser.add_argument(
        "--dry-run",
        action="store_true",
        help="change nothing; print the expired threads and the bytes each would free",
    )
    report_parser = commands.add_parser(
        "report",
        help="print the largest threads' storage, saved against a plain saver; optionally a PNG chart",
        description="Measure every thread's storage in the database (checkpoints, blobs, writes, outbox and "
        "store) and print a table of the largest: thread, tenant, checkpoints kept, bytes now, the bytes a "
        "plain add_messages saver would hold (estimate; see docs/storage.md) and the ratio. Reads the "
        "database directly; safe while services use it. With API keys configured (REDUCING_SAVER_API_KEYS "
        "or --api-keys-file), threads are shown with their tenant.",
    )
    _add_flags(report_parser, REPORT_FLAGS)
    report_parser.add_argument(
        "--top",
        type=_positive,
        default=20,
        metavar="N",
        help="how many of the largest threads to show (default 20)",
    )
    report_parser.add_argument(
        "--png",
        metavar="PATH",
        help="also write a bar chart of those threads, bytes now against plain (needs matplotlib: the report "
        "extra)",
    )
    encrypt_sweep_parser = commands.add_parser(
        "encrypt-sweep",
        help="encrypt plain rows and re-encrypt rows under an old key (PostgreSQL, SQLite)",
        description="Rewrite every plain row, and every row encrypted under a key other than the primary, "
        "as ciphertext under the primary key of REDUCING_SAVER_ENCRYPTION_KEYS, by compare-and-set (safe "
        "while services write and sweep the same database), until none is left; print rows per key id as "
        "JSON. Exit 1 when rows are left.",
    )
    _add_flags(encrypt_sweep_parser, ENCRYPT_SWEEP_FLAGS)
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of threads, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 thread, got {value}")
    return value


#: The heading and description of each group of settings in ``--help``, by the class of ``Settings``
#: declaring them, in the order ``--help`` shows them.
HELP_GROUPS: dict[str, tuple[str, str]] = {
    "ServerSettings": ("server", "the database, the address, processes and logs"),
    "PostgresSettings": ("PostgreSQL connections", "poolers, failover, idle connections"),
    "ReducerSettings": ("window", "what every stored checkpoint keeps of the messages channel"),
    "SecuritySettings": ("security", "API keys, exposure, encryption at rest, code in stored values"),
    "Limits": ("limits", "caps on what one request may carry"),
    "ExtractionSettings": ("long-term memory", "delivering the messages cut from windows to the store"),
    "SummarySettings": ("running summaries", "a summary of what windows cut, kept in them"),
    "SweepSettings": ("TTL sweeps", "what happens to threads left idle"),
    "HistorySettings": ("history", "the checkpoints each thread keeps"),
    "StoreSettings": ("store", "semantic search and item TTLs"),
}
#: Metavars shorter than the field's name, so that most options and their help share a line.
_METAVARS = {
    "database": "URL",
    "host": "ADDRESS",
    "api_keys_file": "PATH",
    "store_index": "JSON",
    "store_ttl": "JSON",
}


def _metavar(field: str) -> str:
    if field in _METAVARS:
        return _METAVARS[field]
    annotation = Settings.model_fields[field].annotation
    if field.endswith(("_seconds", "_interval", "_retention", "_ttl")):
        return "DURATION" if field.endswith(("_interval", "_retention", "_ttl")) else "SECONDS"
    if annotation in (int, float, int | None, float | None):
        return "N"
    if "on_prune" in field or field in ("extractor", "summarizer"):
        return "SPEC"
    return field.upper()


def settings_group(field: str) -> type:
    """The class of ``Settings`` that declares ``field`` (its group in ``--help`` and the reference)."""
    for cls in reversed(Settings.__mro__):
        if field in vars(cls).get("__annotations__", {}):
            return cls
    raise KeyError(field)


def _add_flags(parser: argparse.ArgumentParser, flags: dict[str, str]) -> None:
    """Add each flag, under its group's heading (:data:`HELP_GROUPS`) when they span several groups, as
    uvicorn's and gunicorn's ``--help`` are grouped."""
    groups = {settings_group(field).__name__ for field in flags.values()}
    headings: dict[str, argparse._ArgumentGroup] = {}
    if len(groups) > 1:
        for name in sorted(groups, key=lambda name: [*HELP_GROUPS, name].index(name)):
            title, description = HELP_GROUPS.get(name, (name, ""))
            headings[name] = parser.add_argument_group(f"{title} ({description})" if description else title)
    for flag, field in flags.items():
        target = headings.get(settings_group(field).__name__, parser)
        annotation = Settings.model_fields[field].annotation
        if annotation is bool:
            target.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction, help=_help(field))
        elif get_origin(annotation) is Literal:
            # --help lists the values, and a wrong one is refused before any setting is read.
            target.add_argument(flag, dest=field, choices=get_args(annotation), help=_help(field))
        else:
            target.add_argument(flag, dest=field, metavar=_metavar(field), help=_help(field))


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags on the command line (as argparse read them; ``Settings`` checks them)."""
    return {
        field: getattr(args, field) for field in ALL_FLAGS.values() if getattr(args, field, None) is not None
    }


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
            found = {
                name: match.start()
                for name in Settings.model_fields
                if (match := re.search(rf"\b{name}\b", message)) is not None
            }
            involved = sorted(found, key=found.__getitem__)
        where = ", ".join(_where(name) for name in involved) or "settings"
        shown = ""
        if field and "keys" not in field:
            value = item.get("input")
            if repr(value) not in message and str(value) not in message:
                shown = f" (got {value!r})"
        lines.append(f"  {where}: {message}{shown}")
    return "invalid settings:\n" + "\n".join(lines)


def _exit_after_shutdown(signum: int, frame: object) -> None:
    # uvicorn re-raises SIGTERM once it has shut down gracefully; exit 0 instead of dying by the signal.
    raise SystemExit(0)


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
        hint = (
            "; another process listens there (choose another --port)" if exc.errno == errno.EADDRINUSE else ""
        )
        raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    sock.set_inheritable(True)
    return sock


def _check_backend(settings: Settings) -> None:
    """Open the backend once, migrate it (or, with ``--no-migrate``, check that it needs no migration)
    and close it, so a database that is unreachable, missing, not UTF-8, behind or too new ends ``serve``
    with one line (``StorageError``) instead of a traceback from the app's start-up, and worker processes
    find the tables current."""
    from reducing_saver.service.configuration import store as store_config
    from reducing_saver.service.storage import open_backend
    from reducing_saver.service.storage.migrations import summarized

    backend = open_backend(
        settings.database,
        pool_size=1,
        timeout=settings.db_timeout_seconds,
        migrate=settings.migrate,
        postgres=settings.postgres,
        store_options=store_config.store_options(settings),
    )
    try:
        if settings.migrate:
            applied = backend.migrate()
            for line in applied:
                logger.debug("%s", line)
            logger.info("%s", summarized(applied, settings.database_for_display()))
        else:
            backend.check_schema()
    finally:
        backend.close()


def _check_code(settings: Settings) -> None:
    """Refuse to start when a ``module:attribute`` setting (``--extractor``, ``--on-prune``,
    ``--summarizer``) names nothing usable: one line saying what is missing (the store's ``embed`` is
    :func:`~reducing_saver.service.configuration.store.refusal`'s)."""
    from reducing_saver.service.imports import ResolveError, import_callable

    try:
        if settings.extractor:
            import_callable(settings.extractor, "--extractor")
        for hook in settings.on_prune:
            import_callable(hook, "--on-prune")
    except ResolveError as exc:
        raise CommandError(str(exc), code=2) from None
    if not settings.summarizer:
        return
    from reducing_saver.service.summaries.summarizer import SummarizerError, load_summarizer

    try:
        load_summarizer(
            settings.summarizer,
            max_input_tokens=settings.summary_max_input_tokens,
            max_tokens=settings.summary_max_tokens,
        )
    except SummarizerError as exc:
        raise CommandError(str(exc), code=2) from None


def startup_line(settings: Settings) -> str:
    """What a service runs with, in one line: the backend, the window, encryption, the summarizer and the
    checkpoints each thread keeps."""
    config = settings.reducer_config()
    limits = []
    if config.max_messages is not None:
        cut = f", cut to {config.count_target}" if config.count_target != config.max_messages else ""
        limits.append(f"{config.max_messages} messages{cut}")
    if config.max_tokens is not None:
        cut = f", cut to {config.token_target}" if config.token_target != config.max_tokens else ""
        limits.append(f"{config.max_tokens} tokens{cut}")
    window = " or ".join(limits) or "unbounded"
    keep = (
        settings.keep_checkpoints if settings.keep_checkpoints is not None else "off (every checkpoint kept)"
    )
    return (
        f"reducing-saver {_version()}: backend {settings.backend} ({settings.database_for_display()}), "
        f"window {window}, encryption {settings.encryption}, summarizer {settings.summarizer or 'off'}, "
        f"keep-checkpoints {keep}"
    )


def serve(settings: Settings, flags: dict[str, object] | None = None) -> None:
    """Check the exposure, bind the port, check the database, then run uvicorn on the bound socket.

    Raises:
        CommandError: If the service may not or cannot start (exit 2 for the exposure refusal).
        StorageError: If the database cannot be opened.
    """
    # The commands import what they run only when they run: `--help` stays quick and light.
    import uvicorn

    from reducing_saver.service.configuration import store as store_config
    from reducing_saver.service.http.app import create_app
    from reducing_saver.service.http.observability import configure_logging
    from reducing_saver.service.security import check_exposure

    flags = flags or {}
    configure_logging(settings)

    if refusal := check_exposure(settings):
        raise CommandError(refusal, code=2)
    if refusal := store_config.refusal(settings):
        raise CommandError(refusal, code=2)
    _check_code(settings)
    sock = _bind(settings.host, settings.port)
    try:
        _check_backend(settings)
    except BaseException:
        sock.close()
        raise
    logger.info("%s", startup_line(settings))
    logger.info(
        "reducing-saver listening on http://%s:%d (%d worker%s)",
        settings.host,
        sock.getsockname()[1],
        settings.workers,
        "" if settings.workers == 1 else "s",
    )
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_after_shutdown)
    common: ServerOptions = {
        "log_level": settings.log_level,
        # Every line goes through the handler configure_logging installed; the middleware logs access.
        "log_config": None,
        "access_log": False,
        "timeout_graceful_shutdown": settings.shutdown_grace_seconds,
        "timeout_keep_alive": settings.keep_alive_seconds,
    }
    if settings.workers == 1:
        # Read once (settings.keyring): nothing this process starts inherits the key ring, and
        # /proc/<pid>/environ shows its value blanked (security/environ.py says what cannot be).
        if os.environ.pop(ENCRYPTION_KEYS_ENV, "").strip().startswith("{"):
            blank_initial_value(ENCRYPTION_KEYS_ENV)
        app = create_app(settings)
        server = uvicorn.Server(
            uvicorn.Config(app, **common)  # type: ignore[arg-type]  # uvicorn annotates its timeouts int; asyncio's timers take fractions
        )
        try:
            server.run(sockets=[sock])
        except SystemExit:  # uvicorn's exit when the app's start-up failed
            if app.refusal is None:
                raise
        finally:
            leave_threads_stuck_on_the_database()
        if not server.started:
            # A database found unfit at the app's start (after the check above passed) is one line too.
            raise CommandError(app.refusal or "the service did not start (the log above says why)")
        return
    # Worker processes build their own app: from the environment (and .env) as this process did, plus
    # the flags given here. Nothing else, and no secret, goes into their environment: a key ring given
    # as JSON reaches them as a file only this user can read, removed when the service stops (or, when
    # this process is killed, by its workers as they stop, else at the next start).
    from reducing_saver.service.processes import run_workers

    os.environ[FLAGS_ENV] = json.dumps(flags)
    with _encryption_keys_as_file():
        run_workers(settings, common, [sock])


@contextlib.contextmanager
def _encryption_keys_as_file() -> Iterator[None]:
    """While it lasts, ``REDUCING_SAVER_ENCRYPTION_KEYS`` holding JSON is replaced in this process's
    environment (which workers inherit) by the path of a file holding it: mode 0600, in a private folder
    (in memory under /dev/shm where there is one) named after this process, whose path the workers also
    get (``KEYS_FOLDER_ENV``); the value is blanked in this process's ``/proc/<pid>/environ``. Folders of
    runs whose process is gone (killed, so nothing removed them) are removed first."""
    text = os.environ.get(ENCRYPTION_KEYS_ENV, "")
    if not text.strip().startswith("{"):  # unset, or already a path
        yield
        return
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    _remove_abandoned_key_folders(base)
    folder = tempfile.mkdtemp(prefix=f"{_KEYS_FOLDER_PREFIX}{os.getpid()}-", dir=base)
    path = os.path.join(folder, "encryption-keys.json")
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
        os.environ[ENCRYPTION_KEYS_ENV] = path
        os.environ[KEYS_FOLDER_ENV] = folder
        blank_initial_value(ENCRYPTION_KEYS_ENV)
        yield
    finally:
        os.environ.pop(KEYS_FOLDER_ENV, None)
        os.environ[ENCRYPTION_KEYS_ENV] = text
        shutil.rmtree(folder, ignore_errors=True)


def _remove_abandoned_key_folders(base: str) -> None:
    """Remove this user's key folders (``reducing-saver-<pid>-*``) whose process no longer runs."""
    try:
        entries = list(os.scandir(base))
    except OSError:
        return
    for entry in entries:
        match = re.fullmatch(re.escape(_KEYS_FOLDER_PREFIX) + r"(\d+)-\w+", entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            os.kill(int(match[1]), 0)
        except ProcessLookupError:
            logger.info("removing %s, the key folder of a run that was killed", entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)
        except (OSError, OverflowError):  # a live process of another user, or a pid beyond the platform's
            continue


def worker(settings: Settings) -> None:
    """Deliver until SIGTERM/SIGINT; rows in hand are handed back on the way out.

    The deliverer runs in a thread of its own, so a signal is acted on whatever it waits for: it gets
    ``shutdown_grace_seconds`` to finish the group in hand, then handing back rows and closing the
    database get ``db_timeout_seconds``. A database that does not answer is left behind; the rows come
    back when their lease ends.
    """
    from reducing_saver.service.configuration import store as store_config
    from reducing_saver.service.extraction.recorder import Memory
    from reducing_saver.service.http.observability import configure_logging
    from reducing_saver.service.state import finish_within
    from reducing_saver.service.storage import open_backend

    configure_logging(settings)
    if refusal := store_config.refusal(settings):
        raise CommandError(refusal, code=2)
    _check_code(settings)
    stop = threading.Event()
    # Claims, renewals, completions and the store share one small pool.
    backend = open_backend(
        settings.database,
        pool_size=WORKER_POOL_SIZE,
        timeout=settings.db_timeout_seconds,
        migrate=settings.migrate,
        postgres=settings.postgres,
        store_options=store_config.store_options(settings),
    )
    try:
        backend.setup()
    except BaseException:
        backend.close()
        raise
    memory = Memory(settings, backend, tenant_mode=settings.api_key_set is not None)
    deliverer = memory.deliverer_for()
    running = None
    if settings.summarizer:
        from reducing_saver.service.summaries.setup import RunningSummaries

        running = RunningSummaries(
            settings, backend, wrap=None, registry=None, tenant_mode=settings.api_key_set is not None
        )

    def stop_delivering(signum: int, frame: object) -> None:
        stop.set()
        deliverer.wake()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop_delivering)
    logger.info(
        "reducing-saver worker %s delivering from %s", deliverer.worker_id, settings.database_for_display()
    )
    deliverer.start()
    if running is not None:
        running.start()
    while not stop.wait(1.0):
        pass
    if running is not None:
        running.close(settings.shutdown_grace_seconds)
    deliverer.stop(settings.shutdown_grace_seconds)
    deadline = time.monotonic() + settings.db_timeout_seconds

    def close() -> None:
        memory.close(0)
        backend.close(timeout=max(deadline - time.monotonic(), 0.0))

    if finish_within(deadline, "handing back rows and closing the database", close):
        logger.info("worker %s stopped", deliverer.worker_id)
    leave_threads_stuck_on_the_database()


def migrate(settings: Settings) -> None:
    """Apply the migrations the database lacks; print each one applied, or that the schema is current."""
    from reducing_saver.service.configuration import store as store_config
    from reducing_saver.service.storage import open_backend

    if settings.backend == "memory":
        print("reducing-saver: memory:// keeps its tables inside the service process: nothing to migrate")
        return
    if refusal := store_config.refusal(settings):
        raise CommandError(refusal, code=2)
    backend = open_backend(
        settings.database,
        pool_size=1,
        timeout=settings.db_timeout_seconds,
        postgres=settings.postgres,
        store_options=store_config.store_options(settings),
    )
    try:
        applied = backend.migrate()
    finally:
        backend.close()
    for line in applied:
        print(line)
    if not applied:
        print(f"the schema of {settings.database_for_display()} is current")


def extraction(settings: Settings, action: str) -> None:
    from reducing_saver.service.storage import open_backend

    backend = open_backend(
        settings.database,
        pool_size=1,
        timeout=settings.db_timeout_seconds,
        create=False,
        migrate=settings.migrate,
        postgres=settings.postgres,
    )
    try:
        outbox = backend.outbox()
        book = backend.summaries()
        if action == "status":
            print(json.dumps({**outbox.status(), "summaries": book.status()}))
        else:
            print(json.dumps({"requeued": outbox.retry_dead(), "summary_steps_requeued": book.retry_dead()}))
    finally:
        backend.close()


def sweep(settings: Settings, *, dry_run: bool) -> int:
    """One TTL sweep; prints its report as JSON. Exit 1 when a thread failed (the next sweep retries it)."""
    from reducing_saver.service.http.observability import configure_logging
    from reducing_saver.service.storage import open_backend
    from reducing_saver.service.ttl.sweeper import open_sweeper

    configure_logging(settings)
    if settings.backend == "memory":
        print(
            "reducing-saver: memory:// keeps its threads inside the service process: nothing to sweep",
            file=sys.stderr,
        )
        return 2
    backend = open_backend(
        settings.database,
        pool_size=2,
        timeout=settings.db_timeout_seconds,
        create=False,
        migrate=settings.migrate,
        postgres=settings.postgres,
    )
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


def report(settings: Settings, *, top: int, png: str | None) -> int:
    """Print the largest threads' storage; with ``png``, write the chart too."""
    from reducing_saver.service.storage import open_backend
    from reducing_saver.service.storage import report as storage_report
    from reducing_saver.service.storage.usage import Selection

    if settings.backend == "memory":
        print(
            "reducing-saver: memory:// keeps its threads inside the service process: nothing to report",
            file=sys.stderr,
        )
        return 2
    if png is not None:
        try:
            import matplotlib  # noqa: F401  (an optional dependency: checked before any work)
        except ImportError:
            raise CommandError(storage_report.NO_MATPLOTLIB) from None
    backend = open_backend(
        settings.database,
        pool_size=1,
        timeout=settings.db_timeout_seconds,
        create=False,
        postgres=settings.postgres,
    )
    try:
        backend.refuse_newer_schema()  # a later release's tables may mean something else
        selection = Selection(tenant_mode=settings.api_key_set is not None)
        threads = backend.storage(selection, messages_key=settings.messages_key)
    finally:
        backend.close()
    print(storage_report.table(threads, top))
    if png is not None:
        storage_report.chart(threads[:top], png)
        print(f"chart written to {png}")
    return 0


def encrypt_sweep(settings: Settings) -> int:
    """Passes of the encryption sweep until no row is left behind; prints the last report as JSON."""
    from reducing_saver.service.encryption import Cipher, Sealer
    from reducing_saver.service.encryption.sweep import encrypt_sweep_of
    from reducing_saver.service.http.observability import configure_logging
    from reducing_saver.service.storage import open_backend

    configure_logging(settings)
    if settings.keyring is None:
        raise CommandError("encrypt-sweep needs the key ring: set REDUCING_SAVER_ENCRYPTION_KEYS", code=2)
    if settings.backend == "memory":
        raise CommandError(
            "encrypt-sweep rewrites PostgreSQL and SQLite databases; memory:// keeps nothing beyond the "
            "service process (start the service with --encryption required instead)",
            code=2,
        )
    backend = open_backend(
        settings.database,
        pool_size=1,
        timeout=settings.db_timeout_seconds,
        create=False,
        postgres=settings.postgres,
    )
    # Reads plain and sealed rows whatever --encryption says: rewriting them is its purpose.
    sealer = Sealer(Cipher(settings.keyring), "migrate", tenant_mode=settings.api_key_set is not None)
    try:
        # It rewrites every table it knows, so they must be exactly the ones this release knows.
        backend.check_schema("encrypt-sweep changes no table's schema")
        sweep = encrypt_sweep_of(backend, sealer)
        for _ in range(ENCRYPT_SWEEP_PASSES):
            report = sweep.run()
            if not report.remaining or report.errors:
                break
    finally:
        backend.close()
    print(json.dumps(report.as_dict()))
    return 1 if report.remaining else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # module:attribute settings find modules of the working folder, as uvicorn's --app-dir (default .).
    from reducing_saver.service.imports import working_folder_importable

    working_folder_importable()
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
        elif args.command == "report":
            return report(settings, top=args.top, png=args.png)
        elif args.command == "migrate":
            migrate(settings)
        elif args.command == "encrypt-sweep":
            return encrypt_sweep(settings)
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
