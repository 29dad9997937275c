"""The stack part of ``jalapeno-emu demo``: a tiny gpt-oss on the die, then full-size estimates."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.table import Table

from jalapeno_emu.cli.app import Abort, App

ISL, OSL = 8192, 1024  # the InferenceX headline scenario


def _tiny_section(app: App, args: argparse.Namespace) -> dict[str, Any]:
    from jalapeno_emu.model import load_model_config
    from jalapeno_emu.model.generate import generate

    cfg = load_model_config("tiny-gpt-oss")
    app.status("tiny-gpt-oss on the emulated die: prefill a 32-token prompt, then decode "
               f"{args.tokens} tokens (each kernel launch run functionally)")
    t0 = time.perf_counter()
    gen = generate(cfg, prompt_len=32, tokens=args.tokens, seed=args.seed, preset="jalapeno-v1")
    doc = gen.as_dict()
    doc["emulation_wall_s"] = time.perf_counter() - t0
    decode = [s for s in doc["steps"] if s["phase"] == "decode"]
    last = decode[-1] if decode else doc["steps"][-1]
    if app.json_output:
        return doc
    app.console.print(f"[bold]1. tiny-gpt-oss on the die[/bold] ({cfg.layers} layers, hidden {cfg.hidden}, "
                      f"{cfg.experts} MXFP4 experts top-{cfg.top_k}, sliding window {cfg.sliding_window}, "
                      "sinks, YaRN RoPE)")
    app.console.print(f"   generated tokens: {' '.join(map(str, gen.tokens[0]))}")
    app.console.print(f"   prefill (32 tokens): {doc['prefill_time_s'] * 1e6:,.1f} µs on the die; decode: "
                      f"{doc['decode_time_s_per_token'] * 1e6:,.1f} µs per token; emulated in "
                      f"{doc['emulation_wall_s']:.1f} s of host time")
    table = Table(title=f"one decode step per layer (positions {last['positions']})")
    for col, just in (("layer", "left"), ("µs", "right"), ("bound", "left"), ("HBM util", "right")):
        table.add_column(col, justify=just)
    for lt in last["layers"]:
        tail = "norm+logits" if lt["layer"] == cfg.layers else str(lt["layer"])
        name = {-1: "embedding"}.get(lt["layer"], tail)
        table.add_row(name, f"{lt['time_s'] * 1e6:,.1f}", lt["bound"], f"{lt['hbm_utilization']:.1%}")
    app.console.print(table)
    return doc


BATCHES = (1, 64)  # the full-size decode steps the demo times


def full_size_steps(disk_cache: bool, batches: tuple[int, ...] = BATCHES) -> dict[str, Any]:
    """``batch_B`` -> the ``model --json`` fields of gpt-oss-120b's decode step at batch B,
    context 8192, on jalapeno-v1 (timing-only; module-level: a worker process runs it)."""
    from jalapeno_emu.model import Step, load_model_config
    from jalapeno_emu.model.timing import StepTimer, time_model

    cfg = load_model_config("gpt-oss-120b")
    timer = StepTimer("jalapeno-v1")
    return {f"batch_{b}": time_model(cfg, Step("decode", batch=b, context=8192), timer=timer,
                                     disk_cache=disk_cache).as_dict() for b in batches}


def rack_points(disk_cache: bool) -> list[dict[str, Any]]:
    """gpt-oss-120b served on the rack at the headline ISL/OSL, concurrency 1 and 64."""
    from jalapeno_emu.rack.deployment import rack_estimate

    return rack_estimate("gpt-oss-120b", "jalapeno-v1", ISL, OSL, (1, 64), disk_cache=disk_cache)


def _full_and_rack(disk_cache: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return full_size_steps(disk_cache), rack_points(disk_cache)


def _all_on_disk(disk_cache: bool) -> bool:
    """Whether every full-size step timing the demo shows is on disk already."""
    from jalapeno_emu.model import Step, load_model_config
    from jalapeno_emu.model.timing import model_timing_on_disk

    cfg = load_model_config("gpt-oss-120b")
    return disk_cache and all(model_timing_on_disk(cfg, Step("decode", batch=b, context=8192), "jalapeno-v1")
                              for b in BATCHES)


def _start_in_background(app: App, disk_cache: bool) -> Any:
    """A future of (full-size steps, rack points) computed in a second process while the tiny
    model runs here, when some full-size timing has to be built and there is a second CPU; None
    otherwise (warm: reading the caches here is quicker than starting a process)."""
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cpus < 2 or _all_on_disk(disk_cache):
        return None
    from jalapeno_emu.parallel import LocalPool

    pool = LocalPool(1)
    app.status("timing gpt-oss-120b at full size and on the rack in a second process meanwhile")
    future = pool.submit(_full_and_rack, disk_cache)
    pool.shutdown(wait=False)  # the process ends once the task is done
    return future


def _collect(background: Any) -> tuple[Any, Any]:
    """The background part's results; (None, None) to compute them here when there was none, or
    its process died (killed, out of memory): the sections then run in this process."""
    if background is None:
        return None, None
    from concurrent.futures.process import BrokenProcessPool

    try:
        return background.result()
    except BrokenProcessPool:
        return None, None


def _full_section(app: App, disk_cache: bool, done: dict[str, Any] | None = None) -> dict[str, Any]:
    if done is not None:
        out = done
    else:
        out = {}
        for b in BATCHES:
            app.status(f"gpt-oss-120b decode step, batch {b}, context 8192 (timing-only)")
            out.update(full_size_steps(disk_cache, (b,)))
    if app.json_output:
        return out
    app.console.print("[bold]2. gpt-oss-120b decode step on one Jalapeño die[/bold] (context 8192, "
                      "timing-only at full size)")
    table = Table()
    for col, just in (("batch", "right"), ("step ms", "right"), ("tok/s", "right"), ("tok/s/user", "right"),
                      ("bound", "left"), ("HBM GB", "right"), ("HBM util", "right"), ("weights+KV", "right")):
        table.add_column(col, justify=just)
    for d in out.values():
        b = d["batch"]
        fp = d["footprint"]
        table.add_row(str(b), f"{d['time_s'] * 1e3:.3f}", f"{b / d['time_s']:,.0f}",
                      f"{1 / d['time_s']:,.0f}",
                      d["bound"], f"{d['hbm_bytes'] / 1e9:.2f}", f"{d['hbm_utilization']:.1%}",
                      f"{fp['weight_share'] + fp['kv_share']:.1%} of HBM")
    app.console.print(table)
    per_layer = out["batch_1"]["layers"]
    app.console.print("   batch 1, per layer: " + "; ".join(
        f"{g['kind']} x{g['count']}: {g['time_s_each'] * 1e6:,.1f} µs ({g['bound']})" for g in per_layer))
    return out


def _rack_section(app: App, disk_cache: bool, done: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if done is not None:
        points = done
    else:
        app.status(f"gpt-oss-120b on the rack at {ISL}/{OSL}, concurrency 1 and 64")
        points = rack_points(disk_cache)
    if app.json_output:
        return {"points": points}
    app.console.print(f"[bold]3. gpt-oss-120b served on the rack[/bold] (ISL/OSL {ISL}/{OSL})")
    table = Table()
    for col in ("concurrency", "mapping", "chips", "tok/s/user", "TTFT s", "TPOT ms", "tok/s/chip",
                "tok/s/kW all-in"):
        table.add_column(col, justify="left" if col == "mapping" else "right")
    for p in points:
        table.add_row(str(p["concurrency"]), str(p["mapping"]), str(p["chips"]),
                      f"{p['interactivity_tok_s_user']:,.1f}", f"{p['ttft_s']:.3f}",
                      f"{p['tpot_s'] * 1e3:.2f}",
                      f"{p['throughput_tok_s_per_chip']:,.0f}", f"{p['tok_s_per_kw']['all_in']:,.0f}")
    app.console.print(table)
    return {"points": points}


def run_model_demo(app: App, args: argparse.Namespace) -> int:
    """Run the three sections; JSON collects them under ``tiny``, ``gpt_oss_120b`` and ``rack``."""
    if args.tokens < 1:
        raise Abort(f"--tokens must be >= 1 (got {args.tokens})")
    t0 = time.perf_counter()
    cache = not args.no_cache
    # Cold, the full-size timings (building two fused steps) take as long as the tiny model's
    # compilation: on a second CPU they overlap it (first run on 2 cores: 49 -> 28 s).
    background = _start_in_background(app, cache)
    doc = {"tiny": _tiny_section(app, args)}
    full, rack = _collect(background)
    doc["gpt_oss_120b"] = _full_section(app, cache, full)
    doc["rack"] = _rack_section(app, cache, rack)
    doc["wall_s"] = time.perf_counter() - t0
    if app.json_output:
        app.emit_json("demo", doc)
    else:
        app.console.print(f"[dim]demo took {doc['wall_s']:.1f} s[/dim]")
    return 0
