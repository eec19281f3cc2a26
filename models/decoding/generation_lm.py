"""Decoding for decoder-only models (Llama): ``meshdsl.models.generate`` with a prompt.

    tokens = meshdsl.models.generate(llama, prompt_ids, max_new_tokens=32)             # greedy
    tokens = meshdsl.models.generate(llama, prompt_ids, max_new_tokens=32, method="sample",
                                     key=jax.random.key(0), temperature=0.8, top_k=40, top_p=0.95,
                                     mesh=md.Mesh({"data": 2, "model": 4}),
                                     layout=md.Layout({"batch": "data", "kv_heads": "model"}))

Semantics are Hugging Face ``generate``'s for a decoder-only model: the output ``[batch, length]``
is the prompt followed by the new tokens; a finished row gets pad (0) after its ``eos_id``;
decoding stops as soon as every row has finished, or after ``max_new_tokens``. Prompts of
different lengths are left-padded with ``attention_mask`` ``[batch, length]`` (true for real
tokens), as in Hugging Face; without it every token of the prompt is real.

Two lowered programs, each compiled once per shape: ``prefill`` (the prompt through the stack,
its keys and values into the KV cache, the first new token chosen) and one decode ``step`` reused
for every position (:mod:`meshdsl.models.decoding.llama_decode`). The choice is made inside them in named
ops, so the tokens do not depend on the layout: greedy is ``md.argmax`` over ``vocab``; sampling is
Gumbel-max under ``fold_in(key, slot)`` after temperature, top-k and top-p filtering
(:mod:`meshdsl.models.decoding.sampling`). Beam search is T5's only for now.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import meshdsl as md

from .decode import token_ids
from .generation_setup import cache_length, phase_layouts as _layouts
from .llama_decode import decode_logits, prefill
from .sampling import filter_logits, gumbel_argmax

__all__ = ["LMGenerator", "generate_lm"]

PAD = 0
_GENERATORS: dict = {}     # options -> LMGenerator (compiled programs reused across calls)


class LMGenerator:
    """The lowered prefill and decode-step programs of one mesh, layout pair and method; reuse it
    to decode many batches without compiling again. ``traces`` counts how often each program was
    traced (once per input shape)."""

    def __init__(self, mesh, prefill_layout, decode_layout, *, method="greedy", eos_id=1, temperature=1.0,
                 top_k=None, top_p=None, param_gather="keep"):
        if method not in ("greedy", "sample"):
            raise md.MeshDSLError(f"generate: decoder-only models decode with method 'greedy' or 'sample', "
                                  f"not {method!r} (beam search is implemented for T5 only)")
        self.mesh, self.method, self.eos_id = mesh, method, eos_id
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.traces = {"prefill": 0, "step": 0}
        self.prefill = md.lower(self._prefill, mesh, prefill_layout, param_gather=param_gather)
        self.step = md.lower(self._step, mesh, decode_layout, param_gather=param_gather)
        self.prefill_layout, self.decode_layout = prefill_layout, decode_layout

    def _choose(self, logits, done, key, slot):
        """The next token ``[batch]`` (pad where ``done``) and the new ``done``."""
        if self.method == "sample":
            logits = filter_logits(logits, "vocab", temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
            nxt = gumbel_argmax(logits, "vocab", jax.random.fold_in(key, slot))
        else:
            nxt = md.argmax(logits, "vocab")
        nxt = md.where(done, PAD, nxt).astype(jnp.int32)
        return nxt, md.logical_or(done, md.equal(nxt, self.eos_id))

    def _prefill(self, model, ids, mask, cache_like, key):
        self.traces["prefill"] += 1
        state, logits = prefill(model, ids, cache_like.shape[0], mask=mask)
        done = md.zeros([ids.dims["batch"]], jnp.bool_)
        token, done = self._choose(logits, done, key, ids.dims["length"].size - 1)
        return state, token, done

    def _step(self, model, state, token, slot, done, key):
        self.traces["step"] += 1
        logits, state = decode_logits(model, state, token, slot)
        token, done = self._choose(logits, done, key, slot)
        return state, token, done


def _prompt(inputs, attention_mask):
    """``(ids [batch, length] int32, mask or None)`` of a prompt (a NamedArray or an integer array)."""
    if not isinstance(inputs, md.NamedArray):
        inputs = md.named(jnp.asarray(np.asarray(inputs), jnp.int32), "batch length")
    ids = token_ids(inputs)
    ids = md.named(jnp.asarray(ids.array, jnp.int32), "batch length")
    if attention_mask is None:
        return ids, None
    mask = np.asarray(attention_mask.array if isinstance(attention_mask, md.NamedArray) else attention_mask)
    if mask.shape != ids.dims.sizes:
        raise md.MeshDSLError(f"generate: attention_mask {mask.shape} must have the prompt's shape {ids.dims.sizes}")
    if mask.all():
        return ids, None
    if (np.diff(mask.astype(np.int8), axis=1) < 0).any() or not mask[:, -1].all():
        raise md.MeshDSLError("generate: decoder-only prompts are left-padded: attention_mask must be 0 then 1 "
                              "along each row, ending with a real token")
    return ids, md.named(jnp.asarray(mask.astype(bool)), "batch length")


def _fit_layout(ids, mask, mesh, layout):
    """``(ids, mask, extra)``: the prompt left-padded by ``extra`` masked pads to a multiple of the
    devices the prefill layout splits the prompt's positions over (``length``, ``seq``,
    ``kv_seq``); masked pads change no real token's values."""
    devices = max(mesh.axes_size(layout.axes(d)) for d in ("length", "seq", "kv_seq"))
    n = ids.dims["length"].size
    extra = -n % devices
    if not extra:
        return ids, mask, 0
    real = np.ones(ids.dims.sizes, bool) if mask is None else np.asarray(mask.array)
    padded = np.pad(np.asarray(ids.array), ((0, 0), (extra, 0)))
    real = np.pad(real, ((0, 0), (extra, 0)))
    return (md.named(jnp.asarray(padded, jnp.int32), "batch length"), md.named(jnp.asarray(real), "batch length"),
            extra)


