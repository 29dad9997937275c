"""Chip spec and presets: public figures, provenance on every leaf, invariants, overrides, loader errors."""

import dataclasses
import math
from pathlib import Path

import pytest

from jalapeno_emu import chip
from jalapeno_emu.chip import FIELDS, ChipSpec
from jalapeno_emu.errors import ConfigError, EmuError

PUBLIC = {  # Hot Chips 2026 (OpenAI/Broadcom Jalapeño talk) and press coverage, as the preset cites
    "peak_mxfp4_flops_per_s": 13.3e15,
    "hbm_bytes_per_s": 15.4e12,
    "hbm_capacity_bytes": 216 * 2**30,
}
PRESETS = chip.list_presets()


@pytest.fixture(scope="module")
def v1() -> ChipSpec:
    return chip.load_preset("jalapeno-v1")


@pytest.fixture(scope="module")
def tiny() -> ChipSpec:
    return chip.load_preset("tiny")


def test_shipped_presets_are_listed():
    assert {"jalapeno-v1", "tiny"} <= set(PRESETS)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_jalapeno_v1_lands_within_2_percent_of_the_public_figures(v1, name):
    assert v1.derived()[name] == pytest.approx(PUBLIC[name], rel=0.02)


def test_jalapeno_v1_rack_totals_and_public_leaves(v1):
    d = v1.derived()
    assert 128 * d["peak_mxfp4_flops_per_s"] == pytest.approx(1.7e18, rel=0.02)  # 1.7 EFLOPS per rack
    assert 128 * d["hbm_capacity_bytes"] == 27 * 2**40  # 27 TiB per rack
    assert d["hbm_pseudo_channels"] == 384
    assert (v1.hbm.stacks, v1.power.tdp_w, v1.power.sustained_w, v1.power.facility_w_per_chip) == (
        6, 700.0, 550.0, 1180.0)
    for path in ("hbm.stacks", "power.tdp_w", "power.sustained_w", "power.facility_w_per_chip"):
        assert v1.provenance[path].kind == "public"
        assert "Hot Chips 2026" in v1.provenance[path].note


def test_link_message_cost_is_alpha_beta_over_the_switched_path(v1):
    link = v1.link
    assert (link.domain_chips, link.switch_hops, link.stripe_ports) == (128, 1, link.ports)
    # chip -> switch -> chip: two link hops and one switch, after the per-message set-up
    assert link.path_latency_s == pytest.approx(2 * link.latency_s + link.switch_latency_s)
    assert link.alpha_s == pytest.approx(link.message_setup_s + 2 * 200e-9 + 250e-9)
    assert link.stripe_bytes_per_s == pytest.approx(16 * 100e9 * 0.9)
    assert link.message_s(2**20) == pytest.approx(link.alpha_s + 2**20 / (16 * 100e9 * 0.9))
    d = v1.derived()
    assert d["link_alpha_s"] == link.alpha_s and d["link_stripe_bytes_per_s"] == link.stripe_bytes_per_s
    assert d["domain_hbm_capacity_bytes"] == 27 * 2**40  # the public 27 TiB per 128-chip rack
    assert d["domain_peak_mxfp4_flops_per_s"] == pytest.approx(1.7e18, rel=0.02)


def test_derived_totals_follow_the_definitions(v1):
    d = v1.derived()
    flops_per_mac_cycle = 2 * v1.core.count * v1.core.clock_hz  # a FLOP is 2 per MAC
    assert d["peak_mxfp4_flops_per_s"] == flops_per_mac_cycle * v1.matrix.mxfp4_macs_per_cycle
    assert d["peak_mxfp8_flops_per_s"] == d["peak_mxfp4_flops_per_s"] / 2
    assert d["peak_bf16_flops_per_s"] == d["peak_mxfp4_flops_per_s"] / 4
    assert d["hbm_achievable_bytes_per_s"] == pytest.approx(0.9 * d["hbm_bytes_per_s"])
    assert d["sram_total_bytes"] == 64 * (8 + 2) * 2**20
    assert d["link_bytes_per_s_per_direction"] == v1.link.ports * v1.link.bytes_per_s_per_direction
    assert set(d) == set(chip.DERIVED_QUANTITIES)
    assert v1.hbm.capacity_bytes == d["hbm_capacity_bytes"] and v1.hbm.bytes_per_s == d["hbm_bytes_per_s"]


