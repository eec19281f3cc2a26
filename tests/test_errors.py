"""Errors are part of the interface: every bad input gets a specific meshdsl error, raised while
tracing (before anything compiles), never a raw jax / XLA / Python error.

Each test feeds one mistake and checks the exact error class (``md.LayoutError``,
``md.ShapeError``, ``md.MeshError``; all ``md.MeshDSLError``, a ``ValueError``) and that the
message says what the user needs: the dims and sizes involved, the mesh axes and their sizes, the
op and the user's source line (``test_errors.py:<line>`` when the mistake is in an op call here),
and what to change.

Source lines are found by markers: a line ending in ``# <tag>`` is ``line("tag")``.
Mesh: data=2 x model=4 over the 8 virtual CPU devices; tiny shapes, nothing is run.
"""

from __future__ import annotations

import contextlib
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md

MESH = md.Mesh({"data": 2, "model": 4})
N_DEVICES = len(jax.devices())

_SOURCE = pathlib.Path(__file__).read_text().splitlines()
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def line(tag: str) -> str:
    """``test_errors.py:<n>`` of the one source line ending in ``# <tag>``."""
    hits = [i + 1 for i, text in enumerate(_SOURCE) if text.rstrip().endswith(f"# <{tag}>")]
    assert len(hits) == 1, (tag, hits)
    return f"test_errors.py:{hits[0]}"


@contextlib.contextmanager
def raises(cls, match=None, *, exact: bool = True, eager: bool = False):
    """``pytest.raises(cls, match=...)`` that also checks the class is exactly ``cls`` (a more
    general meshdsl error is not enough) and that nothing was compiled before the error.

    ``eager=True``: the mistake is made outside ``md.lower``, where jax runs op by op, so small
    kernels computed before the check may compile; only the error itself is checked."""
    compiled = []

    def listener(event, duration, **kwargs):
        if event == _COMPILE_EVENT:
            compiled.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with pytest.raises(cls, match=match) as info:
            yield info
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    err = info.value
    if exact:
        assert type(err) is cls, f"expected exactly {cls.__name__}, got {type(err).__name__}: {err}"
    assert isinstance(err, md.MeshDSLError) and isinstance(err, ValueError)
    assert eager or not compiled, f"compiled {compiled} before raising {type(err).__name__}: {err}"


def named(spec: str, *shape, dtype=np.float32) -> md.NamedArray:
    """A NamedArray of ones (numpy-backed: creating it compiles nothing)."""
    return md.named(np.ones(shape, dtype), spec)


def ids(spec: str, *shape) -> md.NamedArray:
    return md.named(np.zeros(shape, np.int32), spec)


def identity(*xs):
    return xs[0] if len(xs) == 1 else xs


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
# LayoutError: rules that name what does not exist, or name it twice
# ===================================================================================================


def test_unknown_mesh_axis_in_a_rule_at_lower_time():
    with raises(md.LayoutError, match="names mesh axis 'dat'") as e:
        md.lower(identity, MESH, md.Layout({"batch": "dat"}))
    msg = str(e.value)
    assert "did you mean 'data'?" in msg
    assert "batch:dat" in msg and "data:2 x model:4" in msg
    assert "fix the rule or the mesh" in msg


def test_unknown_mesh_axis_in_a_params_rule_at_lower_time():
    with raises(md.LayoutError, match="params rule d_model:modle names mesh axis 'modle'") as e:
        md.lower(identity, MESH, md.Layout({"batch": "data"}, params={"d_model": "modle"}))
    assert "did you mean 'model'?" in str(e.value)


def test_unknown_mesh_axis_on_an_abstract_mesh_in_explain():
    mesh = md.Mesh.abstract("pod:4 data:16")
    x = named("batch", 64)
    with raises(md.LayoutError, match="names mesh axis 'dta'") as e:
        md.explain(identity, mesh, md.Layout({"batch": "dta"}), x)
    assert "did you mean 'data'?" in str(e.value) and "pod:4 x data:16" in str(e.value)


