"""Hardware profiles: their numbers, which link each mesh axis runs on, and measuring them here.

The profiles' numbers are vendor datasheet values (cited in ``meshdsl/costmodel/hardware.py``); these tests
pin what must hold whatever the exact values: positive, and ordered as the parts are. Links follow
row-major device order: on a GPU profile (8 devices per host) an axis whose groups stay inside one
host's block of 8 devices runs on NVLink, one whose groups span hosts on the network.
"""

import dataclasses
import math
import time

import jax
import pytest

import meshdsl as md
from meshdsl.costmodel.hardware import PROFILES, Hardware, Link
from meshdsl.costmodel.timing import cache_fit


@pytest.mark.parametrize("name", PROFILES)
def test_every_profile_has_positive_finite_numbers(name):
    hw = Hardware.profile(name)
    assert hw.name == name
    numbers = [*hw.flops.values(), hw.hbm_bandwidth, hw.memory_bytes, hw.host_bandwidth]
    numbers += [v for link in hw.interconnect.values() for v in (link.bandwidth, link.latency)]
    assert all(math.isfinite(v) and v > 0 for v in numbers), hw
    assert set(hw.flops) == {"bfloat16", "float32"}
    assert hw.flops["bfloat16"] >= hw.flops["float32"]   # f32 at default precision is never faster


def test_profiles_are_ordered_as_the_parts_are():
    p = {name: Hardware.profile(name) for name in PROFILES}
    assert p["h200"].memory_bytes > p["h100-80gb"].memory_bytes
    assert p["h200"].hbm_bandwidth > p["h100-80gb"].hbm_bandwidth > p["a100-80gb"].hbm_bandwidth
    assert p["h200"].flops == p["h100-80gb"].flops                    # one die, more memory
    assert p["h100-80gb"].peak_flops("bfloat16") > p["a100-80gb"].peak_flops("bfloat16")
    v5p, v4, v5e = (p[name].peak_flops("bfloat16") for name in ("tpu-v5p", "tpu-v4", "tpu-v5e"))
    assert v5p > v4 > v5e
    assert p["tpu-v5p"].memory_bytes > p["tpu-v4"].memory_bytes > p["tpu-v5e"].memory_bytes
    for gpu in ("a100-80gb", "h100-80gb", "h200"):
        links = p[gpu].interconnect
        assert links["nvlink"].bandwidth > links["network"].bandwidth
    for tpu in ("tpu-v4", "tpu-v5e", "tpu-v5p"):
        links = p[tpu].interconnect
        assert links["ici"].bandwidth > links["dcn"].bandwidth and links["ici"].latency < links["dcn"].latency
    assert p["h100-80gb"].peak_flops("bfloat16") == 989e12 and p["h100-80gb"].hbm_bandwidth == 3.35e12
    assert p["tpu-v5p"].peak_flops("bfloat16") == 459e12 and p["tpu-v5p"].hbm_bandwidth == 2765e9


def test_an_unknown_profile_names_the_known_ones():
    with pytest.raises(md.MeshDSLError, match="did you mean 'h100-80gb'") as err:
        Hardware.profile("h100_80gb")
    assert all(name in str(err.value) for name in PROFILES)
    with pytest.raises(ValueError, match="known profiles: tpu-v4, tpu-v5e, tpu-v5p, a100-80gb"):
        Hardware.profile("mi300x")


def test_a_gpu_axis_inside_a_host_runs_on_nvlink_and_one_across_hosts_on_the_network():
    h100 = Hardware.profile("h100-80gb")
    mesh = {"pipe": 2, "data": 4, "model": 4}   # 32 GPUs, row-major: model's groups are 4 neighbours
    assert h100.link("model", mesh) == "nvlink"     # stride 1 x 4 devices: inside a host of 8
    assert h100.link("data", mesh) == "network"     # stride 4 x 4 = 16 devices: spans 2 hosts
    assert h100.link("pipe", mesh) == "network"
    assert h100.link(("data", "model"), mesh) == "network"   # the slowest of its axes
    assert h100.link(("model",), {"data": 4, "model": 8}) == "nvlink"
    # two axes that fit in one host together: every group stays inside it
    small = md.Mesh({"data": 2, "model": 4})
    assert h100.link("data", small) == h100.link("model", small) == "nvlink"
    assert h100.link("data", str(small)) == "nvlink"          # a report's mesh text works too
    # a part of an axis, as reports write it: x:16 = 2 x 8, the minor 8 stays inside a host
    assert h100.link("x:(2)8", {"x": 16}) == "nvlink"
    assert h100.link("x:(1)2", {"x": 16}) == "network"
    assert h100.link("x", {"x": 16}) == "network"
    # groups of 3 straddle the hosts' blocks of 8
    assert h100.link("model", {"data": 8, "model": 3}) == "network"


