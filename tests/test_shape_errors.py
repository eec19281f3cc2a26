"""Errors are part of the interface (see test_errors.py): an op given dims that do not fit gets an
``md.ShapeError`` naming the op, the user's source line (``test_shape_errors.py:<line>`` for the
op calls here), the dims and sizes involved and what to change; raised while tracing, before
anything compiles. Covers the size clashes between operands, ``md.named`` / ``md.param`` /
``md.shape`` / ``md.Dim``, and every op's own arguments: einsum, rename, reshape, reductions,
top_k, shift, concat, slice, pad, one_hot, take, scan, plain arrays given as operands, random.

Source lines are found by markers: a line ending in ``# <tag>`` is ``line("tag")``.
Mesh: data=2 x model=4 over the 8 virtual CPU devices; tiny shapes, nothing is run.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md
from helpers import ids, marker_lines, named, raises

MESH = md.Mesh({"data": 2, "model": 4})
line = marker_lines(__file__)


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
