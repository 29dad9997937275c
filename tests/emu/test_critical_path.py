"""The critical path as runs (``emu.critical_path``, ``layer --path``, ``kernel --path``): the runs
add up to the window they explain, agree with the per-operator seconds of ``phases``, and say
which instructions they are."""

import itertools
import json

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.cli.main import main
from jalapeno_emu.emu.critical_path import critical_path_runs, launched_path_runs
from jalapeno_emu.emu.phases import path_steps, phase_figures
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.kernels.registry import get_kernel
from jalapeno_emu.model import Step, load_model_config
from jalapeno_emu.model.timing import layer_critical_path, time_layer

LAYER = ["--model", "tiny-gpt-oss", "--phase", "decode", "--context", "64", "--preset", "tiny"]


def _gemm_timeline():
    spec = load_preset("tiny")
    kdef = get_kernel("gemm")
    return run_timing(kdef.build(kdef.shape({}), spec).program, spec)


def test_runs_add_up_to_the_program_and_to_any_window_of_it():
    tl = _gemm_timeline()
    runs = critical_path_runs(tl, label="gemm")
    assert sum(r.critical_s for r in runs) == pytest.approx(tl.makespan_s, rel=1e-12)
    assert all(r.operator == "gemm" and r.critical_s > 0 and r.fixed_s <= r.critical_s + 1e-18 for r in runs)
    # merged runs: no two neighbours share operator, engine and mnemonic; every step is in one
    keys = [(r.operator, r.engine, r.mnemonic) for r in runs]
    assert all(a != b for a, b in itertools.pairwise(keys))
    assert sum(r.count for r in runs) == len(path_steps(tl))
    # cut at a start time: the window's seconds, and only runs that end inside it
    start = tl.makespan_s / 3
    cut = critical_path_runs(tl, start_s=start)
    assert sum(r.critical_s for r in cut) == pytest.approx(tl.makespan_s - start, rel=1e-12)
    assert all(r.end_s > start for r in cut)
    launched = launched_path_runs(tl, label="gemm")
    first = launched[0]
    assert (first.engine, first.mnemonic, first.critical_s) == ("host", "launch", tl.launch_s)
    assert sum(r.critical_s for r in launched) == pytest.approx(tl.time_s, rel=1e-12)
    assert launched[1].start_s == pytest.approx(runs[0].start_s + tl.launch_s)


def test_runs_name_the_instructions_and_the_line_that_issued_them():
    tl = _gemm_timeline()
    for r in critical_path_runs(tl):
        assert r.source.startswith("gemm.py:") or r.mnemonic.startswith("sem."), r
        assert r.mnemonic in {"dma.load", "dma.store", "dma.copy", "mxu.matmul", "vec.acc_read",
                              "vec.binary", "vec.unary", "sem.wait", "sem.signal"}, r.mnemonic
        assert r.cause in {"hbm", "compute", "latency", "synchronisation"}
        assert 0 <= r.start_s < r.end_s <= tl.makespan_s


@pytest.mark.parametrize("fusion", ["step", "layer", "none"])
def test_a_layers_path_adds_up_to_its_time_and_matches_its_operators(fusion):
    cfg = load_model_config("tiny-gpt-oss")
    lt = time_layer(cfg, 1, Step("decode", batch=1, context=64), "tiny", fusion=fusion)
    runs = layer_critical_path(lt)
    assert sum(r.critical_s for r in runs) == pytest.approx(lt.time_s, rel=1e-9)
    if fusion == "step":  # each operator's runs add up to its share of the window (phases)
        end_i, start = lt.window
        per_op = {p.name: p.critical_s for p in phase_figures(lt.timelines[0], end_instruction=end_i,
                                                              start_s=start)}
        for name in {r.operator for r in runs}:
            mine = sum(r.critical_s for r in runs if r.operator == name)
            assert mine == pytest.approx(per_op[name], abs=1e-15)
        assert min(r.end_s for r in runs) > 0 and max(r.end_s for r in runs) == pytest.approx(lt.time_s)
    if fusion == "none":  # one launch run per kernel, in launch order
        launches = [r.operator for r in runs if r.mnemonic == "launch"]
        assert launches == [k.label for k in lt.kernels]


def test_layer_and_kernel_print_the_path(capsys):
    assert main(["layer", *LAYER, "--path", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sum(r["critical_s"] for r in doc["critical_path"]) == pytest.approx(doc["time_s"], rel=1e-9)
    assert {"operator", "engine", "mnemonic", "count", "critical_s", "cause", "source", "chunk"} <= \
        set(doc["critical_path"][0])
    assert main(["kernel", "gemm", "--timing-only", "--path"]) == 0
    out = capsys.readouterr().out
    assert "critical path of gemm" in out and "gemm.py:" in out and "adds µs" in out
