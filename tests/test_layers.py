"""meshdsl.layers: T5 / Switch layers over named dims, sharded.

Each layer program runs once on global arrays (the reference, jitted) and once lowered under six
layouts on 8 devices (data, Megatron, 2-D weights, ZeRO-3 storage, expert parallel, and a mixed 3-D
layout); its outputs and ``jax.grad`` with respect to every parameter and the float input (taken
inside the lowered function) must agree. The loss is a sum of the outputs times fixed probes built
from ``md.arange``, so it is layout-invariant too. Random layers draw the same numbers under every
layout; stacks scanned with ``L.scan_layers`` equal the unrolled loop under every remat policy; MoE
communication is checked against the compiled HLO and ``md.explain``. The layers' math is in
test_layers_math.py. Shapes are small: the file is dominated by XLA compilations.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshdsl as md
import meshdsl.layers as L
from helpers import (B, D, D_FF, D_KV, D_MODEL, E, EXPERTS, HEADS, S, VOCAB, assert_same, bytes_by_kind,
                     explain_summary, hlo_summary, to_numpy)

MESH_2D = {"data": 2, "model": 4}

LAYOUTS = {
    "data": (MESH_2D, {"batch": "data"}, None),
    "megatron": (MESH_2D, {"batch": "data", "heads": "model", "d_ff": "model", "vocab": "model"}, None),
    "2d": (MESH_2D, {"d_model": "data", "d_ff": "model", "heads": "model"}, None),
    "zero3": (MESH_2D, {"batch": "data"}, {"d_model": "data"}),
    "expert": ({"data": 8}, {"batch": "data", "group": "data", "experts": "data"}, None),
    "mixed": ({"data": 2, "model": 2, "fsdp": 2},
              {"batch": "data", "heads": "model", "d_ff": "model", "vocab": "model", "experts": "data",
               "group": "data"}, {"d_model": "fsdp"}),
}


def layout_case(name):
    mesh, rules, params = LAYOUTS[name]
    return md.Mesh(mesh), md.Layout(rules, params=params)


def named_leaves(tree):
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda v: isinstance(v, md.NamedArray))
            if isinstance(x, md.NamedArray)]


def probe(dims, salt: int) -> md.NamedArray:
    """A fixed, layout-invariant, irregular tensor over ``dims``: sin of a weighted sum of positions
    (cheaper to compile than random numbers, which matters at ~40 compiles per file)."""
    phase = 0.1 * salt
    for j, d in enumerate(dims):
        phase = phase + md.arange(d).astype(jnp.float32) * (0.7 + 0.31 * j + 0.13 * salt)
    return md.sin(phase)


def probe_loss(outputs):
    """sum_i <out_i, probe_i>: a scalar NamedArray whose gradient reaches every output element."""
    total = 0.0
    for i, y in enumerate(named_leaves(outputs)):
        if jnp.issubdtype(y.dtype, jnp.floating):
            total = total + md.sum(y.astype(jnp.float32) * probe(y.dims, i))
    return total


def with_grads(program):
    """``run(modules, x, extras) -> (outputs, (param grads, input grad))``, grads taken inside."""
    def run(modules, x, extras):
        graphdef, state = nnx.split(modules)

        def loss(state, x):
            out = program(nnx.merge(graphdef, state), x, extras)
            return probe_loss(out).array, out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
        return out, grads
    return run


def check_invariance(program, modules, x, extras, rtol=2e-4, atol=2e-4, layouts=tuple(LAYOUTS)):
    run = with_grads(program)
    expected = jax.jit(run)(modules, x, extras)
    for name in layouts:
        mesh, layout = layout_case(name)
        try:
            got = md.lower(run, mesh, layout)(modules, x, extras)
            assert_same(got, expected, rtol=rtol, atol=atol)
        except Exception as e:  # name the layout that failed
            raise AssertionError(f"layout {name!r}: {e}") from e
    return expected


# -- layout invariance: forward and gradients --------------------------------------------------------


def test_dense_embedding_norm_dropout_are_layout_invariant(x, ids):
    rngs = nnx.Rngs(0)
    modules = (L.Embedding(VOCAB, D_MODEL, rngs=rngs), L.RMSNorm(D_MODEL), L.Dense(D_MODEL, D_FF, rngs=rngs),
               L.Dropout(0.25), L.Dense(D_FF, D_MODEL, rngs=rngs))

    def program(m, x, extras):
        emb, norm, up, drop, down = m
        ids, key = extras
        h = norm(x + emb(ids))
        h = down(drop(md.relu(up(h)), key))
        return h, emb.attend(h)

    check_invariance(program, modules, x, (ids, jax.random.key(3)))


def test_attention_is_layout_invariant(x, key_mask):
    rngs = nnx.Rngs(1)
    enc = md.random.normal(jax.random.key(4), [md.Dim("batch", B), md.Dim("seq", 16), D_MODEL])
    enc_mask = md.named(np.arange(16)[None, :] < np.array([16, 9, 3, 16, 12, 1, 16, 5])[:, None], "batch seq")
    modules = (L.Attention(D_MODEL, HEADS, D_KV, rngs=rngs, causal=True),
               L.Attention(D_MODEL, HEADS, D_KV, rngs=rngs, relative_bias=False))

    def program(m, x, extras):
        self_attn, cross = m
        key_mask, enc, enc_mask = extras
        y, bias = self_attn(x, key_mask=key_mask)
        z, none = cross(y, enc, key_mask=enc_mask)
        assert none is None
        return y, bias, z

    check_invariance(program, modules, x, (key_mask, enc, enc_mask))


def test_feedforward_is_layout_invariant(x):
    rngs = nnx.Rngs(2)
    modules = (L.FeedForward(D_MODEL, D_FF, rngs=rngs, activation="gated-gelu", dropout_rate=0.1),
               L.FeedForward(D_MODEL, D_FF, rngs=rngs, activation="relu"))

    def program(m, x, key):
        gated, plain = m
        return gated(x, key=key), plain(x)

    check_invariance(program, modules, x, jax.random.key(6))


@pytest.mark.parametrize("top_k, train", [pytest.param(1, True, marks=pytest.mark.slow), (2, False)])  # (1, True): ~27 s
def test_moe_is_layout_invariant(x, top_k, train):
    """Training capacity (factor 1.0: tokens are dropped) and evaluation capacity; jitter noise is
    random, and checked with the other random layers below."""
    moe = L.MoE(D_MODEL, D_FF, EXPERTS, rngs=nnx.Rngs(3), top_k=top_k, capacity_factor=1.0, min_capacity=1,
                router_scale=2.0)

    def program(m, x, extras):
        return m(x, train=train)

    out, _ = check_invariance(program, moe, x, None)
    assert float(out[1]["dropped_fraction"].array) > 0  # capacity is tight enough to drop tokens


def stacked_block(n_layers, rngs):
    stack = md.Dim("layers", n_layers)
    return (L.RelativePositionBias(HEADS, rngs=rngs, scale=D ** -0.5),
            (L.RMSNorm(D_MODEL, stack=stack),
             L.Attention(D_MODEL, HEADS, D_KV, rngs=rngs, relative_bias=False, stack=stack),
             L.RMSNorm(D_MODEL, stack=stack),
             L.FeedForward(D_MODEL, D_FF, rngs=rngs, dropout_rate=0.1, stack=stack)))


def block_step(bias):
    """One pre-norm T5 encoder block; the position bias is computed once, outside the scan."""
    def step(layer, x, key):
        norm1, attn, norm2, ff = layer
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        y, _ = attn(norm1(x), bias=bias, key=k1)
        x = x + y
        x = x + ff(norm2(x), key=k2)
        return x, md.mean(md.square(x))
    return step


def encoder(remat="none"):
    def program(m, x, key):
        position, layers = m
        bias = position(x.dims["seq"], md.Dim("kv_seq", x.dims["seq"].size))
        return L.scan_layers(layers, x, block_step(bias), key=key, remat=remat)
    return program


@pytest.mark.slow   # ~35 s; test_models' T5 and MoE-T5 invariance scan their stacks under every layout by default
def test_scanned_stack_is_layout_invariant(x):
    """The layers inside md.scan (their own six layouts are tested above), with per-layer dropout
    keys and remat: ZeRO-3 storage gathered per step, and the mixed 3-D layout (tensor parallel
    heads and d_ff, storage split over a third axis)."""
    check_invariance(encoder("dots"), stacked_block(2, nnx.Rngs(4)), x, jax.random.key(8),
                     layouts=("zero3", "mixed"))


def test_initialisation_inside_lower_is_layout_invariant():
    """A stacked layer built inside md.lower: each device draws only its block, the values are the
    ones drawn on one device, and the parameters come back in the storage layout."""
    def init(key):
        return nnx.split(L.FeedForward(D_MODEL, D_FF, rngs=nnx.Rngs(params=key), stack=md.Dim("layers", 2)))[1]

    key = jax.random.key(14)
    expected = init(key)
    for name in ("zero3", "mixed"):
        mesh, layout = layout_case(name)
        got = md.lower(init, mesh, layout)(key)
        assert_same(got, expected, rtol=0, atol=0)
        kernel = got["wi_0"]["kernel"].get_value()
        want = jax.sharding.NamedSharding(mesh.jax_mesh, layout.spec(kernel.dims, mesh, storage=True))
        assert kernel.array.sharding.is_equivalent_to(want, kernel.ndim)


def test_dropout_masks_and_router_jitter_are_identical_across_layouts(x):
    key = jax.random.key(11)
    moe = L.MoE(D_MODEL, D_FF, EXPERTS, rngs=nnx.Rngs(12), jitter_noise=0.5, min_capacity=1)

    def program(moe, x, key):
        return (L.dropout(x, 0.3, key), L.Dropout(0.3)(x), L.dropout(x, 0.0, key), moe(x, key=key),
                moe(x, train=True))

    expected = jax.jit(program)(moe, x, key)
    dropped, same, also_same = (to_numpy(v) for v in expected[:3])
    jittered, plain = expected[3][0], expected[4][0]
    assert np.abs(to_numpy(jittered) - to_numpy(plain, jittered.names)).max() > 1e-3  # the jitter acts
    np.testing.assert_array_equal(same, to_numpy(x))
    np.testing.assert_array_equal(also_same, to_numpy(x))
    kept = dropped != 0
    assert 0.6 < kept.mean() < 0.8
    np.testing.assert_allclose(dropped[kept], to_numpy(x)[kept] / 0.7, rtol=1e-6)
    for name in ("expert", "mixed"):  # (dropout under all six layouts: the first test above)
        mesh, layout = layout_case(name)
        got = md.lower(program, mesh, layout)(moe, x, key)
        np.testing.assert_array_equal(to_numpy(got[0]), dropped)
        assert_same(got[3], expected[3], rtol=1e-5, atol=1e-5)


# -- stacks: scan == unrolled loop; remat; compile size --------------------------------------------------


def test_scan_equals_unrolled_python_loop_and_remat_policies(x):
    modules = stacked_block(2, nnx.Rngs(5))
    key = jax.random.key(9)

    def unrolled(m, x, key):
        position, layers = m
        bias = position(x.dims["seq"], md.Dim("kv_seq", S))
        ys = []
        for i in range(2):
            x, y = block_step(bias)(L.layer_at(layers, i), x, jax.random.fold_in(key, i))
            ys.append(md.reshape(y, "layers:1"))
        return x, md.concat(ys, "layers")

    expected = jax.jit(with_grads(unrolled))(modules, x, key)
    policies = list(L.REMAT_POLICIES)
    scanned = jax.jit(lambda *args: [with_grads(encoder(p))(*args) for p in policies])(modules, x, key)
    for ((carry, ys), grads) in scanned:
        assert ys.names == ("layers",)
        assert_same((carry, ys), expected[0], rtol=1e-5, atol=1e-5)
        assert_same(grads, expected[1], rtol=1e-4, atol=1e-5)


def test_remat_policies_by_name_choose_what_is_communicated_again(x):
    """Under Megatron, recomputing a layer (full) runs its forward all-reduces again in the backward
    pass; keeping what collectives produced (by name: "collectives" or "all-reduce") does not, and
    costs no more bytes than keeping everything. The results stay the unsharded ones."""
    modules = stacked_block(2, nnx.Rngs(5))
    key = jax.random.key(9)
    mesh, layout = layout_case("megatron")

    def all_reduce_bytes(policy):
        report = md.explain(with_grads(encoder(policy)), mesh, layout, modules, x, key)
        return sum(r.total_bytes for r in report.collectives if r.kind == "all-reduce")

    kept = all_reduce_bytes("none")
    assert all_reduce_bytes("full") > kept
    assert all_reduce_bytes("collectives") == kept
    assert all_reduce_bytes("all-reduce") == kept
    assert_same(md.lower(with_grads(encoder("collectives")), mesh, layout)(modules, x, key),
                jax.jit(with_grads(encoder("none")))(modules, x, key), rtol=1e-4, atol=1e-5)
    with pytest.raises(md.MeshDSLError, match="value names to keep from"):
        L.remat_policy("einsum,all-gathr")


def test_scan_program_size_does_not_grow_with_depth(x):
    sizes = []
    for n in (2, 5):
        modules = jax.eval_shape(lambda: stacked_block(n, nnx.Rngs(6)))
        jaxpr = jax.make_jaxpr(lambda m, x: with_grads(encoder("full"))(m, x, None))(modules, x)
        sizes.append(len(jaxpr.jaxpr.eqns))
    assert sizes[0] == sizes[1]


def test_scan_layers_needs_the_stack_dim(x):
    with pytest.raises(md.ShapeError, match="stack dim 'layers'"):
        L.scan_layers(L.RMSNorm(D_MODEL), x, lambda layer, c, k: (layer(c), None))
    with pytest.raises(md.MeshDSLError, match="remat policy"):
        L.with_remat(lambda: None, "sometimes")


# -- MoE: expert parallelism, one all-to-all each way -----------------------------------------------


def test_moe_expert_parallelism_is_one_all_to_all_each_way(x):
    """experts: data moves the dispatched tokens with one all-to-all and brings them back with one;
    nothing else in the forward pass. md.explain predicts the compiled HLO byte for byte."""
    moe = L.MoE(D_MODEL, D_FF, EXPERTS, rngs=nnx.Rngs(11), top_k=2, capacity_factor=1.0)
    mesh, layout = layout_case("expert")
    n = mesh.shape["data"]
    capacity = moe.capacity(S, train=False)
    groups_per_device = B * S // S // n
    local = groups_per_device * E * capacity * D * 4           # [group/n, expert_choice, capacity, d_model]
    a2a = (n - 1) / n * local

    def forward(m, x):
        return m(x)[0]

    hlo = hlo_summary(md.lower(forward, mesh, layout), moe, x)
    report = md.explain(forward, mesh, layout, moe, x)
    assert hlo == {"all-to-all": (2, pytest.approx(2 * a2a))}
    assert explain_summary(report) == {"all-to-all": (2, pytest.approx(2 * a2a))}
    assert {r.tensor.split(" move ")[-1] for r in report.collectives} == {
        "data group_all->experts", "data expert_choice->group"}

    def train_grads(m, x):  # gradients for the parameters and the input (a block below needs it)
        graphdef, state = nnx.split(m)
        return jax.grad(lambda s, x: probe_loss(md.square(nnx.merge(graphdef, s)(x)[0])).array,
                        argnums=(0, 1))(state, x)

    hlo = hlo_summary(md.lower(train_grads, mesh, layout), moe, x)
    report = md.explain(train_grads, mesh, layout, moe, x)
    router_grad = 2 * (n - 1) / n * D * E * 4                 # the replicated router's gradient, summed
    assert hlo == {"all-reduce": (1, pytest.approx(router_grad)), "all-to-all": (4, pytest.approx(4 * a2a))}
    assert bytes_by_kind(explain_summary(report)) == pytest.approx(bytes_by_kind(hlo))
    assert [r.kind for r in report.collectives if r.phase == "forward"] == ["all-to-all"] * 2


def test_stacked_moe_in_a_scan_is_two_all_to_alls_per_layer(x):
    moe = L.MoE(D_MODEL, D_FF, EXPERTS, rngs=nnx.Rngs(15), stack=md.Dim("layers", 3))

    def stack(m, x):
        def step(layer, x, key):
            y, metrics = layer(x)
            return x + y, metrics
        return L.scan_layers(m, x, step)

    mesh, layout = layout_case("expert")
    expected = jax.jit(stack)(moe, x)
    f = md.lower(stack, mesh, layout)
    assert_same(f(moe, x), expected, rtol=1e-4, atol=1e-5)
    assert expected[1]["expert_load"].names == ("layers", "experts")
    hlo, report = hlo_summary(f, moe, x), md.explain(stack, mesh, layout, moe, x)
    assert hlo["all-to-all"][0] == 6 and explain_summary(report)["all-to-all"] == hlo["all-to-all"]
    assert bytes_by_kind(explain_summary(report)) == pytest.approx(bytes_by_kind(hlo))
    small = [r for r in report.collectives if r.kind != "all-to-all"]
    assert all(r.bytes <= 3 * E * 4 for r in small)  # the rest: the stacked per-layer metrics only