def test_rule_for_a_near_typo_of_a_program_dim():
    def fn(x, w):
        return md.einsum(x, w, out="batch d_ff")

    f = md.lower(fn, MESH, md.Layout({"batch": "data", "d_fff": "model"}))
    x, w = named("batch d_model", 4, 8), named("d_model d_ff", 8, 8)
    with raises(md.LayoutError, match="layout rule for 'd_fff' matches no dim of the program") as e:
        f(x, w)
    assert "did you mean 'd_ff'?" in str(e.value)
    assert "fix the dim name in the layout" in str(e.value)


def test_params_rule_for_a_near_typo_of_a_program_dim():
    f = md.lower(identity, MESH, md.Layout({}, params={"d_modl": "data"}))
    w = md.param(named("d_model", 4))
    with raises(md.LayoutError, match="'d_modl' matches no dim of the program") as e:
        f(w)
    assert "did you mean 'd_model'?" in str(e.value)


def test_rule_for_a_near_typo_of_a_program_dim_with_the_gspmd_backend():
    def fn(x, w):
        return md.einsum(x, w, out="batch d_ff")

    f = md.lower(fn, MESH, md.Layout({"d_fff": "model"}), backend="gspmd")
    x, w = named("batch d_model", 4, 8), named("d_model d_ff", 8, 8)
    with raises(md.LayoutError, match="'d_fff' matches no dim of the program") as e:
        f(x, w)
    assert "did you mean 'd_ff'?" in str(e.value)


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
# MeshError
# ===================================================================================================


def test_mesh_size_not_the_number_of_devices():
    with raises(md.MeshError, match=f"has 4 devices but {N_DEVICES} are available") as e:
        md.Mesh({"data": 2, "model": 2})
    msg = str(e.value)
    assert "data:2 x model:2" in msg
    assert f"product is {N_DEVICES}" in msg and "md.Mesh.abstract" in msg


@pytest.mark.parametrize("size", [0, -2, 2.0, True, "2"])
def test_mesh_axis_with_a_bad_size(size):
    with raises(md.MeshError, match=f"mesh axis 'data' has size {re.escape(repr(size))}") as e:
        md.Mesh({"data": size, "model": 4})
    assert "integers >= 1" in str(e.value)


@pytest.mark.parametrize("name", ["da ta", 3, ""])
def test_mesh_axis_with_a_bad_name(name):
    with raises(md.MeshError, match=f"mesh axis name {re.escape(repr(name))} is not an identifier"):
        md.Mesh({name: 2, "model": 4})


def test_empty_mesh():
    with raises(md.MeshError, match=re.escape("a mesh is a non-empty dict of axis name -> size, got {}")):
        md.Mesh({})


@pytest.mark.parametrize("axes", [[2, 4], 8])
def test_mesh_that_is_not_a_dict(axes):
    with raises(md.MeshError, match="a mesh is a non-empty dict of axis name -> size") as e:
        md.Mesh(axes)
    assert repr(axes) in str(e.value)


def test_unknown_axis_in_mesh_axis_size():
    with raises(md.MeshError, match="mesh data:2 x model:4 has no axis 'modle'") as e:
        MESH.axis_size("modle")
    assert "did you mean 'model'?" in str(e.value)


def test_unknown_axis_in_mesh_axes_size():
    with raises(md.MeshError, match="has no axis 'pod'"):
        MESH.axes_size(["data", "pod"])


@pytest.mark.parametrize("spec, message", [
    ("data2;model:4", "bad mesh entry 'data2' in 'data2;model:4': write axis:size, e.g. 'data:2;model:4'"),
    ("data:two;model:4", "size 'two' of mesh axis 'data' in 'data:two;model:4' is not an integer"),
    ("data:2;data:4", "mesh axis 'data' appears twice in 'data:2;data:4'"),
    ("", "empty mesh spec ''"),
    ("data:2;model:2", f"has 4 devices but {N_DEVICES} are available"),
], ids=["no-size", "size-not-int", "axis-twice", "empty", "wrong-product"])
def test_unreadable_mesh_string(spec, message):
    with raises(md.MeshError, match=re.escape(message)):
        md.Mesh.parse(spec)


def test_mesh_parse_of_something_not_a_string():
    with raises(md.MeshError, match="Mesh.parse") as e:
        md.Mesh.parse({"data": 2, "model": 4})
    assert "'data:2;model:4'" in str(e.value)  # how to write it (or call md.Mesh(dict))


