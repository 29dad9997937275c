"""``jalapeno-emu layer`` and ``jalapeno-emu model``: per-layer and whole-step latency (timing-only)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from jalapeno_emu.chip import apply_overrides, format_quantity, load_preset
from jalapeno_emu.cli.app import Abort, App, output_file
from jalapeno_emu.cli.human import path_table, trace_note, why_line
from jalapeno_emu.cli.options import add_key_value_option
from jalapeno_emu.files import check_output_paths


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="gpt-oss-120b, gpt-oss-20b, deepseek-r1, kimi-k2.5, "
                   "tiny-gpt-oss, tiny-deepseek, tiny-kimi, or a path to a config.json")
    p.add_argument("--phase", required=True, choices=("decode", "prefill"))
    p.add_argument("--batch", type=int, default=1, help="sequences in the step (default 1)")
    p.add_argument("--context", type=int, help="decode: tokens in each sequence's KV cache, the new "
                   "one included (default 8192)")
    p.add_argument("--seq", type=int, help="prefill: prompt tokens per sequence (default 8192)")
    p.add_argument("--chunk", type=int, default=0, help="prefill: tokens per chunk (0: the whole "
                   "prompt at once); chunk i attends to the i earlier chunks in the cache")
    p.add_argument("--preset", default="jalapeno-v1", help="chip preset (default jalapeno-v1)")
    add_key_value_option(p, "--set", dest="overrides", what="override chip spec fields",
                         examples=("hbm.efficiency=0.85", "core.count=4"))
    p.add_argument("--routing", default="uniform", choices=("uniform", "any"),
                   help="MoE expert slots: expected distinct experts under uniform routing "
                        "(default) or enough for any routing")
    p.add_argument("--fusion", choices=("none", "layer", "step"), default=None,
                   help="how launches join into programs: none (one per kernel), layer (one per "
                        "layer), step (one persistent program per step); default: the preset's "
                        "software.fusion (jalapeno-v1: step, GPU presets: none)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--trace", type=output_file,
                   help="write a Chrome/Perfetto trace JSON of the launches here")
    p.add_argument("--no-cache", action="store_true",
                   help="time fused programs afresh: neither read nor write the timing disk cache "
                        "($JALAPENO_EMU_CACHE_DIR, default ~/.cache/jalapeno-emu; a --trace "
                        "always times afresh)")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``layer`` and ``model`` commands."""
    p = sub.add_parser("layer", help="time one transformer layer as kernel launches (timing-only)")
    _common(p)
    p.add_argument("--layer", type=int, default=None,
                   help="layer index (default: the first full-attention layer, where the context "
                        "matters; gpt-oss's layer 0 has a sliding window)")
    p.add_argument("--path", action="store_true",
                   help="also show the layer's critical path: what waited on what, the µs each run "
                        "of instructions adds and the kernel line that issued it (JSON: "
                        "critical_path; times afresh, like --trace)")
    p.set_defaults(run=run_layer)
    p = sub.add_parser("model", help="time a whole model step: every layer, embedding and logits")
    _common(p)
    p.set_defaults(run=run_model)
    p = sub.add_parser("generate", help="run a tiny model on the die: prefill a prompt, decode tokens")
    p.add_argument("--model", default="tiny-gpt-oss", help="tiny-gpt-oss (default), tiny-deepseek, tiny-kimi")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (seeded random), default 32")
    p.add_argument("--tokens", type=int, default=16, help="tokens to generate, default 16")
    p.add_argument("--batch", type=int, default=1, help="sequences, default 1")
    p.add_argument("--chunk", type=int, default=0, help="prefill chunk (0: the whole prompt)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompt seed")
    p.add_argument("--preset", default="jalapeno-v1", help="chip preset (default jalapeno-v1)")
    p.add_argument("--check", action="store_true", help="run the pure-JAX reference alongside and "
                   "compare logits and greedy tokens at every step (exit 1 on a mismatch)")
    p.add_argument("--fusion", choices=("none", "layer", "step"), default=None,
                   help="run each step's launches one by one (none), one program per layer, or one "
                        "persistent program per step; default: the preset's software.fusion")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run_generate)


def _steps(args: argparse.Namespace) -> list[Any]:
    """The steps the options describe: one decode step, or the prefill chunks in order."""
    from jalapeno_emu.model import Step

    if args.phase == "decode":
        if args.seq is not None or args.chunk:
            raise Abort("--seq and --chunk are for --phase prefill; decode takes --context")
        return [Step("decode", batch=args.batch, context=8192 if args.context is None else args.context,
                     routing=args.routing)]
    if args.context is not None:
        raise Abort("--context is for --phase decode; prefill takes --seq (and --chunk)")
    seq = 8192 if args.seq is None else args.seq
    chunk = args.chunk or seq
    if chunk < 1 or seq < 1:
        raise Abort("--seq and --chunk must be positive")
    return [Step("prefill", batch=args.batch, seq=min(chunk, seq - p), prior=p, routing=args.routing)
            for p in range(0, seq, chunk)]