def test_axis_links_override_the_default_rules():
    h100 = Hardware.profile("h100-80gb").with_links(model="network")
    assert h100.link("model", {"data": 2, "model": 4}) == "network"
    assert h100.link("data", {"data": 2, "model": 4}) == "nvlink"
    assert Hardware.profile("h100-80gb").with_links(data="nvlink").link("data", {"data": 4, "model": 8}) == "nvlink"
    v5p = Hardware.profile("tpu-v5p")
    assert v5p.link("data", {"data": 64, "model": 64}) == "ici"    # ICI spans hosts within a slice
    multislice = v5p.with_links(data="dcn")
    assert multislice.link("data", {"data": 2, "model": 256}) == "dcn"
    assert multislice.link(("data", "model"), {"data": 2, "model": 256}) == "dcn"
    assert multislice.axis_links == {"data": "dcn"} and v5p.axis_links == {}   # a copy
    hw = Hardware(name="mine", flops={"float32": 1e12}, hbm_bandwidth=1e11, memory_bytes=1e9,
                  interconnect={"ici": Link(1e11, 1e-6), "dcn": Link(1e9, 1e-5)}, default_link="ici",
                  axis_links={"replica": "dcn"})
    assert hw.link("replica", {"replica": 2, "x": 4}) == "dcn"


def test_link_mistakes_are_errors():
    h100 = Hardware.profile("h100-80gb")
    with pytest.raises(md.MeshDSLError, match="'nvlnk' is not a link of hardware 'h100-80gb'.*did you mean 'nvlink'"):
        h100.with_links(model="nvlnk")
    with pytest.raises(md.MeshError, match="no axis 'modle'.*did you mean 'model'"):
        h100.link("modle", {"data": 2, "model": 4})
    with pytest.raises(md.MeshDSLError, match="no peak FLOP/s for float16"):
        h100.peak_flops("float16")


def test_measure_fits_positive_finite_constants_in_seconds():
    mesh = md.Mesh({"data": 2, "model": 4})
    start = time.perf_counter()
    hw = Hardware.measure(mesh)
    assert time.perf_counter() - start < 20
    assert hw.name == "measured"
    assert sorted(hw.flops) == ["bfloat16", "float32"] and sorted(hw.interconnect) == ["data", "model"]
    numbers = [*hw.flops.values(), hw.hbm_bandwidth, hw.memory_bytes, hw.host_bandwidth]
    numbers += [v for link in hw.interconnect.values() for v in (link.bandwidth, link.latency)]
    assert all(math.isfinite(v) and v > 0 for v in numbers), hw
    assert hw.link("model", mesh) == "model" and hw.link(("data", "model"), mesh) in ("data", "model")


def test_a_kernel_whose_working_set_fits_the_cache_runs_at_the_cache_bandwidth():
    """``cache_bytes``: kernels touching at most that run at ``cache_bandwidth``, larger ones
    stream at ``hbm_bandwidth`` x ``memory_efficiency``; profiles without a cache stream all."""
    cpu = dataclasses.replace(Hardware.profile("cpu"), cache_bytes=2 ** 20, cache_bandwidth=4e10)
    assert cpu.memory_seconds(2 ** 20) == pytest.approx(2 ** 20 / 4e10)
    assert cpu.memory_seconds(2 ** 21) == pytest.approx(2 ** 21 / (cpu.hbm_bandwidth * cpu.memory_efficiency))
    assert cpu.memory_seconds(8 * 2 ** 20, touched=2 ** 19) == pytest.approx(8 * 2 ** 20 / 4e10)
    h100 = Hardware.profile("h100-80gb")
    assert h100.cache_bytes == 0
    assert h100.memory_seconds(2 ** 10) == pytest.approx(2 ** 10 / (h100.hbm_bandwidth * h100.memory_efficiency))


def test_measure_credits_the_cache_only_up_to_the_sizes_that_ran_faster_than_streaming():
    """The cache size is the largest size up to which every measured size ran at least 1.5x the
    streaming bandwidth; its bandwidth the least of those (never over-credited)."""
    points = [(2 ** 16, 8e9), (2 ** 18, 6e9), (2 ** 20, 7e9), (2 ** 22, 1.2e9), (2 ** 24, 9e9)]
    assert cache_fit(points, 1e9) == (2 ** 20, 6e9)
    assert cache_fit(points, 5e9) == (2 ** 16, 8e9)
    assert cache_fit(points, 6e9) == (0.0, 0.0)
    assert cache_fit([(2 ** 16, 1e9)], 1e9) == (0.0, 0.0)


def test_the_host_link_prices_a_move_to_host_memory_per_device_and_direction():
    """PCIe per direction from the datasheets (the bidirectional totals halved); a profile without
    one says how to give it."""
    assert Hardware.profile("h100-80gb").host_bandwidth == 64e9
    assert Hardware.profile("a100-80gb").host_seconds(32e9) == pytest.approx(1.0)
    assert all(Hardware.profile(name).host_bandwidth > 0 for name in PROFILES)
    bare = dataclasses.replace(Hardware.profile("cpu"), host_bandwidth=0.0)
    with pytest.raises(md.MeshDSLError, match=r"hardware 'cpu' has no host link bandwidth; give one with "
                                              r"dataclasses.replace\(hw, host_bandwidth=...\) or use Hardware.measure"):
        bare.host_seconds(1.0)


def test_measure_needs_devices_to_time():
    with pytest.raises(md.MeshError, match="needs a mesh of devices"):
        Hardware.measure(md.Mesh.abstract({"data": 8}))
    with pytest.raises(md.MeshError, match="axis of size > 1"):
        Hardware.measure(md.Mesh({"one": 1}, devices=jax.devices()[:1]))
