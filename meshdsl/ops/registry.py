"""The lowering-rule registry: one small rule per named op.

``@op("einsum")`` registers ``rule(ctx, *args, **kwargs)`` under its name and returns the public
function users call (without ``ctx``). The public function looks up the current context (global,
gspmd or explicit, see :mod:`meshdsl.context`), remembers which op and user source line is being
lowered (errors and ``md.explain`` records name them), and runs the rule. A rule that calls other
public ops is attributed as a whole to the outermost op.

``RULES`` maps op names to rules, so "what does einsum emit when the contracted dim is split?" is
answered by reading ``RULES["einsum"]``.
"""

from __future__ import annotations

import functools
import inspect

from ..context import current
from ..errors import user_line

__all__ = ["RULES", "op"]

RULES: dict = {}


def op(name: str):
    def register(rule):
        if name in RULES:
            raise RuntimeError(f"lowering rule {name!r} registered twice")
        RULES[name] = rule

        @functools.wraps(rule)
        def public(*args, **kwargs):
            ctx = current()
            if ctx.op is not None:
                return rule(ctx, *args, **kwargs)
            ctx.op = (name, user_line(2))
            try:
                return rule(ctx, *args, **kwargs)
            finally:
                ctx.op = None

        sig = inspect.signature(rule)
        public.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
        del public.__wrapped__
        public.rule = rule
        return public

    return register
