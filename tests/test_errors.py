"""Errors are part of the interface: every bad input gets a specific meshdsl error, raised while
tracing (before anything compiles), never a raw jax / XLA / Python error. This module: layouts
(``md.LayoutError``: two dims of one tensor on one mesh axis, sizes the mesh axes do not divide,
rules that name a dim twice or are unreadable) and the arguments of ``md.lower``. Rules that name
what does not exist (a mesh axis, a dim of the program): test_rule_errors.py. The ops' shape errors are in
test_shape_errors.py, the meshes' in test_mesh_errors.py.

Each test feeds one mistake and checks the exact error class (``md.LayoutError``,
``md.ShapeError``, ``md.MeshError``; all ``md.MeshDSLError``, a ``ValueError``) and that the
message says what the user needs: the dims and sizes involved, the mesh axes and their sizes, the
op and the user's source line (``test_errors.py:<line>`` when the mistake is in an op call here),
and what to change.

Source lines are found by markers: a line ending in ``# <tag>`` is ``line("tag")``.
Mesh: data=2 x model=4 over the 8 virtual CPU devices; tiny shapes, nothing is run.
"""

import re

import jax
import numpy as np
import pytest

import meshdsl as md
from helpers import identity, ids, marker_lines, named, raises

MESH = md.Mesh({"data": 2, "model": 4})
line = marker_lines(__file__)


# ===================================================================================================
# LayoutError: two dims of one tensor on one mesh axis
# ===================================================================================================


def test_input_with_two_dims_on_one_mesh_axis():
    f = md.lower(identity, MESH, md.Layout({"batch": "data", "d_model": "data"}))
    x = named("batch d_model", 4, 4)
    with raises(md.LayoutError, match="puts both 'batch' and 'd_model' on mesh axis 'data'") as e:
        f(x)
    msg = str(e.value)
    assert "argument 0" in msg and "[batch:4 d_model:4]" in msg
    assert "(size 2)" in msg
    assert "map one of them to another axis" in msg


def test_input_with_two_dim_rule_overlapping_another_rule():
    layout = md.Layout({"batch": ("data", "model"), "d_ff": "model"})
    f = md.lower(identity, MESH, layout)
    x = named("batch d_ff", 8, 8)
    with raises(md.LayoutError, match="puts both 'batch' and 'd_ff' on mesh axis 'model'") as e:
        f(x)
    assert "(size 4)" in str(e.value) and "[batch:8 d_ff:8]" in str(e.value)


def test_einsum_output_with_two_dims_on_one_mesh_axis():
    def fn(x, w):
        h = md.einsum(x, w, out="batch d_ff")  # <einsum-clash>
        return md.sum(h)

    f = md.lower(fn, MESH, md.Layout({"batch": "model", "d_ff": "model"}))
    x, w = named("batch d_model", 4, 8), named("d_model d_ff", 8, 8)
    with raises(md.LayoutError, match="puts both 'batch' and 'd_ff' on mesh axis 'model'") as e:
        f(x, w)
    msg = str(e.value)
    assert f"einsum at {line('einsum-clash')}" in msg
    assert "[batch:4 d_ff:8]" in msg and "(size 4)" in msg
    assert "rename one dim" in msg


def test_elementwise_intermediate_with_two_dims_on_one_mesh_axis():
    def fn(x, y):
        return md.sum(x * y)  # <multiply-clash>

    f = md.lower(fn, MESH, md.Layout({"batch": "model", "d_ff": "model"}))
    x, y = named("batch", 4), named("d_ff", 8)
    with raises(md.LayoutError, match="puts both 'batch' and 'd_ff' on mesh axis 'model'") as e:
        f(x, y)
    assert f"multiply at {line('multiply-clash')}" in str(e.value)
    assert "(size 4)" in str(e.value)


def test_rename_intermediate_with_two_dims_on_one_mesh_axis():
    def fn(x):
        return md.sum(md.rename(x, {"d_model": "d_ff"}))  # <rename-clash>

    f = md.lower(fn, MESH, md.Layout({"batch": "model", "d_ff": "model"}))
    x = named("batch d_model", 4, 8)
    with raises(md.LayoutError, match="puts both 'batch' and 'd_ff' on mesh axis 'model'") as e:
        f(x)
    assert f"rename at {line('rename-clash')}" in str(e.value)
    assert "[batch:4 d_ff:8]" in str(e.value)


