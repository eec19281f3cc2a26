"""What JAX and Python give the rest: the one seam to jax's internals and its versions
(:mod:`~meshdsl.platform.jaxcompat`: every jaxpr parameter read, jax 0.10 to 0.12) and the
garbage-collector pause around long traces (:mod:`~meshdsl.platform.gcpause`).

Owns nothing of meshdsl's; imports no meshdsl module (the lowest floor).
"""
