"""Shared test helpers: compare NamedArrays by name, count collectives in compiled HLO; and what
several test modules share: the error checks, the layers' sizes, a small training run."""

from __future__ import annotations

import contextlib
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

import meshdsl as md
from meshdsl.costmodel import hlo_comm
from meshdsl.models.loss import lm_loss


def is_named(x) -> bool:
    return isinstance(x, md.NamedArray)


def to_numpy(x: md.NamedArray, names=None) -> np.ndarray:
    """The global value of ``x`` with axes in ``names`` order."""
    arr = np.asarray(x.array)
    if isinstance(names, str):
        names = names.split()
    if names is not None and tuple(names) != x.names:
        arr = np.transpose(arr, [x.names.index(n) for n in names])
    return arr


def assert_same(actual, expected, rtol=1e-5, atol=1e-5):
    """Pytrees of NamedArrays (or arrays) equal by name: same dims, same values."""
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual, is_leaf=is_named)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected, is_leaf=is_named)
    assert a_tree == e_tree or len(a_leaves) == len(e_leaves), (a_tree, e_tree)
    for a, e in zip(a_leaves, e_leaves):
        if is_named(e):
            assert is_named(a), a
            assert set(a.names) == set(e.names), (a.dims, e.dims)
            assert a.shape == e.shape
            assert a.is_param == e.is_param
            np.testing.assert_allclose(to_numpy(a, e.names).astype(np.float64),
                                       to_numpy(e).astype(np.float64), rtol=rtol, atol=atol)
        else:
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol, atol=atol)


def check_layout(fn, mesh, layout, *args, rtol=1e-5, atol=1e-5, backend="explicit", **kw):
    """Run ``fn`` unsharded and lowered (``kw``: md.lower's options); assert equal; return the
    lowered function."""
    expected = fn(*args)
    f = md.lower(fn, mesh, layout, backend=backend, **kw)
    assert_same(f(*args), expected, rtol, atol)
    return f


def hlo_summary(f, *args) -> dict:
    """kind -> (count, bytes moved per device) in the compiled program."""
    rep = hlo_comm.analyze(f.lower(*args).compile())
    return {k: (v["count"], v["moved_bytes"]) for k, v in rep.summary().items()}


def explain_summary(report) -> dict:
    return {k: (v["count"], v["bytes"]) for k, v in report.summary().items()}


def bytes_by_kind(summary: dict) -> dict:
    return {k: v[1] for k, v in summary.items()}


# -- the three promises on one program (the test_*_keep_the_promises files) ---------------------------------

def moved_by_backend(fn, mesh, layout, *args, **kw):
    """Bytes per device the compiled program moves, explicit and gspmd backends (the explicit plan
    minimising bytes unless ``objective=`` says otherwise: the promise is about that objective)."""
    kw = {"objective": "bytes", **kw}
    return {be: hlo_comm.analyze(md.lower(fn, mesh, layout, backend=be, **kw).lower(*args).compile())
            .total_moved_bytes() for be in ("explicit", "gspmd")}


def explain_vs_hlo(fn, mesh, layout, *args, **kw):
    """(md.explain, compiled HLO) bytes per collective kind, kinds with bytes only (under either
    objective: ``objective=`` passes through)."""
    e = md.explain(fn, mesh, layout, *args, **kw).summary()
    h = hlo_comm.analyze(md.lower(fn, mesh, layout, **kw).lower(*args).compile()).summary()
    return ({k: v["bytes"] for k, v in e.items() if v["bytes"]},
            {k: v["moved_bytes"] for k, v in h.items() if v["moved_bytes"]})


def same_unsharded(fn, mesh, layout, *args, **kw):
    """``fn`` lowered on a mesh and layout given as dicts equals ``fn`` unsharded."""
    assert_same(md.lower(fn, md.Mesh(mesh), md.Layout(layout), **kw)(*args), fn(*args))


def promises_kept(fn, mesh, layout, *args, moved=None, **kw):
    """The three promises on one program: the unsharded values, no more bytes than gspmd (the plan
    minimising bytes), and explain == the compiled HLO (== ``moved``, bytes per kind, when given)."""
    kw = {"objective": "bytes", **kw}
    b = moved_by_backend(fn, mesh, layout, *args, **kw)
    assert b["explicit"] <= b["gspmd"], b
    e, h = explain_vs_hlo(fn, mesh, layout, *args, **kw)
    assert e == h and (moved is None or e == moved), (e, h)
    assert_same(md.lower(fn, mesh, layout, **kw)(*args), fn(*args))


