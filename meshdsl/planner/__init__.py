"""The planner: placements chosen over the whole program by cost.

A shape-only trace records the program as a graph of named ops, each with its candidate
placements and their bytes (:mod:`~meshdsl.planner.graph`); the solver picks one per op so that
the whole program moves the fewest bytes (:mod:`~meshdsl.planner.solve`); the emitting trace then
lowers every op where the plan puts it.
"""
