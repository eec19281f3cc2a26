"""The training CLI (python -m meshdsl.models.train) end to end, on a small T5.

* the same losses under data parallel, Megatron and ZeRO-3 layouts (and MoE: expert vs data parallel);
* --resume continues bit-identically; a checkpoint restores onto another mesh and layout;
* metrics.jsonl / loss.png / run.json; CLI errors (a layout rule for a dim T5 lacks among them);
* two processes x 4 CPU devices (jax.distributed, gloo) train exactly like one process with 8.

Runs go through ``main(argv)`` in this process (8 virtual CPU devices from conftest), except the
two-process test, which starts the CLI twice with ``subprocess``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import meshdsl as md
from meshdsl.models.cli.options import overrides as _overrides
from meshdsl.models.cli.train import _default_layout, build_parser, main
from meshdsl.models.training import checkpoint

SMALL = "d_model=32,d_ff=64,heads=4,d_kv=8"
TINY = ["--override", SMALL, "--batch", "8", "--encoder-length", "32", "--log-every", "1", "--no-explain",
        "--eval-batches", "0", "--ckpt-every", "-1"]
MEGATRON = ["--mesh", "data:2,model:4", "--layout", "batch:data;heads:model;d_ff:model;vocab:model"]
LAYOUTS = {
    "data parallel": [],
    "megatron": MEGATRON,
    "zero3": ["--params-layout", "d_model:data"],
}
STEPS = 10


def train(tmp_path, name: str, *extra: str) -> dict:
    return main([*TINY, "--out", str(tmp_path / name), *extra])


def losses(result) -> list[float]:
    return [r["loss"] for r in result["records"]]


def is_named(x) -> bool:
    return isinstance(x, md.NamedArray)


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x.array if is_named(x) else x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_named)]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """10 steps under each layout, computed once (the two-process test reuses them)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = train(tmp_path_factory.mktemp("layouts"), name, "--steps", str(STEPS), *LAYOUTS[name])
        return cache[name]
    return get


# both with -m slow (~70 s each): test_models' layout invariance and the fused steps cover the rules by default
@pytest.mark.parametrize("name", [pytest.param("megatron", marks=pytest.mark.slow),
                                  pytest.param("zero3", marks=pytest.mark.slow)])
def test_layouts_give_the_same_losses(layout_runs, name):
    reference = losses(layout_runs("data parallel"))
    assert len(reference) == STEPS and reference[-1] < reference[0] - 0.5  # it learns
    np.testing.assert_allclose(losses(layout_runs(name)), reference, rtol=1e-4)


@pytest.mark.slow  # ~40 s on 2 cores: two MoE compiles
def test_moe_expert_parallel_matches_data_parallel(tmp_path):
    moe = ["--model", "moe-t5-tiny", "--override", "expert_d_ff=64", "--steps", "4"]
    expert = train(tmp_path, "ep", *moe)  # default MoE layout: batch, group and experts over data
    assert "experts:data" in expert["trainer"].layout.__str__()
    data = train(tmp_path, "dp", *moe, "--layout", "batch:data")
    np.testing.assert_allclose(losses(expert), losses(data), rtol=1e-4)
    record = expert["records"][-1]
    assert {"moe/load_balancing_loss", "moe/router_z_loss", "moe/dropped_fraction"} <= set(record)
    assert len(record["moe/expert_load"]) == 8 and abs(sum(record["moe/expert_load"]) - 1) < 1e-4


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """An uninterrupted 6-step run (checkpoints at 3 and 6) and one resumed from its step 3."""
    root = tmp_path_factory.mktemp("resume")
    args = ["--steps", "6", "--ckpt-every", "3", "--eval-every", "3", "--eval-batches", "2"]
    full = train(root, "full", *args)
    shutil.copytree(root / "full", root / "resumed")
    shutil.rmtree(root / "resumed" / "checkpoints" / "6")  # as if the run had stopped after step 3
    again = train(root, "resumed", *args, "--resume")
    return full, again


