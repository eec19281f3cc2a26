"""What users read: ``md.explain``'s report (collectives, FLOPs, memory, kernels, decisions),
its HTML and treescope display, and the plots of placements and pipelines.

May import: every floor below it, up to :mod:`meshdsl.lowering`.
"""