@pytest.mark.parametrize("name", PRESETS)
def test_dma_all_cores_saturate_hbm_but_one_core_cannot(name):
    spec = chip.load_preset(name)
    fair_share = spec.hbm.bytes_per_s / spec.core.count
    assert fair_share < spec.dma.bytes_per_s_per_core < spec.hbm.bytes_per_s


@pytest.mark.parametrize("name", PRESETS)
def test_every_leaf_of_every_preset_has_provenance(name):
    spec = chip.load_preset(name)
    assert list(spec.provenance) == sorted(FIELDS)
    for path, prov in spec.provenance.items():
        assert prov.kind in ("public", "assumed", "derived"), path
        assert prov.note.strip(), path
        assert prov.note != "override", path


def test_tiny_is_small_and_keeps_v1_tile_shape_and_provenance(v1, tiny):
    assert tiny.name == "tiny" and tiny.core.count <= 4
    assert tiny.sram.scratchpad_bytes <= 1 << 20 and tiny.derived()["hbm_capacity_bytes"] <= 256 << 20
    assert tiny.derived()["hbm_pseudo_channels"] == 4
    shape = ("tile_m", "tile_n", "tile_k")
    assert [getattr(tiny.matrix, f) for f in shape] == [getattr(v1.matrix, f) for f in shape]
    assert tiny.provenance["matrix.tile_k"] == v1.provenance["matrix.tile_k"]  # inherited with its reason
    assert tiny.provenance["core.count"].kind == "assumed"


def test_specs_are_frozen_hashable_and_equal_across_loads(v1):
    again = chip.load_preset("jalapeno-v1")
    assert again == v1 and hash(again) == hash(v1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        v1.core.count = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        chip.CoreSpec(64, 1.6e9)  # type: ignore[misc]  # keyword-only
    assert "13.4 PFLOP/s" in repr(v1) and "216 GiB" in repr(v1)


def test_replace_revalidates_and_marks_overrides(v1):
    faster = v1.replace(**{"hbm.efficiency": 0.95, "core.count": 32})
    assert faster.hbm.efficiency == 0.95 and faster.core.count == 32
    assert faster.provenance["hbm.efficiency"] == chip.Provenance(kind="assumed", note="override")
    assert faster.provenance["hbm.stacks"].kind == "public"
    assert v1.hbm.efficiency == 0.9  # the original is untouched
    with pytest.raises(ConfigError, match=r"hbm\.efficiency must be in \(0, 1\], found 1\.5"):
        v1.replace(**{"hbm.efficiency": 1.5})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"matrix.mxfp8_macs_per_cycle": 10**6}, r"matrix\.mxfp8_macs_per_cycle must be <= matrix\.mxfp4"),
        ({"matrix.tile_k": 48}, r"matrix\.tile_k must be a multiple of the MX block \(32\), found 48"),
        ({"hbm.interleave_bytes": 384}, r"hbm\.interleave_bytes must be a positive power of two, found 384"),
        ({"core.count": 0}, r"core\.count must be > 0, found 0"),
        ({"core.count": 2.0}, r"core\.count must be int, found float 2\.0"),
        ({"hbm.latency_s": math.inf}, r"hbm\.latency_s must be a finite number"),
        ({"power.sustained_w": 800.0}, r"power\.sustained_w must be <= power\.tdp_w"),
        ({"vector.transcendental_elements_per_cycle": 1024}, r"must be <= vector\.lanes \(512\)"),
        ({"hbm.capacity_bytes_per_stack": 1000}, r"hbm\.capacity_bytes_per_stack must be a multiple"),
        ({"hbm.eficiency": 0.9}, r"unknown chip field 'hbm\.eficiency'; did you mean hbm\.efficiency"),
        ({"link.stripe_ports": 17}, r"link\.stripe_ports must be <= link\.ports \(16\), found 17"),
        ({"link.switch_hops": 0}, r"link\.switch_hops must be at least 1: the scale-up topology is switched"),
        ({"link.efficiency": 0.0}, r"link\.efficiency must be in \(0, 1\], found 0\.0"),
        ({"link.domain_chips": 0}, r"link\.domain_chips must be > 0, found 0"),
    ],
)
def test_invariants_name_the_field_expected_and_found(v1, overrides, message):
    with pytest.raises(ConfigError, match=message):
        v1.replace(**overrides)