def generate_lm(model, inputs, *, max_new_tokens: int, method: str = "greedy", temperature: float = 1.0,
                top_k=None, top_p=None, eos_id: int = 1, key=None, mesh=None, layout=None, attention_mask=None,
                generator: LMGenerator | None = None):
    """Prompt and new tokens ``[batch, length]`` (a NamedArray); see the module docstring."""
    ids, mask = _prompt(inputs, attention_mask)
    if generator is None:
        mesh, pre_layout, dec_layout = _layouts(mesh, layout)
        options = (mesh, pre_layout, dec_layout, method, eos_id, temperature, top_k, top_p)
        if options not in _GENERATORS:
            _GENERATORS[options] = LMGenerator(mesh, pre_layout, dec_layout, method=method, eos_id=eos_id,
                                               temperature=temperature, top_k=top_k, top_p=top_p)
        generator = _GENERATORS[options]
    g = generator
    ids, mask, extra = _fit_layout(ids, mask, g.mesh, g.prefill_layout)
    n = ids.dims["length"].size
    total = cache_length(n + max_new_tokens, g.mesh)
    placed = md.place(model, g.mesh, g.decode_layout)
    rng = key if key is not None else jax.random.key(0)
    pre_model = placed if g.prefill_layout == g.decode_layout else md.place(model, g.mesh, g.prefill_layout)
    state, token, done = g.prefill(pre_model, ids, mask, jnp.zeros((total,), jnp.int8), rng)
    out = [np.asarray(token.array)]
    for t in range(1, max_new_tokens):
        if bool(np.all(np.asarray(done.array))):
            break
        state, token, done = g.step(placed, state, token, jnp.int32(n + t - 1), done, rng)
        out.append(np.asarray(token.array))
    tokens = np.concatenate([np.asarray(ids.array)[:, extra:], np.stack(out, 1)], 1)
    return md.named(jnp.asarray(tokens), "batch length")
