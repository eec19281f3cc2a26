"""Mixture-of-experts feed-forward (Switch / GShard): route, dispatch, expert FFNs, combine.

    x[group, group_size, d_model]          tokens, regrouped from [batch, seq, d_model]
    routing = router(x)                    dispatch, combine: [group, group_size, expert_choice, capacity]
    dispatched[group, expert_choice, capacity, d_model] = x · dispatch            (local)
    expert_in = rename(dispatched, group -> group_all, expert_choice -> experts)
    expert_out[experts, group_all, capacity, d_model] = FFN_experts(expert_in)
    y[group, group_size, d_model] = rename(expert_out, back) · combine

Expert parallelism is the layout ``group: data, experts: data`` (``batch: data`` too). Routing and
the dispatch einsum see only ``group`` split, so they are local to each device's groups (the
router's expert dim is ``expert_choice``, which no layout places). The rename moves the split from
``group`` to ``experts``; the expert kernels ``[experts, d_model, d_ff]`` want ``experts`` split, so
the rewriter emits **one all-to-all**: every device sends each expert's slots of its groups to the
device holding that expert. The expert FFN is local, and the combine einsum, which wants ``group``
split again, brings the outputs back with **one all-to-all**. The backward pass mirrors the two.

``capacity`` slots per expert and group: ``ceil(group_size * capacity_factor * top_k / experts)``
(at least ``min_capacity``), with ``capacity_factor`` for training and ``eval_capacity_factor``
otherwise, or a fixed ``expert_capacity`` (Hugging Face's config). Tokens past an expert's capacity
are dropped: zero output, so they pass through the block's residual connection. ``dropped="hf"``
reproduces Hugging Face's SwitchTransformersSparseMLP instead, which returns ``gate * x`` for a
dropped token (top-1 only).

Returns ``(y, metrics)``: ``load_balancing_loss`` and ``router_z_loss`` (scalars; a model scales
them, Switch: 1e-2 and 1e-3), ``dropped_fraction`` (scalar) and ``expert_load`` (``[experts]``, the
fraction of assignments each expert was chosen for, before capacity).

Under a pipeline (a layout splitting the stacked ``layers``, ``microbatches={"batch": M}``) a layer
sees one microbatch: ``per_token=True`` returns the metrics per token (their means are the above),
which the pipeline joins from the microbatches exactly. Routing is per group and capacity per
group, so a microbatch routes and drops exactly the tokens the whole batch would whenever each
group lies within one sequence (the default ``group_size``) or, for larger groups, within one
device's rows of a microbatch. Router jitter and expert dropout draw over ``group``, which the
pipeline numbers by its rows' global positions (``group`` is cut like ``batch``), so they are the
unsharded program's draws. Under 1F1B, MoE-T5 sums the metrics per row in the carry and the loss
reads them in the stack's head (:class:`meshdsl.models.t5.Stack`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import meshdsl as md

from .feedforward import FeedForward
from .params import cast, stack_dims
from .router import EXPERT_CHOICE, Router, expert_capacity

__all__ = ["MoE"]

DROPPED = ("zero", "hf")


class MoE(nnx.Module):
    """Switch (``top_k=1``) or GShard (``top_k=2``) layer: ``router`` + per-expert ``experts`` FFN
    (kernels ``[*stack, experts, d_model, d_ff]``, ``[*stack, experts, d_ff, d_model]``).

    ``group_size``: tokens per routing group (default: the ``seq`` length, one group per sequence
    as in Hugging Face). ``activation``/``dropout_rate``: the experts' FFN (Switch: ReLU).
    """

    def __init__(self, d_model: md.Dim, d_ff: md.Dim, experts: md.Dim, *, rngs: nnx.Rngs, top_k: int = 1,
                 capacity_factor: float = 1.25, eval_capacity_factor: float = 2.0,
                 expert_capacity: int | None = None, min_capacity: int = 4, group_size: int | None = None,
                 jitter_noise: float = 0.0, renormalize: bool = True, activation: str = "relu",
                 dropout_rate: float = 0.0, dropped: str = "zero", router_scale: float | None = None,
                 stack=None, dtype=jnp.float32, param_dtype=jnp.float32):
        if dropped not in DROPPED or (dropped == "hf" and top_k != 1):
            raise md.MeshDSLError(f"MoE: dropped must be one of {DROPPED} ('hf' only with top_k=1), got {dropped!r}")
        self.d_model, self.experts_dim, self.top_k = d_model, experts, top_k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.expert_capacity, self.min_capacity, self.group_size = expert_capacity, min_capacity, group_size
        self.dropped, self.dtype = dropped, dtype
        self.router = Router(d_model, experts, rngs=rngs, top_k=top_k, jitter_noise=jitter_noise,
                             renormalize=renormalize, stack=stack, scale=router_scale, param_dtype=param_dtype)
        self.experts = FeedForward(d_model, d_ff, rngs=rngs, activation=activation, dropout_rate=dropout_rate,
                                   stack=[*stack_dims(stack), experts], dtype=dtype, param_dtype=param_dtype)

    def capacity(self, group_size: int, train: bool) -> int:
        """Slots per expert and group for groups of ``group_size`` tokens."""
        if self.expert_capacity is not None:
            return min(group_size, self.expert_capacity)
        factor = self.capacity_factor if train else self.eval_capacity_factor
        return expert_capacity(group_size, self.experts_dim.size, self.top_k, factor, self.min_capacity)

    def __call__(self, x: md.NamedArray, *, key=None, train: bool | None = None, per_token: bool = False):
        """``x`` ``[batch, seq, d_model]`` (any token dims) -> ``(y [same dims], metrics)``.

        ``key``: PRNG key for jitter noise and expert dropout. ``train`` (default: a key was given)
        picks the capacity factor and enables jitter. ``per_token``: the metrics per token, over
        ``x``'s token dims (``[batch, seq]``; ``expert_load`` ``[batch, seq, expert_choice]``), whose means
        are the usual metrics (what a pipeline's microbatches can return, :func:`router.token_metrics`).
        """
        train = key is not None if train is None else train
        jitter_key, dropout_key = (None, None) if key is None else tuple(jax.random.split(key))
        x = cast(x, self.dtype)
        tokens = self._group(x)
        capacity = self.capacity(tokens.dims["group_size"].size, train)
        routing = self.router(tokens, capacity, key=jitter_key if train else None, per_token=per_token)

        dispatched = md.einsum(tokens, routing.dispatch.astype(x.dtype),
                               out=["group", EXPERT_CHOICE, "capacity", self.d_model.name])
        expert_in = md.rename(dispatched, {"group": "group_all", EXPERT_CHOICE: self.experts_dim.name})
        expert_out = self.experts(expert_in, key=dropout_key)
        expert_out = md.rename(expert_out, {self.experts_dim.name: EXPERT_CHOICE, "group_all": "group"})
        y = md.einsum(expert_out, routing.combine.astype(x.dtype), out=["group", "group_size", self.d_model.name])

        if self.dropped == "hf":  # HF keeps a dropped token's input, scaled by its router probability
            routed = md.sum(routing.dispatch, [EXPERT_CHOICE, "capacity"])
            y = y + ((1.0 - routed) * routing.gate).astype(x.dtype) * tokens
        metrics = routing.metrics
        if per_token:
            metrics = {k: self._ungroup(v, x) for k, v in metrics.items()}
        return self._ungroup(y, x), metrics

    def _group(self, x: md.NamedArray) -> md.NamedArray:
        """``[*tokens, d_model]`` -> ``[group, group_size, d_model]`` (row-major over the token dims)."""
        token_dims = [d for d in x.dims if d.name != self.d_model.name]
        total = math.prod(d.size for d in token_dims)
        size = self.group_size
        if size is None:
            if "seq" not in x.names:
                raise md.ShapeError(f"MoE: input [{x.dims}] has no 'seq' dim; pass group_size=")
            size = x.dims["seq"].size
        if total % size:
            raise md.ShapeError(f"MoE: group_size={size} does not divide the {total} tokens of [{x.dims}]")
        ordered = [*(d.name for d in token_dims), self.d_model.name]
        if list(x.names) != ordered:
            x = md.transpose(x, ordered)
        return md.reshape(x, [md.Dim("group", total // size), md.Dim("group_size", size), self.d_model])

    def _ungroup(self, y: md.NamedArray, like: md.NamedArray) -> md.NamedArray:
        """``[group, group_size, *rest]`` -> ``like``'s token dims (in its order) and ``rest``."""
        token_dims = [d for d in like.dims if d.name != self.d_model.name]
        rest = [d for d in y.dims if d.name not in ("group", "group_size")]
        if y.names[:2] != ("group", "group_size"):
            y = md.transpose(y, ["group", "group_size", *(d.name for d in rest)])
        y = md.reshape(y, [*token_dims, *rest])
        names = [n for n in like.names if n in y.names] + [d.name for d in rest if d.name not in like.names]
        return y if list(y.names) == names else md.transpose(y, names)