def test_two_wildcard_mesh_axes():
    with raises(md.MeshError, match=re.escape("only one mesh axis may have size -1 in 'data:-1;model:-1'")):
        md.Mesh.parse("data:-1;model:-1")


def test_wildcard_that_cannot_fill_the_devices():
    with raises(md.MeshError, match=f"cannot fill 'model': {N_DEVICES} devices are not divisible by 3"):
        md.Mesh.parse("data:3;model:-1")


def test_wildcard_next_to_a_zero_size():
    with raises(md.MeshError, match="mesh axis 'data' has size 0") as e:
        md.Mesh.parse("data:0;model:-1")
    assert "integers >= 1" in str(e.value)


def test_wildcard_on_an_abstract_mesh():
    with raises(md.MeshError, match=re.escape("an abstract mesh needs every size written, got 'data:-1;model:4'")):
        md.Mesh.abstract("data:-1;model:4")


def test_calling_a_lowered_function_on_an_abstract_mesh():
    mesh = md.Mesh.abstract({"data": 16, "model": 4})
    f = md.lower(identity, mesh, md.Layout({"batch": "data"}))
    x = named("batch", 16)
    with raises(md.MeshError, match="has no devices") as e:
        f(x)
    assert "data:16, model:4" in str(e.value) and "md.explain" in str(e.value)


def test_lowering_to_hlo_on_an_abstract_mesh():
    mesh = md.Mesh.abstract({"data": 16, "model": 4})
    f = md.lower(identity, mesh, md.Layout({"batch": "data"}))
    x = named("batch", 16)
    with raises(md.MeshError, match="has no devices") as e:
        f.lower(x)
    assert "md.explain" in str(e.value)


# ===================================================================================================
# ShapeError: dims that do not fit
# ===================================================================================================


def test_size_clash_in_einsum_operands():
    x, w = named("batch d_model", 4, 8), named("d_model d_ff", 6, 8)
    with raises(md.ShapeError, match="dim 'd_model' has size 8 in operand 1") as e:
        md.einsum(x, w, out="batch d_ff")  # <einsum-size>
    msg = str(e.value)
    assert f"einsum at {line('einsum-size')}" in msg
    assert "[batch:4 d_model:8]" in msg and "but 6 in operand 2 [d_model:6 d_ff:8]" in msg
    assert "rename one of them or fix the sizes" in msg


def test_size_clash_in_an_elementwise_op():
    x, y = named("batch", 4), named("batch", 6)
    with raises(md.ShapeError, match="dim 'batch' has size 4 in operand 1 \\[batch:4\\] but 6") as e:
        x + y  # <add-size>
    assert f"add at {line('add-size')}" in str(e.value)


def test_size_clash_in_where():
    cond, x, y = named("a", 4) > 0, named("a", 4), named("a", 5)
    with raises(md.ShapeError, match="but 5 in operand 3 \\[a:5\\]") as e:
        md.where(cond, x, y)  # <where-size>
    assert f"where at {line('where-size')}" in str(e.value)


def test_size_clash_inside_md_lower():
    def fn(x, y):
        return md.sum(x * y)  # <lowered-size>

    f = md.lower(fn, MESH, md.Layout({"batch": "data"}))
    x, y = named("batch", 4), named("batch", 8)
    with raises(md.ShapeError, match="dim 'batch' has size 4 in operand 1") as e:
        f(x, y)
    assert f"multiply at {line('lowered-size')}" in str(e.value)


def test_duplicate_names_in_md_named():
    a = np.ones((4, 4), np.float32)
    with raises(md.ShapeError, match="duplicate dim names \\['batch'\\]") as e:
        md.named(a, "batch batch")  # <named-dupes>
    assert f"md.named at {line('named-dupes')}" in str(e.value)
    assert "rename one of them" in str(e.value)


def test_wrong_name_count_in_md_named():
    a = np.ones((4, 4, 4), np.float32)
    with raises(md.ShapeError, match=re.escape("2 names ['batch', 'seq'] for an array of rank 3")) as e:
        md.named(a, "batch seq")  # <named-count>
    assert f"md.named at {line('named-count')}" in str(e.value)
    assert "(4, 4, 4)" in str(e.value) and "give one name per axis" in str(e.value)


