"""A loss's gradient program is priced by what it runs: under ``jax.grad`` the compiler drops the
loss's value, so the ops only that value needs are priced by their backward pass
(:mod:`meshdsl.planner.unread`); a whole term may join the loss's pending sum from one device, and
pays the cast it needs where the op deciding its type leaves it invariant. Each program is a fuzz
finding (seeds 50, 52, 53), replayed as text (:mod:`fuzz_replay`)."""

from __future__ import annotations

import jax

import meshdsl as md
from meshdsl.planner.plan import Unread
from fuzz_replay import parse
from helpers import promises_kept

BYTES = {"objective": "bytes"}


A_LOSS_OF_A_SPLIT_AND_A_REPLICATED_TERM = """mesh={'x': 8} layout={'e': ('x',)} params={} param_gather=keep
  v0 = input [e] float
  v1 = input [a] float param
  v2 = input [e] float param
  v3 = input [d] int
  v4 = create(v2; {'f': 'arange', 'dim': 'e'}) -> [e]
  v5 = binary(v1, v4; {'f': 'multiply'}) -> [a e]
  v6 = take(v1, v3; {'dim': 'a'}) -> [d]
  return v5, v6"""


def test_a_loss_of_a_split_and_a_replicated_term_moves_what_its_gradient_needs():
    """``jax.grad`` of ``sum(tanh(w[a] * arange[e:x])) + sum(tanh(take(w, ids)))``: the first sum
    is pending over ``x``, the second whole. The compiler drops the loss's forward value, so
    whatever reduces it there moves nothing; the plan prices those ops by their backward alone
    (:mod:`meshdsl.planner.unread`), and the whole term joins the pending sum from one device
    (the additive rule's candidate), so the gradient's one all-reduce of ``w`` (112 B) is all
    that moves (it cast the loss's partial sum and all-reduced its cotangent as well: 119 B where
    gspmd moves 112; fuzz seed 50)."""
    program = parse(A_LOSS_OF_A_SPLIT_AND_A_REPLICATED_TERM)
    mesh, layout = md.Mesh(program.mesh), md.Layout(program.layout, params=program.params)
    promises_kept(program.grads_inside(), mesh, layout, *program.args(), param_gather=program.param_gather,
                  moved={"all-reduce": 112})


def test_the_planner_finds_the_forward_values_a_gradient_program_never_reads():
    """In ``jax.grad(loss)`` the loss's final sums and the reads of their values are unread
    (the compiler drops their forward); in ``jax.value_and_grad`` the value is returned, so
    nothing is."""
    program = parse(A_LOSS_OF_A_SPLIT_AND_A_REPLICATED_TERM)
    mesh, layout = md.Mesh(program.mesh), md.Layout(program.layout, params=program.params)
    floats = tuple(program.float_inputs())

    def loss(*args):
        return md.sum(md.tanh(program.fn(*args)[0])).array + md.sum(md.tanh(program.fn(*args)[1])).array

    for fn, dropped in ((jax.grad(loss, argnums=floats), True), (jax.value_and_grad(loss, argnums=floats), False)):
        _, _, prog = md.lower(fn, mesh, layout, param_gather="keep", **BYTES).trace(*program.args())
        graph = prog.solved.graph
        sinks = [n.name for n in graph.nodes if n.name.startswith("unread")]
        ops = [n.name for n in graph.nodes if any(isinstance(p, Unread) for p in n.strategies[0].needs)]
        ops = [name.split(" at ")[0] for name in ops if not name.startswith("unread")]
        # the two sums and the two reads of their values (the last ops of the loss)
        assert (ops, len(sinks)) == ((["sum", "sum"], 2) if dropped else ([], 0)), (ops, sinks)


A_LOSS_WHOSE_WHOLE_TERM_MAY_BE_LEFT_INVARIANT = """mesh={'x': 2, 'y': 4} layout={'a': ('x', 'y'), 'b': ('y',), 'd': ('y',), 'e': ('x',), 'm128': ('x',), 'm256': ('y', 'x'), 'm512': ('x',), 'p4': ('x', 'y')} params={} param_gather=auto
  v0 = input [c a] float param
  v1 = input [c] float param
  v2 = input [b] float param
  v3 = input [b] int
  v4 = input [c] int
  v5 = transpose(v2; {'order': 'b'}) -> [b]
  v6 = softmax(v2; {'f': 'softmax', 'dim': 'b'}) -> [b]
  v7 = create(v5; {'f': 'full', 'dim': 'b'}) -> [b]
  v8 = take(v1, v4; {'dim': 'c'}) -> [c]
  return v7, v8"""


def test_a_whole_term_joins_a_pending_loss_free_only_where_it_is_typed_varying_there():
    """``jax.grad`` of a loss summing a term pending over ``y`` and a whole term computed from
    ``take(w, ids)``: the take may widen ``w`` to vary over ``y`` (its result typed varying) or
    not. The whole term joins the pending sum for free only when typed varying; where the take
    leaves it invariant the join casts it (its gradient's all-reduce), and the plan prices that,
    back along the ops that follow the take's type (it took the join free and the unwidened take
    and moved 6 B where gspmd moves nothing; fuzz seed 52)."""
    program = parse(A_LOSS_WHOSE_WHOLE_TERM_MAY_BE_LEFT_INVARIANT)
    mesh, layout = md.Mesh(program.mesh), md.Layout(program.layout, params=program.params)
    promises_kept(program.grads_inside(), mesh, layout, *program.args(), param_gather=program.param_gather)


A_LOSS_TERM_TYPED_BY_A_CONTRACTION_OF_ONE_VALUE_THRICE = """mesh={'x': 8, 'y': 1} layout={'b': ('y', 'x'), 'm512': ('x', 'y'), 'p4': ('y', 'x'), 'q4': ('x', 'y'), 'k2': ('x',)} params={} param_gather=keep dtype=bfloat16
  v0 = input [d b c] float
  v1 = input [a] float param
  v2 = input [c d] int
  v3 = input [c] int
  v4 = einsum3(v0, v1, v1; {'out': 'c'}) -> [c]
  v5 = compare(v1, v4; {'f': 'logical_and'}) -> [a c]
  v6 = einsum(v5, v5; {'out': 'a'}) -> [a]
  v7 = einsum3(v6, v6, v6; {'out': 'a'}) -> [a]
  v8 = scale(v0; {'c': 0.5, 'b': 0.0}) -> [d b c]
  return v7, v8"""


def test_the_type_a_joining_term_follows_is_traced_through_an_op_reading_one_value_thrice():
    """The whole loss term comes from ``einsum3(v, v, v)``, which is typed as ``v`` is: the op
    deciding that type is found through it (one value, read three times), so the join that
    needs it varying pays the cast where that op leaves it invariant (63 B where gspmd moves 56;
    fuzz seed 53)."""
    program = parse(A_LOSS_TERM_TYPED_BY_A_CONTRACTION_OF_ONE_VALUE_THRICE)
    mesh, layout = md.Mesh(program.mesh), md.Layout(program.layout, params=program.params)
    promises_kept(program.grads_inside(), mesh, layout, *program.args(), param_gather=program.param_gather)
