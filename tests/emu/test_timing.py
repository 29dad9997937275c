"""The timing pass: headline rates on jalapeno-v1, overlap, bounds, semantics, traces, invariants.

Full-size programs here are timing-only (no data is ever allocated); building the biggest takes
about a second with the builder.
"""

import json
import math
import random

import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu import Timeline, microbench, run_timing
from jalapeno_emu.emu.timeline import CATEGORIES
from jalapeno_emu.errors import Deadlock
from jalapeno_emu.isa.builder import KernelBuilder

GIB = 1 << 30


@pytest.fixture(scope="module")
def v1():
    return load_preset("jalapeno-v1")


@pytest.fixture(scope="module")
def tiny():
    return load_preset("tiny")


def achievable(spec):
    return spec.hbm.bytes_per_s * spec.hbm.efficiency


# --- headline rates (jalapeno-v1) ------------------------------------------------------------
def test_v1_stream_of_4_gib_over_all_cores_reaches_efficiency_times_15_4_tb_s(v1):
    tl = run_timing(microbench.hbm_stream_program(v1, 4 * GIB), v1)
    s = tl.summary()
    assert s["hbm_bytes"] == 4 * GIB
    assert v1.hbm.bytes_per_s == pytest.approx(15.4e12, rel=1e-3)
    assert s["hbm_bytes_per_s"] == pytest.approx(v1.hbm.efficiency * 15.4e12, rel=0.03)
    assert s["hbm_utilization_of_achievable"] == pytest.approx(1.0, abs=0.03)
    assert s["hbm_utilization"] == pytest.approx(v1.hbm.efficiency, abs=0.03)
    assert s["channel_utilization"]["max"] - s["channel_utilization"]["min"] < 0.01  # interleaved
    assert s["bound"] == "hbm"


def test_v1_one_core_alone_is_capped_by_its_dma_port(v1):
    tl = run_timing(microbench.single_core_stream_program(v1, 256 << 20, chunk_bytes=1 << 20), v1)
    s = tl.summary()
    assert s["hbm_bytes_per_s"] == pytest.approx(v1.dma.bytes_per_s_per_core, rel=0.03)
    assert s["hbm_bytes_per_s"] < 0.05 * achievable(v1)


def test_v1_stride_onto_one_pseudo_channel_gets_one_channels_bandwidth(v1):
    tl = run_timing(microbench.strided_single_channel_program(v1, 8 << 20), v1)
    s = tl.summary()
    n_pc = v1.hbm.pseudo_channels
    assert np.count_nonzero(tl.hbm_bytes_per_channel) == 1
    assert s["hbm_bytes_per_s"] == pytest.approx(achievable(v1) / n_pc, rel=0.10)
    assert s["bound"] == "hbm"


def test_v1_large_mxfp4_gemm_reaches_90_percent_of_peak(v1):
    prog = microbench.mxu_program(v1, 8192, 8192, 8192)
    assert len(prog.instructions) >= 16 * v1.core.count  # many back-to-back matmuls per core
    s = run_timing(prog, v1).summary()
    assert s["flops"] == 2.0 * 8192**3 == s["flops_by_format"]["mxfp4"]
    assert s["mxu_utilization"] >= 0.90
    assert s["mxu_utilization_used_cores"] == pytest.approx(s["mxu_utilization"])
    assert s["bound"] == "compute"


def test_one_small_matmul_pays_the_pipeline_fill(tiny):
    kb = KernelBuilder("one_matmul", tiny)
    a = kb.sram_mx(0, "a", (128, 32), "fp4", axis=1)
    b = kb.sram_mx(0, "b", (32, 128), "fp4", axis=0)
    acc = kb.acc(0, "acc", (128, 128))
    mxu = kb.core(0).mxu
    mxu.matmul_mx(acc, a, b, mode="overwrite")
    mxu.matmul_mx(acc, a, b)  # back to back: streams through the pipe, no second fill
    tl = run_timing(kb.build(), tiny)
    mx, clock = tiny.matrix, tiny.core.clock_hz
    mac_s = mx.tile_m * mx.tile_n * mx.tile_k / mx.mxfp4_macs_per_cycle / clock
    first, second = tl.end_s - tl.start_s
    assert first - mac_s == pytest.approx((mx.pipeline_depth_cycles + mx.issue_overhead_cycles) / clock)
    assert second - mac_s == pytest.approx(mx.issue_overhead_cycles / clock)
    assert tl.start_s[1] == tl.end_s[0]


