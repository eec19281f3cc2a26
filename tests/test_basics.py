"""The vocabulary: Dim, shapes, NamedArray, Mesh, Layout, and the explain report's forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md
from helpers import assert_same


def test_dim_and_shape_strings():
    d = md.Dim("d_model", 512)
    assert (d.name, d.size, str(d)) == ("d_model", 512, "d_model:512")
    s = md.shape("batch:8 seq:128;d_model:16, heads:4")
    assert s.names == ("batch", "seq", "d_model", "heads") and s.sizes == (8, 128, 16, 4)
    assert s["seq"] == md.Dim("seq", 128) and "heads" in s and str(s) == "batch:8 seq:128 d_model:16 heads:4"


def test_named_array_basics():
    x = md.named(jnp.arange(24.0).reshape(2, 3, 4), "batch seq d_model")
    assert x.dims == md.shape("batch:2 seq:3 d_model:4")
    assert x.names == ("batch", "seq", "d_model") and x.shape == {"batch": 2, "seq": 3, "d_model": 4}
    assert x.size == 24 and x.ndim == 3 and x.dtype == jnp.float32
    assert md.named(x.array, ["batch", md.Dim("seq", 3), "d_model:4"]).dims == x.dims
    assert "batch:2 seq:3 d_model:4" in repr(x) and "<table" in x._repr_html_()


def test_named_array_is_a_pytree_that_keeps_dims_and_param_mark():
    w = md.param(md.named(jnp.ones((3, 4)), "d_model d_ff"))
    leaves, tree = jax.tree_util.tree_flatten(w)
    assert len(leaves) == 1
    back = jax.tree_util.tree_unflatten(tree, [leaves[0] * 2])
    assert back.is_param and back.dims == w.dims
    g = jax.grad(lambda w: md.sum(w * w).array)(w)
    assert g.is_param and g.dims == w.dims
    assert_same(g, md.param(w * 2.0))  # op results are not parameters; gradients of them are


def test_operators_broadcast_by_name():
    x = md.named(jnp.arange(6.0).reshape(2, 3), "a b")
    y = md.named(jnp.array([10.0, 20.0, 30.0]), "b")
    z = md.named(jnp.array([1.0, 2.0]), "a")
    np.testing.assert_allclose((x + y).array, np.arange(6.0).reshape(2, 3) + [10, 20, 30])
    out = y * z  # dims in order of first appearance: b, a
    assert out.names == ("b", "a") and out.array.shape == (3, 2)
    np.testing.assert_allclose((2 - x).array, 2 - np.arange(6.0).reshape(2, 3))
    assert ((x > 2) & (x < 5)).dtype == jnp.bool_
    np.testing.assert_allclose((-x / 2).array, -np.arange(6.0).reshape(2, 3) / 2)


def test_einsum_reductions_and_shaping_on_global_arrays():
    x = md.named(jnp.arange(24.0).reshape(2, 3, 4), "batch seq d_model")
    w = md.named(jnp.ones((4, 5)), "d_model d_ff")
    y = md.einsum(x, w, out="batch d_ff")  # seq and d_model are summed
    np.testing.assert_allclose(y.array, np.arange(24.0).reshape(2, 3, 4).sum((1, 2))[:, None] * np.ones(5))
    np.testing.assert_allclose(md.mean(x, "seq").array, np.arange(24.0).reshape(2, 3, 4).mean(1))
    np.testing.assert_allclose(md.logsumexp(x, "d_model").array,
                               jax.scipy.special.logsumexp(jnp.arange(24.0).reshape(2, 3, 4), axis=2), rtol=1e-6)
    heads = md.reshape(x, "batch seq heads:2 d_kv:2")
    np.testing.assert_array_equal(heads.array, np.arange(24.0).reshape(2, 3, 2, 2))
    assert md.rename(x, {"seq": "kv_seq", "batch": "b"}).names == ("b", "kv_seq", "d_model")
    assert md.transpose(x, "d_model batch seq").array.shape == (4, 2, 3)


def test_mesh_construction_and_parsing():
    m = md.Mesh({"data": 2, "model": 4})
    assert m.shape == {"data": 2, "model": 4} and m.size == 8 and m.axis_names == ("data", "model")
    assert md.Mesh.parse("data:2;model:4") == m == md.Mesh.parse("data:2,model:-1")
    assert repr(md.Mesh.abstract("pod:4;data:16;model:8")) == "Mesh.abstract(pod:4, data:16, model:8)"


def test_layout_construction_and_parsing():
    a = md.Layout.parse("batch:data;d_ff:model;heads:model")
    assert a == md.Layout({"batch": "data", "d_ff": "model", "heads": "model"})
    b = md.Layout.parse("batch:pod+data, d_ff:(model)")
    assert b.axes("batch") == ("pod", "data") and b.axes("d_ff") == ("model",) and b.axes("seq") == ()
    z = md.Layout({"d_ff": "model"}, params="d_model:data")
    assert z.storage_axes("d_ff") == ("model",) and z.storage_axes("d_model") == ("data",)
    assert str(z) == "d_ff:model | params d_model:data"
    mesh = md.Mesh({"data": 2, "model": 4})
    w = md.shape("d_model:16 d_ff:32")
    assert z.spec(w, mesh) == jax.sharding.PartitionSpec(None, "model")
    assert z.spec(w, mesh, storage=True) == jax.sharding.PartitionSpec("data", "model")
    zz = md.Layout({"d_ff": "model"}, params={"d_ff": "data"})  # extra storage axes go minor
    assert zz.spec(w, mesh, storage=True) == jax.sharding.PartitionSpec(None, ("model", "data"))


def test_explain_report_forms():
    mesh, layout = md.Mesh({"data": 2, "model": 4}), md.Layout({"batch": "data", "d_ff": "model"})
    x = md.named(jnp.ones((8, 16)), "batch d_model")
    w1, w2 = md.named(jnp.ones((16, 32)), "d_model d_ff"), md.named(jnp.ones((32, 16)), "d_ff d_model")
    report = md.explain(lambda x, a, b: md.einsum(md.relu(md.einsum(x, a, out="batch d_ff")), b, out="batch d_model"),
                        mesh, layout, x, w1, w2)
    d = report.to_dict()
    assert d["summary"] == {"all-reduce": {"count": 1, "bytes": 384.0}}
    assert d["flops_per_device"] == 2 * 4 * 16 * 8 * 2  # two einsums, local blocks
    assert d["memory_per_device"]["arguments"] == (4 * 16 + 16 * 8 + 8 * 16) * 4
    md_text = report.to_markdown()
    assert "| all-reduce | 1 | 384 B |" in md_text and "test_basics.py" in md_text
    assert "<table" in report._repr_html_() and "all-reduce" in report._repr_html_()


def test_explain_shows_the_compiled_memory_next_to_the_estimate():
    """On a concrete mesh the report carries XLA's memory analysis of the compiled program (the
    estimate walks the traced program; XLA reuses buffers); on an abstract mesh there is none."""
    x = md.named(jnp.ones((16, 32)), "batch d")
    w = md.param(md.named(jnp.ones((32, 64)), "d f"))
    fn = lambda x, w: md.sum(md.relu(md.einsum(x, w, out="batch f")))
    layout = md.Layout({"batch": "data"})
    report = md.explain(fn, md.Mesh({"data": 8}), layout, x, w)
    compiled = md.lower(fn, md.Mesh({"data": 8}), layout).lower(x, w).compile().memory_analysis()
    assert report.compiled_memory() == {"arguments": compiled.argument_size_in_bytes,
                                        "outputs": compiled.output_size_in_bytes,
                                        "temporaries": compiled.temp_size_in_bytes}
    assert report.to_dict()["compiled_memory_per_device"] == report.compiled_memory()
    assert "compiled: arguments" in report.to_markdown() and "compiled: arguments" in report._repr_html_()
    abstract = md.explain(fn, md.Mesh.abstract({"data": 8}), layout, x, w)
    assert abstract.compiled_memory() is None and "compiled" not in abstract.to_markdown()