def _setup(args: argparse.Namespace) -> tuple[Any, Any, Any, list[Any]]:
    """(model config, chip spec with overrides, a fresh StepTimer, the steps) for layer/model."""
    from jalapeno_emu.model import load_model_config
    from jalapeno_emu.model.timing import StepTimer

    check_output_paths([args.trace], inputs=[args.model])  # --model may be a config.json
    cfg = load_model_config(args.model)
    spec = apply_overrides(load_preset(args.preset), args.overrides)
    return cfg, spec, StepTimer(spec), _steps(args)


def _disk_cache(args: argparse.Namespace) -> bool:
    """Whether fused timings come from (and go to) the disk cache: not with --no-cache, and not
    for a trace (a cached result keeps no timeline)."""
    return not args.no_cache and not args.trace and not getattr(args, "path", False)


def _us(t: float) -> str:
    return f"{t * 1e6:,.1f}"


def _cores(used: int | None, total: int) -> str:
    """``used/total`` cores, or blank for an entry without the figure."""
    return "" if used is None else f"{used}/{total}"


def _kernel_table(title: str, rows: list[dict[str, Any]], cores: int, *, fused: bool = False) -> Table:
    """One row per launch (or fused operator): time, bound, cores used of the chip's ``cores``,
    the engine with the largest share of the kernel's critical path, HBM and MXU figures."""
    table = Table(title=title)
    first, time = ("operator", "critical µs") if fused else ("launch", "time µs")
    for col, just in ((first, "left"), ("kernel", "left"), (time, "right"), ("bound", "left"),
                      ("cores", "right"), ("critical engine", "left"), ("HBM MB", "right"),
                      ("HBM util", "right"), ("MXU util", "right")):
        table.add_column(col, justify=just)
    for k in rows:
        table.add_row(k["label"], k["kernel"], _us(k["time_s"]), k["bound"],
                      _cores(k.get("cores_used"), cores), k.get("critical_engine") or "",
                      f"{k['hbm_bytes'] / 1e6:,.2f}", f"{k['hbm_utilization']:.1%}",
                      f"{k['mxu_utilization']:.1%}")
    return table


def first_full_attention_layer(cfg: Any) -> int:
    """The default ``layer --layer``: the first layer whose attention is full (no sliding window),
    where the context length shows in the time; layer 0 when every layer slides."""
    return next((i for i in range(cfg.layers) if cfg.window(i) == 0), 0)


def _print_why(app: App, doc: dict[str, Any], qualifier: str = "") -> None:
    """The document's ``why`` under a table, as one line (``why (last chunk): ...``)."""
    line = why_line(doc)
    if line is not None:
        app.console.print(line.replace("why:", f"why{qualifier}:", 1), markup=False, soft_wrap=True)


