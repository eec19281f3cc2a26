"""Communication benchmark: bytes moved per device, explicit rewriter vs GSPMD vs the analytic minimum.

For each program and layout, on 8 devices (data=2 x model=4 unless stated), float32:

* **explicit**: the compiled HLO of ``md.lower(fn, mesh, layout)`` measured by ``hlo_comm``;
* **explain**: what ``md.explain`` predicted before compiling;
* **gspmd**: the compiled HLO of ``backend="gspmd"`` (same program, sharding constraints only);
* **minimum**: the analytic minimum, derived by hand below and stated as a formula.

Run: ``python -m bench.communication`` (writes bench/results/communication.{json,md}).
"""

from __future__ import annotations

from bench import common  # noqa: F401 - sets up devices first

import jax  # noqa: E402

import meshdsl as md  # noqa: E402
from bench.common import fmt_kinds, measure, ratio, total, write  # noqa: E402

B, S, D, F, H, K = 16, 64, 128, 512, 8, 16
F32 = 4
DATA, MODEL = 2, 4


def ar(nbytes, n):
    return 2 * (n - 1) / n * nbytes


def ag(full, n):
    return (n - 1) / n * full


def arrays():
    k = iter(jax.random.split(jax.random.key(0), 16))
    n = lambda shape, dims, s=1.0: md.named(jax.random.normal(next(k), shape) * s, dims)  # noqa: E731
    return {
        "x": n((B, S, D), "batch seq d_model"),
        "w1": md.param(n((D, F), "d_model d_ff", D ** -0.5)),
        "w2": md.param(n((F, D), "d_ff d_model", F ** -0.5)),
        "wq": md.param(n((D, H, K), "d_model heads d_kv", D ** -0.5)),
        "wk": md.param(n((D, H, K), "d_model heads d_kv", D ** -0.5)),
        "wv": md.param(n((D, H, K), "d_model heads d_kv", D ** -0.5)),
        "wo": md.param(n((H, K, D), "heads d_kv d_model", (H * K) ** -0.5)),
        "t": n((B, 4, 2, D), "group experts_all capacity d_model"),
        "we": md.param(n((4, D, F), "experts d_model d_ff", D ** -0.5)),
        "gate": n((B, 4, 2), "group experts_all capacity"),
    }


def mlp(x, w1, w2, seq="seq"):
    h = md.relu(md.einsum(x, w1, out=f"batch {seq} d_ff"))
    return md.einsum(h, w2, out=f"batch {seq} d_model")


def sp_mlp(x, w1, w2):
    return md.rename(mlp(md.rename(x, {"seq": "seq_all"}), w1, w2, "seq_all"), {"seq_all": "seq"})


def attention(x, wq, wk, wv, wo):
    q = md.einsum(x, wq, out="batch seq heads d_kv")
    kv = md.rename(x, {"seq": "kv_seq"})
    k = md.einsum(kv, wk, out="batch kv_seq heads d_kv")
    v = md.einsum(kv, wv, out="batch kv_seq heads d_kv")
    w = md.softmax(md.einsum(q, k, out="batch heads seq kv_seq"), "kv_seq")
    return md.einsum(md.einsum(w, v, out="batch seq heads d_kv"), wo, out="batch seq d_model")


def moe_dispatch_combine(t, we, gate):
    """Tokens grouped over devices meet experts placed over the same axis: one all-to-all each way."""
    x = md.rename(t, {"group": "group_all", "experts_all": "experts"})
    h = md.relu(md.einsum(x, we, out="experts group_all capacity d_ff"))
    return md.rename(h, {"experts": "experts_all", "group_all": "group"}) * gate


def grads_of(fn, argnums):
    """Gradients of sum(fn(...)**2) w.r.t. the arguments ``argnums`` (the loss value is not returned)."""
    def step(*args):
        return jax.grad(lambda *a: md.sum(md.square(fn(*a))).array, argnums=argnums)(*args)
    return step


