"""moe's routed-token slot program (routing=uniform below T rows per slot): each slot computes the
rows of its token list only. Functional results bit for bit against the program's reference and
close to the float64 model; a routing that overflows a list is an error, never a drop; FLOPs are
the routed work; the emitter in a fused program (x an on-chip norm output, y kept on chip) equals
the stand-alone launch bit for bit; gpt-oss-120b's decode MoE at 64 tokens on jalapeno-v1."""

import ml_dtypes
import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.errors import InvalidArgumentError, OutOfBounds
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.kernels import get_kernel, run_kernel
from jalapeno_emu.kernels.compose import Composer
from jalapeno_emu.kernels.emit import Out, TensorRef, emit_store
from jalapeno_emu.kernels.moe import MoePlan, plan_moe
from jalapeno_emu.kernels.norm import rmsnorm_reference
from tests.kernels.moe_helpers import oracle, rel, route_tokens

TINY = load_preset("tiny")
BF16 = ml_dtypes.bfloat16

# 8 tokens, top-2 of 8: uniform routing expects all 8 experts, 2 tokens each (16 rows, not 64).
ROUTED = dict(tokens=8, experts=8, top_k=2, routing="uniform")
CASES = {
    "gpt_oss": ROUTED,
    # biases travel with the experts; a shared expert (T rows, accumulated in the scratchpad)
    "gpt_oss_bias_shared": dict(ROUTED, expert_bias=True, shared_experts=1, act_fmt="bf16"),
    # slots split between the two cores (3 slices per expert): the first core completes them
    "split_slots": dict(ROUTED, intermediate=96, slice=32, shared_experts=2, hidden=128),
    # DeepSeek's sigmoid gating with the score correction and a shared expert
    "deepseek": dict(ROUTED, router="sigmoid_topk", activation="silu", shared_experts=1, score_bias=True,
                     routed_scaling_factor=2.5),
    # three shared experts over two cores: one of them split, its rows completed across cores
    "shared_split": dict(tokens=2, experts=2, top_k=1, routing="uniform", shared_experts=3, intermediate=160,
                         slice=32, expert_bias=True, act_fmt="bf16"),
}


