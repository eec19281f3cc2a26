"""Test setup: 8 virtual CPU devices, set before jax initialises."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("meshdsl", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("meshdsl")

assert len(jax.devices()) == 8, "tests need 8 virtual CPU devices (XLA_FLAGS set too late?)"
