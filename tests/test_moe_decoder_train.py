"""The training CLI trains the MoE decoders: ``--model mixtral-tiny`` under expert parallelism
(``batch:data;experts:data``) learns (its loss falls) and reports the router's metrics, the total
loss adding the load-balancing loss times ``load_balancing_coef``; a MoE decoder's default layout
is expert parallel; ``qwen2-moe-tiny`` (shared expert, q/k/v biases) trains under expert
parallelism with Megatron inside the experts.

Runs go through ``main(argv)`` in this process (8 virtual CPU devices from conftest).
"""

from __future__ import annotations

import json

import numpy as np

import meshdsl as md
from meshdsl.models.cli.train import _default_layout
from meshdsl.models.configs import get_config
from meshdsl.models.train import main

RUN = ["--batch", "8", "--decoder-length", "32", "--log-every", "1", "--no-explain", "--eval-batches", "0",
       "--eval-every", "0", "--optimizer", "adamw", "--lr", "3e-3", "--warmup", "1", "--ckpt-every", "-1"]


def test_mixtral_trains_under_expert_parallelism_and_reports_its_router(tmp_path):
    out = tmp_path / "mixtral"
    result = main(["--model", "mixtral-tiny", *RUN, "--steps", "24", "--layout", "experts:data;batch:data",
                   "--out", str(out)])
    records = result["records"]
    losses = [float(r["loss"]) for r in records]
    assert len(losses) == 24 and abs(losses[0] - np.log(8192)) < 0.5 and np.mean(losses[-4:]) < losses[0] - 1.5
    last = records[-1]
    load = np.asarray(last["moe/expert_load"])
    assert load.shape == (8,) and abs(load.sum() - 1) < 1e-5 and float(last["moe/dropped_fraction"]) == 0.0
    balance = float(last["moe/load_balancing_loss"])
    assert 0 < balance < 16
    np.testing.assert_allclose(float(last["total_loss"]), losses[-1] + 0.02 * balance, rtol=1e-5)
    with open(out / "run.json") as f:
        recorded = json.load(f)["config"]
    assert recorded["experts"] == 8 and recorded["top_k"] == 2
    params = result["state"]["params"]["layers"]["ffn"]["experts"]["wi_0"]["kernel"].get_value()
    assert params.names == ("layers", "experts", "d_model", "d_ff") and params.array.sharding.spec[1] == "data"


def test_a_moe_decoder_s_default_layout_is_expert_parallel():
    mesh = md.Mesh({"data": 8})
    assert _default_layout(get_config("mixtral-tiny"), mesh) == "batch:data;experts:data"
    assert _default_layout(get_config("moe-t5-tiny"), mesh) == "batch:data;group:data;experts:data"
    assert _default_layout(get_config("llama-tiny"), mesh) == "batch:data"


def test_qwen2_moe_trains_with_megatron_inside_the_experts(tmp_path):
    result = main(["--model", "qwen2-moe-tiny", *RUN, "--steps", "3", "--mesh", "data:4,model:2",
                   "--layout", "batch:data;experts:data;d_ff:model;d_shared:model", "--out", str(tmp_path / "qwen")])
    losses = [float(r["loss"]) for r in result["records"]]
    assert len(losses) == 3 and np.isfinite(losses).all() and losses[-1] < losses[0]
    assert "moe/load_balancing_loss" in result["records"][-1]
