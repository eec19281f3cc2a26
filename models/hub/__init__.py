"""Hugging Face: weights and configs from and to ``transformers`` and safetensors directories.

Owns the name and layout maps between HF checkpoints and the families' modules, T5 / Switch
(:mod:`~meshdsl.models.hub.hf`) and Llama (:mod:`~meshdsl.models.hub.hf_llama`), and
``save_pretrained`` / ``load_pretrained``. The public path is the facade ``meshdsl.models.hf``.

May import: :mod:`meshdsl.models.data`, :mod:`meshdsl.models.families` (never training or decoding:
a run's checkpoint becomes an HF directory in :mod:`meshdsl.models.cli.export`).
"""
