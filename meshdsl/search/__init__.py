"""``md.search``: the space of meshes and dim-to-axis maps (:mod:`~meshdsl.search.space`),
the floors that reject a layout before tracing it or order the costing (:mod:`~meshdsl.search.floor`),
one layout's costing (:mod:`~meshdsl.search.costing`), and the search that orders, costs and ranks
them (:mod:`~meshdsl.search.search`). Everything per op is the
planner's.

May import: every floor below it, up to :mod:`meshdsl.views`.
"""
