"""Notebook views: HTML of NamedArrays and reports, the comparison table, placement and report plots.

The placement pictures are checked against jax itself: for arrays placed on the 8 devices, the
block each device holds (``md.device_blocks``) is exactly what ``NamedSharding.devices_indices_map``
says, for 1-D, 2-D and 3-D meshes, dims over two axes, replicated dims and parameters at rest.
"""

import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matplotlib.patches import Rectangle

import meshdsl as md
from meshdsl.views import display

B, D, F = 8, 16, 32


def mlp(x, w1, w2):
    h = md.relu(md.einsum(x, w1, out="batch d_ff"))
    return md.einsum(h, w2, out="batch d_model")


@pytest.fixture(scope="module")
def args():
    k = jax.random.split(jax.random.key(0), 3)
    return (md.named(jax.random.normal(k[0], (B, D)), "batch d_model"),
            md.param(md.named(jax.random.normal(k[1], (D, F)), "d_model d_ff")),
            md.param(md.named(jax.random.normal(k[2], (F, D)), "d_ff d_model")))


@pytest.fixture(scope="module")
def mesh():
    return md.Mesh({"data": 2, "model": 4})


MEGATRON = md.Layout({"batch": "data", "d_ff": "model"})
ZERO3 = md.Layout({"batch": "data"}, params={"d_model": "data"})