def run_layer(app: App, args: argparse.Namespace) -> int:
    """Time one layer for one step (prefill: every chunk, summed)."""
    from jalapeno_emu.model.fused_timing import sum_groups
    from jalapeno_emu.model.timing import (
        layer_critical_path,
        resolve_fusion,
        sum_timings,
        time_layer,
        write_layer_trace,
    )

    cfg, spec, timer, steps = _setup(args)
    fusion = resolve_fusion(args.fusion, spec)
    layer = first_full_attention_layer(cfg) if args.layer is None else args.layer
    chosen = " (the first full-attention layer; --layer picks another)" if args.layer is None else ""
    app.status(f"{cfg.name} layer {layer}{chosen} {args.phase} on {spec.name} (fusion {fusion})")
    timed = [time_layer(cfg, layer, s, timer=timer, fusion=fusion, disk_cache=_disk_cache(args))
             for s in steps]
    kernels = [k for lt in timed for k in lt.kernels]
    if fusion == "none":
        totals = sum_timings(kernels, spec)
    else:
        totals = timed[0].totals if len(timed) == 1 else \
            sum_groups(timed, sum(lt.time_s for lt in timed), spec, fusion)
    doc = {"model": cfg.name, "preset": spec.name, "layer": layer, "kind": timed[0].kind,
           "phase": args.phase, "batch": args.batch,
           "context": steps[0].context if args.phase == "decode" else None,
           "seq": sum(s.seq for s in steps) if args.phase == "prefill" else None,
           "chunks": len(steps), **totals,
           "kernels": [dict(k.as_dict(), chunk=c) for c, lt in enumerate(timed) for k in lt.kernels]}
    if args.path:
        doc["critical_path"] = [dict(r.as_dict(), chunk=c) for c, lt in enumerate(timed)
                                for r in layer_critical_path(lt)]
    if args.trace:
        if fusion == "none":
            write_layer_trace(timed, args.trace)
        else:  # the fused program's own timeline: one track per engine, every operator's instructions
            timed[0].timelines[0].write_chrome_trace(args.trace)
    if app.json_output:
        app.emit_json("layer", doc)
        if args.trace:
            trace_note(app, args.trace)
        return 0
    what = (f"batch {args.batch}, context {doc['context']}" if args.phase == "decode"
            else f"batch {args.batch}, {doc['seq']} tokens in {len(steps)} chunk(s)")
    which = ", the first full-attention layer" if args.layer is None else ""
    title = (f"{cfg.name} layer {layer} ({doc['kind']}{which}) {args.phase}, {what}, on {spec.name}, "
             f"fusion {fusion}")
    app.console.print(_kernel_table(title, doc["kernels"], spec.core.count, fused=fusion != "none"))
    lower = totals["lower_bound_s"]
    app.console.print(f"layer: {_us(totals['time_s'])} µs, {totals['bound']}-bound, "
                      f"{totals['hbm_bytes'] / 1e6:,.1f} MB from HBM at "
                      f"{totals['hbm_utilization']:.1%} of peak "
                      f"bandwidth, {totals['flops'] / 1e9:,.2f} GFLOP at {totals['mxu_utilization']:.1%} of "
                      f"peak MXFP4; roofline {_us(lower)} µs ({totals['time_s'] / lower:.2f}x)")
    _print_why(app, totals)
    if args.path:
        for c, lt in enumerate(timed):
            chunk = f", chunk {c}" if len(timed) > 1 else ""
            runs = [r for r in doc["critical_path"] if r["chunk"] == c]
            title = f"critical path of layer {layer}{chunk} ({_us(lt.time_s)} µs)"
            app.console.print(path_table(title, runs))
    if args.trace:
        trace_note(app, args.trace)
    return 0


def run_model(app: App, args: argparse.Namespace) -> int:
    """Time a whole step (prefill: every chunk)."""
    from jalapeno_emu.model.timing import resolve_fusion, time_model, write_layer_trace

    cfg, spec, timer, steps = _setup(args)
    fusion = resolve_fusion(args.fusion, spec)
    app.status(f"{cfg.name} {args.phase} step on {spec.name} (fusion {fusion})")
    reports = [time_model(cfg, s, timer=timer, fusion=fusion, disk_cache=_disk_cache(args)) for s in steps]
    docs = [r.as_dict() for r in reports]
    last = docs[-1]
    doc = dict(last)
    if len(docs) > 1:
        for key in ("time_s", "time_s_unconstrained", "hbm_bytes", "flops", "lower_bound_s"):
            doc[key] = None if any(d[key] is None for d in docs) else sum(d[key] for d in docs)
        doc["seq"] = sum(d["seq"] for d in docs)
        doc["prior"] = 0
        doc["chunks"] = docs
    if args.trace:
        if fusion == "none":
            groups = [lt for r in reports for lt in (r.head, *(g for _, g in r.groups), r.tail)]
            write_layer_trace(groups, args.trace)
        else:  # the first fused program timed (the whole step, or its first window)
            reports[0].head.timelines[0].write_chrome_trace(args.trace)
    if app.json_output:
        app.emit_json("model", doc)
        if args.trace:
            trace_note(app, args.trace)
        return 0
    table = Table(title=f"{cfg.name} {args.phase} (batch {args.batch}"
                  + (f", context {last['context']}" if args.phase == "decode" else f", {doc['seq']} tokens, "
                     f"{len(docs)} chunk(s); table: last chunk") + f") on {spec.name}")
    for col, just in (("layers", "left"), ("kind", "left"), ("count", "right"), ("µs each", "right"),
                      ("µs total", "right"), ("bound", "left"), ("cores", "right"), ("HBM util", "right"),
                      ("MXU util", "right")):
        table.add_column(col, justify=just)
    head = last["head"] | {"layers": ["embed"], "count": 1, "time_s_each": last["head"]["time_s"]}
    tail = last["tail"] | {"layers": ["norm+logits"], "count": 1, "time_s_each": last["tail"]["time_s"]}
    for g in [head, *last["layers"], tail]:
        idx = g["layers"]
        label = ",".join(map(str, idx)) if len(idx) <= 6 else f"{idx[0]},{idx[1]},...,{idx[-1]}"
        table.add_row(label, g["kind"], str(g["count"]), _us(g["time_s_each"]),
                      _us(g["time_s_each"] * g["count"]), g["bound"], _group_cores(g, spec.core.count),
                      f"{g['hbm_utilization']:.1%}", f"{g['mxu_utilization']:.1%}")
    app.console.print(table)
    fp = last["footprint"]
    cap = format_quantity(fp["capacity_bytes"], "B")
    app.console.print(f"HBM: weights {fp['weight_bytes'] / 1e9:,.1f} GB ({fp['weight_share']:.1%} of {cap}), "
                      f"KV cache {fp['kv_cache_bytes'] / 1e9:,.2f} GB ({fp['kv_share']:.1%})")
    if not last["fits_one_die"]:
        app.console.print(f"[bold yellow]{cfg.name} does not fit one die[/bold yellow]: "
                          f"{(fp['weight_bytes'] + fp['kv_cache_bytes']) / 1e9:,.1f} GB needed, "
                          f"{fp['capacity_bytes'] / 1e9:,.1f} GB available; the step time below assumes "
                          "unlimited HBM (the rack model maps it across chips)")
    t = doc["time_s_unconstrained"]
    tokens = args.batch * (1 if args.phase == "decode" else doc["seq"])
    app.console.print(f"step: {t * 1e3:,.3f} ms ({doc['bound']}-bound, fusion {fusion}), "
                      f"{tokens / t:,.0f} tok/s, HBM {doc['hbm_bytes'] / 1e9:,.2f} GB; roofline "
                      f"{doc['lower_bound_s'] * 1e3:,.3f} ms ({t / doc['lower_bound_s']:.2f}x); "
                      f"{last['distinct_launches']} distinct programs timed")
    _print_why(app, last, "" if len(docs) == 1 else " (last chunk)")
    if args.trace:
        trace_note(app, args.trace)
    return 0


