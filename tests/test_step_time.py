"""The time model: seconds from a report's kernels (or flops and bytes) and collectives, by hand
and from md.explain.

    compute       = sum over kernels of max(flops / achievable peak(dtype), bytes / achievable HBM
                    bandwidth) + a launch each   (a hand-made report: flops / peak + bytes / bandwidth)
    communication = sum of latency(link) x count + total_bytes / bandwidth(link)
    total         = compute + communication - overlap x min(compute, communication)
                    + max(0, host link seconds - compute)
"""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

import meshdsl as md
from meshdsl.costmodel.hardware import Hardware, Link
from meshdsl.costmodel.roofline import Kernel
from meshdsl.costmodel.step_time import StepTime, kernel_seconds, predict

TOY = Hardware(name="toy", flops={"bfloat16": 1e12, "float32": 2.5e11}, hbm_bandwidth=1e11, memory_bytes=1e9,
               interconnect={"fast": Link(bandwidth=1e11, latency=1e-6), "slow": Link(bandwidth=1e9, latency=1e-4)},
               default_link="fast", devices_per_host=8, cross_host_link="slow")


def record(kind, axes, total_bytes, count):
    return SimpleNamespace(kind=kind, axes=axes, total_bytes=total_bytes, count=count, dtype="float32", shape=(8,))


def toy_report(collectives):
    # 32 devices, 8 per host: model's groups stay inside a host (fast), data's span hosts (slow)
    return SimpleNamespace(mesh="data:4 x model:8", flops=3e9,
                           memory={"arguments": 2e6, "outputs": 1e6, "temporaries": 5e6, "peak": 8e6},
                           collectives=collectives)


def test_predict_is_the_hand_computed_sum():
    report = toy_report([record("all-reduce", ("model",), 4e6, 3), record("all-gather", ("data",), 2e6, 2),
                         record("reduce-scatter", ("data", "model"), 1e6, 1)])
    t = predict(report, TOY)
    assert t.matmul_s == pytest.approx(3e9 / 1e12, rel=1e-12)            # bf16 peak
    assert t.memory_s == pytest.approx(8e6 / 1e11, rel=1e-12)            # arguments + outputs + temporaries
    assert t.compute_s == pytest.approx(3e-3 + 8e-5, rel=1e-12)
    seconds = [3 * 1e-6 + 4e6 / 1e11, 2 * 1e-4 + 2e6 / 1e9, 1e-4 + 1e6 / 1e9]   # fast, slow, slowest of both
    assert [r["link"] for r in t.per_collective] == ["fast", "slow", "slow"]
    assert [r["seconds"] for r in t.per_collective] == pytest.approx(seconds, rel=1e-12)
    first = t.per_collective[0]
    assert first["latency_s"] == pytest.approx(3e-6) and first["transfer_s"] == pytest.approx(4e-5)
    assert t.communication_s == pytest.approx(sum(seconds), rel=1e-12)
    assert t.total_s == pytest.approx(t.compute_s + t.communication_s, rel=1e-12)   # overlap 0
    assert predict(report, TOY, dtype="float32").matmul_s == pytest.approx(3e9 / 2.5e11, rel=1e-12)
    assert predict(report, TOY, dtype=jnp.float32).matmul_s == pytest.approx(3e9 / 2.5e11, rel=1e-12)


def test_overlap_hides_the_shorter_of_compute_and_communication():
    report = toy_report([record("all-gather", ("data",), 2e6, 1)])   # communication 2.1 ms < compute 3.08 ms
    none, half, full = (predict(report, TOY, overlap=f) for f in (0.0, 0.5, 1.0))
    assert none.communication_s < none.compute_s
    assert none.total_s == pytest.approx(none.compute_s + none.communication_s, rel=1e-12)
    assert half.total_s == pytest.approx(none.compute_s + 0.5 * none.communication_s, rel=1e-12)
    assert full.total_s == pytest.approx(max(none.compute_s, none.communication_s), rel=1e-12)
    assert (half.compute_s, half.communication_s) == (none.compute_s, none.communication_s)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="overlap is a fraction in"):
            predict(report, TOY, overlap=bad)


