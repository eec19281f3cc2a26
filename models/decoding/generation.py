"""``meshdsl.models.generate``: greedy, sampled and beam-search decoding with a KV cache.

    tokens = generate(model, inputs, max_new_tokens=32)                          # greedy
    tokens = generate(model, inputs, max_new_tokens=32, method="sample", key=jax.random.key(0),
                      temperature=0.8, top_k=40, top_p=0.95)
    tokens = generate(model, inputs, max_new_tokens=32, method="beam", num_beams=4,
                      mesh=md.Mesh({"data": 2, "model": 4}),
                      layout={"prefill": md.Layout({"batch": "data"}),
                              "decode": md.Layout({"heads": "model", "d_ff": "model"})})

Semantics are Hugging Face ``generate``'s for the matching options: the decoder starts from token
0 (pad), a finished row gets pad (0) after its ``eos_id``, the output ``[batch, length]`` starts
with that start token and stops as soon as every row has finished (or after ``max_new_tokens``);
encoder pad tokens are masked when the inputs contain any. Beam search is HF's vectorised beam
search (``early_stopping=False``, ``length_penalty=1.0``): ``2 * num_beams`` candidates per step,
finished hypotheses scored ``sum_logprobs / generated_length``, the heuristic stop.

Everything that touches the model runs in two lowered programs, each compiled once: ``prefill``
(encoder, cross-attention keys/values, an empty cache) and one decode ``step`` reused for every
position (its inputs never change shape). Selection happens inside the step in named ops, so the
tokens do not depend on the layout: greedy is ``md.argmax`` over ``vocab``; sampling is Gumbel-max
with ``md.random.uniform`` (layout-invariant) under ``fold_in(key, position)``, after temperature,
top-k and top-p filtering (:mod:`meshdsl.models.decoding.sampling`); beam search reorders the cache and the
hypotheses with one-hot einsums over the ``beam`` dim, never a positional gather.
"""

from __future__ import annotations

import difflib

import jax
import jax.numpy as jnp
import numpy as np

import meshdsl as md

from .decode import token_ids, decode_logits, encoder_mask_like_hf, prefill
from .generation_lm import generate_lm
from .generation_setup import cache_length, phase_layouts as _layouts
from .sampling import filter_logits, gumbel_argmax

__all__ = ["generate", "Generator", "METHODS"]

METHODS = ("greedy", "sample", "beam")
PAD, NEG = 0, -1.0e9
_PREFILLS: dict = {}      # (mesh, layout, param_gather, beams) -> (lowered prefill, trace counter)
_GENERATORS: dict = {}    # generate()'s options -> Generator (compiled programs reused across calls)


