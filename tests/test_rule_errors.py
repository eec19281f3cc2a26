"""Layout rules that name what does not exist, each an ``md.LayoutError`` raised before anything
compiles: a mesh axis the mesh lacks (a typo is never ignored), a dim that looks like a typo of a
dim of the program, and - with ``md.lower(..., unused_rules="error")``, as the training CLI lowers
a model - any rule for a dim the program never has, listing the program's dims.
Mesh: data=2 x model=4 over the 8 virtual CPU devices; tiny shapes, nothing is run."""

import re

import meshdsl as md
from helpers import identity, named, raises

MESH = md.Mesh({"data": 2, "model": 4})


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


def test_strict_unused_rules_refuse_a_rule_for_a_dim_the_program_lacks():
    """unused_rules="error": Megatron's heads:model on a model whose attention dim is kv_heads
    shards nothing; the error lists the program's dims. By default such a rule is allowed."""
    def fn(x, w):
        return md.einsum(x, w, out="batch kv_heads")

    x, w = named("batch d_model", 4, 8), named("d_model kv_heads", 8, 4)
    layout = md.Layout({"batch": "data", "heads": "model"})
    assert md.lower(fn, MESH, layout)(x, w).names == ("batch", "kv_heads")   # shared layouts: allowed
    with raises(md.LayoutError, match=re.escape("layout rule for 'heads' matches no dim of the program (its dims: "
                                                "batch, d_model, kv_heads)")) as e:
        md.lower(fn, MESH, layout, unused_rules="error")(x, w)
    assert "drop the rule or name one of these dims" in str(e.value)


def test_strict_unused_rules_refuse_a_params_rule_for_a_dim_the_program_lacks():
    f = md.lower(identity, MESH, md.Layout({}, params={"experts": "data"}), unused_rules="error")
    with raises(md.LayoutError, match=re.escape("params rule for 'experts' matches no dim of the program (its "
                                                "dims: d_model)")):
        f(md.param(named("d_model", 4)))


def test_strict_unused_rules_with_the_gspmd_backend():
    f = md.lower(identity, MESH, md.Layout({"d_ff": "model"}), backend="gspmd", unused_rules="error")
    with raises(md.LayoutError, match=re.escape("layout rule for 'd_ff' matches no dim of the program (its dims: "
                                                "batch)")):
        f(named("batch", 4))


def test_unused_rules_is_allow_or_error():
    with raises(md.MeshDSLError, match=re.escape("md.lower: unused_rules must be one of ('allow', 'error'), got "
                                                "'eror'")) as e:
        md.lower(identity, MESH, md.Layout({}), unused_rules="eror")
    assert "did you mean 'error'?" in str(e.value)
