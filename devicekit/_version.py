"""The single source of devicekit's version (read by hatchling and by the CLI)."""

__version__ = "0.1.0"
