"""Text data: the corpus and its vocabulary, and the training batches cut from it.

Owns the offline corpus (the King James Bible, or your text files), the sentencepiece vocabulary
with T5's sentinels (:mod:`~meshdsl.models.data.corpus`), and the batches of token ids, T5 span
corruption and decoder-only LM windows, deterministic per step and per process
(:mod:`~meshdsl.models.data.batches`). Numpy only: nothing here knows a model.

May import: nothing of :mod:`meshdsl.models` outside this subpackage (the bottom floor).
"""
