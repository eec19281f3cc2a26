"""The planner: placements chosen over the whole program by cost.

A shape-only trace records the program as a graph of named ops, each with its candidate
placements and their bytes, compute and memory (:mod:`~meshdsl.planner.graph`); the solver picks one per op so that
the whole program takes the least time or moves the fewest bytes under a memory budget
(:mod:`~meshdsl.planner.solve`); the emitting trace then lowers every op where the plan puts it.

May import: :mod:`meshdsl.platform`, :mod:`meshdsl.names`, :mod:`meshdsl.costmodel`,
:mod:`meshdsl.rewrite` (never the rules: they reach the planner through the context).
"""
