"""``md.attention``'s mistakes: one test per error message, each naming the dims, the sizes or the
strategy and what to change, raised before anything compiles."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import meshdsl as md
from helpers import raises
from test_attention import B, H, L, MESH, _arrays


def test_keys_without_the_over_dim_are_refused_naming_it():
    q, k, v = _arrays()
    with raises(md.ShapeError, r"attention at .*: k \[batch:2 kv_length:24 heads:4 d_kv:8\] has no dim "
                               r"'kv_len' to attend over \(did you mean 'kv_length'\?\); pass over=", eager=True):
        md.attention(q, k, v, over="kv_len")


def test_queries_lacking_the_feature_dim_are_refused():
    q, k, v = _arrays()
    with raises(md.ShapeError, r"q \[.*\] lacks the feature dim 'd_other' that it contracts with k", eager=True):
        md.attention(q, md.rename(k, {"d_kv": "d_other"}), v, features="d_other")


def test_an_ambiguous_query_position_dim_asks_for_length():
    q, k, v = _arrays(kv_heads=2)
    with raises(md.ShapeError, r"cannot tell q's position dim among \['length', 'groups'\] .*pass length=", eager=True):
        md.attention(q, k, v)


def test_a_bias_over_dims_the_logits_lack_is_refused():
    q, k, v = _arrays()
    bias = md.named(jnp.zeros((H, 3)), "heads other")
    with raises(md.ShapeError, r"bias \[heads:4 other:3\] has dims \['other'\] that the logits", eager=True):
        md.attention(q, k, v, bias=bias)


def test_a_mask_must_be_boolean():
    q, k, v = _arrays()
    with raises(md.ShapeError, r"mask must be boolean \(True: may attend\), got float32", eager=True):
        md.attention(q, k, v, mask=md.named(jnp.ones((B, L)), "batch kv_length"))


def test_positions_must_lie_along_their_dim():
    q, k, v = _arrays()
    with raises(md.ShapeError, r"q_positions must be 24 integers \(one per length\), got int64 of shape \(5,\)", eager=True):
        md.attention(q, k, v, causal=True, q_positions=np.arange(5))


def test_forced_ulysses_without_a_divisible_head_dim_is_refused():
    q, k, v = _arrays(heads=3)
    layout = md.Layout({"length": "ctx", "kv_length": "ctx"})
    with raises(md.ShapeError, r"attention='ulysses' needs a dim of q, k and v \(a head dim\) whose size divides "
                               r"by 4 \(ctx\), whole there; .* use attention='ring' or 'gather'"):
        md.explain(lambda *a: md.attention(*a), MESH, layout, q, k, v, attention="ulysses")


def test_a_forced_strategy_where_nothing_splits_the_positions_is_refused_not_replaced():
    """attention='ring' under a layout that splits no positions would run the attention locally:
    the call is refused, saying what to split (a forced strategy is never silently replaced)."""
    q, k, v = _arrays()
    with raises(md.LayoutError, r"attention at .*: attention='ring' is forced but nothing splits the queries' "
                                r"positions 'length' \(nor the dim they are renamed from\) under layout heads:ctx; "
                                r"split 'length' over a mesh axis \(context parallelism\) or leave attention= unset"):
        md.explain(lambda *a: md.attention(*a), MESH, md.Layout({"heads": "ctx"}), q, k, v, attention="ring")


def test_an_unknown_implementation_is_refused_with_a_suggestion():
    q, k, v = _arrays()
    with raises(md.ShapeError, r"implementation must be one of \('flash', 'cudnn', 'xla'\), got 'flsh' "
                               r"\(did you mean 'flash'\?\)", eager=True):
        md.attention(q, k, v, implementation="flsh")


def test_an_unknown_attention_strategy_is_refused_with_a_suggestion():
    with raises(md.MeshDSLError, r"md.lower: attention must be one of \('gather', 'ring', 'ulysses'\) \(or None: "
                                 r"the planner chooses\), got 'rnig' \(did you mean 'ring'\?\)"):
        md.lower(lambda x: x, MESH, md.Layout({}), attention="rnig")
