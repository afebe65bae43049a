"""gpuwatch node agent: collectors -> snapshot -> exporter (see docs/agent.md)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gpuwatch")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