def test_size_written_in_md_named_disagrees_with_the_array():
    a = np.ones((4, 4), np.float32)
    with raises(md.ShapeError, match="dim 'batch' is written with size 8 but the array has size 4") as e:
        md.named(a, "batch:8 seq")  # <named-size>
    assert f"md.named at {line('named-size')}" in str(e.value)


def test_bad_dim_name_in_md_named():
    a = np.ones((4,), np.float32)
    with raises(md.ShapeError, match="'batch-size' in 'batch-size' is not a dim name") as e:
        md.named(a, "batch-size")  # <named-bad-name>
    assert f"md.named at {line('named-bad-name')}" in str(e.value)


def test_md_named_on_a_named_array():
    x = named("a", 4)
    with raises(md.ShapeError, match=re.escape("the value already has dims [a:4]")) as e:
        md.named(x, "b")  # <named-twice>
    assert f"md.named at {line('named-twice')}" in str(e.value)
    assert "md.rename" in str(e.value)


def test_md_param_on_a_plain_array():
    a = np.ones((4,), np.float32)
    with raises(md.ShapeError, match="expected a NamedArray") as e:
        md.param(a)  # <param-plain>
    assert f"md.param at {line('param-plain')}" in str(e.value) and "md.named" in str(e.value)


def test_unknown_dim_in_einsum_out():
    x, w = named("batch d_model", 4, 8), named("d_model d_ff", 8, 8)
    with raises(md.ShapeError, match="out names 'd_f', which no operand has") as e:
        md.einsum(x, w, out="batch d_f")  # <einsum-out>
    msg = str(e.value)
    assert f"einsum at {line('einsum-out')}" in msg
    assert "operands have batch d_model d_ff" in msg and "did you mean 'd_ff'?" in msg


def test_duplicate_dim_in_einsum_out():
    x, w = named("batch d_model", 4, 8), named("d_model d_ff", 8, 8)
    with raises(md.ShapeError, match="out names 'batch' twice") as e:
        md.einsum(x, w, out="batch d_ff batch")  # <einsum-out-twice>
    assert f"einsum at {line('einsum-out-twice')}" in str(e.value)


def test_wrong_size_written_in_einsum_out():
    x = named("a b", 4, 4)
    with raises(md.ShapeError, match="out writes a:5 but the operands have a:4") as e:
        md.einsum(x, out="a:5")  # <einsum-out-size>
    assert f"einsum at {line('einsum-out-size')}" in str(e.value)


def test_md_shape_without_a_size():
    with raises(md.ShapeError, match=re.escape("md.shape('batch:8 seq'): 'seq' has no size; write seq:<size>")):
        md.shape("batch:8 seq")


def test_md_shape_with_a_duplicate_name():
    with raises(md.ShapeError, match=re.escape("duplicate dim names ['a'] in shape [a:2 a:3]")):
        md.shape("a:2 a:3")


@pytest.mark.parametrize("name, size, message", [
    ("d model", 3, "dim name 'd model' is not an identifier"),
    ("d", -3, "dim 'd' has size -3: sizes are integers >= 0"),
    ("d", 2.5, "dim 'd' has size 2.5: sizes are integers >= 0"),
], ids=["bad-name", "negative-size", "float-size"])
def test_bad_dim(name, size, message):
    with raises(md.ShapeError, match=re.escape(message)):
        md.Dim(name, size)


def test_rename_of_a_missing_dim():
    x = named("batch seq", 4, 4)
    with raises(md.ShapeError, match=re.escape("cannot rename 'sq': not a dim of [batch:4 seq:4]")) as e:
        md.rename(x, {"sq": "kv_seq"})  # <rename-missing>
    assert f"rename at {line('rename-missing')}" in str(e.value) and "did you mean 'seq'?" in str(e.value)


def test_rename_producing_duplicate_names():
    x = named("batch seq", 4, 4)
    with raises(md.ShapeError, match="gives two dims named 'batch'") as e:
        md.rename(x, {"seq": "batch"})  # <rename-dupes>
    assert f"rename at {line('rename-dupes')}" in str(e.value) and "[batch:4 seq:4]" in str(e.value)


