"""The service's settings: one class, read from CLI flags, ``REDUCING_SAVER_*`` variables and ``.env``.

The fields come in groups, one model each, each field (and its default) written once: server,
reducer, security, limits, extraction, sweeps, history and the store. :class:`Settings` joins them,
validates across them, and parses the API keys once (``api_key_set``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

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

from reducing_saver.reducer import ReducerConfig
from reducing_saver.service.imports import import_callable
from reducing_saver.service.security.extensions import ANY_CLASS, ExtensionPolicy
from reducing_saver.service.security.keys import ApiKeys, load_api_keys
from reducing_saver.service.security.limits import Limits as LimitSettings
from reducing_saver.service.storage import backend_kind, redact_url, sqlite_path
from reducing_saver.service.ttl.durations import parse_duration

DEFAULT_DATABASE = "sqlite:///reducing-saver.sqlite"


class ServerSettings(BaseModel):
    """Where the service listens, how many processes it runs, and how it logs."""

    database: str = Field(
        DEFAULT_DATABASE,
        description="Where checkpoints live: postgresql://user:pass@host:port/db (an existing UTF8 "
        "database), sqlite:///path/to/file (relative to the working folder; serve and worker create a "
        "missing file and folder, other commands do not) or memory:// (tests only).",
    )
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8080, ge=0, le=65535, description="Port to listen on.")
    workers: int = Field(1, ge=1, description="uvicorn worker processes.")
    pool_size: int = Field(
        4,
        ge=1,
        description="PostgreSQL connections per worker process, shared by saver calls, recording pruned "
        "messages, delivery and sweeps (give a process that delivers at least 2).",
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Largest request body accepted.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["json", "text"] = Field(
        "json", description="Log lines as JSON objects (one per line) or as text."
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
    db_timeout_seconds: float = Field(
        5.0,
        gt=0,
        description="How long a request waits for a free saver or database connection, or for an answer to "
        "a probe or status query, before it is answered 503 (the database is unavailable); also how long "
        "one connection attempt may take (at least 2 s) and how long closing the database may take on "
        "shutdown.",
    )


class ReducerSettings(BaseModel):
    """How the messages channel is reduced (``ReducerConfig``)."""

    max_messages: int | None = Field(20, ge=1, description="Reduce a messages list longer than this.")
    min_messages: int | None = Field(
        None, ge=1, description="Reduce down to this many messages (default: max_messages)."
    )
    max_tokens: int | None = Field(None, ge=1, description="Reduce a messages list over this many tokens.")
    target_tokens: int | None = Field(None, ge=1, description="Reduce down to this many tokens.")
    preserve_first: bool = Field(True, description="Never prune a leading system message.")
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
        "With any key configured every route but /healthz and /readyz needs `Authorization: Bearer <key>`, "
        "and each tenant sees only its own threads.",
    )
    api_keys_file: str | None = Field(
        None, description="File of API keys: one `tenant sha256-hex-of-key` per line (# comments allowed)."
    )
    insecure: bool = Field(
        False, description="Allow listening on a non-loopback address with no API key configured."
    )
    metrics_public: bool = Field(False, description="Serve /metrics without an API key.")
    allowed_state_types: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [ANY_CLASS],
        description="What msgpack extensions in stored channel values and pending writes may name, besides "
        "LangGraph's safe types and the accepted message classes, as comma-separated entries: module:Class, "
        "module (and its submodules), or * for any class-named type outside the standard library (refuse "
        "everything else: only a list without * keeps every stock reader safe from third-party classes).",
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
    extraction_batch_size: int = Field(100, ge=1, description="Outbox rows a deliverer claims at a time.")
    extraction_lease_seconds: float = Field(
        30.0, gt=0, description="How long a claim lasts without renewal (a crashed worker's rows return after it)."
    )
    extraction_max_attempts: int = Field(
        8, ge=1, description="Attempts per message before it becomes a dead letter."
    )
    extraction_base_backoff: float = Field(1.0, ge=0, description="Seconds before the first retry (doubles, with jitter).")
    extraction_max_backoff: float = Field(300.0, ge=0, description="Longest wait between attempts.")
    extraction_idle_seconds: float = Field(1.0, gt=0, description="How long a deliverer sleeps when the outbox is empty.")
    outbox_retention: float = Field(
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
    sweep_interval: float = Field("5m", description="Time between TTL sweeps of this process (s, m, h, d).")
    sweep: bool = Field(True, description="Run the TTL sweeper in this process.")
    sweep_batch_size: int = Field(100, ge=1, description="Expired threads a sweep lists at a time.")
    extract_on_delete: bool = Field(
        False, description="A client's delete_thread sends the thread's last window to long-term memory first."
    )


class HistorySettings(BaseModel):
    """How much checkpoint history each thread keeps (``docs/storage.md``)."""

    keep_checkpoints: int | None = Field(
        None,
        ge=0,
        description="Keep only the newest K checkpoints of each thread and namespace, plus every branch "
        "head (a fork's newest checkpoint) and exactly the blobs and writes they reference; each put "
        "deletes the rest of its namespace (PostgreSQL: in the put's own transaction). A put's config['configurable']['keep_checkpoints'] "
        "overrides it for its thread. Unset or 0: every checkpoint is kept. Threads with a DeltaChannel are "
        "kept whole.",
    )


class StoreSettings(BaseModel):
    """The long-term memory store, as ``langgraph.json`` configures Agent Server's (``service/store_config.py``)."""

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
        from reducing_saver.service.store_config import parse_index

        return parse_index(value)

    @field_validator("store_ttl", mode="before")
    @classmethod
    def _parse_store_ttl(cls, value: object) -> object:
        from reducing_saver.service.store_config import parse_ttl

        return parse_ttl(value)


class Settings(
    ServerSettings,
    ReducerSettings,
    SecuritySettings,
    LimitSettings,
    ExtractionSettings,
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

    @field_validator("extractor")
    @classmethod
    def _check_extractor(cls, value: str | None) -> str | None:
        if value is not None:
            import_callable(value, "extractor")
        return value

    @field_validator("default_ttl", "sweep_interval", "outbox_retention", mode="before")
    @classmethod
    def _parse_duration(cls, value: object, info: ValidationInfo) -> object:
        if info.field_name == "default_ttl" and (value is None or str(value).strip().lower() in ("", "off", "none")):
            return None
        return parse_duration(value, name=info.field_name)

    @model_validator(mode="after")
    def _check_backoff(self) -> Settings:
        if self.extraction_max_backoff < self.extraction_base_backoff:
            raise ValueError("extraction_max_backoff must be at least extraction_base_backoff")
        return self

    @model_validator(mode="after")
    def _check_api_keys(self) -> Settings:
        # The keys are parsed here, once; a malformed line or pair raises ValueError naming it, never a key.
        self._api_key_set = load_api_keys(self)
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
    def limits(self) -> LimitSettings:
        """The input caps alone."""
        return LimitSettings(**{name: getattr(self, name) for name in LimitSettings.model_fields})

    def reducer_config(self, **extra: object) -> ReducerConfig:
        return ReducerConfig(
            max_messages=self.max_messages,
            min_messages=self.min_messages,
            max_tokens=self.max_tokens,
            target_tokens=self.target_tokens,
            preserve_first=self.preserve_first,
            start_on="human" if self.start_on_human else None,
            namespace_key=self.namespace_key,
            **extra,
        )

    def database_for_display(self) -> str:
        """The database URL with any password replaced by ``***``."""
        return redact_url(self.database)

