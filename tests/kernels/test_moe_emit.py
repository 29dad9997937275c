"""The moe emitter in fused programs for each of its programs: the gather program (prefill) reading
x from an HBM tensor another operator stores row block by row block, the small-scratchpad panel
program reading x as on-chip pieces and keeping y on chip. Each equals its stand-alone launch bit
for bit and passes the checker; the program choice goes through planning.first_fitting."""

import ml_dtypes
import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.kernels import get_kernel
from jalapeno_emu.kernels.compose import Composer
from jalapeno_emu.kernels.emit import EmitCtx, Out, TensorRef, emit_store
from jalapeno_emu.kernels.moe import GatherPlan, PanelPlan, emit_moe, moe_tensors, plan_moe
from jalapeno_emu.kernels.norm import rmsnorm_reference
from jalapeno_emu.kernels.planning import Budget, DoesNotFit

BF16 = ml_dtypes.bfloat16


def _run_fused(spec, shape: dict, norm_out: Out | None, moe_out: Out | None):
    """rmsnorm (y placed per ``norm_out``; None: stored to HBM) -> moe (y per ``moe_out``; None:
    to HBM) -> a store if moe's y is on chip;
    returns (y of the fused program, y of the stand-alone moe launch on the norm's output, program)."""
    t, h = shape["tokens"], shape["hidden"]
    kb = KernelBuilder("norm_moe", chip=spec)
    comp = Composer(kb, spec)
    for name in ("x", "res"):
        comp.value(name, TensorRef.hbm(name, kb.hbm(name, (t, h), "bf16")))
    norm = get_kernel("rmsnorm")
    outs = {} if norm_out is None else {"y": norm_out, "h": norm_out}
    comp.add_kernel("n", "rmsnorm", norm.shape({"tokens": t, "hidden": h}),
                    inputs={"x": "x", "residual": "res"}, outputs={"y": "y", "h": "h"}, outs=outs)
    comp.add_kernel("m", "moe", shape, inputs={"x": "y"}, outputs={"y": "moe_y"},
                    outs={} if moe_out is None else {"y": moe_out})
    result = "m/y"
    if moe_out is not None:
        out = kb.hbm("out", (t, h), "bf16")
        comp.add("s", lambda ctx, src: emit_store(ctx, src, Out.to(TensorRef.hbm("out", out))),
                 inputs={"src": "moe_y"}, outputs={"y": "stored"})
        result = "out"
    comp.build()
    prog = kb.build()
    check_program(prog, spec)
    alone = get_kernel("moe").build(shape, spec)
    data = alone.make_inputs(0)
    rng = np.random.default_rng(1)
    x, res = np.asarray(data["x"]), (0.01 * rng.standard_normal(data["x"].shape)).astype(BF16)
    w = np.ones((1, h), BF16)
    moe_op = next(op for op in comp.ops if op.label == "m")
    # A re-planned operator packs its weights for its own plan: the stand-alone data would not fit.
    assert not moe_op.replanned
    bind = {"x": x, "res": res, "n/w": w, **comp.ctx.consts}
    bind |= {moe_op.hbm[name]: data[name] for name in moe_op.hbm if name in data}
    got = run_functional(prog, bind).read(result, "bf16", (t, h))
    y, _ = rmsnorm_reference(x, res, w, 1e-5)
    want = run_functional(alone.program, {**data, "x": np.asarray(y)}).read("y")
    return np.asarray(got), want, prog


@pytest.mark.parametrize("keep_y", [False, True])
def test_gather_program_reads_x_as_another_operator_stores_it(keep_y):
    """Prefill: the norm stores its rows tile by tile; the gather program waits for each row block
    it reads (quantisation, router panels) and stores y, or keeps each block where it is made."""
    spec = load_preset("tiny")
    shape = get_kernel("moe").shape(dict(tokens=160, grouping="gather", capacity_factor=3.0, expert_bias=True,
                                         shared_experts=1, act_fmt="bf16"))
    assert isinstance(plan_moe(shape, spec), GatherPlan)
    got, want, _ = _run_fused(spec, shape, None, Out.onchip() if keep_y else None)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("placement", ["replicated", "onchip"])
