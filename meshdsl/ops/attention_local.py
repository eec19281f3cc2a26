"""Attention where its placement puts it: local blocks of every operand, the flash computation
(:mod:`meshdsl.ops.flash`) with its hand-written backward, and - where the keys stay split and the
queries do not (``partial``) - the devices' results combined by their softmax statistics."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..rewrite import collectives as C
from . import flash
from ..names.dims import Shape
from ..names.named import NamedArray
from .attention_bias import is_bias_fn, local_table, named_operands
from .attention_cost import kernel, record
from .common import as_named

__all__ = ["local_attention", "operands", "dense", "chunk"]


def chunk(spec, k, v, b, m, positions) -> flash.Chunk:
    """The flash chunk of local keys and values: ``b`` is the bias's block, or the bias
    function's table."""
    if spec.bias_fn is not None:
        return flash.Chunk(k, v, None, m, positions, b)
    return flash.Chunk(k, v, b, m, positions)


def _local_positions(ctx, p, dim, axes, vary):
    """This device's block of positions along ``dim``: given ones relaid (a NamedArray) or sliced
    (numpy constants); else global indices."""
    if isinstance(p, NamedArray):
        return ctx.local(p, {dim.name: axes}, vary)
    block = dim.size // ctx.axes_size(axes) if axes else dim.size
    start = ctx.block_start(dim.name, dim.size, axes, block)
    if p is not None:
        return jax.lax.dynamic_slice_in_dim(jnp.asarray(p, jnp.int32), jnp.asarray(start, jnp.int32), block)
    iota = jnp.arange(block, dtype=jnp.int32)
    return jnp.asarray(start, jnp.int32) + (0 if jnp.ndim(start) == 1 else iota)


def operands(ctx, spec, dims, axes, q, k, v, bias, mask, pos, vary):
    """Local blocks of everything, placed by ``axes`` (a bias function's table: its blocks)."""
    local = [ctx.local(x, axes, vary) for x in (q, k, v)]
    if is_bias_fn(bias):
        b = local_table(ctx, bias[1], axes, vary)
    else:
        b = ctx.local(as_named(ctx, bias), axes, vary) if bias is not None else None
    m = ctx.local(as_named(ctx, mask), axes, vary) if mask is not None else None
    qp = _local_positions(ctx, pos[0], dims[spec.length], axes[spec.length], vary)
    kp = _local_positions(ctx, pos[1], dims[spec.over], axes[spec.over], vary)
    return local, b, m, qp, kp


def local_attention(ctx, spec, dims, axes, q, k, v, bias, mask, pos, block, strategy="local", ring=(),
                    implementation="flash"):
    """Attention where ``axes`` puts it; a split ``over`` (``partial``) combines the devices'
    results by their statistics. ``implementation``: ``"flash"`` (:mod:`meshdsl.ops.flash`), or
    ``"cudnn"`` / ``"xla"`` (``jax.nn.dot_product_attention``) where the keys are whole."""
    vary = ctx.vary(axes.values(), [q, k, v] + named_operands(bias, mask))
    (ql, kl, vl), b, m, qp, kp = operands(ctx, spec, dims, axes, q, k, v, bias, mask, pos, vary)
    split = axes[spec.over]
    out_dtype = jnp.float32 if split else v.dtype
    if strategy == "local" and axes[spec.length] and not split:   # the queries split, the keys brought whole
        strategy, ring = "gather", axes[spec.length]                 # (the plan relaid them): a gather's work
    scope = record(ctx, spec, dims, "partial" if split else strategy, split or ring, ql, kl, vl, v.dtype, pos, block)
    if implementation != "flash" and not split:
        aligned = pos[0] is None and pos[1] is None and not axes[spec.length] and dims[spec.length].size == dims[spec.over].size

        def library(ql, kl, vl, b, m, qp, kp):   # jax's kernel and its own gradient, as one custom_vjp
            def attend(ql, kl, vl, b):
                return flash.dot_product(spec, ql, chunk(spec, kl, vl, b, m, kp), qp, implementation, aligned)
            return jax.vjp(attend, ql, kl, vl, b)

        def pullback(vjp, ct):
            return (*vjp(ct), None, None, None)

        out = C.attributed_vjp(ctx, kernel(scope, "f", library), kernel(scope, "b", pullback))(ql, kl, vl, b, m, qp, kp)
        return ctx.out(out.astype(v.dtype), Shape(dims[n] for n in spec.out), axes)

    # every array is an argument (a custom_vjp closing over a tracer breaks under remat and scan);
    # the mask and positions get no gradient
    def forward(ql, kl, vl, b, m, qp, kp):
        out, lse = flash.attend(spec, ql, chunk(spec, kl, vl, b, m, kp), qp, block, block)
        return (out.astype(out_dtype), lse), (ql, kl, vl, b, m, qp, kp, out, lse)

    def backward(res, ct):
        ql, kl, vl, b, m, qp, kp, out, lse = res
        dout, dlse = (dense(x, like) for x, like in zip(ct, (out, lse)))
        grads = flash.attend_backward(spec, ql, chunk(spec, kl, vl, b, m, kp), qp, out, lse,
                                      dout.astype(vl.dtype), dlse, block, block)
        return (*grads, None, None, None)

    def types(ql, kl, vl, b, m, qp, kp):
        out, lse = flash.attend_types(spec, ql, chunk(spec, kl, vl, b, m, kp), qp)
        return out.astype(out_dtype), lse

    out, lse = C.attributed_vjp(ctx, kernel(scope, "f", forward), kernel(scope, "b", backward),
                                priced=types)(ql, kl, vl, b, m, qp, kp)
    if split:
        out = _combine(ctx, spec, out, lse, split).astype(v.dtype)
    return ctx.out(out, Shape(dims[n] for n in spec.out), axes)


def dense(ct, like):
    """A cotangent jax passed symbolically as zero, as zeros."""
    if isinstance(ct, jax.custom_derivatives.SymbolicZero) or ct is None:
        return jnp.zeros(like.shape, like.dtype)
    return ct


def _combine(ctx, spec, out, lse, axes):
    """Each device's attention to its keys, ``(out, lse)``, made the attention to all: weights
    ``exp(lse - max)``, one pmax and two psums over ``axes``."""
    top = C.pmax(ctx, jax.lax.stop_gradient(lse), axes, "attention statistics (max)")
    w = jnp.exp(lse - top)
    total = C.psum(ctx, w, axes, "attention statistics (sum)")
    num = C.psum(ctx, out * flash.expand(w, spec.stats, spec.out), axes, "attention weighted values")
    return num / flash.expand(total, spec.stats, spec.out)