def test_matmul_rate_follows_the_operand_format(tiny):
    def one(fmt_a, fmt_b):
        kb = KernelBuilder("fmt", tiny)
        a = kb.sram_mx(0, "a", (128, 256), fmt_a, 1) if fmt_a != "bf16" else \
            kb.sram(0, "a", (128, 256), "bf16")
        b = kb.sram_mx(0, "b", (256, 128), fmt_b, 0) if fmt_b != "bf16" else \
            kb.sram(0, "b", (256, 128), "bf16")
        kb.core(0).mxu.matmul_mx(kb.acc(0, "acc", (128, 128)), a, b, mode="overwrite")
        return float(run_timing(kb.build(), tiny).work_s[0])

    mx = tiny.matrix
    fp4 = one("fp4", "fp4")
    assert one("fp8e4", "fp4") == pytest.approx(fp4 * mx.mxfp4_macs_per_cycle / mx.mxfp8_macs_per_cycle)
    assert one("bf16", "fp8e5") == pytest.approx(fp4 * mx.mxfp4_macs_per_cycle / mx.bf16_macs_per_cycle)


# --- overlap: double vs single buffering ------------------------------------------------------
def test_double_buffering_overlaps_dma_and_matmul_single_buffering_adds_them(v1):
    def run(nbuf):
        prog = microbench.streamed_matmul_program(v1, 128, 8 * 2048, 2048, chunk_k=2048, nbuf=nbuf,
                                                  cores=[0])
        return run_timing(prog, v1)

    single, double = run(1), run(2)
    # With one buffer nothing overlaps, so its engines' busy times are the standalone costs.
    sel = single.category == CATEGORIES.index("dma")
    order = np.argsort(single.start_s[sel])
    s, e = single.start_s[sel][order], single.end_s[sel][order]
    prev = np.maximum.accumulate(np.concatenate(([0.0], e[:-1])))
    dma_s = float(np.maximum(e - np.maximum(s, prev), 0).sum())  # time with any DMA in flight
    mxu_s = single.busy_s()["c0.mxu"]
    launch = v1.sync.kernel_launch_s
    assert 0.5 < dma_s / mxu_s < 2  # comparable, so overlap matters
    assert single.time_s == pytest.approx(launch + dma_s + mxu_s, rel=0.15)
    assert double.time_s == pytest.approx(launch + max(dma_s, mxu_s), rel=0.15)
    assert double.time_s < 0.7 * single.time_s
    assert single.bound() == "synchronisation"


# --- GEMV: HBM-bound when big, latency-bound when tiny ----------------------------------------
def test_v1_batch1_gemv_over_4_gib_of_mxfp4_weights_is_hbm_bound(v1):
    k, n = 32768, 262144
    prog = microbench.streamed_matmul_program(v1, 1, k, n, chunk_k=512, nbuf=4)
    s = run_timing(prog, v1).summary()
    weight_bytes = k * n // 2 + (k // 32) * n  # MXFP4 codes + E8M0 scales
    assert weight_bytes >= 256e6
    assert s["hbm_bytes"] >= weight_bytes
    assert s["time_s"] == pytest.approx(weight_bytes / achievable(v1), rel=0.05)
    assert s["bound"] == "hbm"


