"""The command lines: ``python -m meshdsl.models.train``, ``.generate`` and ``.export``.

Owns each command's parser and setup: training (:mod:`~meshdsl.models.cli.train`, its options in
:mod:`~meshdsl.models.cli.options`), text generation from a run (:mod:`~meshdsl.models.cli.generate`)
and a run's export to Hugging Face (:mod:`~meshdsl.models.cli.export`). The facades
``meshdsl.models.train``, ``.generate`` and ``.export`` re-export them and run them as ``__main__``.

May import: every other subpackage of :mod:`meshdsl.models` (the top floor): data, families, hub,
decoding, training.
"""
