"""Dropless mixture-of-experts feed-forward (Mixtral, Qwen-MoE, DeepSeek-style): no capacity.

    logits[tokens, expert_choice] = float32(x) · w_router
    probs = softmax over expert_choice of logits
    gates, index[tokens, choice] = top_k of probs (+ bias, selection only)   k = top_k
    gates = gates / sum over choice of gates                                  (normalize=True)
    out[tokens, choice, d_model] = FFN_index(x)                  md.expert_ffn: grouped matmuls
    y[tokens, d_model] = sum over choice of gates · out  (+ sigmoid(x · w_gate) · shared(x))

Every token reaches all of its ``top_k`` experts: :func:`meshdsl.expert_ffn` sorts the
assignments by expert and runs the experts as grouped matmuls (``jax.lax.ragged_dot``); under
expert parallelism (``experts: data`` with the tokens split on ``data``) it sends each row to the
device holding its expert in one all-to-all of a buffer large enough for any routing and brings
the results back in one more - never a dropped token. ``experts: model`` with the tokens whole
there is a partial sum instead; ``d_ff: model`` splits each expert Megatron-style.

``order="softmax-topk"`` (Mixtral, Qwen) takes the top-k of the probabilities; ``"topk-softmax"``
the softmax of the top-k logits (equal to softmax-topk with ``normalize``). ``normalize``: the
chosen gates sum to one (Mixtral; Qwen's ``norm_topk_prob``). ``balance_bias``: DeepSeek-V3's
auxiliary-loss-free balancing - a per-expert bias added to the scores for choosing only (never to
the gates), moved by :meth:`DroplessMoE.balanced_bias` from the observed load. ``shared_d_ff``: a
shared expert every token goes through (Qwen2-MoE: gated by ``sigmoid(x · w_shared_gate)``).

Returns ``(y, metrics)``: ``load_balancing_loss`` (Hugging Face's Mixtral form: ``E * sum over
choices c and experts e of f_ce * P_e``, f the fraction of tokens whose c-th choice is e, P the
mean probability), ``router_z_loss``, ``expert_load`` (``[experts]``: fraction of assignments) and
``dropped_fraction`` (0: reported to compare with the capacity MoE).

``exchange_factor``: under expert parallelism the default exchange buffer holds the most any
routing can send one device (``tokens x min(top_k, local experts)`` rows), which moves up to
``devices x min(top_k, local experts) / top_k`` times a balanced routing's bytes. A factor ``f``
sizes it at ``f`` times the balanced rows instead (MaxText's static buffer); assignments past it
get zeros and ``dropped_fraction`` says how many - the trainer stops on a step that drops one
(never a silent drop), naming the step and the factor to raise. ``exchange``: ``"ragged"`` sends
only the rows (``ragged_all_to_all``, the default on GPU and TPU), ``"padded"`` the whole buffer
(the default on CPU, whose XLA has no ragged all-to-all).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import meshdsl as md

from .dense import Dense
from .feedforward import FeedForward
from .params import cast, stack_dims
from .router import EXPERT_CHOICE

__all__ = ["DroplessMoE", "ORDERS"]

ORDERS = ("softmax-topk", "topk-softmax")


class BalanceBias(nnx.Variable):
    """A non-trained per-expert bias of the routing scores (auxiliary-loss-free balancing)."""


class DroplessMoE(nnx.Module):
    """Router ``[*stack, d_model, expert_choice]`` + experts (``experts.wi_0/wi_1/wo`` kernels
    ``[*stack, experts, d_model, d_ff]`` etc., as :class:`~meshdsl.layers.MoE`) + optional shared
    expert (``shared``, ``shared_gate``). ``activation``: the experts' (SwiGLU: ``"gated-silu"``)."""

    def __init__(self, d_model: md.Dim, d_ff: md.Dim, experts: md.Dim, *, rngs: nnx.Rngs, top_k: int = 2,
                 order: str = "softmax-topk", normalize: bool = True, activation: str = "gated-silu",
                 shared_d_ff: md.Dim | None = None, shared_gate: bool = True, balance_bias: bool = False,
                 router_scale: float | None = None, exchange_factor: float | None = None, exchange: str | None = None,
                 stack=None,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        if order not in ORDERS:
            raise md.MeshDSLError(f"DroplessMoE: order must be one of {ORDERS}, got {order!r}")
        if not 1 <= top_k <= experts.size:
            raise md.MeshDSLError(f"DroplessMoE: top_k={top_k} must be in 1..{experts.size} (number of experts)")
        self.d_model, self.experts_dim, self.top_k = d_model, experts, top_k
        self.order, self.normalize, self.activation, self.dtype = order, normalize, activation, dtype
        self.exchange_factor, self.exchange = exchange_factor, exchange
        self.router = Dense(d_model, md.Dim(EXPERT_CHOICE, experts.size), rngs=rngs, stack=stack,
                            dtype=jnp.float32, param_dtype=param_dtype, scale=router_scale)
        kw = dict(rngs=rngs, activation=activation, dtype=dtype, param_dtype=param_dtype)
        self.experts = FeedForward(d_model, d_ff, stack=[*stack_dims(stack), experts], **kw)
        self.shared = None if shared_d_ff is None else FeedForward(d_model, shared_d_ff, stack=stack, **kw)
        self.shared_gate = None if shared_d_ff is None or not shared_gate else Dense(
            d_model, md.Dim("shared_gate", 1), rngs=rngs, stack=stack, dtype=dtype, param_dtype=param_dtype)
        self.bias = BalanceBias(md.zeros([*stack_dims(stack), md.Dim(EXPERT_CHOICE, experts.size)])) \
            if balance_bias else None

    def kernels(self) -> list:
        """The experts' kernels in :func:`meshdsl.expert_ffn`'s order, cast to the compute dtype."""
        ffn = self.experts
        ws = [ffn.wi_0, ffn.wi_1, ffn.wo] if ffn.gated else [ffn.wi, ffn.wo]
        return [cast(w.kernel.get_value(), self.dtype) for w in ws]

    def route(self, x: md.NamedArray):
        """``(gates [*tokens, choice] float32, index [*tokens, choice], logits, probs)``."""
        logits = self.router(x.astype(jnp.float32))
        probs = md.softmax(logits, EXPERT_CHOICE)
        scores = probs if self.bias is None else probs + self.bias.get_value()
        if self.order == "topk-softmax" and self.bias is None:
            top, index = md.top_k(logits, EXPERT_CHOICE, k=self.top_k, out="choice")
            return md.softmax(top, "choice"), index, logits, probs
        _, index = md.top_k(scores, EXPERT_CHOICE, k=self.top_k, out="choice")
        chosen = md.one_hot(index, probs.dims[EXPERT_CHOICE], dtype=jnp.float32)
        gates = md.sum(chosen * probs, EXPERT_CHOICE)                 # the probabilities, never the bias
        if self.normalize or self.order == "topk-softmax":
            gates = gates / md.sum(gates, "choice")
        return gates, index, logits, probs

    def __call__(self, x: md.NamedArray, *, key=None, train: bool | None = None):
        """``x`` ``[*tokens, d_model]`` -> ``(y [same dims], metrics)``. ``key``/``train``: accepted
        for the trainer (no jitter, no dropout here)."""
        del key, train
        x = cast(x, self.dtype)
        gates, index, logits, probs = self.route(x)
        out = md.expert_ffn(x, index, self.kernels(), experts=self.experts_dim.name,
                            activation=_act_name(self.activation), distinct=True, exchange_factor=self.exchange_factor,
                            exchange=self.exchange)
        out, dropped = out if self.exchange_factor is not None else (out, None)
        tokens = [n for n in x.names if n != self.d_model.name]
        y = md.einsum(out, gates.astype(out.dtype), out=[*tokens, self.d_model.name])
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = s * md.sum(md.sigmoid(self.shared_gate(x)), "shared_gate")
            y = y + s
        y = md.transpose(y, list(x.names)) if y.names != x.names else y
        metrics = _metrics(logits, probs, index, self.top_k)
        if dropped is not None:
            metrics["dropped_fraction"] = dropped
        return y, metrics

    def balanced_bias(self, expert_load: md.NamedArray, rate: float = 1e-3) -> md.NamedArray:
        """DeepSeek-V3's update: each expert's bias moves by ``rate`` towards balance (up where its
        load ``[experts]`` is under the mean, down where over). Assign it to ``self.bias``."""
        if self.bias is None:
            raise md.MeshDSLError("DroplessMoE.balanced_bias: the layer was built with balance_bias=False")
        load = md.rename(expert_load, {self.experts_dim.name: EXPERT_CHOICE})
        return self.bias.get_value() + rate * md.sign(md.mean(load) - load)


def _act_name(activation: str) -> str:
    """:func:`meshdsl.expert_ffn`'s name of a Hugging Face style activation (``gated-`` stripped)."""
    name = activation[len("gated-"):] if activation.startswith("gated-") else activation
    return "gelu_new" if activation == "gated-gelu" else name


def _metrics(logits, probs, index, top_k: int) -> dict:
    """The router's losses and the experts' load over every token."""
    experts = probs.dims[EXPERT_CHOICE]
    chosen = md.one_hot(index, experts, dtype=jnp.float32)            # [*tokens, choice, expert_choice]
    tokens = [n for n in index.names if n != "choice"]
    per_choice = md.mean(chosen, tokens)                              # f_ce
    mean_prob = md.mean(probs, tokens)                                # P_e
    load = md.sum(per_choice, "choice") / float(top_k)
    return {
        "load_balancing_loss": md.sum(per_choice * mean_prob) * float(experts.size),
        "router_z_loss": md.mean(md.square(md.logsumexp(logits, EXPERT_CHOICE))),
        "dropped_fraction": md.zeros([]),
        "expert_load": md.rename(load, {EXPERT_CHOICE: "experts"}),
    }