def test_host_transfers_run_beside_the_compute_and_only_what_outlasts_it_adds():
    """Bytes over the host link (an offloaded stack fetched a layer ahead, offloaded residuals)
    move while the step computes: the step takes the longer of the two, communication added."""
    report = toy_report([record("all-gather", ("data",), 2e6, 1)])
    plain = predict(report, TOY)
    for host_bandwidth, moved in ((1e12, 1e9), (1e9, 1e7), (1e11, 0.0)):   # hidden, outlasting, none
        hw = dataclasses.replace(TOY, host_bandwidth=host_bandwidth)
        report.memory["transfers"] = {"to device": 0.75 * moved, "to host": 0.25 * moved}
        t = predict(report, hw)
        assert t.host_s == pytest.approx(moved / host_bandwidth)
        assert t.total_s == pytest.approx(plain.total_s + max(0.0, t.host_s - plain.compute_s), rel=1e-12)
        assert ("host link" in t.to_markdown()) == bool(moved)
    assert predict(report, TOY).host_s == 0   # nothing moved: no host link needed
    report.memory["transfers"] = {"to device": 1.0, "to host": 0.0}
    with pytest.raises(md.MeshDSLError, match="hardware 'toy' has no host link bandwidth"):
        predict(report, TOY)


def test_no_collectives_is_compute_alone():
    t = predict(toy_report([]), TOY, overlap=1.0)
    assert t.communication_s == 0 and t.total_s == t.compute_s and t.per_collective == []
    assert "(none)" in t.to_markdown()


def test_views():
    t = predict(toy_report([record("all-reduce", ("model",), 4e6, 3)]), TOY, overlap=0.25)
    assert isinstance(t, StepTime)
    d = t.to_dict()
    assert d["total_s"] == t.total_s and d["hardware"] == "toy" and d["overlap"] == 0.25
    assert d["per_collective"][0] == {"kind": "all-reduce", "axes": ("model",), "link": "fast", "count": 3,
                                      "bytes": 4e6, "latency_s": pytest.approx(3e-6),
                                      "transfer_s": pytest.approx(4e-5), "seconds": pytest.approx(4.3e-5)}
    text = str(t)
    assert text.startswith("**step** ") and "on toy" in text and "overlap 25%" in text
    assert "| all-reduce | model | fast | 3 | 3.81 MiB | 3.00 us | 40.00 us | 43.00 us |" in text


def test_predict_reads_an_explain_report():
    f32 = jnp.float32
    x = md.named(jax.ShapeDtypeStruct((16, 256), f32), "batch d_model")
    w1 = md.param(md.named(jax.ShapeDtypeStruct((256, 1024), f32), "d_model d_ff"))
    w2 = md.param(md.named(jax.ShapeDtypeStruct((1024, 256), f32), "d_ff d_model"))

    def mlp(x, w1, w2):
        return md.einsum(md.relu(md.einsum(x, w1, out="batch d_ff")), w2, out="batch d_model")

    layout = md.Layout.parse("batch:data;d_ff:model")
    report = md.explain(mlp, md.Mesh({"data": 2, "model": 4}), layout, x, w1, w2)
    h100 = Hardware.profile("h100-80gb")
    t = predict(report, h100, dtype="float32")
    seconds = [k.count * max(k.flops / (494.5e12 * 0.75), k.bytes / (3350e9 * 0.9)) for k in report.kernels]
    assert t.compute_s == pytest.approx(sum(seconds) + 3e-6 * t.kernels, rel=1e-12)
    assert t.kernels == sum(k.count for k in report.kernels) > 0
    (row,) = t.per_collective
    assert (row["kind"], row["axes"], row["link"]) == ("all-reduce", ("model",), "nvlink")
    assert t.communication_s == pytest.approx(1e-5 + report.total_bytes / 450e9, rel=1e-12)
    # over 32 GPUs, 8 per host: model:16 spans two hosts, unless it is said to run on NVLink
    big = md.explain(mlp, md.Mesh.abstract({"data": 2, "model": 16}), layout, x, w1, w2)
    assert predict(big, h100).per_collective[0]["link"] == "network"
    assert predict(big, h100.with_links(model="nvlink")).per_collective[0]["link"] == "nvlink"


def test_unknown_dtype_is_an_error():
    with pytest.raises(md.MeshDSLError, match="no peak FLOP/s for float16"):
        predict(toy_report([]), TOY, dtype="float16")


