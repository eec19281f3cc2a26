"""Training with what is offloaded in host memory, through the training CLI: the optimizer
state (``--offload optimizer``: split as its parameter is stored, brought to the device for each
update and sent back; unchanged to float rounding, a checkpoint resumes into host memory, the run
says what moves each step), the parameters streamed to each layer (``--offload params``), and a
scan's residuals (``--offload activations``); each trains as the same run on the device does."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

import meshdsl as md
from meshdsl.models.cli.train import main

TINY = ["--override", "d_model=32,d_ff=64,heads=4,d_kv=8", "--batch", "8", "--encoder-length", "32",
        "--log-every", "1", "--no-explain", "--eval-batches", "0", "--params-layout", "d_model:data"]
STEPS = 10   # a checkpoint at the half (HALF) resumed
HALF = STEPS // 2


def _kinds(tree) -> set:
    return {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(tree)}


def _leaves(tree) -> list:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _assert_trained_alike(got, want) -> None:
    """The parameters of two runs equal to float rounding, except where a gradient was zero up to
    rounding all along: Adafactor's unfactored second moment ``v`` of a rounding error normalises
    it into a whole step of its sign, so there one run's rounding steps one way and the other's
    the other (one element of the embedding's 262144 on this machine, its ``v`` 1.2e-20). There
    ``v`` is under 1e-8 of the leaf's largest (a gradient under 1e-4 of the largest), at no more
    than four elements of a leaf."""
    second = {jax.tree_util.keystr(path).split(".v", 1)[1]: np.asarray(v)
              for path, v in jax.tree_util.tree_flatten_with_path(want["opt_state"])[0]
              if ".v[" in jax.tree_util.keystr(path)}
    for path, a in jax.tree_util.tree_flatten_with_path(got["params"])[0]:
        key = jax.tree_util.keystr(path)
        b = np.asarray(_at(want["params"], path))
        off = ~np.isclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)
        if off.any():
            assert key in second and off.sum() <= 4 and (second[key][off] < 1e-8 * second[key].max()).all(), \
                (key, int(off.sum()), second.get(key, np.zeros_like(b))[off][:4], np.asarray(a)[off][:4], b[off][:4])


def _at(tree, path):
    """The leaf of ``tree`` at a key path."""
    for key in path:
        tree = tree[key.key] if hasattr(key, "key") else tree[key.idx] if hasattr(key, "idx") else getattr(tree, key.name)
    return tree


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """10 steps with the optimizer state on the device, the same offloaded (a checkpoint at step
    5), and the offloaded run resumed from that checkpoint."""
    root = tmp_path_factory.mktemp("offload")
    device = main([*TINY, "--out", str(root / "device"), "--steps", str(STEPS), "--ckpt-every", "-1"])
    host = main([*TINY, "--out", str(root / "host"), "--steps", str(STEPS), "--ckpt-every", str(HALF),
                 "--offload", "optimizer"])
    shutil.copytree(root / "host", root / "resumed")
    shutil.rmtree(root / "resumed" / "checkpoints" / str(STEPS))
    resumed = main([*TINY, "--out", str(root / "resumed"), "--steps", str(STEPS), "--ckpt-every", str(HALF),
                    "--offload", "optimizer", "--resume"])
    return device, host, resumed


@pytest.fixture(scope="module")
def streamed(tmp_path_factory, runs):
    """10 steps with the parameters (stored d_model:data) and the optimizer state in host memory."""
    root = tmp_path_factory.mktemp("offload-params")
    return main([*TINY, "--out", str(root / "params"), "--steps", str(STEPS), "--ckpt-every", "-1",
                 "--offload", "params,optimizer"])


def test_an_offloaded_optimizer_state_trains_exactly_as_one_on_the_device(runs):
    device, host, _ = runs
    losses = [[float(r["loss"]) for r in run["records"]] for run in (device, host)]
    assert len(losses[0]) == STEPS and losses[0][-1] < losses[0][0]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    for part in ("params", "opt_state"):
        for a, b in zip(_leaves(host["state"][part]), _leaves(device["state"][part])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert _kinds(host["state"]["opt_state"]) == {"pinned_host"}
    assert _kinds(host["state"]["params"]) == _kinds(device["state"]["opt_state"]) == {"device"}


def test_an_offloaded_run_resumes_into_host_memory_bit_identically(runs):
    _, host, resumed = runs
    assert [r["step"] for r in resumed["records"]] == list(range(HALF + 1, STEPS + 1))
    assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in host["records"][HALF:]]
    for a, b in zip(_leaves(resumed["state"]), _leaves(host["state"])):
        np.testing.assert_array_equal(a, b)
    assert _kinds(resumed["state"]["opt_state"]) == {"pinned_host"}


def test_the_run_names_each_transfer_and_its_bytes_per_device(runs, capsys):
    _, host, _ = runs
    trainer, state = host["trainer"], host["state"]
    (to_device, to_host) = trainer.transfers(state)
    per_device = sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(state["opt_state"])
                     for s in leaf.addressable_shards[:1])
    # priced on the host link of the platform's profile (the cpu's: a copy in DRAM), or the one given
    seconds = per_device / md.Hardware.profile("cpu").host_bandwidth
    assert to_device == {"what": "optimizer state", "direction": "host to device", "bytes": per_device,
                         "seconds": pytest.approx(seconds)}
    assert to_host["direction"] == "device to host" and to_host["bytes"] == per_device
    assert trainer.transfers(state, "h100-80gb")[0]["seconds"] == pytest.approx(per_device / 64e9)
    # stored as its parameter (d_model:data): an eighth of a replicated state's, where a factor splits
    whole = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state["opt_state"]))
    assert per_device < whole / 2
    assert runs[0]["trainer"].transfers(runs[0]["state"]) == []


@pytest.mark.slow  # ~35 s on 2 cores; the streamed stack at one step: tests/test_offload.py
def test_parameters_in_host_memory_train_exactly_as_on_the_device(runs, streamed):
    """Parameters streamed from host memory to each layer (and again to its backward pass), their
    gradients sent back, the update on the device: the same losses and parameters, which live in
    host memory between steps."""
    device = runs[0]
    np.testing.assert_allclose([float(r["loss"]) for r in streamed["records"]],
                               [float(r["loss"]) for r in device["records"]], rtol=1e-5)
    _assert_trained_alike(streamed["state"], device["state"])
    assert _kinds(streamed["state"]["params"]) == _kinds(streamed["state"]["opt_state"]) == {"pinned_host"}
    moves = {(t["what"], t["direction"]): t["bytes"] for t in streamed["trainer"].transfers(streamed["state"])}
    per_device = sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(streamed["state"]["params"])
                     for s in leaf.addressable_shards[:1])
    assert moves[("parameters", "host to device")] == 4 * per_device
    assert moves[("parameters", "device to host")] == 2 * per_device


@pytest.mark.slow  # ~15 s on 2 cores; the offloading policies at one step: tests/test_offload.py
def test_activations_in_host_memory_train_exactly_as_on_the_device(runs, tmp_path):
    """``--offload activations``: what each layer keeps for its backward pass waits in host memory
    (``--remat offload``); 20 steps give the same losses and parameters, which stay on the device."""
    device = runs[0]
    acts = main([*TINY, "--out", str(tmp_path / "acts"), "--steps", str(STEPS), "--ckpt-every", "-1",
                 "--offload", "activations"])
    assert acts["trainer"].remat == "offload" and not acts["trainer"].layout.offload
    np.testing.assert_allclose([float(r["loss"]) for r in acts["records"]],
                               [float(r["loss"]) for r in device["records"]], rtol=1e-5)
    _assert_trained_alike(acts["state"], device["state"])
    assert _kinds(acts["state"]["params"]) == _kinds(acts["state"]["opt_state"]) == {"device"}


def test_offloading_activations_and_a_remat_policy_that_decides_otherwise_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([*TINY, "--out", str(tmp_path / "x"), "--steps", "1", "--offload", "activations", "--remat", "full"])
    assert "--offload activations keeps everything each layer saves for its backward pass in host memory " \
           "(--remat offload), which --remat full decides otherwise: drop one of them" in capsys.readouterr().err


def test_offload_auto_without_a_layout_search_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([*TINY, "--out", str(tmp_path / "x"), "--steps", "1", "--offload", "auto"])
    assert "--offload auto is the layout search's choice: pass --layout auto" in capsys.readouterr().err
