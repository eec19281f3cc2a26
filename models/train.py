"""``python -m meshdsl.models.train``: train T5, MoE-T5 or Llama (``--help`` lists the options).

A facade: the command lives in :mod:`meshdsl.models.cli.train`; this module re-exports it and runs
it as ``__main__``.
"""

import sys

from meshdsl.models.cli.train import build_parser, cli, main, parse_args

__all__ = ["main", "cli", "build_parser", "parse_args"]

if __name__ == "__main__":
    sys.exit(cli())
