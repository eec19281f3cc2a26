"""The lowering-rule registry: one small rule per named op.

``@op("einsum")`` registers ``rule(ctx, *args, **kwargs)`` under its name and returns the public
function users call (without ``ctx``). The public function looks up the current context (global,
gspmd or explicit: :mod:`meshdsl.rewrite.contexts`, :mod:`meshdsl.rewrite.explicit`), remembers which op and user source line is being
lowered (errors and ``md.explain`` records name them), and runs the rule. A rule that calls other
public ops is attributed as a whole to the outermost op.

``RULES`` maps op names to rules, so "what does einsum emit when the contracted dim is split?" is
answered by reading ``RULES["einsum"]``; the test suite checks that every registered op is
covered by the program fuzzer.
"""

from __future__ import annotations

import functools
import inspect

import jax

from ..rewrite.contexts import active
from ..names.errors import user_line
from ..names.named import is_named

__all__ = ["RULES", "op"]

RULES: dict = {}


def op(name: str, *, gathers: bool = False, swaps: bool = False):
    """Register a rule. ``gathers``: the planner (:mod:`meshdsl.planner`) also prices the op with
    its operands entering with one dim gathered where they sit as the layout says (an op moving
    data along a dim - a reshape, a shift, a lookup - may read a copy other ops share).
    ``swaps``: and with one operand's mesh axis swapped for one no operand uses (a lookup's ids
    leaving the table's axis to it, so its halves see the same ids)."""
    def register(rule):
        if name in RULES:
            raise RuntimeError(f"lowering rule {name!r} registered twice")
        RULES[name] = rule
        rule.gathers = gathers
        rule.swaps = swaps

        @functools.wraps(rule)
        def public(*args, **kwargs):
            ctx = active()
            if ctx.op is not None:  # called by another op's rule: part of that op
                return rule(ctx, *args, **kwargs)
            with ctx.at(name, user_line(2)):
                result = ctx.apply(name, rule, args, kwargs)
            if ctx.explicit:
                ctx.derived(_named_leaves((args, kwargs)), _named_leaves(result))
            return result

        sig = inspect.signature(rule)
        public.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
        del public.__wrapped__
        public.rule = rule
        return public

    return register


def _named_leaves(tree) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_named) if is_named(x)]