def test_reshape_with_a_different_total_size():
    x = named("batch seq", 4, 4)
    with raises(md.ShapeError, match=re.escape("cannot reshape [batch:4 seq:4] (16 elements) to [batch:4 seq:8]")) as e:
        md.reshape(x, "batch seq:8")  # <reshape-total>
    assert f"reshape at {line('reshape-total')}" in str(e.value) and "(32 elements)" in str(e.value)


def test_reshape_with_two_unknown_sizes():
    x = named("batch seq", 4, 4)
    with raises(md.ShapeError, match=re.escape("cannot infer the sizes of ['a', 'b']")) as e:
        md.reshape(x, "a b")  # <reshape-unknown>
    assert f"reshape at {line('reshape-unknown')}" in str(e.value)
    assert "write all but one as name:size" in str(e.value)


def test_reshape_whose_unknown_size_cannot_be_inferred():
    x = named("batch seq", 4, 3)
    message = "cannot infer 'b': 12 elements of [batch:4 seq:3] are not a multiple of 5"
    with raises(md.ShapeError, match=re.escape(message)) as e:
        md.reshape(x, "a:5 b")  # <reshape-infer>
    assert f"reshape at {line('reshape-infer')}" in str(e.value)


def test_reshape_with_a_size_that_is_not_an_integer():
    x = named("a", 4)
    with raises(md.ShapeError, match="size 'x' of 'a' in 'a:x' is not an integer") as e:
        md.reshape(x, "a:x")  # <reshape-bad-size>
    assert f"reshape at {line('reshape-bad-size')}" in str(e.value) and "d_model:512" in str(e.value)


def test_transpose_missing_dims():
    x = named("batch seq", 4, 4)
    with raises(md.ShapeError, match=re.escape("new dim order ['seq'] misses ['batch'] of [batch:4 seq:4]")) as e:
        md.transpose(x, "seq")  # <transpose>
    assert f"transpose at {line('transpose')}" in str(e.value)


def test_sum_over_a_dim_the_tensor_lacks():
    x = named("batch d_model", 4, 4)
    with raises(md.ShapeError, match="'d_modle', which is not a dim of \\[batch:4 d_model:4\\]") as e:
        md.sum(x, "d_modle")  # <sum-typo>
    assert f"sum at {line('sum-typo')}" in str(e.value) and "did you mean 'd_model'?" in str(e.value)


def test_softmax_over_a_dim_the_tensor_lacks():
    x = named("batch kv_seq", 4, 4)
    with raises(md.ShapeError, match="softmax dim names 'kv_sq'") as e:
        md.softmax(x, "kv_sq")  # <softmax-typo>
    assert f"softmax at {line('softmax-typo')}" in str(e.value) and "did you mean 'kv_seq'?" in str(e.value)


def test_reduction_naming_a_dim_twice():
    x = named("a b", 4, 4)
    with raises(md.ShapeError, match="dims to sum names 'a' twice") as e:
        md.sum(x, "a a")  # <sum-twice>
    assert f"sum at {line('sum-twice')}" in str(e.value)


def test_cumsum_over_two_dims():
    x = named("a b", 4, 4)
    with raises(md.ShapeError, match=re.escape("cumsum dim must be exactly one dim, got ['a', 'b']")) as e:
        md.cumsum(x, "a b")  # <cumsum-two>
    assert f"cumsum at {line('cumsum-two')}" in str(e.value)


@pytest.mark.parametrize("k", [0, 5])
def test_top_k_with_k_out_of_range(k):
    x = named("batch experts", 4, 4)
    with raises(md.ShapeError, match=re.escape(f"k={k} is not in 1..4 (size of 'experts')")) as e:
        md.top_k(x, "experts", k=k)  # <top-k-range>
    assert f"top_k at {line('top-k-range')}" in str(e.value)


def test_top_k_out_dim_already_present():
    x = named("batch experts", 4, 4)
    with raises(md.ShapeError, match=re.escape("out dim 'batch' already exists in [batch:4 experts:4]")) as e:
        md.top_k(x, "experts", k=2, out="batch")  # <top-k-out>
    assert f"top_k at {line('top-k-out')}" in str(e.value)