# -- one mistake, one exact error (test_errors, test_shape_errors, test_mesh_errors) ---------------

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def marker_lines(path: str):
    """``line(tag)`` for the test module at ``path``: ``<its file name>:<n>`` of its one source line
    ending in ``# <tag>`` (the line an error message must name)."""
    path = pathlib.Path(path)
    source = path.read_text().splitlines()

    def line(tag: str) -> str:
        hits = [i + 1 for i, text in enumerate(source) if text.rstrip().endswith(f"# <{tag}>")]
        assert len(hits) == 1, (tag, hits)
        return f"{path.name}:{hits[0]}"
    return line


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


# -- meshdsl.layers: the sizes (test_layers, test_layers_math; their inputs are in conftest.py) ----

B, S, D, F, H, K, V, E = 8, 8, 16, 32, 4, 4, 32, 8
D_MODEL, D_FF, HEADS, D_KV = md.Dim("d_model", D), md.Dim("d_ff", F), md.Dim("heads", H), md.Dim("d_kv", K)
VOCAB, EXPERTS = md.Dim("vocab", V), md.Dim("experts", E)


# -- the training CLI: a small 8-step run (test_train_faults, test_supervisor) ---------------------

SMALL = "d_model=32,d_ff=64,heads=4,d_kv=8"
RUN = ["--override", SMALL, "--batch", "8", "--encoder-length", "32", "--log-every", "1", "--no-explain",
       "--eval-batches", "0", "--steps", "8", "--ckpt-every", "2"]


def gated_mlp_stack(layers=4, batch=8, seq=64, d_model=128, d_ff=512):
    """Weights ``w1 [layers d_model d_ff]``, ``w2 [layers d_ff d_model]`` (parameters) and an input
    ``x [batch seq d_model]`` of a stack of gated MLP blocks."""
    r = np.random.default_rng(0)
    w1 = md.param(md.named(jax.numpy.asarray(r.standard_normal((layers, d_model, d_ff)) * 0.05, np.float32),
                           "layers d_model d_ff"))
    w2 = md.param(md.named(jax.numpy.asarray(r.standard_normal((layers, d_ff, d_model)) * 0.05, np.float32),
                           "layers d_ff d_model"))
    x = md.named(jax.numpy.asarray(r.standard_normal((batch, seq, d_model)), np.float32), "batch seq d_model")
    return w1, w2, x


def gated_mlp_grads(remat):
    """The gradients (of ``w1``, ``w2``) of ``sum(h * h)`` after the stack of gated MLP blocks
    :func:`gated_mlp_stack` makes, scanned over ``layers`` with ``remat``."""
    def loss(w1, w2, x):
        def step(h, ws):
            a, b = ws
            u = md.einsum(h, a, out="batch seq d_ff")
            return h + md.einsum(md.tanh(u) * md.sigmoid(u), b, out="batch seq d_model"), None
        h, _ = md.scan(step, x, (w1, w2), dim="layers", remat=remat)
        return md.sum(h * h).array

    return lambda w1, w2, x: jax.grad(loss, argnums=(0, 1))(w1, w2, x)


# -- decoder-only language models: a batch and a training step (test_llama, test_moe_decoder) ----------

def lm_batch(vocab: int, batch: int = 8, length: int = 16, seed: int = 3) -> dict:
    """A decoder-only batch: random targets in ``2 .. vocab-1``, their inputs shifted right after a
    0, the last three positions unweighted; dims ``batch targets``."""
    r = np.random.RandomState(seed)
    targets = r.randint(2, vocab, (batch, length))
    inputs = np.concatenate([np.zeros((batch, 1), int), targets[:, :-1]], 1)
    weights = np.ones((batch, length), np.float32)
    weights[:, -3:] = 0
    return {"decoder_input_tokens": md.named(jax.numpy.asarray(inputs), "batch targets"),
            "decoder_target_tokens": md.named(jax.numpy.asarray(targets), "batch targets"),
            "decoder_loss_weights": md.named(jax.numpy.asarray(weights), "batch targets")}


def lm_step(model, batch):
    """``(loss, metrics, gradients)`` of :func:`meshdsl.models.loss.lm_loss` on ``batch``."""
    (loss, metrics), grads = nnx.value_and_grad(lambda m: (lambda r: (r[0].array, r[1]))(lm_loss(m, batch)),
                                                has_aux=True)(model)
    return loss, metrics, grads
