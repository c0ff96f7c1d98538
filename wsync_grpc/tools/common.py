"""What every ``wsync`` sub-command shares: the default port and the usage error."""

from __future__ import annotations

DEFAULT_PORT = 50051
"""The engine's default gRPC port (``wsync serve --port``, every command's ``--target``)."""


class UsageError(Exception):
    """A command line that cannot work (printed as one line, exit status 2)."""
