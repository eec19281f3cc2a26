"""Tests for hlo_comm on hand-written HLO text (no JAX needed).

The tool lives in the package as ``meshdsl.costmodel.hlo_comm``.
"""
from meshdsl.costmodel import hlo_comm, hlo_text

ASYNC_HLO = """\
HloModule m, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%rs_comp (p: f32[64,16]) -> f32[16,16] {
  %p = f32[64,16]{1,0} parameter(0)
  ROOT %rs = f32[16,16]{1,0} reduce-scatter(%p), channel_id=3, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add
}

%body (t: (s32[], bf16[8,8])) -> (s32[], bf16[8,8]) {
  %t = (s32[], bf16[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = bf16[8,8]{1,0} get-tuple-element(%t), index=1
  %ar = bf16[8,8]{1,0} all-reduce(%v), channel_id=5, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  ROOT %r = (s32[], bf16[8,8]{1,0}) tuple(%i, %ar)
}

%cond (t: (s32[], bf16[8,8])) -> pred[] {
  %t = (s32[], bf16[8,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[16,16], y: bf16[8,8]) -> f32[16,16] {
  %x = f32[16,16]{1,0} parameter(0)
  %y = bf16[8,8]{1,0} parameter(1)
  %ars = f32[16,16]{1,0} all-reduce-start(%x), channel_id=1, replica_groups={}, use_global_device_ids=true, to_apply=%add
  %ard = f32[16,16]{1,0} all-reduce-done(%ars)
  %ags = (f32[16,16]{1,0}, f32[64,16]{1,0}) all-gather-start(%ard), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[64,16]{1,0} all-gather-done(%ags)
  %rss = ((f32[64,16]{1,0}), f32[16,16]{1,0}) async-start(%agd), calls=%rs_comp
  %rsd = f32[16,16]{1,0} async-done(%rss)
  %cps = (f32[16,16]{1,0}, f32[16,16]{1,0}, u32[], u32[]) collective-permute-start(%rsd), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,8]{1,0}) tuple(%zero, %y)
  %w = (s32[], bf16[8,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %cpd = f32[16,16]{1,0} collective-permute-done(%cps)
}
"""


def test_async_forms_and_iota_groups():
    rep = hlo_comm.parse_hlo_text(ASYNC_HLO)
    s = rep.summary()
    assert rep.num_partitions == 8
    assert s["all-reduce"]["count"] == 1 + 3          # start + 3 loop iterations
    assert s["all-gather"] == {"count": 1, "operand_bytes": 1024, "result_bytes": 4096,
                               "moved_bytes": 3072}
    assert s["reduce-scatter"] == {"count": 1, "operand_bytes": 4096, "result_bytes": 1024,
                                   "moved_bytes": 3072}
    assert s["collective-permute"]["moved_bytes"] == 1024
    assert s["collective-permute"]["result_bytes"] == 1024
    by_name = {c.name: c for c in rep.collectives}
    assert by_name["ars"].group_size == 8                 # empty groups = all devices
    assert by_name["ars"].moved_bytes == 2 * 7 / 8 * 1024
    assert by_name["rs"].group_size == 4 and by_name["rs"].num_groups == 2
    assert by_name["ar"].multiplier == 3 and by_name["ar"].operand_bytes == 128
    assert by_name["ar"].moved_bytes == 128               # 2*(2-1)/2 * 128


def test_iota_transpose():
    groups = hlo_text.parse_groups("[2,4]<=[4,2]T(1,0)", 8)
    assert groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert hlo_text.parse_groups("[4,2]<=[8]", 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert hlo_text.parse_groups("{{0,4},{1,5}}", 8) == [[0, 4], [1, 5]]


def test_mesh_axes_groups():
    f = hlo_text.group_shape
    assert f("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", 8) == (4, 2)
    assert f("mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}", 8) == (8, 1)
    assert f("mesh[x=8,y=8,z=16] {x:(2)4,y:(2)4}", 1024) == (16, 64)
    assert f("mesh[x=2,y=4], device_ids=([2,4]<=[4,2]T(1,0)) {x}", 8) == (2, 4)
    assert f("{}", 8) == (8, 1)
    line = ("HloModule m, num_partitions=8\n\nENTRY %e (p: f32[32,64]) -> f32[32,256] {\n"
            "  %p = f32[32,64]{1,0} parameter(0)\n"
            "  ROOT %ag = f32[32,256]{0,1} all-gather(%p), channel_id=1, "
            "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={1}, "
            "use_global_device_ids=true\n}\n")
    c = hlo_comm.parse_hlo_text(line).collectives[0]
    assert (c.group_size, c.num_groups, c.moved_bytes) == (4, 2, 3 / 4 * 32 * 256 * 4)


def test_shape_bytes():
    assert hlo_comm.shape_bytes("(f32[2,3]{1,0}, (bf16[4]{0}, s32[]))") == 24 + 8 + 4
    assert hlo_comm.shape_bytes("pred[10]") == 10
    assert hlo_comm.shape_bytes("s4[8]") == 4


def test_no_collectives():
    rep = hlo_comm.parse_hlo_text("HloModule e\n\nENTRY %m (x: f32[2]) -> f32[2] {\n"
                                  "  ROOT %x = f32[2]{0} parameter(0)\n}\n")
    assert rep.summary() == {} and rep.total_moved_bytes() == 0
    assert "(no collectives)" in rep.table()


def test_index_comments_in_long_tuples_are_counted():
    """XLA prints /*index=N*/ before the 6th+ element of long tuples; every element must count."""
    elems = ", ".join(["f32[4]{0}"] * 5 + ["/*index=5*/f32[4]{0}", "f32[4]{0}"])
    ops = ", ".join(f"%p{i}" for i in range(5)) + ", /*index=5*/%p5, %p6"
    params = "\n".join(f"  %p{i} = f32[4]{{0}} parameter({i})" for i in range(7))
    text = (
        "HloModule m, num_partitions=2\n\n"
        "%add (a: f32[], b: f32[]) -> f32[] {\n"
        "  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
        "  ROOT %s = f32[] add(%a, %b)\n}\n\n"
        "ENTRY %main () -> f32[4] {\n"
        f"{params}\n"
        f"  %ar = ({elems}) all-reduce({ops}), replica_groups={{{{0,1}}}}, to_apply=%add\n"
        "  ROOT %g = f32[4]{0} get-tuple-element(%ar), index=0\n}\n"
    )
    rep = hlo_comm.parse_hlo_text(text)
    assert rep.summary()["all-reduce"]["operand_bytes"] == 7 * 16
    assert rep.summary()["all-reduce"]["result_bytes"] == 7 * 16
