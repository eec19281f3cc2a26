"""What both generators share (:mod:`~meshdsl.models.generation` for encoder-decoders,
:mod:`~meshdsl.models.decoding.generation_lm` for decoder-only models): the prefill and decode layouts a
call's ``mesh`` and ``layout`` give, and the KV cache's length."""

from __future__ import annotations

import jax

import meshdsl as md

__all__ = ["phase_layouts", "cache_length"]


def phase_layouts(mesh, layout):
    """(mesh, prefill layout, decode layout); no mesh: one device, nothing split."""
    if mesh is None:
        if layout is not None:
            raise md.MeshDSLError("generate: a layout needs a mesh= (e.g. md.Mesh({'data': 2, 'model': 4}))")
        return md.Mesh({"data": 1}, devices=jax.devices()[:1]), md.Layout({}), md.Layout({})
    if isinstance(layout, dict) and not isinstance(layout, md.Layout):
        unknown = set(layout) - {"prefill", "decode"}
        if unknown or not layout:
            raise md.MeshDSLError(f"generate: a layout per phase is a dict with keys 'prefill' and 'decode', "
                                  f"got {sorted(layout)}")
        pre, dec = layout.get("prefill", md.Layout({})), layout.get("decode", md.Layout({}))
    else:
        pre = dec = md.Layout({}) if layout is None else layout
    for name, lay in (("prefill", pre), ("decode", dec)):
        if isinstance(lay, str):
            lay = md.Layout.parse(lay)
        if not isinstance(lay, md.Layout):
            raise md.MeshDSLError(f"generate: the {name} layout must be an md.Layout, got {type(lay).__name__}")
        if name == "prefill":
            pre = lay
        else:
            dec = lay
    return mesh, pre, dec


def cache_length(max_new_tokens: int, mesh: md.Mesh | None = None) -> int:
    """Positions in the KV cache: the ``max_new_tokens`` decoder inputs, rounded up to a multiple
    of 8 (and of the mesh size, so any ``kv_length`` rule divides it). Extra positions are masked;
    a fixed rounding keeps the attention sums the same on every mesh."""
    size = 8
    while size % (mesh.size if mesh is not None else 1):
        size += 8
    return -(-max_new_tokens // size) * size