@pytest.mark.parametrize("offset", [4, -4, 9])
def test_shift_by_the_whole_dim_or_more(offset):
    x = named("seq", 4)
    with raises(md.ShapeError, match=f"shift by {offset} along seq:4 leaves nothing") as e:
        md.shift(x, "seq", offset=offset)  # <shift-big>
    assert f"shift at {line('shift-big')}" in str(e.value)
    assert "use |offset| < 4, or wrap=True" in str(e.value)


def test_shift_by_a_non_integer():
    x = named("seq", 4)
    with raises(md.ShapeError, match="shift offset must be a Python int, got 1.5") as e:
        md.shift(x, "seq", offset=1.5)  # <shift-float>
    assert f"shift at {line('shift-float')}" in str(e.value)


def test_concat_of_mismatching_operands():
    x, y = named("batch seq", 4, 4), named("batch seq", 2, 4)
    with raises(md.ShapeError, match=re.escape("operand 2 [batch:2 seq:4] does not match operand 1 [batch:4 seq:4] "
                                               "apart from 'seq'")) as e:
        md.concat([x, y], "seq")  # <concat>
    assert f"concat at {line('concat')}" in str(e.value)


def test_concat_of_an_operand_without_the_dim():
    x, y = named("batch seq", 4, 4), named("batch", 4)
    with raises(md.ShapeError, match=re.escape("operand 2 [batch:4] does not match")) as e:
        md.concat([x, y], "seq")  # <concat-missing>
    assert f"concat at {line('concat-missing')}" in str(e.value)


@pytest.mark.parametrize("start, size, shown", [(2, 4, "[2:6]"), (-1, 2, "[-1:1]")])
def test_slice_out_of_range(start, size, shown):
    x = named("seq", 4)
    with raises(md.ShapeError, match=re.escape(f"slice {shown} is outside seq:4")) as e:
        md.slice(x, "seq", start, size)  # <slice>
    assert f"slice at {line('slice')}" in str(e.value)


def test_pad_with_a_negative_width():
    x = named("seq", 4)
    with raises(md.ShapeError, match="pad widths must be >= 0, got -1, 0") as e:
        md.pad(x, "seq", -1, 0)  # <pad>
    assert f"pad at {line('pad')}" in str(e.value)


def test_one_hot_dim_already_present():
    i = ids("vocab", 4)
    with raises(md.ShapeError, match=re.escape("ids [vocab:4] already have a dim 'vocab'")) as e:
        md.one_hot(i, md.Dim("vocab", 8))  # <one-hot-present>
    assert f"one_hot at {line('one-hot-present')}" in str(e.value)


def test_one_hot_dim_without_a_size():
    i = ids("batch", 4)
    with raises(md.ShapeError, match="needs the size of 'vocab': write vocab:<size>") as e:
        md.one_hot(i, "vocab")  # <one-hot-size>
    assert f"one_hot at {line('one-hot-size')}" in str(e.value)


def test_take_with_overlapping_dims():
    table, i = named("vocab d_model", 8, 4), ids("d_model", 4)
    with raises(md.ShapeError, match=re.escape("ids [d_model:4] and table [vocab:8 d_model:4] share dims "
                                               "['d_model']")) as e:
        md.take(table, i, "vocab")  # <take-overlap>
    assert f"take at {line('take-overlap')}" in str(e.value) and "rename one side" in str(e.value)


def test_take_with_float_ids():
    table, i = named("vocab d_model", 8, 4), named("batch", 4)
    with raises(md.ShapeError, match="ids") as e:
        md.take(table, i, "vocab")  # <take-float>
    msg = str(e.value)
    assert f"take at {line('take-float')}" in msg
    assert "float32" in msg and "int" in msg  # what they are and what they must be


def test_scan_over_xs_lacking_the_dim():
    c, xs = named("d", 4), named("d", 4)
    with raises(md.ShapeError, match=re.escape("xs entry [d:4] has no dim 'layers' to scan over")) as e:
        md.scan(lambda c, x: (c, x), c, xs, dim="layers")  # <scan-no-dim>
    assert f"md.scan at {line('scan-no-dim')}" in str(e.value)


