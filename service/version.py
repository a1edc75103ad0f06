"""The installed version of reducing-saver (``0.0.0`` when running from a source tree not installed)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("reducing-saver")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0"