def cells(html_text: str, row: str) -> list[str]:
    """The cell texts of one row (by its header) of named_array_html's table."""
    import re
    m = re.search(rf"<tr><th[^>]*>{row}</th>(.*?)</tr>", html_text)
    return [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", m.group(1))] if m else []


# -- NamedArray HTML -------------------------------------------------------------------------------


def test_html_of_a_global_array_shows_dims_sizes_dtype(args):
    x = args[0]
    text = x._repr_html_()
    assert cells(text, "dim") == ["batch", "d_model"] and cells(text, "size") == ["8", "16"]
    assert "float32" in text and "parameter" not in text and "split over" not in text
    assert "on cpu:" in text  # one device, not placed by a layout


def test_html_of_a_placed_parameter_shows_its_storage_split(args, mesh):
    w1 = md.place(args[1], mesh, ZERO3)
    text = display.named_array_html(w1)
    assert "parameter" in text
    assert cells(text, "split over") == ["data(2)", "—"]
    assert cells(text, "block") == [str(D // 2), str(F)]
    assert "replicated over model" in text and "data:2 x model:4" in text
    assert tuple(map(int, cells(text, "block"))) == w1.array.sharding.shard_shape((D, F))


def test_html_of_a_lowered_output_shows_the_layout(args, mesh):
    y = md.lower(mlp, mesh, MEGATRON)(*args)
    text = y._repr_html_()
    assert cells(text, "split over") == ["data(2)", "—"] and cells(text, "block") == [str(B // 2), str(D)]
    assert display.placement_of(y)["source"] == "sharding"


def test_html_inside_md_lower_shows_the_rewriters_placement_and_pending_sums(args, mesh):
    seen = {}

    def f(x, w1, w2):
        h = md.einsum(x, w1, out="batch d_ff")
        y = md.einsum(h, w2, out="batch d_model")  # contracted d_ff split on model: a pending sum
        seen["h"], seen["y"] = display.named_array_html(h), display.named_array_html(y)
        return y

    md.lower(f, mesh, MEGATRON)(*args)
    assert cells(seen["h"], "split over") == ["data(2)", "model(4)"]
    assert cells(seen["h"], "block") == [str(B // 2), str(F // 4)] and "traced" in seen["h"]
    assert "<b>pending sum</b> over model" in seen["y"] and "inside md.lower" in seen["y"]


def test_html_of_an_abstract_array_and_a_dim_over_two_axes():
    x = md.named(jax.ShapeDtypeStruct((B, D), jnp.bfloat16), "batch d_model")
    text = display.named_array_html(x)
    assert "abstract" in text and "bfloat16" in text
    mesh = md.Mesh({"pod": 2, "data": 2, "model": 2})
    placed = md.place(md.named(jnp.zeros((B, D)), "batch d_model"), mesh, md.Layout.parse("batch:pod+data"))
    where = display.placement_of(placed)
    assert where["axes"] == (("pod", "data"), ()) and where["block"] == (B // 4, D)
    assert cells(display.named_array_html(placed), "split over")[0] == "pod(2)+data(2)"


# -- reports ---------------------------------------------------------------------------------------


def test_report_html_lists_kinds_shares_and_collectives(args, mesh):
    def grads(x, w1, w2):
        return jax.grad(lambda w1, w2: md.sum(md.square(mlp(x, w1, w2))).array, argnums=(0, 1))(w1, w2)

    report = md.explain(grads, mesh, ZERO3, *args)
    text = md.report_html(report)
    for kind, row in report.summary().items():
        assert kind in text and display._fmt_bytes(row["bytes"]) in text
    assert "forward" in text and "backward" in text and "test_display.py" in text
    assert text.count("<details>") == 0  # 4 collectives: all shown, no disclosure
    short = md.report_html(report, top=2)
    assert "largest 2</b> of 4" in short and short.count("<details>") == 1
    quiet = md.report_html(md.explain(mlp, mesh, md.Layout({"batch": "data"}), *args))
    assert "no communication" in quiet


def test_reports_table_compares_layouts_as_markdown_and_html(args, mesh):
    reports = {name: md.explain(mlp, mesh, layout, *args) for name, layout in
               {"data": md.Layout({"batch": "data"}), "Megatron": MEGATRON, "ZeRO-3": ZERO3}.items()}
    table = md.reports_table(reports)
    assert table.columns[:3] == ["layout", "mesh", "communication/device"]
    assert {"all-reduce", "all-gather"} <= set(table.columns) and "reduce-scatter" not in table.columns
    assert [r["bytes"] for r in table.records] == [r.total_bytes for r in reports.values()]
    assert [r["memory"] for r in table.records] == [r.memory["peak"] for r in reports.values()]
    text = str(table)
    assert text.count("\n") == 1 + len(reports) and "| Megatron | data:2 x model:4 |" in text
    assert "params d_model:data" in text.replace("\\|", "|")
    assert table._repr_html_().count("<tr>") == 1 + len(reports)
    grouped = md.reports_table({"small": reports, "again": {"data": reports["data"]}})
    assert grouped.columns[0] == "group" and [r["group"] for r in grouped.records] == ["small"] * 3 + ["again"]


# -- which device holds which block ----------------------------------------------------------------

PLACEMENTS = [  # mesh, layout, dims, parameter
    ({"data": 8}, "batch:data", "batch:16 d_model:4", False),
    ({"data": 2, "model": 4}, "batch:data;d_ff:model", "batch:8 d_ff:16", False),
    ({"data": 2, "model": 4}, "batch:data", "batch:8 seq:4 d_model:4", False),                 # replicated over model
    ({"data": 2, "model": 4}, "batch:data;d_ff:model | params d_model:data", "d_model:8 d_ff:16", True),
    ({"data": 2, "model": 4}, "batch:model+data", "batch:16 d_model:2", False),                # two axes, minor first
    ({"pod": 2, "data": 2, "model": 2}, "batch:pod+data;d_ff:model", "batch:8 d_ff:4 d_model:2", False),
    ({"pod": 2, "data": 2, "model": 2}, "experts:pod;d_model:data;d_ff:model", "experts:2 d_model:4 d_ff:4", False),
]


def layout_of(text):
    rules, _, params = text.partition("|")
    return md.Layout.parse(rules, params=params.replace("params", "").strip() or None)


@pytest.mark.parametrize("axes, layout, dims, is_param", PLACEMENTS)
def test_device_blocks_equal_jax_sharding(axes, layout, dims, is_param):
    mesh, layout, shape = md.Mesh(axes), layout_of(layout), md.shape(dims)
    x = md.named(jnp.zeros(shape.sizes), shape.names)
    x = md.param(x) if is_param else x
    placed = md.place(x, mesh, layout)
    expected = placed.array.sharding.devices_indices_map(shape.sizes)
    blocks = md.device_blocks(x, mesh, layout)  # storage follows the parameter mark
    assert len(blocks) == 8 and {b.device for b in blocks} == {d.id for d in jax.devices()}
    for b in blocks:
        want = tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(expected[jax.devices()[b.device]],
                                                                                       shape.sizes))
        assert b.block == want, (b, want)
    # every element is held by the same number of devices
    copies = 8 // len({b.block_id for b in blocks})
    counts = np.zeros(shape.sizes, int)
    for b in blocks:
        counts[tuple(slice(lo, hi) for lo, hi in b.block)] += 1
    assert (counts == copies).all()


def test_device_blocks_on_an_abstract_mesh_and_storage_rules():
    mesh = md.Mesh.abstract({"data": 64, "model": 8})
    blocks = md.device_blocks("batch:1024 d_model:512", mesh, "batch:data")
    assert len(blocks) == 512 and len({b.block_id for b in blocks}) == 64
    assert blocks[9].coords == (1, 1) and blocks[9].block == ((16, 32), (0, 512))
    stored = md.device_blocks("d_model:512 d_ff:2048", {"data": 64, "model": 8}, "d_ff:model | params d_model:data",
                              storage=True)
    assert len({b.block_id for b in stored}) == 512 and stored[9].block == ((8, 16), (256, 512))
    in_use = md.device_blocks("d_model:512 d_ff:2048", {"data": 64, "model": 8}, "d_ff:model | params d_model:data")
    assert len({b.block_id for b in in_use}) == 8


def test_device_blocks_refuse_what_the_layout_refuses():
    with pytest.raises(md.LayoutError, match="moddel"):
        md.device_blocks("batch:8", {"data": 2, "model": 4}, "batch:moddel")
    with pytest.raises(md.LayoutError, match="does not divide"):
        md.device_blocks("batch:6", {"data": 4}, "batch:data")
    with pytest.raises(md.ShapeError, match="no size"):
        md.plot_placement("batch d_model", {"data": 2}, "batch:data")


# -- plots -----------------------------------------------------------------------------------------


def texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def png_bytes(fig) -> int:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    return len(buf.getvalue())


def test_plot_placement_2d_mesh_labels_devices_and_blocks(args, mesh):
    fig = md.plot_placement(args[1], mesh, md.Layout({"batch": "data", "d_ff": "model"}, params={"d_model": "data"}))
    tensor_ax, grid_ax = fig.axes
    assert grid_ax.get_xlabel() == "mesh axis model (4)" and grid_ax.get_ylabel() == "mesh axis data (2)"
    labels = texts(grid_ax)
    assert len(labels) == 8 and "dev 5\nd_model 8:16\nd_ff 8:16" in labels
    colors = {p.get_facecolor() for p in grid_ax.patches if isinstance(p, Rectangle)}
    assert len(colors) == 8                                 # 8 distinct blocks
    assert len(tensor_ax.patches) == 8 and "dev 5" in texts(tensor_ax)
    assert "stored" in fig._suptitle.get_text() and "1 copy each" in fig._suptitle.get_text()
    in_use = md.plot_placement(args[1], mesh, md.Layout({"d_ff": "model"}, params={"d_model": "data"}), storage=False)
    assert "replicated over data" in in_use._suptitle.get_text()
    assert len({p.get_facecolor() for p in in_use.axes[1].patches}) == 4
    assert png_bytes(fig) > 1000


def test_plot_placement_1d_3d_and_large_meshes():
    one = md.plot_placement("batch:16 d_model:8", {"data": 8}, "batch:data")
    assert one.axes[1].get_xlabel() == "mesh axis data (8)" and one.axes[1].get_ylabel() == ""
    three = md.plot_placement("batch:8 d_ff:4", md.Mesh({"pod": 2, "data": 2, "model": 2}), "batch:pod+data;d_ff:model")
    grids = three.axes[1:]
    assert len(grids) == 2 and [g.get_title() for g in grids] == ["pod = 0", "pod = 1"]
    assert "dev 6\nbatch 6:8\nd_ff 0:2" in texts(grids[1])
    replicated = md.plot_placement("d_model:8", {"data": 2, "model": 4}, "batch:data")
    assert "all" in texts(replicated.axes[1])[0] and "8 copies each" in replicated._suptitle.get_text()
    big = md.plot_placement("batch:1024 d_model:512", md.Mesh.abstract({"data": 64, "model": 8}), "batch:data")
    grid = big.axes[1]
    assert texts(grid) == [] and len(grid.patches) == 512   # too many devices to label
    assert grid.get_xlabel() == "mesh axis data (64)"       # the long axis is drawn across
    three_split = md.plot_placement("a:2 b:2 c:2", {"x": 2, "y": 2, "z": 2}, "a:x;b:y;c:z")
    assert len(three_split.axes) == 2                        # no tensor panel for three split dims
    assert png_bytes(big) > 1000


def test_plot_reports_stacks_bytes_per_kind_and_marks_measured(args, mesh):
    from meshdsl.costmodel import hlo_comm
    layouts = {"data": md.Layout({"batch": "data"}), "Megatron": MEGATRON, "ZeRO-3": ZERO3}
    reports = {n: md.explain(mlp, mesh, lay, *args) for n, lay in layouts.items()}
    measured = {"Megatron": hlo_comm.analyze(md.lower(mlp, mesh, MEGATRON).lower(*args).compile())}
    fig = md.plot_reports(reports, measured=measured)
    comm, memory, compute = fig.axes
    unit = 2 ** 10  # the largest total here is in KiB
    assert "KiB" in comm.get_ylabel()
    heights = {}
    for bar in comm.patches:
        x = round(bar.get_x() + bar.get_width() / 2)
        heights[x] = heights.get(x, 0.0) + bar.get_height()
    for i, r in enumerate(reports.values()):
        assert heights.get(i, 0.0) * unit == pytest.approx(r.total_bytes)
    (marker,) = comm.lines
    assert marker.get_ydata()[0] * unit == pytest.approx(measured["Megatron"].total_moved_bytes())
    mem_unit = {"KiB": 2 ** 10, "MiB": 2 ** 20}[memory.get_ylabel().split("(")[1][:-1]]
    tops = [bars.get_height() + below.get_height() for below, bars in
            zip(memory.patches[:3], memory.patches[3:])]
    assert [t * mem_unit for t in tops] == pytest.approx([r.memory["peak"] for r in reports.values()])
    flop_unit = {"kFLOP": 1e3, "MFLOP": 1e6}[compute.get_ylabel().split("(")[1][:-1]]
    assert [b.get_height() * flop_unit for b in compute.patches] == pytest.approx([r.flops for r in reports.values()])
    grouped = md.plot_reports({"a": reports, "b": {"data": reports["data"]}}, log=True)
    assert len(grouped.axes) == 6 and grouped.axes[0].get_yscale() == "log"
    assert png_bytes(grouped) > 1000


def test_treescope_renders_named_arrays_with_their_dim_names(args, mesh):
    treescope = pytest.importorskip("treescope")
    assert md.register_treescope() and md.register_treescope()  # idempotent
    from treescope import type_registries
    w1 = md.place(args[1], mesh, ZERO3)
    adapter = type_registries.lookup_ndarray_adapter(w1)
    axes = adapter.get_axis_info_for_array_data(w1)
    assert [(a.axis_name, a.size) for a in axes] == [("d_model", D), ("d_ff", F)]
    info = adapter.get_sharding_info_for_array_data(w1)
    assert info.shard_shape == (D // 2, F) and len(info.device_index_to_shard_slices) == 8
    text = treescope.render_to_text({"w1": w1})
    assert "dims='d_model:16 d_ff:32'" in text and "is_param=True" in text and "'d_model': 'data'" in text
    assert treescope.render_array(w1) is not None
    assert math.isfinite(float(np.asarray(w1.array).sum()))


def test_plot_pipeline_draws_which_stage_works_on_which_microbatch():
    from meshdsl.views.pipeline_plot import schedule_grid
    assert schedule_grid(3, 2, backward=False) == [[0, 1, None, None], [None, 0, 1, None], [None, None, 0, 1]]
    assert schedule_grid(2, 2)[1] == [None, 0, 1, 1, 0, None]          # forward, then the ticks in reverse
    entry = {"schedule": "gpipe", "axis": "pipe", "stages": 4, "microbatches": 3, "ticks": 6,
             "bubble_fraction": 3 / 6}
    fig = md.plot_pipeline(entry)
    (ax,) = fig.axes
    labels = texts(ax)
    assert sorted(t for t in labels if t.isdigit()) == sorted(["0", "1", "2"] * 4 * 2)   # each stage, each pass
    assert len(ax.patches) == 4 * 12 and sum(p.get_facecolor()[:3] == (1, 1, 1) for p in ax.patches) == 2 * 4 * 3
    assert "4 stages, 3 microbatches, 6 ticks, bubble 50%" in ax.get_title()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1", "stage 2", "stage 3"]
    assert png_bytes(fig) > 1000
    with pytest.raises(ValueError, match="no pipeline"):
        md.plot_pipeline({})


def test_plot_pipeline_draws_the_1f1b_schedule():
    """Each tick's forward and backward phase: stage s runs microbatch t - s forward and
    t - (2S - 2 - s) backward; the last stage's forward pass is part of its backward phase."""
    from meshdsl.views.pipeline_plot import one_f_one_b_grid
    grid = one_f_one_b_grid(2, 2)
    assert grid == [[(0, None), (1, None), (None, 0), (None, 1)], [(None, None), (None, 0), (None, 1), (None, None)]]
    entry = {"schedule": "1f1b", "axis": "pipe", "stages": 4, "microbatches": 3, "ticks": 3 + 2 * 4 - 2,
             "bubble_fraction": 3 / 6}
    fig = md.plot_pipeline(entry)
    (ax,) = fig.axes
    assert sorted(t for t in texts(ax) if t.isdigit()) == sorted(["0", "1", "2"] * (4 + 3))   # B: 4 stages, F: 3
    assert len(ax.patches) == 4 * 9 * 2
    assert "1f1b: 4 stages, 3 microbatches, 9 ticks, bubble 50%" in ax.get_title()
    assert png_bytes(fig) > 1000


def test_plot_pipeline_draws_the_circular_schedule():
    """Stage s works on item k = t - s at tick t: repeat k // M of microbatch k mod M, R*M + S - 1
    ticks; a cell reads m on a microbatch's first repeat and m·r on its repeat r, the bubble blank."""
    from meshdsl.views.pipeline_plot import schedule_grid
    assert schedule_grid(2, 2, backward=False, repeats=2) == [[(0, 0), (1, 0), (0, 1), (1, 1), None],
                                                              [None, (0, 0), (1, 0), (0, 1), (1, 1)]]
    assert schedule_grid(2, 2, repeats=2)[0][5:] == [None, (1, 1), (0, 1), (1, 0), (0, 0)]   # then in reverse
    assert schedule_grid(2, 2, repeats=1) == schedule_grid(2, 2)                              # one repeat: GPipe
    entry = {"schedule": "circular", "axis": "pipe", "stages": 4, "microbatches": 4, "repeats": 2,
             "ticks": 2 * 4 + 4 - 1, "bubble_fraction": 3 / 11}
    fig = md.plot_pipeline(entry)
    (ax,) = fig.axes
    cells = [t for t in texts(ax) if t[0].isdigit()]
    assert sorted(cells) == sorted(["0", "1", "2", "3", "0·1", "1·1", "2·1", "3·1"] * 4 * 2)  # each stage, each pass
    assert len(ax.patches) == 4 * 22 and sum(p.get_facecolor()[:3] == (1, 1, 1) for p in ax.patches) == 2 * 4 * 3
    first, later = (next(p for p in ax.patches if p.get_xy() == xy) for xy in [(0, 3), (4, 3)])
    assert first.get_facecolor() != later.get_facecolor()           # microbatch 0, a lighter shade on repeat 1
    assert "circular: 4 stages, 4 microbatches, 2 repeats, 11 ticks, bubble 27%" in ax.get_title()
    assert png_bytes(fig) > 1000


def test_plot_pipeline_of_a_circular_report_counts_the_chunk_moves_apart():
    from test_pipeline import MESH, inputs, loss_and_grads
    layout = md.Layout({"layers": "pipe", "batch": "data"}, microbatches={"batch": 4})
    report = md.explain(loss_and_grads, MESH, layout, *inputs(layers=16), schedule="circular", repeats=2)
    (ax,) = md.plot_pipeline(report).axes
    assert len([t for t in texts(ax) if t[0].isdigit()]) == 4 * 8 * 2 and len(ax.patches) == 4 * 22
    moves = [r for r in report.collectives if "chunks to their circular stage" in r.tensor]
    ring = [r for r in report.collectives if "next stage" in r.tensor]
    title = ax.get_title()
    assert "circular: 4 stages, 4 microbatches, 2 repeats, 11 ticks" in title
    assert f"ppermutes between stages: {sum(r.count for r in ring)}x" in title
    assert f"chunks to their stage: {sum(r.count for r in moves)}x, " in title and moves