def _check(method, max_new_tokens, num_beams, temperature, top_k, top_p, key, vocab):
    if method not in METHODS:
        close = difflib.get_close_matches(str(method), METHODS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise md.MeshDSLError(f"generate: method must be one of {METHODS}, got {method!r}{hint}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise md.MeshDSLError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if method == "beam" and (not isinstance(num_beams, int) or num_beams < 1 or 2 * num_beams > vocab):
        raise md.MeshDSLError(f"generate: num_beams must be an int in 1..{vocab // 2} (2 * num_beams candidates "
                              f"from a vocabulary of {vocab}), got {num_beams!r}")
    if method == "sample":
        if key is None:
            raise md.MeshDSLError("generate: method='sample' needs key= (a jax PRNG key, e.g. jax.random.key(0))")
        if not temperature > 0:
            raise md.MeshDSLError(f"generate: temperature must be > 0, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or not 0 < top_k <= vocab):
            raise md.MeshDSLError(f"generate: top_k must be an int in 1..{vocab} or None, got {top_k!r}")
        if top_p is not None and not 0 < top_p <= 1:
            raise md.MeshDSLError(f"generate: top_p must be in (0, 1] or None, got {top_p!r}")
    elif key is not None or top_k is not None or top_p is not None or temperature != 1.0:
        raise md.MeshDSLError(f"generate: key, temperature, top_k and top_p are for method='sample', "
                              f"not {method!r}")


class Generator:
    """The lowered prefill and decode-step programs of one model, mesh, layout and method; reuse
    it to generate many batches of one shape without compiling again. ``traces`` counts how often
    each program was traced (1 each after any number of tokens and calls)."""

    def __init__(self, mesh, prefill_layout, decode_layout, *, method="greedy", num_beams=4, eos_id=1,
                 temperature=1.0, top_k=None, top_p=None, param_gather="keep"):
        self.mesh, self.method, self.num_beams, self.eos_id = mesh, method, num_beams, eos_id
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self._step_traces = 0
        extra = (md.Dim("beam", num_beams),) if method == "beam" else ()
        self.extra = extra

        prefill_key = (mesh, prefill_layout, param_gather, num_beams if method == "beam" else 0)
        if prefill_key not in _PREFILLS:    # greedy and sampling share it; traced once per shape
            counter = {"prefill": 0}

            def pre(model, ids, mask, max_length_like):
                counter["prefill"] += 1
                return prefill(model, ids, max_length_like.shape[0], mask=mask, extra=extra)

            _PREFILLS[prefill_key] = (md.lower(pre, mesh, prefill_layout, param_gather=param_gather), counter)
        self.prefill, self._prefill_traces = _PREFILLS[prefill_key]

        step = {"greedy": self._greedy_step, "sample": self._greedy_step, "beam": self._beam_step}[method]

        def counted(*args):
            self._step_traces += 1
            return step(*args)

        self.step = md.lower(counted, mesh, decode_layout, param_gather=param_gather)
        self.decode_layout = decode_layout

    @property
    def traces(self) -> dict:
        """How often the prefill (shared by generators of one mesh, layout and beam count) and this
        decode step were traced: once per input shape."""
        return {"prefill": self._prefill_traces["prefill"], "step": self._step_traces}

    # -- greedy and sampling -------------------------------------------------------------------

    def _greedy_step(self, model, state, token, position, done, key):
        logits, state = decode_logits(model, state, token, position)
        if self.method == "sample":
            logits = filter_logits(logits, "vocab", temperature=self.temperature, top_k=self.top_k,
                                   top_p=self.top_p)
            nxt = gumbel_argmax(logits, "vocab", jax.random.fold_in(key, position))
        else:
            nxt = md.argmax(logits, "vocab")
        nxt = md.where(done, PAD, nxt).astype(jnp.int32)
        return state, nxt, md.logical_or(done, md.equal(nxt, self.eos_id))

    # -- beam search (Hugging Face's vectorised beam search, in named ops) ----------------------

    def _beam_step(self, model, state, beams, position, max_new_tokens_like):
        """``beams``: running ``tokens`` [batch, beam] (last token), ``running`` scores, ``seqs``
        [batch, beam, out] (running hypotheses), ``fin_seqs``/``fin_scores``/``fin_done``/``fin_len``
        (the best finished ones) and ``open`` [batch] (HF's early-stop heuristic not yet met)."""
        n, total = self.num_beams, max_new_tokens_like.shape[0]
        logits, state = decode_logits(model, state, beams["tokens"], position)
        logprobs = logits - md.logsumexp(logits, "vocab")
        acc = logprobs + beams["running"]                                  # [batch, beam, vocab]
        k2 = 2 * n
        # the best 2n of beam x vocab: the best 2n of each beam, then the best 2n of those
        v1, i1 = md.top_k(acc, "vocab", k2, out="rank")
        cand = md.Dim("candidate", n * k2)
        v1 = md.reshape(v1, [d for d in v1.dims if d.name not in ("beam", "rank")] + [cand])
        i1 = md.reshape(i1, [d for d in i1.dims if d.name not in ("beam", "rank")] + [cand])
        top, pick = md.top_k(v1, "candidate", k2, out="topk")            # [batch, topk]
        chosen = md.one_hot(pick, cand, jnp.bool_)                         # [batch, topk, candidate]
        token = _select(i1, chosen, "candidate")                          # [batch, topk]
        src = md.floor(pick.astype(jnp.float32) / k2).astype(jnp.int32)          # its beam
        src_beam = md.one_hot(src, md.Dim("beam", n), jnp.bool_)           # [batch, topk, beam]
        out_len = beams["seqs"].dims["out"]
        step_no = position + 1                                            # tokens generated after this one
        seqs = _select(beams["seqs"], src_beam, "beam")                     # [batch, topk, out]
        seqs = md.where(md.equal(md.arange(out_len), step_no), token, seqs)
        hits = md.logical_or(md.equal(token, self.eos_id), step_no >= total)  # [batch, topk]

        # running hypotheses for the next step: the best n that did not just finish
        alive = top + md.where(hits, NEG, 0.0)
        running, keep = md.top_k(alive, "topk", n, out="beam")           # [batch, beam]
        keep_oh = md.one_hot(keep, md.Dim("topk", k2), jnp.bool_)          # [batch, beam, topk]
        new_seqs = _select(seqs, keep_oh, "topk")
        parent = _select(src, keep_oh, "topk")                            # [batch, beam]
        new_tokens = _select(token, keep_oh, "topk")

        # finished hypotheses: merge the ones that just finished (among the top n) with the kept ones
        in_top = md.arange(md.Dim("topk", k2)) < n
        just = md.logical_and(hits, in_top)
        scored = top / step_no.astype(jnp.float32)
        scored = scored + md.where(beams["open"], 0.0, NEG) + md.where(just, 0.0, NEG)
        m = md.Dim("merged", n + k2)
        merged_scores = md.concat([md.rename(beams["fin_scores"], {"beam": "merged"}),
                                   md.rename(scored, {"topk": "merged"})], "merged")
        fin_scores, best = md.top_k(merged_scores, "merged", n, out="beam")
        best_oh = md.one_hot(best, m, jnp.bool_)
        merged = lambda old, new: md.concat([md.rename(old, {"beam": "merged"}),  # noqa: E731
                                             md.rename(new, {"topk": "merged"})], "merged")
        fin_seqs = _select(merged(beams["fin_seqs"], seqs), best_oh, "merged")
        fin_done = md.not_equal(_select(merged(beams["fin_done"].astype(jnp.int32), just.astype(jnp.int32)),
                                        best_oh, "merged"), 0)
        now = md.where(just, step_no, 0)
        fin_len = _select(merged(beams["fin_len"], now), best_oh, "merged")

        # reorder the cache: beam b continues parent[b] (a one-hot einsum over beam)
        parent_oh = md.one_hot(parent, md.Dim("parent", n))                # [batch, beam, parent]
        cache = [tuple(_reorder(t, parent_oh) for t in kv) for kv in state["cache"]]
        state = {**state, "cache": cache}

        # HF's heuristic: can the best running beam still beat the worst finished one?
        best_running = md.max(running, "beam") / step_no.astype(jnp.float32)
        worst = md.where(fin_done, md.min(fin_scores, "beam"), NEG)
        better = md.max(md.where(best_running > worst, 1, 0), "beam")
        still_open = md.logical_and(beams["open"], md.not_equal(better, 0))
        every_hit = md.min(md.where(hits, 1, 0), "topk")
        beams = {"tokens": new_tokens, "running": running, "seqs": new_seqs, "fin_seqs": fin_seqs,
                 "fin_scores": fin_scores, "fin_done": fin_done, "fin_len": fin_len, "open": still_open}
        return state, beams, every_hit


def _select(x: md.NamedArray, onehot: md.NamedArray, dim: str) -> md.NamedArray:
    """``x`` picked along ``dim`` by a boolean one-hot ``[..., new, dim]``: a masked sum, exact for
    integers and floats; no positional gather, so any layout of ``dim`` works."""
    zero = jnp.zeros((), x.dtype)
    picked = md.sum(md.where(onehot, x, zero), dim)
    order = [n for n in onehot.names if n != dim] + [n for n in x.names if n not in onehot.names and n != dim]
    return md.transpose(picked, order) if picked.names != tuple(order) else picked


def _reorder(cache: md.NamedArray, parent_oh: md.NamedArray) -> md.NamedArray:
    """Cache ``[layers, batch, beam, ...]`` with beam ``b`` taken from beam ``parent[b]``."""
    src = md.rename(cache, {"beam": "parent"})
    out = md.einsum(src, parent_oh.astype(cache.dtype), out=list(cache.names))
    return out


def _as_ids(inputs) -> md.NamedArray:
    if isinstance(inputs, md.NamedArray):
        return inputs
    arr = np.asarray(inputs)
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise md.MeshDSLError(f"generate: inputs must be integer token ids [batch, length], got "
                              f"{arr.dtype}{arr.shape}")
    return md.named(jnp.asarray(arr, jnp.int32), "batch length")


def generate(model, inputs, *, max_new_tokens: int, method: str = "greedy", temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, num_beams: int = 4, eos_id: int = 1,
             key=None, mesh: md.Mesh | None = None, layout=None, generator: Generator | None = None,
             attention_mask=None):
    """Token ids ``[batch, length]`` (a NamedArray) continuing ``inputs`` ``[batch, length]``;
    see the module docstring. ``layout``: one :class:`md.Layout` for both phases or
    ``{"prefill": ..., "decode": ...}``. ``generator``: reuse compiled programs across calls.

    A decoder-only model (Llama) continues the prompt ``inputs``: the output is the prompt and the
    new tokens, left-padded prompts marked by ``attention_mask`` (see
    :mod:`meshdsl.models.decoding.generation_lm`; greedy and sampling)."""
    ids = _as_ids(inputs)
    _check(method, max_new_tokens, num_beams, temperature, top_k, top_p, key, model.config.vocab)
    if getattr(model.config, "decoder_only", False):
        return generate_lm(model, ids, max_new_tokens=max_new_tokens, method=method, temperature=temperature,
                           top_k=top_k, top_p=top_p, eos_id=eos_id, key=key, mesh=mesh, layout=layout,
                           attention_mask=attention_mask, generator=generator)
    if attention_mask is not None:
        raise md.MeshDSLError("generate: attention_mask is for decoder-only prompts; T5 masks its encoder's pad "
                              "tokens (0) itself")
    if generator is None:
        mesh, pre_layout, dec_layout = _layouts(mesh, layout)
        options = (mesh, pre_layout, dec_layout, method, num_beams if method == "beam" else 0, eos_id,
                   temperature, top_k, top_p)
        if options not in _GENERATORS:
            _GENERATORS[options] = Generator(mesh, pre_layout, dec_layout, method=method, num_beams=num_beams,
                                             eos_id=eos_id, temperature=temperature, top_k=top_k, top_p=top_p)
        generator = _GENERATORS[options]
    g = generator
    ids = md.named(jnp.asarray(token_ids(ids).array, jnp.int32), "batch length")
    mask = encoder_mask_like_hf(ids)
    total = cache_length(max_new_tokens, g.mesh)
    placed = md.place(model, g.mesh, g.decode_layout)
    state = g.prefill(md.place(model, g.mesh, g.prefill.layout) if g.prefill.layout != g.decode_layout else placed,
                      ids, mask, jnp.zeros((total,), jnp.int8))
    batch = ids.dims["batch"]
    if g.method == "beam":
        return _beam(g, placed, state, batch, max_new_tokens)
    token = md.zeros([batch], jnp.int32)
    done = md.zeros([batch], jnp.bool_)
    out = [np.zeros((batch.size,), np.int32)]
    rng = key if key is not None else jax.random.key(0)
    for t in range(max_new_tokens):
        state, token, done = g.step(placed, state, token, jnp.int32(t), done, rng)
        out.append(np.asarray(token.array))
        if bool(np.all(np.asarray(done.array))):
            break
    return md.named(jnp.asarray(np.stack(out, 1)), "batch length")


def _beam(g, model, state, batch, max_new_tokens):
    n = g.num_beams
    beam, out = md.Dim("beam", n), md.Dim("out", 1 + max_new_tokens)
    running = np.full((batch.size, n), NEG, np.float32)
    running[:, 0] = 0.0
    beams = {"tokens": md.zeros([batch, beam], jnp.int32), "running": md.named(jnp.asarray(running), [batch, beam]),
             "seqs": md.zeros([batch, beam, out], jnp.int32), "fin_seqs": md.zeros([batch, beam, out], jnp.int32),
             "fin_scores": md.full([batch, beam], NEG, jnp.float32), "fin_done": md.zeros([batch, beam], jnp.bool_),
             "fin_len": md.zeros([batch, beam], jnp.int32), "open": md.ones([batch], jnp.bool_)}
    like = jnp.zeros((max_new_tokens,), jnp.int8)
    for t in range(max_new_tokens):
        state, beams, every_hit = g.step(model, state, beams, jnp.int32(t), like)
        if not bool(np.any(np.asarray(beams["open"].array))) or bool(np.all(np.asarray(every_hit.array))):
            break
    seqs = np.asarray(beams["fin_seqs"].array)[:, 0]
    length = 1 + int(np.asarray(beams["fin_len"].array)[:, 0].max())
    return md.named(jnp.asarray(seqs[:, :length]), "batch length")