def test_tiny_gemv_is_latency_bound_and_pays_dma_setup(v1):
    s = run_timing(microbench.streamed_matmul_program(v1, 1, 256, 256, chunk_k=256, nbuf=1,
                                                      cores=[0]), v1).summary()
    floor = v1.sync.kernel_launch_s + 2 * (v1.dma.setup_latency_s + v1.hbm.latency_s)  # load, store
    assert s["time_s"] >= floor
    assert s["bound"] == "latency"
    assert s["critical_fixed_s"] >= 0.5 * s["time_s"]


# --- semantics of individual instructions -----------------------------------------------------
def test_dma_pays_setup_latency_and_signal_waits_for_transfers_in_flight(tiny):
    """A signal lands when the queue's transfers do; the queue itself keeps issuing."""
    kb = KernelBuilder("dma", tiny)
    x, buf = kb.hbm("x", (64, 256), "f32"), kb.sram(0, "buf", (64, 256), "f32")
    done = kb.semaphore("done")
    c0 = kb.core(0)
    c0.dma[0].load(buf, x)
    c0.dma[0].signal(done)
    c0.vpu.wait(done, 1)
    tl = run_timing(kb.build(), tiny)
    nbytes = 64 * 256 * 4
    expect = tiny.dma.setup_latency_s + nbytes / tiny.dma.bytes_per_s_per_core + tiny.hbm.latency_s
    assert tl.end_s[0] == pytest.approx(expect)
    assert tl.end_s[1] == tl.end_s[0]  # the signal took effect when the transfer landed...
    assert tl.start_s[1] == 0.0  # ...but the queue issued it at once and did not stop
    sem_lat = tiny.sync.semaphore_latency_cycles / tiny.core.clock_hz
    assert tl.end_s[2] == pytest.approx(tl.end_s[1] + sem_lat)
    assert tl.time_s == pytest.approx(tl.makespan_s + tiny.sync.kernel_launch_s)


def test_a_queue_overlaps_up_to_max_outstanding_descriptors(tiny):
    limit = tiny.dma.max_outstanding_per_queue
    kb = KernelBuilder("outstanding", tiny)
    x, buf = kb.hbm("x", (2 * limit, 256), "u8"), kb.sram(0, "buf", (1, 256), "u8")
    for r in range(2 * limit):
        kb.core(0).dma[0].load(buf, x.sub(r, 0, 1, 256))
    tl = run_timing(kb.build(), tiny)
    assert (tl.start_s[:limit] == 0).all()  # issued back to back: setup latency overlaps
    assert (tl.start_s[limit:] > 0).all()  # each waits for a slot
    assert (tl.start_s[limit:] == tl.end_s[:limit]).all()


def test_sram_copy_uses_no_hbm_and_gather_pays_per_row_rounds(tiny):
    kb = KernelBuilder("copy_gather", tiny)
    table = kb.hbm("table", (64, 64), "f32")
    a, b = kb.sram(0, "a", (40, 64), "f32"), kb.sram(1, "b", (40, 64), "f32")
    idx = kb.sram(0, "idx", (40, 1), "i32")
    c0 = kb.core(0)
    c0.dma[0].copy(b, a)
    c0.dma[1].gather(a, table, idx)
    tl = run_timing(kb.build(), tiny)
    rows_bytes = 40 * 64 * 4
    assert tl.hbm_bytes == rows_bytes  # only the gather touched HBM: rows 0..39 assumed
    rounds = math.ceil(40 / tiny.dma.max_outstanding_per_queue)
    assert tl.fixed_s[1] == pytest.approx(rounds * (tiny.dma.setup_latency_s + tiny.hbm.latency_s))
    copy_rate = min(tiny.dma.bytes_per_s_per_core, tiny.sram.bytes_per_cycle * tiny.core.clock_hz)
    assert tl.end_s[0] == pytest.approx(tiny.dma.setup_latency_s + rows_bytes / copy_rate)


