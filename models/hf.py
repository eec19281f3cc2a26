"""Hugging Face import and export, by its public path: ``from meshdsl.models import hf``
(``hf.load``, ``hf.export``, ``hf.save_pretrained``, ``hf.load_pretrained``).

A facade: the code lives in :mod:`meshdsl.models.hub.hf` (Llama's half in :mod:`meshdsl.models.hub.hf_llama`).
"""

from meshdsl.models.hub.hf import config_from_hf, export, hf_config_dict, load, load_pretrained, save_pretrained

__all__ = ["load", "export", "config_from_hf", "save_pretrained", "load_pretrained", "hf_config_dict"]
