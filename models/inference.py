"""Decode-step layouts and their cost, by their public path:
``from meshdsl.models.inference import INFERENCE_LAYOUTS, decode_step_cost``.

A facade: the code lives in :mod:`meshdsl.models.decoding.inference`.
"""

from meshdsl.models.decoding.inference import INFERENCE_LAYOUTS, bytes_per_device, decode_step_cost, inference_layout

__all__ = ["INFERENCE_LAYOUTS", "inference_layout", "decode_step_cost", "bytes_per_device"]
