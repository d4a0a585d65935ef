"""The installed distribution's version, read from its metadata (one place; nothing here imports the package)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hf_tev")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