def test_vector_ops_cost_elements_over_lanes(tiny):
    kb = KernelBuilder("vec", tiny)
    x, y = kb.sram(0, "x", (64, 256), "f32"), kb.sram(0, "y", (64, 256), "f32")
    vpu = kb.core(0).vpu
    vpu.add(y, x, x)
    vpu.exp(y, x)
    tl = run_timing(kb.build(), tiny)
    vu, clock = tiny.vector, tiny.core.clock_hz
    assert tl.end_s[0] - tl.start_s[0] == pytest.approx(
        (vu.issue_overhead_cycles + math.ceil(64 * 256 / vu.lanes)) / clock)
    assert tl.end_s[1] - tl.start_s[1] == pytest.approx(
        (vu.issue_overhead_cycles + math.ceil(64 * 256 / vu.transcendental_elements_per_cycle)) / clock)


def test_barrier_releases_everyone_after_the_last_arrival(tiny):
    kb = KernelBuilder("barrier", tiny)
    x = kb.sram(0, "x", (64, 256), "f32")
    c0, c1 = kb.core(0), kb.core(1)
    c0.vpu.exp(x, x)  # c0.vpu arrives late
    c0.vpu.barrier(7, 2)
    c1.mxu.barrier(7, 2)
    tl = run_timing(kb.build(), tiny)
    lat = tiny.sync.barrier_latency_cycles / tiny.core.clock_hz
    assert tl.end_s[1] == tl.end_s[2] == pytest.approx(tl.end_s[0] + lat)
    assert tl.start_s[2] == 0.0


def test_link_send_and_receive_on_one_chip(tiny):
    kb = KernelBuilder("link", tiny)
    x, y = kb.sram(0, "x", (16, 256), "f32"), kb.sram(0, "y", (16, 256), "f32")
    kb.link.send(x, 0, 5)
    kb.link.recv(y, 0, 5)
    tl = run_timing(kb.build(), tiny)
    link = tiny.link
    assert tl.end_s[0] == pytest.approx(link.alpha_s + 16 * 256 * 4 / link.stripe_bytes_per_s)
    assert tl.end_s[0] == pytest.approx(link.message_s(16 * 256 * 4))
    assert tl.end_s[1] == tl.end_s[0]


def test_deadlock_names_the_waiting_engine(tiny):
    kb = KernelBuilder("stuck", tiny)
    never, x = kb.semaphore("never"), kb.sram(0, "x", (8, 64), "f32")
    c0 = kb.core(0)
    c0.vpu.exp(x, x)
    c0.mxu.wait(never, 1)
    with pytest.raises(Deadlock) as info:
        run_timing(kb.build(), tiny)
    assert "c0.mxu" in str(info.value) and "never" in str(info.value)
    assert info.value.engine == "c0.mxu" and info.value.index == 1


