"""GPU comparison presets: datasheet figures within 2 %, honest labels, NVLink domains, calibration knobs."""

import json

import pytest

from jalapeno_emu import chip
from jalapeno_emu.cli.main import main

GB = 1e9
PF = 1e15
# Dense datasheet figures per GPU (NVIDIA's "with sparsity" numbers halved), the ones the preset
# files cite: FP4, FP8, BF16 FLOP/s, HBM B/s, HBM capacity (datasheet "GB", read as GiB), TDP W.
DATASHEET = {
    "b200": (9 * PF, 4.5 * PF, 2.25 * PF, 7.7e12, 180, 1000),  # NVIDIA HGX B200
    "gb200-nvl72": (10 * PF, 5 * PF, 2.5 * PF, 8e12, 186, 1200),  # NVIDIA GB200 NVL72
    "gb300-nvl72": (15 * PF, 5 * PF, 2.5 * PF, 8e12, 288, 1400),  # Blackwell Ultra blog, GTC 2025
    "h200": (None, 1.979 * PF, 0.989 * PF, 4.8e12, 141, 700),  # NVIDIA H200 (no FP4 tensor cores)
}
# (NVLink bytes/s per direction per GPU, scale-up domain)
NVLINK = {"b200": (900 * GB, 8), "gb200-nvl72": (900 * GB, 72), "gb300-nvl72": (900 * GB, 72),
          "h200": (450 * GB, 8)}
CALIBRATION_KNOBS = ("hbm.efficiency", "link.efficiency", "link.message_setup_s", "sync.kernel_launch_s",
                     "power.sustained_w")


@pytest.fixture(scope="module", params=sorted(DATASHEET))
def gpu(request) -> tuple[str, chip.ChipSpec]:
    return request.param, chip.load_preset(request.param)


def test_gpu_presets_are_shipped():
    assert set(DATASHEET) <= set(chip.list_presets())


def test_peak_rates_and_hbm_match_the_datasheet_within_2_percent(gpu):
    name, spec = gpu
    fp4, fp8, bf16, hbm_bps, capacity_gb, tdp_w = DATASHEET[name]
    d = spec.derived()
    assert d["peak_mxfp8_flops_per_s"] == pytest.approx(fp8, rel=0.02)
    assert d["peak_bf16_flops_per_s"] == pytest.approx(bf16, rel=0.02)
    if fp4 is not None:
        assert d["peak_mxfp4_flops_per_s"] == pytest.approx(fp4, rel=0.02)
    assert d["hbm_bytes_per_s"] == pytest.approx(hbm_bps, rel=0.02)
    assert d["hbm_capacity_bytes"] == pytest.approx(capacity_gb * 2**30, rel=0.02)
    assert spec.power.tdp_w == tdp_w and spec.provenance["power.tdp_w"].kind == "public"


def test_h200_runs_mxfp4_at_the_fp8_rate_and_says_so():
    spec = chip.load_preset("h200")
    assert spec.matrix.mxfp4_macs_per_cycle == spec.matrix.mxfp8_macs_per_cycle
    note = spec.provenance["matrix.mxfp4_macs_per_cycle"].note
    assert "no FP4" in note and "FP8 rate" in note
    assert "no FP4" in spec.description


def test_blackwell_ultra_has_three_times_fp4_over_fp8():
    spec = chip.load_preset("gb300-nvl72")
    assert spec.matrix.mxfp4_macs_per_cycle == 3 * spec.matrix.mxfp8_macs_per_cycle
    assert chip.load_preset("gb200-nvl72").matrix.mxfp4_macs_per_cycle == 2 * spec.matrix.mxfp8_macs_per_cycle


def test_labels_say_model_not_isa_emulation(gpu):
    _, spec = gpu
    assert spec.description.startswith("Model of an NVIDIA")
    assert "not an emulation of its ISA" in spec.description


def test_nvlink_is_the_switched_scale_up_domain(gpu):
    name, spec = gpu
    per_direction, domain = NVLINK[name]
    assert spec.derived()["link_bytes_per_s_per_direction"] == pytest.approx(per_direction)
    assert spec.link.ports == 18 and spec.link.stripe_ports == 18 and spec.link.switch_hops == 1
    assert spec.link.domain_chips == domain
    for path in ("link.ports", "link.bytes_per_s_per_direction", "link.domain_chips"):
        assert spec.provenance[path].kind == "public", path


def test_efficiency_knobs_are_assumed_and_marked_for_calibration(gpu):
    _, spec = gpu
    for path in CALIBRATION_KNOBS:
        prov = spec.provenance[path]
        # The NVIDIA launch cost is public (CUDA graphs on an H100) and still a calibration knob.
        assert "calibration knob" in prov.note, path
        assert prov.kind == "assumed" or (path == "sync.kernel_launch_s" and prov.kind == "public"), path
    assert spec.power.sustained_w < spec.power.tdp_w < spec.power.facility_w_per_chip


def test_chip_show_prints_a_gpu_preset_with_provenance(capsys):
    assert main(["chip", "show", "gb200-nvl72"]) == 0
    out = capsys.readouterr().out
    assert "Model of an NVIDIA B200 GPU in a GB200 NVL72 rack" in out
    assert "GB200 NVL72 datasheet" in out and "calibration" in out
    assert main(["chip", "show", "gb200-nvl72", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["name"] == "gb200-nvl72" and doc["spec"]["link"]["domain_chips"] == 72
    assert doc["provenance"]["power.tdp_w"]["kind"] == "public"
    assert doc["derived"]["domain_peak_mxfp4_flops_per_s"] == pytest.approx(72 * 10 * PF, rel=0.02)


def test_gb300_all_in_power_is_the_public_comparison_point():
    # The figure quoted with the Jalapeño disclosure (2.55 kW per GB300 against 1.18 kW per chip),
    # not an estimate of our own: ratios per kW all-in against jalapeno-v1 rest on it.
    gb300, jalapeno = chip.load_preset("gb300-nvl72"), chip.load_preset("jalapeno-v1")
    assert gb300.power.facility_w_per_chip == 2550 and jalapeno.power.facility_w_per_chip == 1180
    for spec in (gb300, jalapeno):
        assert spec.provenance["power.facility_w_per_chip"].kind == "public"
