"""Where an ``md.scan``'s carry enters its step is the plan's choice, seen at both ends of the
step (:mod:`meshdsl.planner.carries`): the step's ops may leave the carry elsewhere than it
entered only where the plan pays its relay back every step, and the relay before the loop is
an edge the plan shares with the loop's other readers. The program that runs moves what the
plan priced."""

import jax.numpy as jnp
import numpy as np

import meshdsl as md
from helpers import promises_kept

MESH = md.Mesh({"data": 2, "model": 4})


def _normal(shape, names, seed):
    return md.named(jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)), names)


def _step(carry, w):
    """A step leaving its carry ``h[b f]`` computed from a contraction over ``n2`` split on model."""
    h, acc = carry
    z = md.rename(md.einsum(h, w, out="b n2"), {"n2": "f"})
    hn = md.transpose(md.softmax(z, "b") + h * 0.5, "b f")
    return (hn, acc + md.sum(z, "f") * 0.1), md.sum(hn)


def _program(x0, x1, w):
    """A carry made by a contraction (a pending sum over model), read by a sum before the loop."""
    t3 = md.einsum(x1, md.pad(x0, "b", 5, 3, value=0), out="b f")
    t11 = md.sum(t3, "f") * 0.0 + 1.0
    (t9, t8), t10 = md.scan(_step, (t3, t11), w, dim="L")
    return t10, t11, t9, t8


def _args():
    return _normal((8, 16, 32), "d h b", 0), _normal((8, 8), "f d", 1), _normal((3, 8, 8), "L f n2", 2)


LAYOUT = md.Layout({"f": "data", "d": "model", "h": "data", "n2": "model"})


def test_a_carry_reduced_before_the_loop_shares_the_reduction_with_a_reader_before_it():
    """The loop reads its carry reduced (the einsum's pending sum over model), as the sum before
    the loop may: one reduction for both, gspmd's bytes (4812 B; the rules' own choices, and the
    plan when the loop's own cost held that reduction, reduce twice: 4932 B)."""
    promises_kept(_program, MESH, LAYOUT, *_args(), moved={"all-reduce": 2892.0, "all-gather": 1440.0,
                                                           "collective-permute": 480.0})


def test_the_plan_prices_what_its_program_moves_where_the_step_moves_its_carry():
    """Under the bytes objective the plan moves the step's ops; the graph prices each step's carry
    relaid back to where it entered, so the bytes it priced are the bytes its program moves."""
    report = md.explain(_program, MESH, LAYOUT, *_args(), objective="bytes")
    assert report.planned["bytes"] == report.total_bytes == 4812.0
