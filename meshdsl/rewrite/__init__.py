"""The rewriter's machinery: the contexts a program is traced in (explicit per-device, GSPMD,
dims-only), the collectives module (every collective emitted goes through it and is recorded),
relayout and redistribution between placements, the placement rules, the parameter-gather
policies. The op rules (:mod:`meshdsl.ops`) use it; it never imports them.

May import: :mod:`meshdsl.platform`, :mod:`meshdsl.names`, :mod:`meshdsl.costmodel`.
"""