def test_resume_is_bit_identical(resumed):
    full, again = resumed
    assert [r["step"] for r in again["records"]] == [4, 5, 6]
    for a, b in zip(full["records"][3:], again["records"]):
        assert (a["loss"], a["grad_norm"], a.get("val_loss")) == (b["loss"], b["grad_norm"], b.get("val_loss"))
    for a, b in zip(leaves(full["state"]), leaves(again["state"])):
        np.testing.assert_array_equal(a, b)
    with open(os.path.join(again["out"], "metrics.jsonl")) as f:  # the resumed file equals the full run's
        assert [json.loads(line)["loss"] for line in f] == losses(full)


def test_restore_onto_another_mesh_and_layout(resumed):
    full, _ = resumed
    trainer = full["trainer"]
    mesh = md.Mesh.parse("data:2,model:4")
    layout = md.Layout.parse("batch:data;heads:model;d_ff:model;vocab:model", "d_model:data")
    like = jax.eval_shape(trainer._init)
    state = checkpoint.restore(os.path.join(full["out"], "checkpoints"), like, mesh, layout)
    assert jax.tree_util.tree_structure(state, is_leaf=is_named) == \
        jax.tree_util.tree_structure(full["state"], is_leaf=is_named)
    for a, b in zip(leaves(full["state"]), leaves(state)):  # params, optimizer state, step and rng
        np.testing.assert_array_equal(a, b)
    kernel = state["params"]["encoder"]["layers"][0]["ffn"]["wi_0"]["kernel"].get_value()
    assert kernel.names == ("layers", "d_model", "d_ff")
    assert kernel.array.sharding.spec == jax.sharding.PartitionSpec(None, "data", "model")
    assert int(state["step"]) == 6