# --- invariants over random programs ----------------------------------------------------------
def random_program(seed: int, spec):
    """A random legal program on ``spec`` (tiny) that cannot deadlock: every wait only asks for
    signal counts issued earlier in program order, and barrier arrivals are issued together, so
    program order itself is a valid execution."""
    rng = random.Random(seed)
    kb = KernelBuilder(f"random{seed}", spec)
    x = kb.hbm("x", (128, 256), "f32")
    w = kb.hbm_mx("w", (256, 256), "fp4", axis=0)
    table = kb.hbm("table", (64, 64), "f32")
    cores = range(spec.core.count)
    buf = {c: kb.sram(c, "buf", (32, 256), "f32") for c in cores}
    a = {c: kb.sram_mx(c, "a", (128, 256), "fp4", axis=1) for c in cores}
    b = {c: kb.sram_mx(c, "b", (256, 128), "fp4", axis=0) for c in cores}
    acc = {c: kb.acc(c, "acc", (128, 128)) for c in cores}
    rows = {c: kb.sram(c, "rows", (16, 64), "f32") for c in cores}
    idx = {c: kb.sram(c, "idx", (16, 1), "i32") for c in cores}
    sems = [kb.semaphore(f"s{i}") for i in range(4)]
    issued = [0] * len(sems)
    barrier_id = 0

    def engine(c):
        core = kb.core(c)
        return rng.choice([*core.dma, core.mxu, core.vpu])

    for _ in range(rng.randint(5, 60)):
        c = rng.choice(list(cores))
        core = kb.core(c)
        op = rng.choice(["load", "load", "store", "copy", "gather", "matmul", "matmul", "vec", "vec",
                         "signal", "signal", "wait", "wait", "barrier"])
        q = rng.choice(core.dma)
        if op == "load":
            r, h = rng.randrange(0, 96), rng.choice([1, 8, 32])
            cols = rng.choice([64, 256])
            q.load(buf[c].sub(0, 0, h, cols), x.sub(r, 0, h, cols))
        elif op == "store":
            q.store(x.sub(rng.randrange(0, 96), 0, 32, 256), buf[c])
        elif op == "copy":
            q.copy(buf[(c + 1) % len(cores)], buf[c])
        elif op == "gather":
            q.gather(rows[c], table, idx[c])
        elif op == "matmul":
            m, n, k = rng.choice([32, 128]), rng.choice([32, 128]), rng.choice([32, 96, 256])
            core.mxu.matmul_mx(acc[c].sub(0, 0, m, n), a[c].sub(0, 0, m, k), b[c].sub(0, 0, k, n))
            if rng.random() < 0.3:
                q.load(b[c].codes, w.sub(0, 0, 256, 128).codes)
        elif op == "vec":
            kind = rng.choice(["exp", "add", "reduce", "acc_read"])
            v = core.vpu
            if kind == "exp":
                v.exp(buf[c], buf[c])
            elif kind == "add":
                v.add(buf[c], buf[c], buf[c])
            elif kind == "reduce":
                v.reduce("max", buf[c].sub(0, 0, 32, 1), buf[c])
            else:
                v.acc_read(buf[c].sub(0, 0, 32, 128), acc[c].sub(0, 0, 32, 128))
        elif op == "signal":
            s = rng.randrange(len(sems))
            count = rng.choice([1, 2])
            engine(c).signal(sems[s], count)
            issued[s] += count
        elif op == "wait":
            ready = [s for s in range(len(sems)) if issued[s]]
            if ready:
                s = rng.choice(ready)
                engine(c).wait(sems[s], rng.randint(1, issued[s]))
        else:
            members = rng.sample([e for cc in cores for e in (*kb.core(cc).dma, kb.core(cc).mxu)],
                                 rng.randint(1, 3))
            for e in members:
                e.barrier(barrier_id, len(members))
            barrier_id += 1
    return kb.build()


@pytest.mark.parametrize("seed", range(50))
def test_random_programs_respect_bounds_and_engine_order(seed, tiny):
    prog = random_program(seed, tiny)
    tl = run_timing(prog, tiny)
    s = tl.summary()
    assert s["time_s"] >= s["lower_bound_s"]
    assert (tl.end_s >= tl.start_s).all() and (tl.start_s >= 0).all()
    limit = tiny.dma.max_outstanding_per_queue
    for eng, stream in prog.streams().items():
        starts, ends = tl.start_s[stream], tl.end_s[stream]
        assert (np.diff(starts) >= 0).all(), eng
        if eng.unit != "dma":
            assert (starts[1:] >= ends[:-1]).all(), eng  # one instruction at a time
            continue
        is_transfer = np.array([prog.instructions[i].mnemonic.startswith("dma.") for i in stream])
        for j, i in enumerate(stream):
            earlier = ends[:j][is_transfer[:j]]
            if prog.instructions[i].mnemonic == "sem.signal":
                # a signal lands only when every earlier transfer of its queue has landed
                assert (earlier <= ends[j]).all(), eng
            elif is_transfer[j]:
                assert int((earlier > starts[j]).sum()) < limit, eng
    assert (tl.end_s <= tl.makespan_s).all()
    # Each instruction's predecessor ended no later than it did, and the critical path is a chain.
    has = tl.pred >= 0
    assert (tl.end_s[tl.pred[has]] <= tl.end_s[has] + 1e-15).all()
    assert (tl.pred != np.arange(len(prog.instructions))).all()
    path = tl.critical_path()
    assert len(set(path.tolist())) == len(path) and tl.end_s[path[-1]] == tl.makespan_s


