"""The installed version of reducing-saver (``0.0.0`` when running from a source tree that is not installed):
the client's User-Agent and the service's ``/v1/capabilities``, ``--version`` and metrics say it."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("reducing-saver")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0"
