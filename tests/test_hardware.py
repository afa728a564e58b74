"""Hardware registry: every spec well formed, relations the datasheets imply, clear errors, host CPU measured."""
import pytest

from pdjax.sim import hardware as hwmod
from pdjax.sim.hardware import HARDWARE_SPECS, HardwareSpec, get_hardware_spec, host_cpu


@pytest.mark.parametrize("name", sorted(HARDWARE_SPECS))
def test_registry_specs_are_positive_and_self_consistent(name):
    spec = get_hardware_spec(name)
    assert spec.name == name
    for dtype in ("bfloat16", "float16", "float32"):
        assert spec.peak_flops(dtype) > 0
    # fp32 matmul is never faster than the 16-bit tensor/MXU path.
    assert spec.peak_flops("float32") <= spec.peak_flops("bfloat16")
    assert spec.hbm_capacity >= 16e9 and spec.hbm_bandwidth >= 100e9
    # Inside a node is never slower than between nodes (TPU slices use ICI for both).
    assert spec.intra_node_bandwidth >= spec.inter_node_bandwidth
    assert spec.compute_units >= 1


def test_required_families_are_present():
    for name in ("a100-40gb-sxm", "a100-80gb-sxm", "a100-40gb-pcie", "a100-80gb-pcie", "h100-sxm", "h200", "a40",
                 "l4", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"):
        assert name in HARDWARE_SPECS


def test_generations_and_variants_are_ordered():
    a100, h100, h200 = (get_hardware_spec(n) for n in ("a100-80gb-sxm", "h100-sxm", "h200"))
    assert h100.peak_flops_bf16 > 2 * a100.peak_flops_bf16
    assert h200.hbm_bandwidth > h100.hbm_bandwidth > a100.hbm_bandwidth
    assert h200.hbm_capacity > h100.hbm_capacity
    assert get_hardware_spec("a100-80gb-sxm").hbm_bandwidth > get_hardware_spec("a100-80gb-pcie").hbm_bandwidth
    assert get_hardware_spec("a100-80gb-sxm").hbm_capacity == 2 * get_hardware_spec("a100-40gb-sxm").hbm_capacity


def test_pairwise_nvlink_box_pairs_fast_groups_slow():
    box = get_hardware_spec("a100-80gb-pcie")
    assert box.intra_node_topology == "pairwise"
    pair_bw, _ = box.group_link(2)
    quad_bw, _ = box.group_link(4)
    assert pair_bw > 5 * quad_bw   # NVLink bridge vs the PCIe hop
    beyond_bw, beyond_latency = box.group_link(box.devices_per_node + 1)
    assert beyond_bw == box.inter_node_bandwidth and beyond_latency == box.inter_node_latency
    switch = get_hardware_spec("a100-80gb-sxm")
    assert switch.group_link(2) == switch.group_link(8)


def test_aliases_and_case():
    assert get_hardware_spec("A100") is get_hardware_spec("a100-80gb-sxm")
    assert get_hardware_spec("v5e") is get_hardware_spec("tpu-v5e")


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match="unknown hardware 'b300'.*a100-80gb-sxm.*tpu-v6e"):
        get_hardware_spec("b300")


def test_bad_dtype_and_bad_fields_are_named():
    spec = get_hardware_spec("h100-sxm")
    with pytest.raises(ValueError, match="dtype='int4'"):
        spec.peak_flops("int4")
    with pytest.raises(ValueError, match="hbm_bandwidth=0"):
        spec.replace(hbm_bandwidth=0)
    with pytest.raises(ValueError, match="pairwise_bandwidth"):
        spec.replace(intra_node_topology="pairwise", pairwise_bandwidth=None)
    with pytest.raises(ValueError, match="group_size=0"):
        spec.group_link(0)


def test_host_cpu_is_measured():
    spec = host_cpu()
    assert isinstance(spec, HardwareSpec) and spec.kind == "cpu"
    # Any machine this runs on does between 1 GFLOP/s and 100 TFLOP/s fp32 and copies 0.5-2000 GB/s.
    assert 1e9 < spec.peak_flops_fp32 < 1e14
    assert 0.5e9 < spec.hbm_bandwidth < 2e12
    assert spec.hbm_capacity > 2**30


def test_measurements_scale_with_work(monkeypatch):
    # The matmul-rate probe divides the FLOPs it did by the time it took: a fake clock makes that checkable.
    ticks = iter(range(100))
    monkeypatch.setattr(hwmod.time, "perf_counter", lambda: float(next(ticks)))
    assert hwmod.measure_matmul_flops(n=64, repeats=2) == pytest.approx(2 * 64**3)
    ticks2 = iter(range(100))
    monkeypatch.setattr(hwmod.time, "perf_counter", lambda: float(next(ticks2)))
    assert hwmod.measure_copy_bandwidth(num_bytes=8 * 1024, repeats=2) == pytest.approx(2 * 8 * 1024)
