"""Decoding: greedy, sampled and beam-search generation with a KV cache, and what it costs.

Owns the cached prefill and decode steps of T5 (:mod:`~meshdsl.models.decoding.decode`) and Llama
(:mod:`~meshdsl.models.decoding.llama_decode`), the generators (:mod:`~meshdsl.models.decoding.generation`,
:mod:`~meshdsl.models.decoding.generation_lm`, their shared layouts in
:mod:`~meshdsl.models.decoding.generation_setup`), top-k / top-p sampling
(:mod:`~meshdsl.models.decoding.sampling`), the decode-step layouts and their cost
(:mod:`~meshdsl.models.decoding.inference`), and span filling measured by decoding
(:mod:`~meshdsl.models.decoding.spans`). The public paths are ``meshdsl.models.generate`` (the
function) and the facades ``meshdsl.models.generation`` and ``meshdsl.models.inference``.

May import: :mod:`meshdsl.models.data`, :mod:`meshdsl.models.families`, :mod:`meshdsl.models.hub`
(it needs neither of the last two: it reads the models' own modules), :mod:`meshdsl.layers`.
"""
