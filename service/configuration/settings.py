"""The service's settings: one class, read from CLI flags, ``REDUCING_SAVER_*`` variables and ``.env``.

The fields come in groups, one model each, each field (and its default) written once: server,
reducer, security, limits, extraction, sweeps, history and the store. :class:`Settings` joins them,
validates across them, and parses the API keys once (``api_key_set``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from reducing_saver.reducer import PruneHook, ReducerConfig
from reducing_saver.service.security.extensions import ANY_CLASS, ExtensionPolicy
from reducing_saver.service.security.keys import ApiKeys, load_api_keys, load_metrics_keys

if TYPE_CHECKING:
    from reducing_saver.service.encryption import KeyRing
from reducing_saver.service.security.limits import Limits as LimitSettings
from reducing_saver.service.storage import PostgresSettings, backend_kind, redact_url, sqlite_path
from reducing_saver.service.storage.lifecycle import MAX_KEEP_CHECKPOINTS
from reducing_saver.service.ttl.durations import parse_duration

DEFAULT_DATABASE = "sqlite:///reducing-saver.sqlite"

#: The flags given to ``serve``, for its worker processes (JSON); the environment and ``.env`` they read
#: themselves. Never a secret: no flag takes a key.
FLAGS_ENV = "REDUCING_SAVER_SERVE_FLAGS"
#: The private folder holding the key ring's file of a ``--workers`` run, in the workers' environment (a
#: worker whose supervisor is gone removes it: ``processes``).
KEYS_FOLDER_ENV = "REDUCING_SAVER_KEYS_FOLDER"


class ServerSettings(BaseModel):
    """Where the service listens, how many processes it runs, and how it logs."""

    database: str = Field(
        DEFAULT_DATABASE,
        description="Where checkpoints live: postgresql://user:pass@host:port/db (an existing UTF8 "
        "database; several hosts, postgresql://user:pass@h1:5432,h2:5432/db, for a primary and its standbys: "
        "the service connects to the one that accepts writes, target_session_attrs=read-write unless the URL "
        "says otherwise), sqlite:///path/to/file (relative to the working folder; serve and worker create a "
        "missing file and folder, other commands do not) or memory:// (tests only).",
    )
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8080, ge=0, le=65535, description="Port to listen on.")
    workers: int = Field(
        1, ge=1, description="uvicorn worker processes (every scrape of /metrics adds up all of them)."
    )
    pool_size: int = Field(
        4,
        ge=1,
        description="PostgreSQL connections per worker process, shared by saver calls, recording pruned "
        "messages, delivery and sweeps (give a process that delivers at least 2).",
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Largest request body accepted.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["auto", "json", "text"] = Field(
        "auto",
        description="Log lines as JSON objects (one per line) or as text; auto: text on a terminal, JSON "
        "otherwise (a container's or a process manager's log).",
    )
    shutdown_grace_seconds: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, how long in-flight requests may run before they are cancelled; closing "
        "the database then takes at most db_timeout_seconds, even when it does not answer.",
    )
    keep_alive_seconds: float = Field(
        75.0,
        gt=0,
        description="How long an idle client connection is kept open. Longer than clients keep theirs "
        "(RemoteReducingSaver's async client: 15 s) and than a load balancer's idle timeout (often 60 s), "
        "so that the client, not the service, closes an idle connection and no call goes out on a "
        "connection the service has just closed.",
    )
    migrate: bool = Field(
        True,
        description="At start, apply the migrations the database lacks (the service's own tables, then "
        "langgraph's checkpoint and store tables), each once, under a lock replicas share. With "
        "--no-migrate the process changes no table and refuses to start on a database that is behind: "
        "run `reducing-saver migrate` first (a deploy job, say).",
    )
    db_timeout_seconds: float = Field(
        5.0,
        gt=0,
        description="How long a request waits for a free saver or database connection, or for an answer to "
        "a probe or status query, before it is answered 503 (the database is unavailable); also how long "
        "one connection attempt may take (at least 2 s) and how long closing the database may take on "
        "shutdown.",
    )
    latest_cache_threads: int = Field(
        1000,
        ge=0,
        description="PostgreSQL: how many threads' latest checkpoints each worker process keeps in memory "
        "(least recently used dropped first; an entry above 64 KiB of values is not kept) to answer a run's "
        "first read of its thread after one cheap query proves the database still holds exactly those rows; "
        "0 reads every latest checkpoint from the database (docs/storage.md).",
    )
    storage_refresh_seconds: float = Field(
        60.0,
        ge=0,
        description="How often a background thread measures every thread's storage for the "
        "reducing_saver_storage_* metrics (one pass over the checkpoint, outbox and store tables; /metrics "
        "answers from the last pass); 0 turns the measuring and those metrics off.",
    )


class ReducerSettings(BaseModel):
    """How the messages channel is reduced (``ReducerConfig``)."""

    max_messages: int | None = Field(20, ge=1, description="Reduce a messages list longer than this.")
    min_messages: int | None = Field(
        None, ge=1, description="Reduce down to this many messages (default: max_messages)."
    )
    max_tokens: int | None = Field(None, ge=1, description="Reduce a messages list over this many tokens.")
    target_tokens: int | None = Field(None, ge=1, description="Reduce down to this many tokens.")
    preserve_first: bool = Field(
        True, description="Never prune the leading system messages, nor a summary message right after them."
    )
    start_on_human: bool = Field(True, description="Kept windows start on a human message.")
    messages_key: str = Field("messages", description="The channel holding the messages list.")
    namespace_key: str = Field(
        "memory_namespace", description="config['configurable'] key naming a run's memory namespace."
    )
    allowed_message_classes: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Extra message classes the service accepts in the messages channel, as "
        "comma-separated module:Class names (LangChain's own message classes are always accepted).",
    )
    on_prune: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hooks called with (pruned messages as dicts, namespace) after a prune, as "
        "comma-separated module:callable import paths.",
    )


class SecuritySettings(BaseModel):
    """API keys, tenants and exposure (``service/security/``)."""

    api_keys: SecretStr | None = Field(
        None,
        description="API keys as comma-separated tenant=key pairs (development; prefer api_keys_file). "
        "With any key configured every route but the probes and the API description (docs_public) needs "
        "`Authorization: Bearer <key>`, and each tenant sees only its own threads.",
    )
    api_keys_file: str | None = Field(
        None, description="File of API keys: one `tenant sha256-hex-of-key` per line (# comments allowed)."
    )
    insecure: bool = Field(
        False, description="Allow listening on a non-loopback address with no API key configured."
    )
    metrics_key: SecretStr | None = Field(
        None,
        description="The key the metrics scraper sends to /metrics (`Authorization: Bearer <key>` or "
        "`x-api-key`); development, prefer metrics_key_file. /metrics shows every tenant's figures, so no "
        "tenant's API key reads it (403).",
    )
    metrics_key_file: str | None = Field(
        None,
        description="File of the metrics scraper's keys, one sha256-hex per line (# comments allowed; "
        "several for a rotation): /metrics answers those keys only.",
    )
    metrics_public: bool = Field(
        False,
        description="Serve /metrics without any key. It shows every tenant's figures: only where nobody but "
        "the scraper reaches the port.",
    )
    docs_public: bool = Field(
        True,
        description="Serve the API description (/docs, /redoc, /openapi.json and the pages' assets) "
        "without an API key: it describes routes and bodies, never stored data. Off: it needs a key like "
        "other routes.",
    )
    encryption: Literal["off", "migrate", "required"] = Field(
        "off",
        description="Encryption at rest (docs/encryption.md): off stores plain values; migrate reads plain "
        "and encrypted rows and writes only encrypted ones (reducing-saver encrypt-sweep rewrites the rest); "
        "required writes only encrypted rows and refuses to read a plain one. Keys: "
        "REDUCING_SAVER_ENCRYPTION_KEYS.",
    )
    encryption_keys: SecretStr | None = Field(
        None,
        description='The encryption key ring as JSON {"primary": "<key id>", "keys": {"<key id>": "<base64 '
        'of 32 bytes>"}}, or the path of a file holding it (a mounted secret). Environment or .env only: '
        "no flag carries a key.",
    )
    allowed_state_types: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [ANY_CLASS],
        description="What msgpack extensions in stored channel values and pending writes may name, besides "
        "LangGraph's safe types and the accepted message classes, as comma-separated entries: module:Class, "
        "module (and its submodules), or * for any class-named type outside the standard library that its "
        "module defines (read from its source, never imported; a module the service lacks cannot be read, "
        "so * accepts its class names: only a list without * keeps every stock reader safe from them).",
    )


class ExtractionSettings(BaseModel):
    """Delivery of pruned messages to long-term memory (``service/extraction/``)."""

    extract: bool = Field(
        True,
        description="Deliver pruned messages to long-term memory from this process (turn off when "
        "`reducing-saver worker` processes deliver instead).",
    )
    extractor: str | None = Field(
        None,
        description="module:callable called as (messages, namespace, store) for each namespace's pruned "
        "messages; default: write each message into the store under its namespace.",
    )
    remember_removed: Literal["trimmed", "all", "none"] = Field(
        "trimmed",
        description="Which messages the agent removes from its own state reach long-term memory: trimmed "
        "(those removed from the oldest end, by RemoveMessage or REMOVE_ALL_MESSAGES and a summary, as the "
        "window's cut; a RemoveMessage of a newer message is a deliberate deletion: never remembered, and "
        "removed from memory if it was), all (every removal is remembered), none (no removal is; "
        "deletions are still removed from memory). docs/memory.md.",
    )
    extraction_batch_size: int = Field(100, ge=1, description="Outbox rows a deliverer claims at a time.")
    extraction_lease_seconds: float = Field(
        30.0,
        gt=0,
        description="How long a claim lasts without renewal (a crashed worker's rows return after it).",
    )
    extraction_max_attempts: int = Field(
        8, ge=1, description="Attempts per message before it becomes a dead letter."
    )
    extraction_base_backoff: float = Field(
        1.0, ge=0, description="Seconds before the first retry (doubles, with jitter)."
    )
    extraction_max_backoff: float = Field(300.0, ge=0, description="Longest wait between attempts.")
    extraction_idle_seconds: float = Field(
        1.0, gt=0, description="How long a deliverer sleeps when the outbox is empty."
    )
    outbox_retention: float = Field(  # type: ignore[assignment]  # pydantic types a default as the value; validate_default parses it
        "7d",
        description="How long delivered outbox rows are kept before a TTL sweep (each sweep of this "
        "process, and reducing-saver sweep) deletes them: seconds or 90s, 15m, 2h, 7d. A message pruned "
        "again after its row is gone is extracted again.",
    )
    extraction_linger_seconds: float = Field(
        0.25,
        ge=0,
        description="How long a deliverer woken by new rows waits for more before claiming: batches the "
        "pruned messages of many puts into one store write (0: deliver each put's rows at once).",
    )


class SummarySettings(BaseModel):
    """Running summaries of what windows cut (``service/summaries/``, docs/summaries.md)."""

    summarizer: str | None = Field(
        None,
        description="Keep a running summary of what each window cuts, right after its system messages: "
        "provider:model (LangChain's init_chat_model, e.g. openai:gpt-4o-mini; install langchain and the "
        "provider's package) or module:attribute naming a BaseChatModel or a callable (previous_summary, "
        "messages) -> str, sync or async. Off when unset. The summarizer runs where extraction does "
        "(extract); serve needs the setting for its put path even when workers summarize.",
    )
    summary_max_input_tokens: int = Field(
        4000,
        ge=256,
        description="Cap of a summary prompt: the previous summary and the new batch, in tokens.",
    )
    summary_max_tokens: int = Field(
        800, ge=16, description="Cap of a summary, in tokens (asked of the model, and enforced)."
    )
    summary_hard_limit: int | None = Field(
        None,
        ge=2,
        description="Messages a window may hold while its cut waits for a summary; above it the window "
        "cuts without one (logged, counted, summarized later). Default: twice max_messages (and twice "
        "max_tokens in token mode).",
    )
    summarize_tenants: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="Tenants whose conversations are summarized, comma-separated (conversations go to the "
        "summarizer's model, which some tenants refuse); default: every tenant but those whose keys carry "
        "no-summary in api_keys_file.",
    )
    summary_lease_seconds: float = Field(
        300.0,
        gt=0,
        description="How long a summarizer's claim of a batch lasts; renewed every third of it while the model "
        "call runs (a crashed summarizer's batch returns after it).",
    )
    summary_concurrency: int = Field(
        1, ge=1, le=64, description="Summarizer calls a process makes at once (batches of different threads)."
    )


class SweepSettings(BaseModel):
    """TTL sweeps of idle threads (``service/ttl/``)."""

    ttl_strategy: Literal["keep_latest", "delete"] = Field(
        "keep_latest",
        description="What a sweep does to a thread idle for longer than its TTL: keep_latest prunes it to its "
        "head checkpoint; delete removes it (its last window goes to long-term memory first).",
    )
    default_ttl: float | None = Field(
        None,
        description="TTL of threads whose puts set no checkpoint_ttl, counted from the last write: seconds or "
        "90s, 15m, 2h, 7d; off when unset.",
    )
    sweep_interval: float = Field(  # type: ignore[assignment]  # pydantic types a default as the value; validate_default parses it
        "5m", description="Time between TTL sweeps of this process (s, m, h, d)."
    )
    sweep: bool = Field(True, description="Run the TTL sweeper in this process.")
    sweep_batch_size: int = Field(100, ge=1, description="Expired threads a sweep lists at a time.")
    extract_on_delete: bool = Field(
        False,
        description="A client's delete_thread sends the thread's last window to long-term memory first.",
    )


class HistorySettings(BaseModel):
    """How much checkpoint history each thread keeps (``docs/storage.md``)."""

    keep_checkpoints: int | None = Field(
        None,
        ge=0,
        le=MAX_KEEP_CHECKPOINTS,
        description="Keep only the newest K checkpoints of each thread and namespace, plus every branch "
        "head (a fork's newest checkpoint) and exactly the blobs and writes they reference; each put "
        "deletes the rest of its namespace (PostgreSQL: in the put's own transaction). A put's config['configurable']['keep_checkpoints'] "
        "overrides it for its thread. Unset or 0: every checkpoint is kept. On a thread with a DeltaChannel a kept "
        "checkpoint keeps the ancestors it is rebuilt from, and the service has LangGraph snapshot a channel "
        "whose last snapshot is K or more steps back when a run starts (docs/storage.md).",
    )


class StoreSettings(BaseModel):
    """The long-term memory store, as ``langgraph.json`` configures Agent Server's (``service/configuration/store.py``)."""

    store_index: Annotated[dict[str, Any] | None, NoDecode] = Field(
        None,
        description='Semantic search: JSON {"dims": N, "embed": "provider:model" | "module:callable", "fields": '
        '["$"]}; embedding happens in the service. Memory and SQLite (sqlite-vec); PostgreSQL needs pgvector.',
    )
    store_ttl: Annotated[dict[str, Any] | None, NoDecode] = Field(
        None,
        description='Item TTL: JSON {"default_ttl": minutes, "refresh_on_read": true, "sweep_interval_minutes": '
        "N}; applied to extracted memories too. PostgreSQL and SQLite.",
    )

    @field_validator("store_index", mode="before")
    @classmethod
    def _parse_store_index(cls, value: object) -> object:
        from reducing_saver.service.configuration.store import parse_index

        return parse_index(value)

    @field_validator("store_ttl", mode="before")
    @classmethod
    def _parse_store_ttl(cls, value: object) -> object:
        from reducing_saver.service.configuration.store import parse_ttl

        return parse_ttl(value)


