"""Every command's flags: which setting each sets, and why the settings without one have none.

``cli.py`` builds its parser from these tables; ``docs.py`` renders the configuration reference from them.
"""

from __future__ import annotations

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
    "--docs-public": "docs_public",
    # No flag for metrics_key either: --metrics-key-file takes hashed keys.
    "--metrics-key-file": "metrics_key_file",
    "--metrics-public": "metrics_public",
    # No flag for encryption_keys either: REDUCING_SAVER_ENCRYPTION_KEYS holds the ring or its file's path.
    "--encryption": "encryption",
    "--log-level": "log_level",
    "--log-format": "log_format",
    "--shutdown-grace-seconds": "shutdown_grace_seconds",
    "--keep-alive-seconds": "keep_alive_seconds",
    "--db-timeout-seconds": "db_timeout_seconds",
    "--postgres-prepared-statements": "postgres_prepared_statements",
    "--storage-refresh-seconds": "storage_refresh_seconds",
    "--migrate": "migrate",
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
    "--remember-removed": "remember_removed",
    "--keep-checkpoints": "keep_checkpoints",
    "--store-index": "store_index",
    "--store-ttl": "store_ttl",
    "--summarizer": "summarizer",
    "--summary-max-input-tokens": "summary_max_input_tokens",
    "--summary-max-tokens": "summary_max_tokens",
    "--summary-hard-limit": "summary_hard_limit",
    "--summarize-tenants": "summarize_tenants",
    "--summary-lease-seconds": "summary_lease_seconds",
    "--summary-concurrency": "summary_concurrency",
}
#: The settings with no flag, and why: each is an environment variable (or a ``.env`` line) only.
_TUNING = (
    "a tuning knob whose default suits nearly every deployment; kept off the command line so that --help "
    "shows what deployments change"
)
_AGREED = (
    "must agree with the agents' graphs (their state and config keys): a deployment's setting, not a "
    "one-off run's"
)
ENV_ONLY: dict[str, str] = {
    "api_keys": "a key on a command line is visible to every user of the host (ps); --api-keys-file takes "
    "hashed keys",
    "metrics_key": "a key on a command line is visible to every user of the host (ps); --metrics-key-file takes "
    "hashed keys",
    "encryption_keys": "a key on a command line is visible to every user of the host (ps); the variable may "
    "name a file (a mounted secret) instead",
    "preserve_first": _AGREED,
    "start_on_human": _AGREED,
    "messages_key": _AGREED,
    "namespace_key": _AGREED,
    "max_writes_per_call": _TUNING,
    "max_ids_per_call": _TUNING,
    "max_list_limit": _TUNING,
    "latest_cache_threads": _TUNING,
    "max_nesting_depth": _TUNING,
    "max_thread_id_length": _TUNING,
    "max_channels": _TUNING,
    "max_messages_per_put": _TUNING,
    "extraction_base_backoff": _TUNING,
    "extraction_max_backoff": _TUNING,
    "extraction_idle_seconds": _TUNING,
    "sweep_batch_size": _TUNING,
    "postgres_check_idle_seconds": _TUNING,
    "postgres_keepalives_idle_seconds": _TUNING,
    "postgres_keepalives_interval_seconds": _TUNING,
    "postgres_keepalives_count": _TUNING,
    "postgres_tcp_user_timeout_seconds": _TUNING,
}
#: The flags of ``worker``: where the outbox is, how to deliver, how to log.
WORKER_FLAGS: dict[str, str] = {
    flag: SERVE_FLAGS[flag]
    for flag in (
        "--database",
        "--postgres-prepared-statements",
        "--extractor",
        "--extraction-batch-size",
        "--extraction-max-attempts",
        "--extraction-lease-seconds",
        "--store-index",
        "--store-ttl",
        "--migrate",
        "--summarizer",
        "--summary-max-input-tokens",
        "--summary-max-tokens",
        "--summary-lease-seconds",
        "--summary-concurrency",
        "--encryption",
        "--log-level",
        "--log-format",
    )
}
#: The flags of ``migrate``: the database, and the store's settings (vector search adds tables).
MIGRATE_FLAGS: dict[str, str] = {
    flag: SERVE_FLAGS[flag]
    for flag in (
        "--database",
        "--postgres-prepared-statements",
        "--store-index",
        "--db-timeout-seconds",
        "--log-level",
    )
}
EXTRACTION_FLAGS: dict[str, str] = {
    flag: SERVE_FLAGS[flag] for flag in ("--database", "--postgres-prepared-statements")
}
#: The flags of ``sweep`` (one TTL sweep, for cron); ``--dry-run`` is its own.
SWEEP_FLAGS: dict[str, str] = {
    flag: SERVE_FLAGS[flag]
    for flag in (
        "--database",
        "--postgres-prepared-statements",
        "--ttl-strategy",
        "--default-ttl",
        "--outbox-retention",
        "--allow-message-class",
        "--encryption",
        "--log-level",
        "--log-format",
    )
}
#: The flags of ``report`` besides its own (``--top``, ``--png``).
REPORT_FLAGS: dict[str, str] = {
    flag: SERVE_FLAGS[flag] for flag in ("--database", "--postgres-prepared-statements", "--api-keys-file")
}
#: The flags of ``encrypt-sweep``; the key ring comes from REDUCING_SAVER_ENCRYPTION_KEYS only.
ENCRYPT_SWEEP_FLAGS: dict[str, str] = {
    flag: SERVE_FLAGS[flag]
    for flag in (
        "--database",
        "--postgres-prepared-statements",
        "--api-keys-file",
        "--log-level",
        "--log-format",
    )
}
ALL_FLAGS = {
    **SERVE_FLAGS,
    **WORKER_FLAGS,
    **MIGRATE_FLAGS,
    **EXTRACTION_FLAGS,
    **SWEEP_FLAGS,
    **REPORT_FLAGS,
    **ENCRYPT_SWEEP_FLAGS,
}