def test_a_report_predicts_its_own_time_on_a_profile():
    x = md.named(jax.ShapeDtypeStruct((16, 256), jnp.float32), "batch d_model")
    w = md.param(md.named(jax.ShapeDtypeStruct((256, 1024), jnp.float32), "d_model d_ff"))
    report = md.explain(lambda x, w: md.einsum(x, w, out="batch d_ff"), md.Mesh.abstract({"data": 2, "model": 4}),
                        md.Layout.parse("batch:data;d_model:model"), x, w)
    h100 = md.Hardware.profile("h100-80gb")
    assert report.time(h100, overlap=0.5, dtype="float32") == predict(report, h100, overlap=0.5, dtype="float32")
    assert report.time(h100).communication_s > 0 and report.time(h100).total_s > report.time(h100).compute_s


def test_memory_time_is_the_bytes_the_program_reads_and_writes():
    """A fused elementwise chain reads its input and writes its result once (its inside is never
    in memory); a matmul reads both operands and writes its result; a slice reads only its part."""
    x = md.named(jax.ShapeDtypeStruct((64, 256), jnp.float32), "batch d_model")
    w = md.param(md.named(jax.ShapeDtypeStruct((256, 512), jnp.float32), "d_model d_ff"))
    mesh, layout = md.Mesh.abstract({"data": 2}), md.Layout.parse("batch:data")
    block = 32 * 256 * 4   # x per device
    chain = md.explain(lambda x: md.exp(md.tanh(md.exp(x))), mesh, layout, x)
    assert chain.bytes_accessed == 2 * block
    matmul = md.explain(lambda x, w: md.einsum(x, w, out="batch d_ff"), mesh, layout, x, w)
    assert matmul.bytes_accessed == block + 256 * 512 * 4 + 32 * 512 * 4
    part = md.explain(lambda x: md.slice(x, "d_model", 0, 64), mesh, layout, x)
    assert part.bytes_accessed == 2 * 32 * 64 * 4
    (kernel,) = matmul.kernels
    assert (kernel.kind, kernel.flops, kernel.bytes) == ("matmul", 2 * 32 * 512 * 256, matmul.bytes_accessed)


def test_recomputing_activations_costs_their_traffic_again():
    """remat trades time for memory: the step recomputing its layers reads and writes more and
    is predicted slower, while holding less at its peak."""
    x = md.named(jax.ShapeDtypeStruct((64, 256), jnp.float32), "batch d_model")
    w = md.param(md.named(jax.ShapeDtypeStruct((8, 256, 256), jnp.float32), "layers d_model d_ff"))

    def grads(x, w, remat):
        def loss(w):
            def step(h, w):
                return md.tanh(md.rename(md.einsum(h, w, out="batch d_ff"), {"d_ff": "d_model"})), None
            body = jax.checkpoint(step) if remat else step
            h, _ = md.scan(body, x, w, dim="layers")
            return md.sum(md.square(h)).array
        return jax.grad(loss)(w)
    mesh, layout = md.Mesh.abstract({"data": 2}), md.Layout.parse("batch:data")
    kept, again = (md.explain(lambda x, w: grads(x, w, r), mesh, layout, x, w) for r in (False, True))
    assert again.bytes_accessed > kept.bytes_accessed and again.memory["peak"] < kept.memory["peak"]
    assert predict(again, TOY).compute_s > predict(kept, TOY).compute_s


def _kernels(fn, *args, layout="batch:data"):
    return md.explain(fn, md.Mesh.abstract({"data": 2}), md.Layout.parse(layout), *args).kernels


def test_a_kernel_takes_the_longer_of_its_flops_and_its_bytes_plus_a_launch():
    hw = dataclasses.replace(TOY, matmul_efficiency=0.5, memory_efficiency=0.8, kernel_launch_s=1e-6)
    flops_bound = Kernel("matmul", "bfloat16", 1e9, 1e5, 3)     # 2 ms of FLOPs, 1.25 us of bytes
    bytes_bound = Kernel("fusion", "", 0.0, 8e7, 2)             # 1 ms of bytes
    report = SimpleNamespace(mesh="data:4 x model:8", kernels=[flops_bound, bytes_bound], collectives=[])
    t = predict(report, hw)
    assert t.matmul_s == pytest.approx(3 * 1e9 / (1e12 * 0.5), rel=1e-12)
    assert t.memory_s == pytest.approx(2 * 8e7 / (1e11 * 0.8), rel=1e-12)
    assert t.launch_s == pytest.approx(5e-6) and t.kernels == 5
    assert t.compute_s == pytest.approx(t.matmul_s + t.memory_s + t.launch_s, rel=1e-12)
    assert kernel_seconds(flops_bound, hw, "float32") == pytest.approx((1e9 / (2.5e11 * 0.5), 1e5 / 8e10))
    assert predict(report, hw, dtype="float32").matmul_s == pytest.approx(3 * 1e9 / (2.5e11 * 0.5), rel=1e-12)