def test_output_with_two_dims_on_one_mesh_axis():
    def fn(x):
        return md.named(np.ones((4, 8), np.float32), "batch d_ff")

    f = md.lower(fn, MESH, md.Layout({"batch": "model", "d_ff": "model"}))
    x = named("seq", 4)
    with raises(md.LayoutError, match="puts both 'batch' and 'd_ff' on mesh axis 'model'") as e:
        f(x)
    assert "md.named at test_errors.py" in str(e.value) and "[batch:4 d_ff:8]" in str(e.value)
    assert "(size 4)" in str(e.value)


def test_gspmd_backend_checks_the_same_layout():
    def fn(x, y):
        return md.sum(x * y)  # <gspmd-clash>

    f = md.lower(fn, MESH, md.Layout({"batch": "model", "d_ff": "model"}), backend="gspmd")
    x, y = named("batch", 4), named("d_ff", 8)
    with raises(md.LayoutError, match="puts both 'batch' and 'd_ff' on mesh axis 'model'") as e:
        f(x, y)
    assert f"multiply at {line('gspmd-clash')}" in str(e.value)


def test_explain_raises_the_layout_error_without_compiling():
    def fn(x, w):
        return md.sum(md.einsum(x, w, out="batch d_ff"))  # <explain-clash>

    layout = md.Layout({"batch": "model", "d_ff": "model"})
    x, w = named("batch d_model", 4, 8), named("d_model d_ff", 8, 8)
    with raises(md.LayoutError, match="puts both 'batch' and 'd_ff' on mesh axis 'model'") as e:
        md.explain(fn, MESH, layout, x, w)
    assert f"einsum at {line('explain-clash')}" in str(e.value)


def test_layout_error_surfaces_through_jax_grad_of_a_lowered_function():
    def loss(x, y):
        return md.sum(x * y).array  # <grad-clash>

    f = md.lower(loss, MESH, md.Layout({"batch": "model", "d_ff": "model"}))
    x, y = named("batch", 4), named("d_ff", 8)
    with raises(md.LayoutError, match="puts both 'batch' and 'd_ff'") as e:
        jax.grad(f)(x, y)
    assert f"multiply at {line('grad-clash')}" in str(e.value)


# ===================================================================================================
# LayoutError: sizes the mesh axes do not divide
# ===================================================================================================


def test_indivisible_input():
    f = md.lower(identity, MESH, md.Layout({"batch": "model"}))
    x = named("batch", 6)
    with raises(md.LayoutError, match=re.escape("dim 'batch' of size 6 is split over model(4) = 4 devices")) as e:
        f(x)
    msg = str(e.value)
    assert "argument 0" in msg and "[batch:6]" in msg
    assert "make 'batch' a multiple of 4 or change its layout rule" in msg


def test_indivisible_intermediate_from_reshape():
    def fn(x):
        return md.sum(md.reshape(x, "inner:2 rest:8"))  # <reshape-indivisible>

    f = md.lower(fn, MESH, md.Layout({"inner": "model"}))
    x = named("batch", 16)
    with raises(md.LayoutError, match="dim 'inner' of size 2") as e:
        f(x)
    msg = str(e.value)
    assert f"reshape at {line('reshape-indivisible')}" in msg
    assert "model(4)" in msg and "multiple of 4" in msg


def test_indivisible_intermediate_from_rename():
    def fn(x):
        return md.sum(md.rename(x, {"d_model": "seq"}))  # <rename-indivisible>

    f = md.lower(fn, MESH, md.Layout({"seq": "model"}))
    x = named("batch d_model", 4, 6)
    with raises(md.LayoutError, match="dim 'seq' of size 6") as e:
        f(x)
    assert f"rename at {line('rename-indivisible')}" in str(e.value)
    assert "model(4)" in str(e.value)


