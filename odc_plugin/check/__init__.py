"""odc-check: ODC measured on this machine against what it replaces (cli.py)."""

from .cli import main

__all__ = ["main"]
