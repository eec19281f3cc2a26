"""Span filling measured by decoding: each sentinel span of a span-corruption target reproduced
exactly (``span_exact_match``), and whole targets (``exact_match``). The training loop calls
:func:`span_filling_accuracy` on its validation batches; ``python -m meshdsl.models.generate``
re-exports both functions.
"""

from __future__ import annotations

import numpy as np

__all__ = ["span_filling_accuracy", "split_spans"]


def split_spans(tokens, is_sentinel) -> dict[int, tuple[int, ...]]:
    """``{sentinel id: the tokens after it up to the next sentinel}`` for the tokens before the
    first eos (1) of a target; pads (0) dropped."""
    spans: dict[int, tuple[int, ...]] = {}
    current = None
    for t in (int(t) for t in tokens):
        if t == 1:
            break
        if t == 0:
            continue
        if is_sentinel(t):
            current = t
            spans.setdefault(t, ())
        elif current is not None:
            spans[current] = spans[current] + (t,)
    return spans


def span_filling_accuracy(model, batches, vocab, *, max_new_tokens: int | None = None, method: str = "greedy",
                          num_beams: int = 4, mesh=None, layout=None) -> dict:
    """Span filling on span-corruption batches (``{"encoder_input_tokens", "decoder_target_tokens"}``,
    numpy ``[batch, length]`` as :mod:`meshdsl.models.data.batches` makes them).

    Decodes each batch from its encoder inputs and compares with the targets: ``span_exact_match``
    is the fraction of target spans (a sentinel and the tokens up to the next one) reproduced
    exactly, ``exact_match`` the fraction of examples whose every span is. ``vocab``: a
    :class:`~meshdsl.models.data.corpus.Vocabulary` (sentinels are ids ``sp_size .. unpadded_size - 1``).
    Returns ``{"exact_match", "span_exact_match", "examples", "spans"}``.
    """
    from .generation import generate
    import meshdsl as md

    def is_sentinel(t):
        return vocab.sp_size <= t < vocab.unpadded_size

    examples = matched = spans = spans_matched = 0
    for b in batches:
        inputs = np.asarray(b["encoder_input_tokens"])
        targets = np.asarray(b["decoder_target_tokens"])
        n = max_new_tokens or targets.shape[1]
        kw = dict(num_beams=num_beams) if method == "beam" else {}
        out = np.asarray(generate(model, md.named(inputs.astype(np.int32), "batch length"), max_new_tokens=n,
                                  method=method, eos_id=vocab.eos_id, mesh=mesh, layout=layout, **kw).array)
        for row_out, row_target in zip(out, targets):
            want, got = split_spans(row_target, is_sentinel), split_spans(row_out[1:], is_sentinel)
            good = sum(got.get(s) == toks for s, toks in want.items())
            examples += 1
            matched += int(good == len(want) and set(got) <= set(want))
            spans += len(want)
            spans_matched += good
    return {"exact_match": matched / max(examples, 1), "span_exact_match": spans_matched / max(spans, 1),
            "examples": examples, "spans": spans}