def test_an_elementwise_chain_and_a_reduction_each_run_as_one_kernel():
    """XLA fuses an elementwise chain into one kernel (its inside never in memory), and the chain
    feeding a reduction into the reduction's kernel; a value a matmul reads is written once."""
    x = md.named(jax.ShapeDtypeStruct((64, 256), jnp.float32), "batch d_model")
    w = md.param(md.named(jax.ShapeDtypeStruct((256, 512), jnp.float32), "d_model d_ff"))
    block = 32 * 256 * 4
    (chain,) = _kernels(lambda x: md.exp(md.tanh(md.exp(x))), x)
    assert (chain.kind, chain.bytes, chain.count) == ("fusion", 2 * block, 1)
    (reduction,) = _kernels(lambda x: md.sum(md.exp(md.tanh(x)), "d_model"), x)
    assert (reduction.kind, reduction.bytes) == ("reduction", block + 32 * 4)
    kinds = sorted(k.kind for k in _kernels(lambda x, w: md.einsum(md.tanh(x) * 2.0, w, out="batch d_ff"), x, w))
    assert kinds == ["fusion", "matmul"]


def test_attention_is_priced_as_its_fused_kernel_not_its_blockwise_loop():
    """md.attention's blockwise loop (what a CPU runs) is priced as the fused kernel a GPU runs:
    FLOPs of the query-key pairs its 128 x 128 tiles compute (causal: those some query sees),
    forward and backward, and its inputs and outputs once; nothing of the loop's tiles."""
    b, length, heads, d = 2, 1024, 4, 64
    x = md.named(jax.ShapeDtypeStruct((b, length, heads, d), jnp.bfloat16), "batch length heads d_kv")

    def grads(x):
        def loss(x):
            kv = md.rename(x, {"length": "kv_length"})
            return md.sum(md.attention(x, kv, kv, causal=True).astype(jnp.float32)).array
        return jax.grad(loss)(x)

    kernels = _kernels(grads, x)
    forward, backward = (k for k in kernels if k.kind == "attention")   # sorted: forward's fewer FLOPs
    tiles = length // 128
    pairs = (b // 2) * heads * length * length * (tiles + 1) / (2 * tiles)
    assert (forward.flops, backward.flops) == (2 * pairs * (d + d), 2 * pairs * (3 * d + 2 * d))
    qkv = 3 * (b // 2) * length * heads * d * 2
    assert forward.bytes == qkv + (b // 2) * length * heads * (d * 2 + 4)
    assert forward.count == backward.count == 1 and forward.dtype == "bfloat16"
    assert sum(k.flops * k.count for k in kernels if k.kind != "attention") == 0   # no tile's matmul


def _llama_step(batch, length):
    """Llama-2-7B's widths, 4 layers, bfloat16: loss and gradients of one step, shapes only."""
    from flax import nnx
    from meshdsl.models.autolayout import step_of
    from meshdsl.models.configs import get_config
    from meshdsl.models.llama import Llama
    from meshdsl.models.loss import lm_loss
    config = get_config("llama-2-7b").replace(layers=4)
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    tokens = md.named(jax.ShapeDtypeStruct((batch, length), jnp.int32), "batch targets")
    data = {"decoder_input_tokens": tokens, "decoder_target_tokens": tokens,
            "decoder_loss_weights": md.named(jax.ShapeDtypeStruct((batch, length), jnp.float32), "batch targets")}
    return step_of("none", lm_loss), model, data


@pytest.mark.parametrize("batch, length, measured_s", [(4, 2048, 94.8e-3), (1, 8192, 105.9e-3)])
def test_a_llama_step_on_an_h100_is_predicted_within_a_quarter(batch, length, measured_s):
    """Measured on one H100 (jax 0.11.2, md.attention's default path; docs/cost_model.md): the
    prediction from shapes alone on the h100-80gb profile is within 25%."""
    step, model, data = _llama_step(batch, length)
    report = md.explain(step, md.Mesh.abstract({"data": 1}), md.Layout({}), model, data)
    predicted = report.time(md.Hardware.profile("h100-80gb")).total_s
    assert abs(predicted / measured_s - 1) < 0.25, (predicted, measured_s)