def test_the_gemm_example_times_without_data(tiny):
    from tests.emu.programs import build_gemm

    for double in (False, True):
        tl = run_timing(build_gemm(256, 256, 1024, double_buffer=double), tiny)
        assert tl.summary()["time_s"] > tl.lower_bound_s() > 0
    assert run_timing(build_gemm(256, 256, 1024, double_buffer=True), tiny).time_s < \
        run_timing(build_gemm(256, 256, 1024, double_buffer=False), tiny).time_s


# --- summary and trace ------------------------------------------------------------------------
SUMMARY_KEYS = {
    "time_s", "launch_s", "makespan_s", "cycles", "instructions", "hbm_bytes", "hbm_bytes_per_s",
    "hbm_utilization", "hbm_utilization_of_achievable", "channel_utilization", "flops",
    "flops_by_format", "flops_per_s", "mxu_utilization", "mxu_utilization_used_cores", "bound",
    "lower_bound_s", "memory_bound_s", "compute_bound_s", "critical_fixed_s", "busy_s",
    "mxu_utilization_of_format_peak", "why", "critical_fixed_by_kind_s", "critical_path_by_engine_s",
    "critical_engine", "cores_used", "cores_total",
}


def test_summary_keys_and_json_ready(tiny):
    tl = run_timing(random_program(3, tiny), tiny)
    s = tl.summary()
    assert set(s) == SUMMARY_KEYS
    assert s["bound"] in {"compute", "hbm", "latency", "synchronisation"}
    assert s["cycles"] == pytest.approx(s["time_s"] * tiny.core.clock_hz)
    json.dumps(s)
    assert tl.channel_utilization().shape == (tiny.hbm.pseudo_channels,)
    assert isinstance(tl, Timeline)


def test_chrome_trace_has_one_event_per_instruction_and_a_track_per_engine(tiny, tmp_path):
    prog = microbench.streamed_matmul_program(tiny, 32, 1024, 256, chunk_k=256, nbuf=2)
    tl = run_timing(prog, tiny)
    trace = json.loads(json.dumps(tl.to_chrome_trace()))
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(prog.instructions)
    assert sorted(e["args"]["index"] for e in slices) == list(range(len(prog.instructions)))
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    engines = {str(e) for e in prog.engines()}
    assert {name.split(" ")[0] for name in names.values()} == engines  # lanes: "c0.dma0 +1"
    assert set(engines) <= set(names.values())  # one main track per engine
    for e in slices:  # slices on one track never overlap
        assert names[e["tid"]].split(" ")[0] == e["args"]["engine"]
    by_tid: dict = {}
    for e in sorted(slices, key=lambda e: e["ts"]):
        assert e["ts"] >= by_tid.get(e["tid"], 0.0) - 1e-9
        by_tid[e["tid"]] = e["ts"] + e["dur"]
    assert any(e["ph"] == "C" and e["name"] == "HBM bandwidth" for e in events)
    assert slices[0]["args"]["source"].startswith("microbench.py:")
    path = tmp_path / "trace.json"
    tl.write_chrome_trace(path)
    assert json.loads(path.read_text())["traceEvents"]
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]  # no temp file left behind


def test_hbm_bandwidth_series_integrates_to_the_bytes_moved(v1):
    tl = run_timing(microbench.hbm_stream_program(v1, 64 << 20), v1)
    t, bw = tl.hbm_bandwidth_series(bins=100)
    assert float((bw * np.diff(np.append(t, tl.makespan_s))).sum()) == pytest.approx(64 << 20, rel=1e-6)


