"""meshdsl reads jaxpr equations the same under jax 0.10 and jax 0.11+.

jax 0.10 writes a ``scan``'s operand groups as counts (``num_consts``, ``num_carry``);
jax 0.11 and 0.12 as flat trees (``ft_in = (consts, carry, xs)``, ``ft_out = (carry, ys)``). The
installed jax makes only its own form, so the other is built by hand from it: a program's scans
rewritten to the 0.11 form must read exactly as the original (the explain counts, the memory
model), and no module of meshdsl reads ``eqn.params`` outside :mod:`meshdsl.platform.jaxcompat`.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jcore

import meshdsl as md
from meshdsl.platform import jaxcompat
from meshdsl.costmodel import jaxpr_stats, liveness, simplify


class _FlatTree:
    """The part of jax 0.11's ``jax._src.flattree.FlatTree`` that a scan's ``ft_in`` shows: a tuple
    of groups, each a tree of leaves (``len`` counts them)."""

    def __init__(self, *groups):
        self.groups = tuple(tuple(g) for g in groups)

    def unpack(self):
        return self.groups

    def __len__(self):
        return sum(len(g) for g in self.groups)

    def __hash__(self):
        return hash(self.groups)

    def __eq__(self, other):
        return isinstance(other, _FlatTree) and self.groups == other.groups


def _as_jax_0_11(jaxpr):
    """``jaxpr`` (open) with every scan's params, at any depth, in jax 0.11's form."""
    eqns = []
    for eqn in jaxpr.eqns:
        params = {k: _converted(v) for k, v in eqn.params.items()}
        if eqn.primitive.name == "scan":
            n_consts, n_carry = params.pop("num_consts"), params.pop("num_carry")
            params.pop("linear", None)
            params.pop("jaxpr_", None)
            body = params["jaxpr"].jaxpr
            n_in, n_out = len(body.invars), len(body.outvars)
            params["ft_in"] = _FlatTree([None] * n_consts, [None] * n_carry, [None] * (n_in - n_consts - n_carry))
            params["ft_out"] = _FlatTree([None] * n_carry, [None] * (n_out - n_carry))
        eqns.append(eqn.replace(params=params))
    return jaxpr.replace(eqns=eqns)


def _converted(value):
    if isinstance(value, jcore.ClosedJaxpr):
        return jcore.ClosedJaxpr(_as_jax_0_11(value.jaxpr), value.consts)
    if isinstance(value, jcore.Jaxpr):
        return _as_jax_0_11(value)
    if isinstance(value, tuple):
        return tuple(_converted(v) for v in value)
    return value


def _scans(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
        for sub in jaxpr_stats.sub_jaxprs(eqn):
            yield from _scans(sub)


def _scan_program():
    """A stacked two-layer MLP's training step: scans with constants, a carry and stacked xs,
    forward and backward, under a layout that splits the contracted dim (a collective per layer)."""
    x = md.named(jnp.ones((8, 16)), "batch d_model")
    w = md.param(md.named(jnp.ones((2, 16, 32)), "layers d_model d_ff"))

    def step(x, w):
        def loss(w):
            def layer(h, wl):
                return md.tanh(md.einsum(md.einsum(h, wl, out="batch d_ff"), wl, out="batch d_model")), None
            h, _ = md.scan(layer, x, w, dim="layers")
            return md.sum(h * h).array
        return jax.grad(loss)(w)

    mesh = md.Mesh.abstract({"data": 2, "model": 4})
    return md.lower(step, mesh, md.Layout.parse("batch:data;d_ff:model")), (x, w)


def test_a_scan_reads_the_same_from_either_params_form():
    closed = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda c, x: (c + x * 2.0, c * x), c, xs))(
        jnp.ones(3), jnp.ones((5, 3)))
    (eqn,) = _scans(closed.jaxpr)
    (new,) = _scans(_as_jax_0_11(closed.jaxpr))
    assert "ft_in" in new.params and "num_consts" not in new.params
    old_parts, new_parts = jaxcompat.scan_parts(eqn), jaxcompat.scan_parts(new)
    assert (new_parts.length, new_parts.n_consts, new_parts.n_carry) == \
           (old_parts.length, old_parts.n_consts, old_parts.n_carry) == (5, eqn.params["num_consts"], 1)
    assert new_parts.xs == old_parts.xs and len(new_parts.xs) == 1


def test_explain_and_the_memory_model_read_jax_0_11_scans_as_jax_0_10_ones():
    lowered, args = _scan_program()
    closed, _, _ = lowered.trace(*args)
    body = simplify.live(jaxpr_stats.inner_body(closed))
    body = getattr(body, "jaxpr", body)
    new = _as_jax_0_11(body)
    assert any(True for _ in _scans(body)) and all("ft_in" in e.params for e in _scans(new))
    assert jaxpr_stats.name_scopes(new) == jaxpr_stats.name_scopes(body) != {}
    assert jaxpr_stats.bytes_accessed(new) == jaxpr_stats.bytes_accessed(body)
    assert jaxpr_stats.matmul_flops(new) == jaxpr_stats.matmul_flops(body) > 0
    assert liveness.memory(new) == liveness.memory(body)


def test_a_scan_in_an_unknown_form_is_refused_naming_the_params():
    with pytest.raises(NotImplementedError, match=r"a scan whose params are \['jaxpr', 'length', 'weird'\]"):
        jaxcompat.scan_parts({"jaxpr": None, "length": 3, "weird": 1})


def test_no_module_reads_jaxpr_params_outside_the_compat_layer():
    root = pathlib.Path(md.__file__).parent
    raw = re.compile(r"params\[\"(num_consts|num_carry|linear|jaxpr|body_nconsts|cond_nconsts|length|ft_in|"
                     r"ft_out|dimension_numbers)\"\]|params\.get\(\"(jaxpr|length|num_consts)\"")
    found = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "jaxcompat.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if raw.search(line)]
    assert found == []