def programs():
    a = arrays()
    act = B // DATA * S * D * F32                    # one data-shard of the activations [B, S, D]
    w_mp = D * F // MODEL * F32                       # one model-shard of w1 or w2
    attn_w = D * H * K // MODEL * F32                 # one model-shard of wq, wk, wv or wo
    mlp_args = (a["x"], a["w1"], a["w2"])
    attn_args = (a["x"], a["wq"], a["wk"], a["wv"], a["wo"])
    megatron = md.Layout({"batch": "data", "d_ff": "model", "heads": "model"})
    sequence = md.Layout({"batch": "data", "seq": "model", "d_ff": "model"})
    zero3 = md.Layout({"batch": "data"}, params={"d_model": "data"})
    return [
        ("Megatron MLP forward", mlp, megatron, mlp_args,
         {"all-reduce": ar(act, MODEL)}, "AR(out shard [B/2,S,D], model)"),
        ("Megatron MLP forward+backward", grads_of(mlp, (0, 1, 2)), megatron, mlp_args,
         {"all-reduce": 2 * ar(act, MODEL) + 2 * ar(w_mp, DATA)},
         "AR(out, model) + AR(dx, model) + 2 AR(w shard, data)"),
        ("Megatron attention forward+backward", grads_of(attention, (0, 1, 2, 3, 4)), megatron, attn_args,
         {"all-reduce": 2 * ar(act, MODEL) + 4 * ar(attn_w, DATA)},
         "AR(out, model) + AR(dx, model) once for q,k,v + 4 AR(w shard, data)"),
        ("sequence-parallel MLP forward", sp_mlp, sequence, mlp_args,
         {"all-gather": ag(act, MODEL), "reduce-scatter": ag(act, MODEL)}, "AG(x, model) + RS(out, model)"),
        ("sequence-parallel MLP forward+backward", grads_of(sp_mlp, (0, 1, 2)), sequence, mlp_args,
         {"all-gather": 2 * ag(act, MODEL), "reduce-scatter": 2 * ag(act, MODEL),
          "all-reduce": 2 * ar(w_mp, DATA)}, "2 AG + 2 RS of [B/2,S,D] over model + 2 AR(w shard, data)"),
        ("ZeRO-3 MLP forward+backward", grads_of(mlp, (0, 1, 2)), zero3, mlp_args,
         {"all-gather": 2 * ag(D * F * F32, DATA), "reduce-scatter": 2 * ag(D * F * F32, DATA)},
         "per weight: AG forward + RS of its gradient, over data"),
        ("MoE dispatch + expert FFN + combine", moe_dispatch_combine,
         md.Layout({"group": "data", "experts": "data"}), (a["t"], a["we"], a["gate"]),
         {"all-to-all": ag(B // DATA * 4 * 2 * D * F32, DATA) + ag(B // DATA * 4 * 2 * F * F32, DATA)},
         "all-to-all of the [G/2,E,C,D] tokens there, of the [G/2,E,C,F] results back"),
        ("shift by 1 (halo)", lambda x: md.shift(x, "seq", 1), md.Layout({"batch": "data", "seq": "model"}),
         (a["x"],), {"collective-permute": B // DATA * 1 * D * F32}, "one boundary row [B/2,1,D]"),
        ("shift by S/8 + 1", lambda x: md.shift(x, "seq", S // 8 + 1), md.Layout({"batch": "data", "seq": "model"}),
         (a["x"],), {"collective-permute": B // DATA * (S // 8 + 1) * D * F32}, "S/8+1 boundary rows from one neighbour"),
    ]


def _row(program, mesh, layout, minimum, formula, m):
    return {"program": program, "mesh": str(mesh), "layout": str(layout), "formula": formula,
            "minimum": None if minimum is None else {"total": {"count": None, "bytes": minimum}}, **m}


def run(quick: bool = False) -> str:
    mesh = md.Mesh({"data": DATA, "model": MODEL})
    rows = []
    for name, fn, layout, args, minimum, formula in programs():
        m = measure(fn, mesh, layout, *args)
        rows.append(_row(name, mesh, layout, sum(minimum.values()), formula, m))
        print(f"{name:40s} explicit/min {ratio(total(m['explicit']), sum(minimum.values()))}", flush=True)
    from bench import models
    for kind, label in (("dense", "t5-small x2 layers, train step"), ("moe", "MoE-T5 8 experts x2, train step")):
        for name, mmesh, layout, fn, args, minimum, formula in models.cases(kind, quick):
            m = measure(fn, mmesh, layout, *args, **models.lower_kwargs(name))
            rows.append(_row(f"{label}: {name}", mmesh, layout, minimum, formula, m))
            print(f"{label}: {name:34s} explicit/gspmd {ratio(total(m['explicit']), total(m['gspmd']))}", flush=True)
    same = lambda a, b: {k: round(v["bytes"]) for k, v in a.items()} == {k: round(v["bytes"]) for k, v in b.items()}  # noqa: E731
    columns = [
        ("program", lambda r: r["program"]),
        ("mesh", lambda r: r["mesh"]),
        ("layout", lambda r: f"`{r['layout']}`"),
        ("explicit (HLO)", lambda r: fmt_kinds(r["explicit"])),
        ("gspmd (HLO)", lambda r: fmt_kinds(r["gspmd"])),
        ("minimum", lambda r: "-" if r["minimum"] is None else f"{total(r['minimum']):.0f} B: {r['formula']}"),
        ("explain = HLO", lambda r: "yes" if same(r["explain"], r["explicit"]) else "NO"),
        ("explicit / minimum", lambda r: "-" if r["minimum"] is None else ratio(total(r["explicit"]),
                                                                                  total(r["minimum"]))),
        ("explicit / gspmd", lambda r: ratio(total(r["explicit"]), total(r["gspmd"]))),
    ]
    shape = models.shapes(quick)
    return write("communication", rows, columns, "Communication: bytes moved per device",
                 notes=f"Canonical programs: B={B} S={S} D={D} F={F} H={H} d_kv={K}, float32, mesh data={DATA} x "
                       f"model={MODEL}. Model rows: one training step (loss + gradients), t5-small widths "
                       f"(d_model 512, d_ff 2048, 8 heads, vocab 32128), 2 + 2 layers, batch {shape['batch']}, "
                       f"{shape['enc']} / {shape['dec']} tokens.")


if __name__ == "__main__":
    print(run())
