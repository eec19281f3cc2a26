"""The cost models: the bytes a collective moves (:mod:`~meshdsl.costmodel.cost`, ring formulas),
hardware profiles and their links, per-kernel rooflines as XLA fuses them, the step's time,
per-device memory by liveness, FLOPs and name scopes read from a traced program, and the
measurement of a compiled program's collectives (HLO) they are checked against.

May import: :mod:`meshdsl.platform`, :mod:`meshdsl.names`.
"""