def test_metrics_plot_and_run_record(resumed):
    full, _ = resumed
    out = full["out"]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert {"step", "loss", "lr", "tokens_per_s", "step_time_s", "grad_norm", "accuracy"} <= set(records[0])
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert records[-1]["val_loss"] < records[2]["val_loss"]
    if importlib.util.find_spec("matplotlib"):
        with open(os.path.join(out, "loss.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out, "run.json")) as f:
        run = json.load(f)
    assert run["mesh"] == "data:8" and run["target_unigram_entropy"] > 3
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["3", "6"]


def test_options_run(tmp_path):
    """AdamW, accumulation, remat, re-gathered ZeRO-3 weights, bfloat16 parameters, the LM task."""
    result = train(tmp_path, "options", "--steps", "3", "--batch", "16", "--optimizer", "adamw", "--accum", "2",
                   "--remat", "full", "--param-gather", "regather", "--params-layout", "d_model:data",
                   "--param-dtype", "bfloat16", "--task", "lm", "--decoder-length", "16")
    assert all(np.isfinite(losses(result))) and abs(losses(result)[0] - np.log(8192)) < 1.0
    kernel = result["state"]["params"]["shared"]["embedding"].get_value()
    assert kernel.dtype == np.dtype("bfloat16")


@pytest.mark.slow  # ~30 s on 2 cores: a search through the CLI (its ranking: tests/test_search.py)
def test_layout_auto_trains_with_the_layout_the_search_ranks_first(tmp_path, capsys):
    """--layout auto: md.search ranks the training step's layouts on the mesh given (a rich table),
    the run trains with the first and records it in run.json (so --resume keeps it)."""
    result = train(tmp_path, "auto", "--steps", "2", "--mesh", "data:8", "--layout", "auto", "--memory-budget", "1GiB",
                   "--hardware", "h100-80gb")
    printed = capsys.readouterr().out
    assert "md.search:" in printed and "rank" in printed and "layout     auto: mesh data:8" in printed
    layout = result["trainer"].layout
    recorded = json.loads((tmp_path / "auto" / "run.json").read_text())
    assert recorded["layout"] == ";".join(f"{d}:{'+'.join(a)}" for d, a in layout.rules.items())
    assert np.isfinite(losses(result)).all()
    with pytest.raises(SystemExit, match="--layout auto chooses the parameters' storage too: drop --params-layout"):
        main([*TINY, "--out", str(tmp_path / "bad"), "--layout", "auto", "--params-layout", "d_model:data"])


@pytest.mark.slow  # ~25 s on 2 cores: a search through the CLI (the plan's choice: test_remat_is_a_strategy_...)
def test_remat_auto_is_chosen_with_the_layout_and_recorded(tmp_path, capsys):
    """--remat auto with --layout auto: each layout's plan chooses the remat policy (none, dots,
    full); the run trains with the best layout and its plan's policy, and records both."""
    result = train(tmp_path, "auto", "--steps", "1", "--mesh", "data:8", "--layout", "auto", "--remat", "auto",
                   "--memory-budget", "1GiB", "--hardware", "h100-80gb")
    printed = capsys.readouterr().out
    assert "remat=" in printed
    chosen = printed.split("layout     auto: ")[1].splitlines()[0].rsplit("remat ", 1)[1]
    assert chosen in ("none", "dots", "full") and result["trainer"].remat == chosen
    assert json.loads((tmp_path / "auto" / "run.json").read_text())["remat"] == chosen


@pytest.mark.slow  # ~25 s on 2 cores: the plan's remat choice is tests/test_remat_is_a_strategy_the_planner_weighs.py's
def test_remat_auto_on_a_given_layout_is_the_planners_choice_under_the_memory_budget(tmp_path):
    """--remat auto without --layout auto: the planner chooses the stacks' policy within
    --memory-budget; the run trains the losses of --remat none (recomputing changes no value)."""
    kept = train(tmp_path, "none", "--steps", "2", "--mesh", "data:8", "--remat", "none")
    auto = train(tmp_path, "auto", "--steps", "2", "--mesh", "data:8", "--remat", "auto", "--memory-budget", "1GiB")
    assert auto["trainer"].remat == "auto" and auto["trainer"].grad_fn.memory_budget == 2 ** 30
    np.testing.assert_allclose(losses(auto), losses(kept), rtol=1e-5)


def test_cli_defaults_and_errors(tmp_path, resumed):
    args = build_parser().parse_args([])
    assert (args.model, args.mesh, args.optimizer, args.task) == ("t5-tiny", "data:-1", "adafactor", "span_corruption")
    assert _overrides(["d_model=32,d_ff=64", "dropout_rate=0.1"]) == {"d_model": 32, "d_ff": 64, "dropout_rate": 0.1}
    from meshdsl.models.configs import get_config
    assert _default_layout(get_config("moe-t5-tiny"), md.Mesh.parse("data:8")) == "batch:data;group:data;experts:data"
    with pytest.raises(SystemExit, match="--resume"):  # never silently overwrite a run's checkpoints
        main([*TINY, "--out", resumed[0]["out"]])
    with pytest.raises(SystemExit, match="multiple of 8"):
        train(tmp_path, "accum", "--steps", "1", "--batch", "8", "--accum", "2")


def test_a_layout_rule_for_a_dim_t5_lacks_names_its_dims_and_the_megatron_rule(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*TINY, "--out", str(tmp_path / "bad"), "--mesh", "data:2,model:4", "--layout",
              "batch:data;kv_heads:model"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --layout rule 'kv_heads' matches no dim of t5-tiny (its dims: batch, buckets, d_ff, d_kv, "
                   "d_model, heads, inputs, kv_seq, layers, length, seq, targets, vocab); for Megatron on T5 use "
                   "heads:model")


def test_a_layout_rule_for_experts_on_a_dense_t5_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*TINY, "--out", str(tmp_path / "bad"), "--layout", "batch:data;experts:data"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --layout rule 'experts' matches no dim of t5-tiny (its dims: batch, buckets, ")
    assert err.endswith("; drop the rule, or name one of these dims")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two real processes (~1 min): python -m pytest -m slow
def test_two_processes_match_one(layout_runs, tmp_path):
    """2 processes x 4 CPU devices, Megatron on data:2,model:4 (data across the processes)."""
    reference = losses(layout_runs("megatron"))[:4]
    port, out = _free_port(), tmp_path / "two"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, "-m", "meshdsl.models.train", *TINY, *MEGATRON, "--steps", "4", "--ckpt-every", "0",
            "--out", str(out), "--cpu-devices", "4", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    procs = [subprocess.Popen([*argv, "--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    assert "2 process(es)" in logs[0]
    with open(out / "metrics.jsonl") as f:
        got = [json.loads(line)["loss"] for line in f]
    np.testing.assert_allclose(got, reference, rtol=1e-4)
    assert checkpoint.latest_step(str(out / "checkpoints")) == 4