def test_scan_over_xs_disagreeing_on_the_length():
    c, xs = named("d", 4), [named("layers d", 2, 4), named("layers d", 3, 4)]
    with raises(md.ShapeError, match=re.escape("xs disagree on the size of 'layers': [2, 3]")) as e:
        md.scan(lambda c, x: (c, x), c, xs, dim="layers")  # <scan-lengths>
    assert f"md.scan at {line('scan-lengths')}" in str(e.value)


def test_scan_over_a_plain_array():
    c, xs = named("d", 4), np.ones((2, 4), np.float32)
    with raises(md.ShapeError, match="xs must hold NamedArrays with dim 'layers'") as e:
        md.scan(lambda c, x: (c, x), c, xs, dim="layers")  # <scan-plain>
    assert f"md.scan at {line('scan-plain')}" in str(e.value)


def test_scan_step_changing_the_carry_dims():
    def fn(c, xs):
        return md.scan(lambda c, x: (md.rename(c, {"d": "e"}), x), c, xs, dim="layers")  # <scan-carry>

    f = md.lower(fn, MESH, md.Layout({"d": "model"}))
    c, xs = named("d", 4), named("layers d", 2, 4)
    with raises(md.ShapeError, match=re.escape("carry entry 0 entered as [d:4] and left as [e:4]")) as e:
        f(c, xs)
    assert f"md.scan at {line('scan-carry')}" in str(e.value)
    assert "return the carry with the same dims" in str(e.value)


def test_scan_step_changing_the_carry_size():
    c, xs = named("d", 4), named("layers d", 2, 4)
    with raises(md.ShapeError, match=re.escape("entered as [d:4] and left as [d:5]"), eager=True):
        md.scan(lambda c, x: (md.pad(c, "d", 0, 1), x), c, xs, dim="layers")


def test_scan_step_changing_the_carry_dtype():
    c, xs = named("d", 4), named("layers d", 2, 4)
    with raises(md.ShapeError, match="entered as float32 and left as int32", eager=True) as e:
        md.scan(lambda c, x: (c.astype(jnp.int32), x), c, xs, dim="layers")
    assert "astype" in str(e.value)


def test_scan_step_changing_the_carry_structure():
    c, xs = named("d", 4), named("layers d", 2, 4)
    with raises(md.ShapeError, match="the step returned a carry of structure", eager=True):
        md.scan(lambda c, x: ((c, c), x), c, xs, dim="layers")


def test_plain_array_passed_to_an_op():
    a = np.ones((4,), np.float32)
    with raises(md.ShapeError, match=re.escape("operand 1 is a ndarray of shape (4,), not a NamedArray")) as e:
        md.exp(a)  # <plain-operand>
    assert f"exp at {line('plain-operand')}" in str(e.value)
    assert "md.named(array, 'dim names')" in str(e.value)


def test_plain_jax_array_passed_to_an_op_inside_md_lower():
    def fn(x):
        return x * jnp.ones((4,))  # <plain-operand-lowered>

    f = md.lower(fn, MESH, md.Layout({"batch": "data"}))
    x = named("batch", 4)
    with raises(md.ShapeError, match=re.escape("operand 2 is a")) as e:
        f(x)
    assert f"multiply at {line('plain-operand-lowered')}" in str(e.value)
    assert "of shape (4,), not a NamedArray" in str(e.value)


@pytest.mark.parametrize("key", [3, np.ones((3,), np.float32)])
def test_random_with_a_bad_key(key):
    with raises(md.ShapeError, match=re.escape("expected a jax PRNG key (jax.random.key(0))"), eager=True) as e:
        md.random.normal(key, "a:4")  # <random-key>
    assert f"normal at {line('random-key')}" in str(e.value)


def test_random_dims_without_a_size():
    key = jax.random.key(0)
    with raises(md.ShapeError, match="needs the size of 'a': write a:<size>") as e:
        md.random.uniform(key, "a")  # <random-size>
    assert f"uniform at {line('random-size')}" in str(e.value)


def test_bernoulli_with_a_named_array_probability():
    key, p = jax.random.key(0), named("a", 4)
    with raises(md.ShapeError) as e:
        md.random.bernoulli(key, p, "a:4")  # <bernoulli-p>
    msg = str(e.value)
    assert f"bernoulli at {line('bernoulli-p')}" in msg
    assert re.search(r"\bp\b", msg), msg  # names the argument that is wrong (not an internal operand)


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
