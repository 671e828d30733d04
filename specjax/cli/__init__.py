"""The `specjax` command line."""
from specjax.cli.main import main

__all__ = ["main"]