def test_panel_program_reads_onchip_pieces_and_keeps_y(placement):
    # 40 KB: the panel program, and room beside the norm's rows for its stand-alone plan (at 22 KB
    # it was re-planned, and the stand-alone packed weights then matched its layout only by luck)
    spec = load_preset("tiny").replace(**{"sram.scratchpad_bytes": 40 * 1024})
    shape = get_kernel("moe").shape(dict(tokens=8, hidden=128, intermediate=64, experts=16, top_k=4,
                                         router="sigmoid_topk", activation="silu", score_bias=True, n_group=4,
                                         topk_group=2, routed_scaling_factor=2.5, shared_experts=1))
    assert isinstance(plan_moe(shape, spec), PanelPlan)
    place = Out.replicated(range(spec.core.count)) if placement == "replicated" else Out.onchip()
    got, want, _ = _run_fused(spec, shape, place, Out.onchip())
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("keep_y", [False, True])
def test_dense_panel_program_writes_y_from_its_down_items(keep_y):
    """A dense FFN (one shared expert, no routing) in panel form: each down item rounds its block
    of y to BF16 and keeps it, or stores it, with no combine phase and no FP32 scratch."""
    spec = load_preset("tiny").replace(**{"sram.scratchpad_bytes": 20 * 1024})
    shape = get_kernel("moe").shape(dict(tokens=8, hidden=128, intermediate=64, experts=0, top_k=1,
                                         shared_experts=1, activation="silu"))
    p = plan_moe(shape, spec)
    assert isinstance(p, PanelPlan) and p.direct and len(p.down_blocks) > 1
    assert "outs" not in {t.name for t in moe_tensors(shape, spec)}
    got, want, _ = _run_fused(spec, shape, Out.onchip(), Out.onchip() if keep_y else None)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_tensors_of_lists_each_programs_weights_and_staging():
    spec = load_preset("tiny")
    moe = get_kernel("moe")
    roles = {ts.name: ts.role for ts in moe_tensors(moe.shape({"routing": "uniform", "tokens": 8}), spec)}
    assert roles["x"] == "input" and roles["y"] == roles["expert_ids"] == "output"
    assert {roles[n] for n in ("router", "router_bias", "experts")} == {"weight"}
    assert roles["xq"] == roles["o_rows"] == "scratch"  # the routed arrangement's staging
    gather = {ts.name: ts.role for ts in moe_tensors(moe.shape({"tokens": 160, "grouping": "gather"}), spec)}
    assert "expert_ids" not in gather and gather["routed_out"] == "scratch"


def test_first_fitting_reports_every_program():
    spec = load_preset("tiny").replace(**{"sram.scratchpad_bytes": 4 * 1024})
    shape = get_kernel("moe").shape({})
    with pytest.raises(DoesNotFit, match=r"slots: .*panel: ") as err:
        plan_moe(shape, spec)
    assert [name for name, _ in err.value.reasons] == ["slots", "panel"]


def test_a_replan_that_outgrows_its_scratch_tables_refuses():
    """Planning only, full size: DeepSeek-R1's dense FFN of a tp=4 chip at 1024 tokens gathers with
    five shared-partial tables in the stand-alone budget and nine in 6.47 MB of scratchpad. Given
    the stand-alone tables and the smaller budget, the emitter refuses by name; it must not write
    past them (a fused program then times the operator as a launch)."""
    spec = load_preset("jalapeno-v1")
    shape = get_kernel("moe").shape({"tokens": 1024, "hidden": 7168, "intermediate": 4608, "experts": 0,
                                     "top_k": 1, "shared_experts": 1, "activation": "silu"})
    small = Budget(6_469_177, Budget.of(spec).acc_bytes, spec.core.count)
    assert plan_moe(shape, spec).n_partials == 5 and plan_moe(shape, spec, small).n_partials == 9
    kb = KernelBuilder("replanned", chip=spec)
    tensors = {ts.name: TensorRef.hbm(ts.name, kb.hbm(ts.name, ts.shape, ts.dtype) if ts.mx_axis is None
                                      else kb.hbm_mx(ts.name, ts.shape, ts.dtype, ts.mx_axis))
               for ts in moe_tensors(shape, spec) if ts.role != "output"}
    with pytest.raises(DoesNotFit, match=r"larger scratch tables.*shared_out \[9216, 7168\] \(given \[5120"):
        emit_moe(EmitCtx(kb, spec, small), shape, tensors, {})
