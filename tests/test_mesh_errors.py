"""Errors are part of the interface (see test_errors.py): a mesh that cannot be built (sizes that
are not the number of devices, bad axis names or sizes, unreadable ``md.Mesh.parse`` strings,
wildcards that cannot fill the devices), an axis the mesh lacks, and an abstract mesh asked to run
get an ``md.MeshError`` that says what to write instead; nothing is compiled first.
"""

import re

import jax
import pytest

import meshdsl as md
from helpers import identity, named, raises

MESH = md.Mesh({"data": 2, "model": 4})
N_DEVICES = len(jax.devices())


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
