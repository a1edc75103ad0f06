"""The installed version of reducing-saver (``reducing_saver.wire.version``, which the client reads too)."""

from reducing_saver.wire.version import __version__

__all__ = ["__version__"]
