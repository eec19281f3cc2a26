"""The version of meshdsl: the one place it is written (setuptools reads it for the package metadata)."""

__version__ = "0.1.0"
