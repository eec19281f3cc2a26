"""``md.search``: the space of meshes and dim-to-axis maps (:mod:`~meshdsl.search.space`),
the memory floor that rejects a layout before tracing it (:mod:`~meshdsl.search.floor`), and the
search that costs and ranks the rest (:mod:`~meshdsl.search.search`). Everything per op is the
planner's.

May import: every floor below it, up to :mod:`meshdsl.views`.
"""
