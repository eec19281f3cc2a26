"""Training: the trainer and its loop, optimizers, checkpoints, faults, progress and run records.

Owns the model state and the compiled step and evaluation (:mod:`~meshdsl.models.training.trainer`),
the step loop (:mod:`~meshdsl.models.training.runloop`), optimizers and schedules
(:mod:`~meshdsl.models.training.optim`), orbax checkpoints with manifests
(:mod:`~meshdsl.models.training.checkpoint`), the user's mistakes, divergence and preemption
(:mod:`~meshdsl.models.training.faults`), multi-process supervision
(:mod:`~meshdsl.models.training.supervisor`), logs and plots (:mod:`~meshdsl.models.training.progress`),
``run.json`` (:mod:`~meshdsl.models.training.runrecord`), a run's summary and baselines
(:mod:`~meshdsl.models.training.runinfo`) and ``--layout auto`` (:mod:`~meshdsl.models.training.autolayout`).

May import: :mod:`meshdsl.models.data`, :mod:`meshdsl.models.families`, :mod:`meshdsl.models.hub`,
:mod:`meshdsl.models.decoding` (the loop's span filling), :mod:`meshdsl.layers`, :mod:`meshdsl`.
"""