def test_indivisible_intermediate_from_one_hot():
    def fn(i):
        return md.sum(md.one_hot(i, md.Dim("vocab", 6)))  # <one-hot-indivisible>

    f = md.lower(fn, MESH, md.Layout({"vocab": "model"}))
    i = ids("batch", 4)
    with raises(md.LayoutError, match="dim 'vocab' of size 6") as e:
        f(i)
    assert f"one_hot at {line('one-hot-indivisible')}" in str(e.value)
    assert "model(4)" in str(e.value)


def test_indivisible_output_of_top_k():
    def fn(x):
        values, _ = md.top_k(x, "seq", k=2, out="k")  # <top-k-indivisible>
        return values

    f = md.lower(fn, MESH, md.Layout({"k": "model"}))
    x = named("seq", 8)
    with raises(md.LayoutError, match="dim 'k' of size 2") as e:
        f(x)
    assert f"top_k at {line('top-k-indivisible')}" in str(e.value)
    assert "model(4) = 4 devices" in str(e.value)


def test_indivisible_over_two_mesh_axes():
    f = md.lower(identity, MESH, md.Layout({"batch": ("data", "model")}))
    x = named("batch", 4)
    with raises(md.LayoutError, match=re.escape("split over data(2)+model(4) = 8 devices")) as e:
        f(x)
    assert "'batch' of size 4" in str(e.value) and "multiple of 8" in str(e.value)


def test_indivisible_parameter_storage():
    f = md.lower(identity, MESH, md.Layout({}, params={"d_model": "data"}))
    w = md.param(named("d_model d_ff", 3, 4))
    with raises(md.LayoutError, match="dim 'd_model' of size 3") as e:
        f(w)
    assert "parameter" in str(e.value) and "data(2)" in str(e.value)


# ===================================================================================================
# LayoutError: rules that name a dim twice, or cannot be read
# ===================================================================================================


def test_one_dim_mapped_to_the_same_axis_twice():
    with raises(md.LayoutError, match="dim 'batch' maps to mesh axis 'data' twice") as e:
        md.Layout({"batch": ("data", "data")})
    assert "list each axis once" in str(e.value)


def test_one_dim_mapped_to_the_same_axis_twice_in_a_parsed_layout():
    with raises(md.LayoutError, match="dim 'batch' maps to mesh axis 'data' twice") as e:
        md.Layout.parse("batch:data+data")
    assert "md.Layout.parse" in str(e.value)


def test_parsed_layout_with_two_rules_for_one_dim():
    with raises(md.LayoutError, match="dim 'batch' has two rules") as e:
        md.Layout.parse("batch:data;batch:model")
    assert "'batch:a+b'" in str(e.value)


@pytest.mark.parametrize("spec", ["batch", "batch:", ":data", "1x:data", "batch=data"])
def test_unreadable_layout_string(spec):
    with raises(md.LayoutError, match=re.escape(f"cannot read {spec!r}")) as e:
        md.Layout.parse(spec)
    assert "md.Layout.parse" in str(e.value)
    assert "'batch:data;d_ff:model'" in str(e.value)  # an example of what to write


@pytest.mark.parametrize("spec", ["batch:da-ta", "batch:(data"])
def test_layout_string_whose_rule_is_not_mesh_axis_names(spec):
    with raises(md.LayoutError, match=re.escape(f"{spec!r}") + ".*does not name mesh axes") as e:
        md.Layout.parse(spec)
    assert "dim:axis" in str(e.value)


def test_layout_string_with_two_colons_suggests_the_several_axes_form():
    with raises(md.LayoutError, match="does not name mesh axes") as e:
        md.Layout.parse("batch:data:model")
    assert "batch:data+model" in str(e.value)  # what the user most likely meant


def test_layout_string_with_a_dangling_plus():
    with raises(md.LayoutError, match=re.escape("'batch:data+'")) as e:
        md.Layout.parse("batch:data+")
    assert "batch:data+" in str(e.value)


def test_layout_that_is_not_a_dict():
    with raises(md.LayoutError, match="expected a dict of dim name -> mesh axes"):
        md.Layout(["batch"])


def test_layout_rule_key_that_is_not_a_dim_name():
    with raises(md.LayoutError, match="'batch size' is not a dim name"):
        md.Layout({"batch size": "data"})


