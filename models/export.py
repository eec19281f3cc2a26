"""``python -m meshdsl.models.export --run DIR --out HF_DIR``: a training run's checkpoint as a
Hugging Face directory.

A facade: the command lives in :mod:`meshdsl.models.cli.export`; this module re-exports it and
runs it as ``__main__``.
"""

from meshdsl.models.cli.export import export_run, main

__all__ = ["export_run", "main"]

if __name__ == "__main__":
    main()