def test_construction_checks_provenance_coverage(v1):
    partial = {k: v for k, v in v1.provenance.items() if k != "hbm.latency_s"}
    with pytest.raises(ConfigError, match=r"provenance missing for hbm\.latency_s"):
        dataclasses.replace(v1, provenance=partial)
    with pytest.raises(ConfigError, match="non-empty note"):
        chip.Provenance(kind="public", note=" ")
    with pytest.raises(ConfigError, match="provenance kind must be one of"):
        chip.Provenance(kind="rumour", note="x")  # type: ignore[arg-type]


def test_apply_overrides_parses_by_declared_type_and_unit(v1):
    spec = chip.apply_overrides(v1, [
        "hbm.efficiency=0.85", "core.count=32", "core.clock_hz=1.8e9", "hbm.latency_s=400ns",
        "sram.scratchpad_bytes=4MiB", "dma.bytes_per_s_per_core = 0.5TB/s",
    ])
    assert spec.hbm.efficiency == 0.85 and spec.core.count == 32 and spec.core.clock_hz == 1.8e9
    assert spec.hbm.latency_s == 400e-9 and spec.sram.scratchpad_bytes == 4 * 2**20
    assert spec.dma.bytes_per_s_per_core == 5e11 and isinstance(spec.core.count, int)
    assert chip.apply_overrides(v1, []) is v1
    assert chip.parse_field_value("core.count", "2e3") == 2000


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("hbm.efficiency", r"must look like key=value"),
        ("core.count=1.5", r"core\.count expects a whole number, found '1\.5'"),
        ("core.clock_hz=fast", r"core\.clock_hz expects a number with an optional suffix \(Hz, kHz"),
        ("core.clock_hz=1.6GB", r"core\.clock_hz expects a number"),
        ("hbm.efficiency=2", r"hbm\.efficiency must be in \(0, 1\], found 2\.0"),
        ("hbm.stack=2", r"did you mean hbm\.stacks"),
        ("hbm.zzz=2", r"hbm has hbm\.stacks, hbm\.channels_per_stack"),
        ("gpu.clockspeed=2", r"block one of core, matrix"),
    ],
)
def test_bad_overrides_are_config_errors(v1, item, message):
    with pytest.raises(ConfigError, match=message):
        chip.apply_overrides(v1, [item])


def test_unknown_preset_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match=r"unknown chip preset 'jalapeno-v2'; did you mean jalapeno-v1\?"):
        chip.load_preset("jalapeno-v2")
    with pytest.raises(ConfigError, match="does not exist"):
        chip.load_preset("no/such/file.toml")


