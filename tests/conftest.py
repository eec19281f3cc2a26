"""Test setup: 8 virtual CPU devices, set before jax initialises; the inputs the layers tests
share (test_layers, test_layers_math)."""

import os

# 8 virtual CPU devices. The tests' programs are tiny, so XLA's compile time dominates the suite:
# LLVM at -O0 (no expensive passes) compiles about a third faster. Only machine-code generation
# changes; the HLO passes that choose and place collectives, and buffer assignment (temp memory),
# run as they do for users, so the bytes and memory the tests pin are the ones users get.
_FLAGS = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
          "--xla_llvm_disable_expensive_passes=true")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAGS).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

import meshdsl as md  # noqa: E402
from helpers import B, D_MODEL, S, V  # noqa: E402

settings.register_profile("meshdsl", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("meshdsl")

assert len(jax.devices()) == 8, "tests need 8 virtual CPU devices (XLA_FLAGS set too late?)"


# -- meshdsl.layers: a float input, token ids and a key mask, built once per module ------------------


@pytest.fixture(scope="module")
def x():
    return md.random.normal(jax.random.key(1), [md.Dim("batch", B), md.Dim("seq", S), D_MODEL])


@pytest.fixture(scope="module")
def ids():
    return md.named(jax.random.randint(jax.random.key(2), (B, S), 0, V), "batch seq")


@pytest.fixture(scope="module")
def key_mask():
    lengths = np.array([8, 5, 8, 3, 6, 8, 1, 7])
    return md.named(np.arange(S)[None, :] < lengths[:, None], "batch seq")