def test_layout_rule_value_that_is_not_an_axis():
    with raises(md.LayoutError, match="rule for 'batch' must be a mesh axis name or a tuple of them, got 3"):
        md.Layout({"batch": 3})


def test_layout_rule_with_a_non_axis_entry():
    with raises(md.LayoutError, match="3 in the rule for 'batch' is not a mesh axis name"):
        md.Layout({"batch": ("data", 3)})


def test_params_rule_repeating_its_compute_axis():
    with raises(md.LayoutError, match="params rule for 'd_model' repeats mesh axis 'data'") as e:
        md.Layout({"d_model": "data"}, params={"d_model": "data"})
    assert "only the extra axes" in str(e.value)


def test_params_rule_clashing_with_a_compute_axis_of_the_same_tensor():
    def fn(x, w):
        return md.einsum(x, w, out="batch d_ff")

    layout = md.Layout({"d_ff": "model"}, params={"d_model": "model"})
    f = md.lower(fn, MESH, layout)
    x, w = named("batch d_model", 4, 8), md.param(named("d_model d_ff", 8, 8))
    with raises(md.LayoutError, match="puts both 'd_model' and 'd_ff' on mesh axis 'model'") as e:
        f(x, w)
    msg = str(e.value)
    assert "argument 1" in msg and "(size 4)" in msg
    assert "params" in msg  # the storage rule params={"d_model": "model"} is the one to change


def test_scan_over_a_dim_the_compute_layout_splits():
    def fn(carry, xs):
        carry, _ = md.scan(lambda c, x: (c + x, x), carry, xs, dim="layers")  # <scan-split>
        return carry

    f = md.lower(fn, MESH, md.Layout({"layers": "data"}))
    c, xs = named("d", 4), named("layers d", 2, 4)
    with raises(md.LayoutError, match="the layout splits 'layers'") as e:
        f(c, xs)
    msg = str(e.value)   # a pipeline over data, but the carry has no dim to cut into microbatches
    assert f"md.scan at {line('scan-split')}" in msg and "'data'" in msg
    assert "microbatches={'batch': M}" in msg and "remove the rule for 'layers'" in msg


def test_output_that_is_a_plain_array_differing_between_devices():
    f = md.lower(lambda x: x.array, MESH, md.Layout({"batch": "data"}))
    x = named("batch", 4)
    with raises(md.LayoutError, match="output 0 is a plain jax array that differs between devices") as e:
        f(x)
    assert "(it varies over data)" in str(e.value) and "return NamedArrays" in str(e.value)


# ===================================================================================================
# md.lower arguments
# ===================================================================================================


def test_backend_typo():
    with raises(md.MeshDSLError, match="backend must be one of \\('explicit', 'gspmd'\\), got 'gspdm'",
                exact=False) as e:
        md.lower(identity, MESH, md.Layout({}), backend="gspdm")
    assert "did you mean 'gspmd'?" in str(e.value)


def test_param_gather_typo():
    with raises(md.MeshDSLError, match="param_gather must be one of \\('keep', 'regather', 'auto'\\), got 'regahter'",
                exact=False) as e:
        md.lower(identity, MESH, md.Layout({}), param_gather="regahter")
    assert "did you mean 'regather'?" in str(e.value)


def test_lower_with_a_jax_mesh_instead_of_an_md_mesh():
    with raises(md.MeshError, match="mesh must be an md.Mesh, got Mesh"):
        md.lower(identity, MESH.jax_mesh, md.Layout({}))


def test_lower_with_a_layout_string_instead_of_an_md_layout():
    with raises(md.LayoutError, match="layout must be an md.Layout, got str") as e:
        md.lower(identity, MESH, "batch:data")
    assert "md.Layout.parse" in str(e.value)


def test_lower_with_an_argument_holding_a_local_block():
    x = md.NamedArray(np.ones((2,), np.float32), md.shape("batch:4"))
    f = md.lower(identity, MESH, md.Layout({"batch": "data"}))
    with raises(md.ShapeError, match=re.escape("argument 0 [batch:4] holds an array of shape (2,); pass global arrays")):
        f(x)