class Settings(
    ServerSettings,
    PostgresSettings,
    ReducerSettings,
    SecuritySettings,
    LimitSettings,
    ExtractionSettings,
    SummarySettings,
    SweepSettings,
    HistorySettings,
    StoreSettings,
    BaseSettings,
):
    """Everything the service can be told, from flags, ``REDUCING_SAVER_<FIELD>`` variables and ``.env``.

    The fields come in groups (the classes above); each group is also a model of its own, so a part of
    the service can take just its group (``settings.limits``) with the same defaults.
    """

    model_config = SettingsConfigDict(
        env_prefix="REDUCING_SAVER_",
        env_file=".env",
        extra="ignore",
        validate_default=True,
        # str(ValidationError) would quote the raw input, API keys included (the CLI names the field).
        hide_input_in_errors=True,
    )
    _api_key_set: Any = PrivateAttr(default=None)
    _metrics_key_set: Any = PrivateAttr(default=None)
    _keyring: Any = PrivateAttr(default=None)

    @field_validator("extractor")
    @classmethod
    def _check_extractor(cls, value: str | None) -> str | None:
        # The form only: what it names is imported where it runs, and checked by the commands at start
        # (reducing_saver.service.imports says how, for every module:attribute setting).
        if value is not None and (not value.partition(":")[0] or not value.partition(":")[2]):
            raise ValueError(f"{value!r} is not a module:callable import path")
        return value

    @field_validator("default_ttl", "sweep_interval", "outbox_retention", mode="before")
    @classmethod
    def _parse_duration(cls, value: object, info: ValidationInfo) -> object:
        if info.field_name == "default_ttl" and (
            value is None or str(value).strip().lower() in ("", "off", "none")
        ):
            return None
        name = info.field_name
        assert name is not None, "a field validator's"
        return parse_duration(value, name=name)

    @model_validator(mode="after")
    def _check_backoff(self) -> Settings:
        if self.extraction_max_backoff < self.extraction_base_backoff:
            raise ValueError("extraction_max_backoff must be at least extraction_base_backoff")
        return self

    @model_validator(mode="after")
    def _check_api_keys(self) -> Settings:
        # The keys are parsed here, once; a malformed line or pair raises ValueError naming it, never a key.
        self._api_key_set = load_api_keys(self)
        self._metrics_key_set = load_metrics_keys(self, self._api_key_set)
        opted_out = self._api_key_set.no_summary if self._api_key_set is not None else frozenset()
        if both := sorted(opted_out & set(self.summarize_tenants or ())):
            raise ValueError(
                f"summarize_tenants names {', '.join(both)}, whose keys carry no-summary: "
                "drop one or the other"
            )
        return self

    @field_validator("summarize_tenants", mode="before")
    @classmethod
    def _split_tenants(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()] or None
        return value

    @field_validator("summarizer")
    @classmethod
    def _check_summarizer(cls, value: str | None) -> str | None:
        if value is not None and (not value.partition(":")[0] or not value.partition(":")[2]):
            raise ValueError(f"{value!r} is not provider:model or module:attribute")
        return value or None

    @model_validator(mode="after")
    def _check_encryption(self) -> Settings:
        # Parsed once, here; errors name the field or key id that is wrong, never a key.
        from reducing_saver.service.encryption import load_keyring

        if self.encryption != "off" and self.encryption_keys is None:
            raise ValueError(
                f"encryption {self.encryption} needs a key ring: set REDUCING_SAVER_ENCRYPTION_KEYS "
                "(JSON, or the path of a file holding it)"
            )
        if self.encryption != "off" and self.store_index is not None:
            raise ValueError(
                f"encryption {self.encryption} cannot be combined with store_index: the semantic index's "
                "vectors are computed from, and reveal, the plain text of the values it encrypts"
            )
        if self.encryption_keys is not None:
            self._keyring = load_keyring(self.encryption_keys.get_secret_value())
        return self

    @field_validator("allowed_message_classes", "on_prune", "allowed_state_types", mode="before")
    @classmethod
    def _split_names(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("allowed_message_classes", "on_prune")
    @classmethod
    def _check_import_paths(cls, value: list[str]) -> list[str]:
        for name in value:
            module, _, attribute = name.partition(":")
            if not module or not attribute:
                raise ValueError(f"{name!r} is not a module:name import path")
        return value

    @field_validator("allowed_state_types")
    @classmethod
    def _check_state_types(cls, value: list[str]) -> list[str]:
        ExtensionPolicy(value)  # raises ValueError naming a malformed entry
        return value

    @field_validator("database")
    @classmethod
    def _check_database(cls, value: str) -> str:
        if backend_kind(value) == "sqlite" and not sqlite_path(value):
            raise ValueError("a sqlite URL needs a file path: sqlite:///path/to/file.sqlite")
        return value

    @model_validator(mode="after")
    def _check_summary_hard_limit(self) -> Settings:
        hard, window = self.summary_hard_limit, self.max_messages
        if hard is not None and window is not None and hard <= window:
            raise ValueError(
                f"summary_hard_limit ({hard}) must be above max_messages ({window}): a window waits for its "
                "summary between the two"
            )
        return self

    @model_validator(mode="after")
    def _check_reducer(self) -> Settings:
        try:
            self.reducer_config()
        except ValueError as exc:
            raise ValueError(f"reducer settings: {exc}") from None
        return self

    @property
    def backend(self) -> str:
        """``"postgres"``, ``"sqlite"`` or ``"memory"``."""
        return backend_kind(self.database)

    @property
    def api_key_set(self) -> ApiKeys | None:
        """The configured API keys, parsed; ``None`` without any (single-tenant mode)."""
        return self._api_key_set

    @property
    def metrics_key_set(self) -> ApiKeys | None:
        """The metrics scraper's keys, parsed; ``None`` without any."""
        return self._metrics_key_set

    @property
    def keyring(self) -> KeyRing | None:
        """The encryption key ring, parsed; ``None`` when none is configured."""
        return self._keyring

    @property
    def postgres(self) -> PostgresSettings:
        """The PostgreSQL connection settings alone (what ``storage.open_backend`` takes)."""
        return PostgresSettings(**{name: getattr(self, name) for name in PostgresSettings.model_fields})

    @property
    def limits(self) -> LimitSettings:
        """The input caps alone."""
        return LimitSettings(**{name: getattr(self, name) for name in LimitSettings.model_fields})

    def reducer_config(self, *, on_prune: Sequence[PruneHook] = ()) -> ReducerConfig:
        return ReducerConfig(
            max_messages=self.max_messages,
            min_messages=self.min_messages,
            max_tokens=self.max_tokens,
            target_tokens=self.target_tokens,
            preserve_first=self.preserve_first,
            start_on="human" if self.start_on_human else None,
            namespace_key=self.namespace_key,
            on_prune=on_prune,
        )

    def summary_hard_reducer(self) -> ReducerConfig:
        """The reducer whose trigger is the summary hard limit, with the window's targets."""
        config = self.reducer_config()
        hard = self.summary_hard_limit
        if hard is None and config.max_messages is not None:
            hard = 2 * config.max_messages
        return ReducerConfig(
            max_messages=hard,
            min_messages=min(config.count_target, hard) if hard is not None and config.count_target else None,
            max_tokens=2 * config.max_tokens if config.max_tokens is not None else None,
            target_tokens=config.token_target,
            preserve_first=config.preserve_first,
            start_on=config.start_on,
            namespace_key=config.namespace_key,
        )

    def database_for_display(self) -> str:
        """The database URL with any password replaced by ``***``."""
        return redact_url(self.database)
