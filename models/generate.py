"""``python -m meshdsl.models.generate``: generate text with a trained run (``--help`` lists the
options). ``meshdsl.models.generate`` stays the decoding function; import the command's names from
here: ``from meshdsl.models.generate import main, span_filling_accuracy``.

A facade: the command lives in :mod:`meshdsl.models.cli.generate` (span filling in
:mod:`meshdsl.models.decoding.spans`); this module re-exports it and runs it as ``__main__``.
"""

from meshdsl.models.cli.generate import encode_prompt, load_run, main, prompt_batch, span_filling_accuracy, split_spans

__all__ = ["main", "load_run", "encode_prompt", "span_filling_accuracy", "split_spans", "prompt_batch"]

if __name__ == "__main__":
    main()
