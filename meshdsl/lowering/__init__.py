"""Lowering a user's function: ``md.lower`` (options checked, one compiled variant per input
structure) and the traced program (:mod:`~meshdsl.lowering.program`: the planning trace, the
solve, the emitting trace, the GSPMD backend).

May import: every floor below it (platform, names, costmodel, rewrite, ops, planner).
"""
