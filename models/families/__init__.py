"""The model families: their configs, modules, parameter counts and losses.

Owns T5 / MoE-T5 (:mod:`~meshdsl.models.families.t5`) and the decoder-only Llama
(:mod:`~meshdsl.models.families.llama`), their configs by name (:mod:`~meshdsl.models.families.configs`,
:mod:`~meshdsl.models.families.llama_configs`), the losses that train them
(:mod:`~meshdsl.models.families.loss`), and which model and loss a config means
(:mod:`~meshdsl.models.families.family`). The public paths are the facades
``meshdsl.models.t5``, ``.llama``, ``.configs``, ``.llama_configs`` and ``.loss``.

May import: :mod:`meshdsl.models.data` (it needs none of it), :mod:`meshdsl.layers`, :mod:`meshdsl`.
"""