def _picks(p) -> list[tuple[int, ...]]:
    """Token t prefers experts t, t+1, ...: every expert gets exactly T*k/E tokens."""
    return [tuple((t + j) % p.e for j in range(p.k)) for t in range(p.t)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_routed_program_matches_reference_and_model(name):
    kd = get_kernel("moe")
    shape = kd.shape(CASES[name])
    b = kd.build(shape, TINY)
    p = plan_moe(shape, TINY)
    assert isinstance(p, MoePlan) and p.routed and b.notes["arrangement"] == "routed"
    assert sum(p.caps) == p.t * p.k  # the lists hold the routed rows, not D * T
    check_program(b.program, TINY)
    inputs = b.make_inputs(0)
    route_tokens(inputs, p, _picks(p))
    got = run_functional(b.program, inputs).read("y")
    assert np.array_equal(got.view(np.uint16), b.reference(inputs)["y"].view(np.uint16))
    want, ids = oracle(inputs, shape, TINY)
    assert np.array_equal(np.sort(ids, axis=1), np.sort(np.array(_picks(p)), axis=1))
    # MXFP8 activations cost a few per cent against the float64 model; BF16 ones well under 1 %
    assert rel(got, want) < (0.01 if shape["act_fmt"] == "bf16" else 0.1)


def test_list_overflow_is_an_error_not_a_drop():
    kd = get_kernel("moe")
    shape = kd.shape(CASES["gpt_oss"])
    b = kd.build(shape, TINY)
    p = plan_moe(shape, TINY)
    inputs = b.make_inputs(0)
    route_tokens(inputs, p, [(0, 1)] * 3 + [(t % 8, (t + 1) % 8) for t in range(3, 8)])  # expert 0: 4 tokens
    with pytest.raises(InvalidArgumentError, match="capacity=2"):
        b.reference(inputs)
    with pytest.raises(OutOfBounds, match="distinct values"):
        run_functional(b.program, inputs)


def test_flops_are_the_routed_work():
    """Every matmul's M is its list's rows: FLOPs are T*k expert rows (plus the router), where the
    all-token program computes D*T of them."""
    shape = dict(tokens=8, hidden=128, intermediate=128, experts=16, top_k=2)
    h, i, e, t, k = 128, 128, 16, 8, 2
    routed = run_kernel("moe", dict(shape, routing="uniform"))
    dense = run_kernel("moe", dict(shape, routing="any", distinct_experts=routed.notes["distinct_experts"]))
    router = 2 * t * h * e
    assert routed.notes["routed_rows"] == t * k
    assert routed.summary["flops"] == 2 * t * k * 3 * h * i + router
    assert dense.summary["flops"] == 2 * routed.notes["distinct_experts"] * t * 3 * h * i + router
    # the same experts' bytes either way
    per_expert = routed.notes["expert_bytes"]
    assert routed.summary["hbm_bytes"] >= routed.notes["distinct_experts"] * per_expert


def _fused(shape: dict, placement: Out):
    """rmsnorm (its output replicated on every core or split over them) -> moe -> store."""
    kb = KernelBuilder("norm_moe", chip=TINY)
    comp = Composer(kb, TINY)
    t, h = shape["tokens"], shape["hidden"]
    for name in ("x", "res"):
        comp.value(name, TensorRef.hbm(name, kb.hbm(name, (t, h), "bf16")))
    out = kb.hbm("out", (t, h), "bf16")
    norm = get_kernel("rmsnorm")
    comp.add_kernel("n", "rmsnorm", norm.shape({"tokens": t, "hidden": h}),
                    inputs={"x": "x", "residual": "res"}, outputs={"y": "y", "h": "h"},
                    outs={"y": placement, "h": placement})
    comp.add_kernel("m", "moe", shape, inputs={"x": "y"}, outputs={"y": "moe_y"},
                    outs={"y": Out.onchip(), "expert_ids": Out.onchip()})
    comp.add("s", lambda ctx, src: emit_store(ctx, src, Out.to(TensorRef.hbm("out", out))),
             inputs={"src": "moe_y"}, outputs={"y": "stored"})
    comp.build()
    return kb.build(), comp


@pytest.mark.parametrize("routing, placement", [("any", "replicated"), ("uniform", "replicated"),
                                                ("uniform", "onchip")])
def test_fused_with_an_onchip_norm_output_equals_the_launch(routing, placement):
    """The moe emitter after an rmsnorm whose output every core holds (read in place) or whose rows
    are split over the cores (fetched), its own output kept on chip: the same arithmetic as the
    stand-alone launch on the norm's output."""
    kd = get_kernel("moe")
    shape = kd.shape(dict(ROUTED, routing=routing, expert_bias=True, act_fmt="bf16"))
    place = Out.replicated(range(TINY.core.count)) if placement == "replicated" else Out.onchip()
    prog, comp = _fused(shape, place)
    # replicated: each core reads the norm's output in place (nothing fetched); split: fetched
    x_loaded = {sid for sid, name in prog.semaphores
                if name.startswith("m/c") and name.endswith(".x_loaded")}
    fetches = sum(1 for i in prog.instructions
                  if i.mnemonic == "sem.signal" and dict(i.args)["sem"] in x_loaded)
    assert (fetches == 0) == (placement == "replicated")
    check_program(prog, TINY)
    ops = {op.label: op for op in comp.ops}
    alone = kd.build(shape, TINY)
    p = plan_moe(shape, TINY)
    data = alone.make_inputs(0)
    if routing == "uniform":  # routed so that every list holds its tokens: through the norm's scaling
        route_tokens(data, p, _picks(p))
    rng = np.random.default_rng(1)
    x, res = np.asarray(data["x"]), (0.01 * rng.standard_normal(data["x"].shape)).astype(BF16)
    w = np.ones((1, shape["hidden"]), BF16)
    bind = {"x": x, "res": res, "n/w": w, **comp.ctx.consts}
    bind |= {ops["m"].hbm[name]: data[name] for name in ops["m"].hbm if name in data}
    got = run_functional(prog, bind).read("out", "bf16", (shape["tokens"], shape["hidden"]))
    y, _ = rmsnorm_reference(x, res, w, 1e-5)
    want = run_functional(alone.program, {**data, "x": np.asarray(y)}).read("y")
    assert np.array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))