def test_what_if_retiming_reuses_the_program_and_follows_the_knob(v1):
    from jalapeno_emu.emu.costs import program_facts

    prog = microbench.hbm_stream_program(v1, 256 << 20)
    base = run_timing(prog, v1).summary()
    assert program_facts(prog) is program_facts(prog)  # read once per Program object
    slow = run_timing(prog, v1.replace(**{"hbm.efficiency": 0.45})).summary()
    assert slow["hbm_utilization"] < 0.45 < base["hbm_utilization"]
    assert slow["time_s"] - slow["launch_s"] > 1.8 * (base["time_s"] - base["launch_s"])
    assert run_timing(prog, "jalapeno-v1").summary()["time_s"] == base["time_s"]


def test_a_program_for_a_bigger_chip_is_rejected(v1, tiny):
    from jalapeno_emu.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"c2\.dma0, which tiny does not have"):
        run_timing(microbench.hbm_stream_program(v1, 64 << 20), tiny)


def test_dma_queue_keeps_streaming_past_a_pending_signal(tiny):
    kb = KernelBuilder("stream", tiny)
    x = kb.hbm("x", (64, 256), "f32")
    bufs = [kb.sram(0, f"b{i}", (16, 256), "f32") for i in range(4)]
    sems = [kb.semaphore(f"s{i}") for i in range(4)]
    q = kb.core(0).dma[0]
    for i, b in enumerate(bufs):
        q.load(b, x.sub(16 * i, 0, 16, 256))
        q.signal(sems[i])
    tl = run_timing(kb.build(), tiny)
    loads = [0, 2, 4, 6]
    # Every load is issued before the first one lands: signals do not serialise the queue.
    assert max(tl.start_s[j] for j in loads) < tl.end_s[0]
    assert all(tl.end_s[j + 1] == pytest.approx(max(tl.end_s[k] for k in loads if k <= j))
               for j in loads)


# --- explanations ---------------------------------------------------------------------------
def _bf16_matmuls_on_one_core(spec, steps: int = 64):
    """Many BF16 matmuls on core 0's matrix unit back to back: compute-bound on that one unit."""
    kb = KernelBuilder("bf16_mm", chip=spec)
    a, b = kb.sram(0, "a", (128, 256), "bf16"), kb.sram(0, "b", (256, 128), "bf16")
    acc = kb.acc(0, "acc", (128, 128))
    m = kb.core(0).mxu
    for i in range(steps):
        m.matmul(acc, a, b, mode="overwrite" if i == 0 else "accumulate")
    return kb.build()


def test_why_names_the_busy_unit_its_format_and_the_cores_that_worked(v1):
    s = run_timing(_bf16_matmuls_on_one_core(v1), v1).summary()
    assert s["bound"] == "compute"
    assert s["why"].startswith("compute-bound: c0.mxu (bf16 matmuls)")
    assert "1 of 64 cores" in s["why"]
    assert (s["cores_used"], s["cores_total"], s["critical_engine"]) == (1, 64, "c0.mxu")
    # BF16 runs at a quarter of the MXFP4 peak: against its own peak the unit looks 4x as busy
    assert s["mxu_utilization_of_format_peak"] == pytest.approx(4 * s["mxu_utilization"])


def test_why_of_an_hbm_bound_stream_and_of_a_latency_bound_gemv(v1):
    stream = microbench.streamed_matmul_program(v1, 1, 32768, 262144, chunk_k=512, nbuf=4)
    s = run_timing(stream, v1).summary()
    assert s["bound"] == "hbm" and s["why"].startswith("HBM-bound") and s["cores_used"] == 64
    s = run_timing(microbench.streamed_matmul_program(v1, 1, 256, 256, chunk_k=256, nbuf=1, cores=[0]),
                   v1).summary()
    assert s["bound"] == "latency" and s["why"].startswith("latency-bound") and s["cores_used"] == 1
    kinds = s["critical_fixed_by_kind_s"]
    assert sum(kinds.values()) == pytest.approx(s["critical_fixed_s"])
    assert kinds["launch"] == v1.sync.kernel_launch_s
    assert kinds["dma_setup"] == pytest.approx(2 * v1.dma.setup_latency_s)  # the load, the store
    assert sum(s["critical_path_by_engine_s"].values()) == pytest.approx(s["makespan_s"])
