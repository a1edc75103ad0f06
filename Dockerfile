# reducing-saver: the checkpoint service, and (same image, other command) the example agent worker.
#
#   docker build -t reducing-saver .
#   docker run -p 8080:8080 -e REDUCING_SAVER_DATABASE=postgresql://user:pass@host:5432/db reducing-saver
#
# Every setting is an environment variable REDUCING_SAVER_<FIELD> (see README.md, "Configuration");
# arguments after the image name are `reducing-saver serve` flags. Without REDUCING_SAVER_DATABASE the
# service keeps a SQLite file in /data (mount a volume there to keep it).
#
# The image listens on 0.0.0.0, so the service refuses to start without API keys: mount a key file and
# set REDUCING_SAVER_API_KEYS_FILE (lines `tenant sha256-hex-of-key`), or, for a throwaway local run,
# pass -e REDUCING_SAVER_INSECURE=true.
#
# glibc slim, not alpine: ormsgpack's Rust code needs more than musl's default thread stack.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependency layer: the project's metadata over empty stub packages, so this layer is rebuilt only
# when pyproject.toml changes, not on every source edit. `server` is the service, `examples` the
# agent worker's langgraph.
WORKDIR /src
COPY pyproject.toml ./
# DL3013 wants `pip install name==version`; this installs the local project, whose dependency ranges
# are pyproject.toml's (the project has no lock file to pin them with).
# hadolint ignore=DL3013
RUN mkdir client service reducer wire \
    && touch README.md client/__init__.py service/__init__.py reducer/__init__.py wire/__init__.py \
    && pip install --no-cache-dir ".[server,examples]"

# Source layer: the real packages replace the stubs; no dependency is resolved again.
COPY README.md ./
COPY reducer/ reducer/
COPY wire/ wire/
COPY client/ client/
COPY service/ service/
RUN pip install --no-cache-dir --no-deps --force-reinstall . \
    && rm -rf /src

# Numeric user, so Kubernetes' runAsNonRoot can verify it; /data is the only folder it writes.
RUN groupadd --system --gid 10001 reducing-saver \
    && useradd --system --no-log-init --uid 10001 --gid 10001 --home-dir /data --shell /usr/sbin/nologin reducing-saver \
    && mkdir /data \
    && chown 10001:10001 /data

# The example agent worker runs from here: `python -m examples.agent_worker`.
WORKDIR /app
COPY examples/ examples/

USER 10001:10001

ENV REDUCING_SAVER_HOST=0.0.0.0 \
    REDUCING_SAVER_PORT=8080 \
    REDUCING_SAVER_DATABASE=sqlite:////data/reducing-saver.sqlite
EXPOSE 8080

# Liveness only (the process answers); /readyz also asks the database. No curl in slim: Python's urllib,
# with proxies off so an HTTP_PROXY in the environment cannot turn a loopback probe into a proxy call.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as r; r.build_opener(r.ProxyHandler({})).open('http://127.0.0.1:%s/healthz' % os.environ.get('REDUCING_SAVER_PORT', '8080'), timeout=4)"]

ENTRYPOINT ["reducing-saver", "serve"]