def test_full_size_gpt_oss_decode_64_tokens_timing_only():
    """gpt-oss-120b's MoE as the model launches it at 64 tokens: FLOPs within 10 % of the routed
    work and time within 1.3x of the roofline bound (its weights at the achievable HBM rate)."""
    h = i = 2880
    shape = dict(tokens=64, hidden=h, intermediate=i, experts=128, top_k=4, activation="swiglu_oai",
                 router="softmax_topk", expert_bias=True, routing="uniform")
    r = run_kernel("moe", shape, preset="jalapeno-v1", safety_checks=False)
    s = r.summary
    routed = 2 * 64 * 4 * 3 * h * i + 2 * 64 * h * 128
    assert r.notes["arrangement"] == "routed" and r.notes["distinct_experts"] == 112
    assert routed <= s["flops"] < 1.1 * routed
    assert s["lower_bound_s"] <= s["time_s"] <= 1.3 * s["lower_bound_s"]


def _queue0_pieces(program, core: int) -> list[str]:
    """Core ``core``'s queue-0 signals of weight pieces, in issue order: "gu" (a gate|up segment
    landed) or "rest" (the down projection and biases)."""
    names = dict(program.semaphores)
    out = []
    for ins in program.instructions:
        if ins.mnemonic == "sem.signal" and ins.engine.core == core and ins.engine.unit == "dma" \
                and ins.engine.queue == 0:
            name = names[ins.arg("sem")].rsplit(".", 1)[-1]
            if name in ("loaded_gu", "loaded"):
                out.append("gu" if name == "loaded_gu" else "rest")
    return out


def test_gate_up_goes_ahead_of_the_rest_before_it_past_the_fill():
    """Where the matrix unit paces a core (MXFP8 activations) and it has items past the pipeline's
    fill, queue 0 sends item n + 1's gate|up before item n's rest (the unit's order: gate|up of
    n + 1, then the down projection of n); with few items, in item order."""
    kd = get_kernel("moe")
    shape = kd.shape(CASES["split_slots"])
    p = plan_moe(shape, TINY)
    b = kd.build(shape, TINY)
    for c in range(p.cores):
        items = p.core_items(c)
        shared = sum(1 for it in items if it[0])
        assert len(items) > p.nbuf + 2
        want = ["gu", "rest"] * shared + ["gu"] + ["gu", "rest"] * (len(items) - shared - 1) + ["rest"]
        assert _queue0_pieces(b.program, c) == want
    few = kd.shape(dict(CASES["gpt_oss"]))
    pf = plan_moe(few, TINY)
    assert all(len(pf.core_items(c)) <= pf.nbuf + 2 for c in range(pf.cores))
    pieces = _queue0_pieces(kd.build(few, TINY).program, 0)
    assert pieces == ["gu", "rest"] * len(pf.core_items(0))


def test_slots_after_many_shared_items_do_not_deadlock():
    """A core whose first routed item comes after more shared items than it has weight buffers:
    its queue 0 must gather the first slot's x rows before it waits for a buffer, since the vector
    unit waits for those rows before it drains the shared items the matrix unit needs drained
    (Kimi K2.5 at 96 tokens on jalapeno-v1 deadlocked; this is the same program on 8 cores)."""
    spec = load_preset("jalapeno-v1").replace(**{"core.count": 8})
    kdef = get_kernel("moe")
    shape = kdef.shape({"tokens": 96, "hidden": 4096, "intermediate": 1024, "experts": 128, "top_k": 4,
                        "shared_experts": 1, "activation": "silu", "routing": "uniform"})
    p = plan_moe(shape, spec)
    assert isinstance(p, MoePlan) and p.routed
    first = [next(n for n, it in enumerate(p.core_items(c)) if not it[0]) for c in range(p.cores)]
    assert max(first) > p.nbuf  # the case: shared items fill every buffer before the first slot
    tl = run_timing(kdef.build(shape, spec).program, spec)  # raised Deadlock before
    assert tl.time_s >= tl.lower_bound_s()