def _write(tmp_path: Path, text: str, name: str = "custom.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_child_preset_overrides_only_what_differs(tmp_path, v1):
    path = _write(tmp_path, 'inherits = "jalapeno-v1"\n'
                            '[hbm]\nefficiency = { value = 0.8, assumed = "a pessimistic controller" }\n')
    spec = chip.load_preset(path)
    assert spec.name == "custom" and spec.hbm.efficiency == 0.8
    assert spec.provenance["hbm.efficiency"].note == "a pessimistic controller"
    assert spec.replace(**{"hbm.efficiency": 0.9}).hbm == v1.hbm


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[hbm\nstacks = 1", r"custom\.toml: malformed TOML"),
        ('inherits = "jalapeno-v1"\n[hbm]\nstacks = { value = 1, public = "a", assumed = "b" }',
         r"hbm\.stacks needs exactly one of public, assumed or derived \(its provenance\), "
         r"found public and assumed"),
        ('inherits = "jalapeno-v1"\n[hbm]\nstacks = { value = 1 }', r"found none"),
        ('inherits = "jalapeno-v1"\n[hbm]\nstacks = 1', r"hbm\.stacks must be written \{ value"),
        ('inherits = "jalapeno-v1"\n[hbm]\nstacks = { value = 1, assumed = "" }', r"non-empty assumed note"),
        ('inherits = "jalapeno-v1"\n[hbm]\nstacks = { value = 1, assumed = "x", unit = "n" }',
         r"unexpected key\(s\) unit"),
        ('inherits = "jalapeno-v1"\n[hbm]\nstacks = { assumed = "x" }', r"hbm\.stacks has no value"),
        ('inherits = "jalapeno-v1"\n[hbm]\nstack = { value = 1, assumed = "x" }',
         r"did you mean hbm\.stacks"),
        ('inherits = "jalapeno-v1"\n[hmb]\nstacks = { value = 1, assumed = "x" }',
         r"unknown top-level key 'hmb'; did you mean hbm\?"),
        ('inherits = "jalapeno-v1"\nhbm = 3', r"hbm must be a table"),
        ('inherits = "jalapeno-v1"\n[hbm]\nlatency_s = { value = "5 parsecs", assumed = "x" }',
         r"custom\.toml: hbm\.latency_s expects a number with an optional suffix \(s, ms"),
        ('inherits = "jalapeno-v1"\n[hbm]\nefficiency = { value = 1.2, assumed = "x" }',
         r"custom\.toml: hbm\.efficiency must be in \(0, 1\], found 1\.2"),
        ('inherits = "jalapeno-v9"', r"custom\.toml: inherits: unknown chip preset 'jalapeno-v9'"),
        ('inherits = "custom.toml"', r"preset inheritance loops"),
        ('[core]\ncount = { value = 1, assumed = "x" }',
         r"missing field\(s\) core\.clock_hz, matrix\.tile_m"),
    ],
)
def test_malformed_preset_files_are_one_sentence_config_errors(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        chip.load_preset(str(path))
    assert "\n" not in str(info.value)
    assert isinstance(info.value, EmuError)


def test_quantities_parse_and_print_with_units():
    assert chip.parse_quantity("36GiB", "B") == 36 * 2**30
    assert chip.parse_quantity("1.6 GHz", "Hz") == 1.6e9
    assert chip.parse_quantity("65_536", "MAC/cycle") == 65536
    assert chip.format_quantity(1.6e9, "Hz") == "1.60 GHz"
    assert chip.format_quantity(8 * 2**20, "B") == "8.00 MiB"
    assert chip.format_quantity(15.4e12 / 384, "B/s") == "40.1 GB/s"
    assert chip.format_quantity(500e-9, "s") == "500 ns"
    assert chip.format_quantity(65536, "MAC/cycle") == "65,536 MAC/cycle"
    with pytest.raises(ValueError, match="optional suffix"):
        chip.parse_quantity("8 Mb", "B")


def test_docstring_examples_run():
    import doctest
    import importlib

    for name in ("jalapeno_emu.chip._units", "jalapeno_emu.chip.load"):
        result = doctest.testmod(importlib.import_module(name))
        assert result.attempted > 0 and result.failed == 0, name


# --- limits (issue 13): every numeric field has an upper bound, rates a lower one ---------------

def test_every_numeric_field_has_a_limit_with_a_reason():
    for path, info in FIELDS.items():
        if info.type in (int, float):
            assert info.limit is not None and info.limit.why.strip(), path
            assert isinstance(info.limit.maximum, info.type), path  # reachable by that type


def _at_the_limits(tiny: ChipSpec, end: str) -> ChipSpec:
    """``tiny`` with every field at its largest value ("max"), or every rate at its smallest ("min")."""
    values = {}
    for path, info in FIELDS.items():
        if info.limit is not None:
            bound = info.limit.maximum if end == "max" else info.limit.minimum
            if bound is not None:
                values[path] = info.type(bound)
    return tiny.replace(**values)


@pytest.mark.parametrize("end", ["max", "min"])
def test_a_spec_at_its_limits_times_and_stays_finite(tiny, end):
    from jalapeno_emu.emu import run_timing
    from tests.emu.programs import matmul_tile_program

    spec = _at_the_limits(tiny, end)
    assert all(math.isfinite(v) for v in spec.derived().values())
    timeline = run_timing(matmul_tile_program(), spec)
    assert math.isfinite(timeline.time_s) and timeline.time_s > 0


@pytest.mark.parametrize(
    ("item", "message"),
    [  # the inputs of issue 13: each passed validation, then crashed or ran without end
        ("hbm.stacks=1e300", r"hbm\.stacks must be <= 64 \(.+\), found an integer of 301 digits"),
        ("matrix.tile_m=1e300", r"matrix\.tile_m must be <= 4,096 \(.+\), found an integer of 301 digits"),
        ("matrix.tile_k=1e18", r"matrix\.tile_k must be <= 4,096 \(.+\), found 1000000000000000000"),
        ("dma.max_outstanding_per_queue=9223372036854775808",
         r"dma\.max_outstanding_per_queue must be <= 4,096 \(.+\), found 9223372036854775808"),
        ("core.count=9223372036854775808", r"core\.count must be <= 4,096 \(.+\), found 9223372036854775808"),
        ("core.clock_hz=1e12",
         r"core\.clock_hz must be <= 1e\+11 Hz \(100 GHz: .+\), found 1000000000000\.0"),
        ("hbm.bytes_per_s_per_pseudo_channel=1e-300",
         r"hbm\.bytes_per_s_per_pseudo_channel must be >= 1 B/s \(times and totals divide by it\)"),
        ("hbm.efficiency=1e-300", r"hbm\.efficiency must be >= 0\.001"),
        ("core.clock_hz=1e1000000", r"core\.clock_hz is too large: '1e1000000' is beyond any finite number"),
        ("sram.scratchpad_bytes=" + "9" * 5000, r"sram\.scratchpad_bytes is too large: '9{32}\.\.\.9999'"),
    ],
)
def test_values_past_a_limit_are_refused_naming_the_field_and_the_limit(tiny, item, message):
    with pytest.raises(ConfigError, match=message) as info:
        chip.apply_overrides(tiny, [item])
    assert len(str(info.value)) < 300


def test_huge_values_through_the_python_api_are_config_errors(tiny):
    with pytest.raises(ConfigError, match=r"core\.clock_hz must be a finite number, found an integer of "
                                          r"5,001 digits"):
        tiny.replace(**{"core.clock_hz": 10**5000})
    with pytest.raises(ConfigError, match=r"core\.count must be <= 4,096 .* found an integer of 5,001 "):
        tiny.replace(**{"core.count": 10**5000})
    with pytest.raises(ConfigError, match=r"core\.clock_hz expects a finite number in Hz, found an integer"):
        chip.parse_field_value("core.clock_hz", 10**2000)


@pytest.mark.parametrize(
    ("leaf", "message"),
    [
        ('clock_hz = { value = "1e1000000", assumed = "x" }', r"core\.clock_hz is too large"),
        ('clock_hz = { value = 1e1000000, assumed = "x" }',
         r"core\.clock_hz must be a finite number, found inf"),
        ("count = { value = " + "1" * 400 + ', assumed = "x" }',
         r"core\.count must be <= 4,096 .* found an integer of 400 digits"),
        ("count = { value = " + "1" * 5000 + ', assumed = "x" }',
         r"custom\.toml: unreadable TOML value: Exceeds"),
    ],
)
def test_huge_values_in_a_preset_file_are_config_errors(tmp_path, leaf, message):
    path = _write(tmp_path, f'inherits = "tiny"\n[core]\n{leaf}\n')
    with pytest.raises(ConfigError, match=message) as info:
        chip.load_preset(path)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400
