# reducing-saver: the checkpoint service, and (same image, other command) the example agent worker.
#
#   docker build -t reducing-saver .
#   docker run -p 8080:8080 -e REDUCING_SAVER_DATABASE=postgresql://user:pass@host:5432/db reducing-saver
#
# Every setting is an environment variable REDUCING_SAVER_<FIELD> (see docs/configuration.md);
# arguments after the image name are `reducing-saver serve` flags. Without REDUCING_SAVER_DATABASE the
# service keeps a SQLite file in /data (mount a volume there to keep it).
#
# The image listens on 0.0.0.0, so the service refuses to start without API keys: mount a key file and
# set REDUCING_SAVER_API_KEYS_FILE (lines `tenant sha256-hex-of-key`), or, for a throwaway local run,
# pass -e REDUCING_SAVER_INSECURE=true.
#
# Two stages. `build` makes the project's wheel from a fresh copy of the sources; the runtime stage
# installs the dependencies from pyproject.toml alone (a layer rebuilt only when pyproject.toml changes)
# and then that wheel, and nothing else of the source tree: no build/ folder, no egg-info and no file
# of an earlier install can reach the installed package.
#
# glibc slim, not alpine: ormsgpack's Rust code needs more than musl's default thread stack. Another
# Python 3.11+ glibc image (a mirror, a digest pin): docker build --build-arg PYTHON_IMAGE=...
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# The build backend pyproject.toml asks for, in a cached layer of its own, so a source edit does not
# download it again (hence --no-build-isolation below).
COPY pyproject.toml ./
# DL3013 wants `pip install name==version`; these are pyproject.toml's own ranges (no lock file).
# hadolint ignore=DL3013
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires']))" > /tmp/build-requires.txt \
    && pip install --no-cache-dir -r /tmp/build-requires.txt

# The whole build context: .dockerignore lets through pyproject.toml, README.md and the package folders
# only, so the wheel is built from the sources as they are, never from an earlier build's output.
COPY . ./
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /dist .


FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependency layer: what pyproject.toml requires, with the extras `server` (the service) and `examples`
# (the agent worker's langgraph). Rebuilt only when pyproject.toml changes, not on every source edit.
COPY pyproject.toml /tmp/deps/
# hadolint ignore=DL3013
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/deps/pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['server'] + p['optional-dependencies']['examples']))" > /tmp/deps/requirements.txt \
    && pip install --no-cache-dir -r /tmp/deps/requirements.txt \
    && rm -rf /tmp/deps

# The project itself: the wheel only. Its requirements are already met above, so nothing is resolved
# again; `pip check` fails the build if the layer above missed one.
COPY --from=build /dist/ /tmp/dist/
# hadolint ignore=DL3013
RUN wheel="$(echo /tmp/dist/reducing_saver-*.whl)" \
    && pip install --no-cache-dir "${wheel}[server,examples]" \
    && pip check \
    && rm -rf /tmp/dist

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
