"""Names and layouts: dims and shapes, the NamedArray value, the mesh and its factor axes,
the layout's rules from dims to mesh axes, errors, units, and the stack of tracing contexts.

May import: :mod:`meshdsl.platform`.
"""