def _group_cores(group: dict[str, Any], total: int) -> str:
    """The cores a group of layers' kernels used, of ``total``: ``2/2``, or the range over its
    kernels (``1-2/2``) when they differ."""
    used = sorted({k["cores_used"] for k in group.get("kernels", ()) if k.get("cores_used") is not None})
    if not used:
        return ""
    return f"{used[0]}/{total}" if len(used) == 1 else f"{used[0]}-{used[-1]}/{total}"


def run_generate(app: App, args: argparse.Namespace) -> int:
    """Functional generation on the die with per-step timing."""
    from rich.progress import Progress

    from jalapeno_emu.model import load_model_config
    from jalapeno_emu.model.generate import generate

    cfg = load_model_config(args.model)
    with Progress(console=app.err_console, transient=True, disable=app.json_output) as bar:
        task = bar.add_task(f"{cfg.name} on {args.preset}", total=None)
        gen = generate(cfg, prompt_len=args.prompt_len, tokens=args.tokens, batch=args.batch,
                       chunk=args.chunk,
                       seed=args.seed, preset=args.preset, check=args.check, fusion=args.fusion,
                       progress=lambda done, total: bar.update(task, completed=done, total=total))
    doc = gen.as_dict()
    failed = gen.check is not None and not gen.check["passed"]
    if app.json_output:
        app.emit_json("generate", doc)
        return 1 if failed else 0
    table = Table(title=f"{cfg.name} on {gen.preset} (fusion {gen.fusion}): {args.prompt_len}-token prompt, "
                  f"{args.tokens} tokens, "
                  f"batch {args.batch}")
    for col, just in (("step", "right"), ("phase", "left"), ("positions", "right"), ("token(s)", "left"),
                      ("die µs", "right"), ("bound", "left"), ("HBM util", "right"),
                      ("emulation s", "right")):
        table.add_column(col, justify=just)
    first_decode = len(doc["steps"]) - (gen.tokens.shape[1] - 1)
    for n, st in enumerate(doc["steps"]):
        tok = gen.tokens[:, n - first_decode + 1] if n >= first_decode - 1 else None
        shown = "" if tok is None else " ".join(map(str, tok))
        table.add_row(str(n), st["phase"], str(st["positions"]), shown,
                      _us(st["time_s"]), st["bound"], f"{st['hbm_utilization']:.1%}", f"{st['wall_s']:.2f}")
    app.console.print(table)
    if doc["decode_time_s_per_token"]:
        app.console.print(f"prefill {_us(doc['prefill_time_s'])} µs on the die; decode "
                          f"{_us(doc['decode_time_s_per_token'])} µs per token "
                          f"({1 / doc['decode_time_s_per_token']:,.0f} tok/s per sequence)")
    if gen.check is not None:
        c = gen.check
        verdict = "[green]passed[/green]" if c["passed"] else "[bold red]FAILED[/bold red]"
        app.console.print(f"check against the pure-JAX reference: {verdict}; logits rel. RMS <= "
                          f"{c['max_rel_rms']:.2%}, max error {c['max_abs_of_peak']:.2%} of the peak logit; "
                          f"greedy tokens identical: {c['tokens_identical']} (near-ties: {c['near_ties']})")
    return 1 if failed else 0
