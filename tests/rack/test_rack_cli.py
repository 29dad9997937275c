"""``serve``, ``sweep`` and ``compare``: JSON contract fields, files written, one-line errors."""

import json
import re

import pytest

from jalapeno_emu.cli.main import main

TINY = ["--model", "tiny-gpt-oss", "--isl", "128", "--osl", "16"]


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("JALAPENO_EMU_CACHE_DIR", str(tmp_path / "cache"))


def test_serve_json_has_the_contract_fields(capsys):
    assert main(["serve", *TINY, "--concurrency", "2", "--mapping", "tp=2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["command"] == "serve" and doc["mapping"] == "tp=2,ep=1,dp=1,pp=1" and doc["chips"] == 2
    for key in ("interactivity_tok_s_user", "ttft_s", "tpot_s", "e2e_s", "throughput_tok_s_per_chip"):
        assert doc[key] > 0, key
    assert set(doc["tok_s_per_kw"]) == {"package", "sustained", "all_in"}
    assert doc["interactivity_tok_s_user"] == pytest.approx(1 / doc["tpot_s"])
    assert doc["kernel_limits"] == [] and doc["stack"] == "jalapeno" and doc["mtp"] is None


def test_serve_searches_a_mapping_when_none_is_given(capsys):
    assert (
        main(
            [
                "serve",
                *TINY,
                "--concurrency",
                "4",
                "--objective",
                "throughput",
                "--finalists",
                "1",
                "--no-cache",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tok/s/user" in out and "searched" in out and "mappings (analytic screen)" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mapping", "tp=x", "--concurrency", "1"], "tp='x' is not a positive integer"),
        (["--mapping", "tp=3", "--concurrency", "1"], "tp=3 must divide the 4 attention heads"),
        (["--concurrency", "1", "--routing", "zipf"], "is not 'uniform' or 'zipf:S'"),
        (["--concurrency", "0", "--mapping", "tp=1"], "concurrency=0 must be an integer >= 1"),
    ],
)
def test_serve_errors_are_one_line_exit_2(capsys, argv, message):
    assert main(["serve", *TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_serve_a_model_that_does_not_fit(capsys):
    assert main(["serve", "--model", "deepseek-r1", "--mapping", "tp=1", "--concurrency", "1"]) == 2
    assert "GB of weights per chip exceed" in capsys.readouterr().err


@pytest.mark.slow
def test_sweep_writes_plot_svg_csv_and_the_frontier(capsys, tmp_path):
    png = tmp_path / "front.png"
    csv = tmp_path / "points.csv"
    assert (
        main(
            [
                "sweep",
                *TINY,
                "--concurrency",
                "1,8",
                "--finalists",
                "1",
                "--plot",
                str(png),
                "--csv",
                str(csv),
                "--json",
                "--workers",
                "1",  # serial: process pools are tested once, in test_parallel_rack.py
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert png.stat().st_size > 0 and (tmp_path / "front.svg").stat().st_size > 0
    assert csv.read_text().count("\n") == len(doc["points"]) + 1
    assert doc["frontier"] and {p["concurrency"] for p in doc["points"]} == {1, 8}
    assert doc["candidates_screened"] >= len({p["mapping"] for p in doc["points"]})


def test_compare_reports_ratios_at_matched_concurrencies(capsys):
    assert (
        main(
            [
                "compare",
                *TINY,
                "--presets",
                "jalapeno-v1,h200",
                "--concurrency",
                "2",
                "--finalists",
                "1",
                "--json",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    row = doc["rows"][0]
    assert row["concurrency"] == 2 and not doc["errors"]
    ratio = row["ratios"]["h200"]
    assert ratio["interactivity"] == pytest.approx(
        row["jalapeno-v1"]["interactivity_tok_s_user"] / row["h200"]["interactivity_tok_s_user"]
    )


def test_compare_fails_loudly_for_a_preset_whose_kernels_refuse_the_model(capsys, tmp_path):
    # GPU presets whose shared memory is shrunk until no kernel tiling fits.
    paths = []
    for base in ("gb300-nvl72", "h200"):
        path = tmp_path / f"cramped-{base}.toml"
        path.write_text(f'inherits = "{base}"\nname = "cramped-{base}"\n[sram]\n'
                        'scratchpad_bytes = { value = "4KiB", assumed = "too small for any tiling" }\n')
        paths.append(str(path))
    args = ["compare", "--model", "gpt-oss-120b", "--presets", ",".join(paths), "--concurrency", "1",
            "--workers", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert re.search(r"cramped-gb300-nvl72.toml: kernel \S+ cannot run on cramped-gb300-nvl72", err), err
    assert re.search(r"cramped-h200.toml: kernel \S+ cannot run on cramped-h200", err), err


def test_serve_shows_the_kernel_programs_built_while_it_runs():
    import io
    import time
    from types import SimpleNamespace

    from rich.console import Console

    from jalapeno_emu.cli.app import App
    from jalapeno_emu.cli.rack import _builds_shown

    out = io.StringIO()
    app = App(err_console=Console(file=out, force_terminal=True, width=120))
    timer = SimpleNamespace(builds=0)
    with _builds_shown(app, timer, "m on p", every_s=0.01):
        for n in range(1, 30):
            timer.builds = n
            time.sleep(0.01)
    assert "m on p:" in out.getvalue() and "kernel programs built and timed" in out.getvalue()
    quiet = io.StringIO()
    quiet_app = App(json_output=True, err_console=Console(file=quiet, force_terminal=True))
    with _builds_shown(quiet_app, timer, "x", every_s=0.01):
        time.sleep(0.05)
    assert quiet.getvalue() == ""  # --json: nothing on stderr


def test_compare_at_an_interactivity_and_at_the_peak_reads_each_frontier(capsys):
    argv = ["compare", *TINY, "--presets", "jalapeno-v1,h200", "--concurrency", "1,4,16", "--finalists", "1",
            "--power", "all-in", "--json", "--workers", "1"]
    assert main([*argv, "--peak"]) == 0
    first = json.loads(capsys.readouterr().out)
    front = first["frontiers"]["jalapeno-v1"]
    assert len(front) >= 2
    x = (front[0]["interactivity_tok_s_user"] + front[1]["interactivity_tok_s_user"]) / 2
    assert main([*argv, "--interactivity", str(x), "--peak"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["power"] == "all_in" and doc["concurrencies"] == [1, 4, 16] and not doc["errors"]
    assert doc["frontiers"] == first["frontiers"]
    row = doc["interactivity"][0]
    for preset in ("jalapeno-v1", "h200"):
        front = doc["frontiers"][preset]
        xs = [p["interactivity_tok_s_user"] for p in front]
        assert xs == sorted(xs) and {p["concurrency"] for p in front} <= {1, 4, 16}
        got = row[preset]
        if len(got["from"]) == 2:  # x lies between two simulated points: linear between them
            lo, hi = got["from"]
            x0, x1 = lo["interactivity_tok_s_user"], hi["interactivity_tok_s_user"]
            assert x0 < x <= x1
            share = (x - x0) / (x1 - x0)
            for key in ("throughput_tok_s_per_chip", "tok_s_per_kw"):
                assert got[key] == pytest.approx(lo[key] + share * (hi[key] - lo[key]))
        elif x <= xs[0]:  # every point is fast enough: the peak
            assert got["throughput_tok_s_per_chip"] == front[0]["throughput_tok_s_per_chip"]
        else:  # no point is fast enough
            assert got["throughput_tok_s_per_chip"] is None and "no point reaches" in got["reason"]
        peak = doc["peak"][preset]
        assert peak["throughput_tok_s_per_chip"] == max(p["throughput_tok_s_per_chip"] for p in front)
        key = (peak["concurrency"], peak["mapping"])
        at = next(p for p in front if (p["concurrency"], p["mapping"]) == key)
        assert peak["tok_s_per_kw"] == pytest.approx(at["tok_s_per_kw"]["all_in"])
    assert len(row["jalapeno-v1"]["from"]) == 2
    if row["h200"]["tok_s_per_kw"] is not None:
        assert row["ratios"]["h200"]["tok_s_per_kw"] == pytest.approx(
            row["jalapeno-v1"]["tok_s_per_kw"] / row["h200"]["tok_s_per_kw"])


@pytest.mark.parametrize("argv, message", [
    (["--interactivity", "fast"], "--interactivity 'fast' must be a number"),
    (["--interactivity", "-5"], "must be a positive, finite number"),
    (["--power", "wall"], "invalid choice: 'wall'"),
])
def test_compare_frontier_errors_are_one_line(capsys, argv, message):
    assert main(["compare", *TINY, "--presets", "jalapeno-v1,h200", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_sweep_holds_one_mapping_at_every_concurrency(capsys):
    argv = ["sweep", *TINY, "--concurrency", "1,4", "--mapping", "tp=2", "--json", "--workers", "1"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mapping"] == "tp=2,ep=1,dp=1,pp=1" and doc["candidates_screened"] == 0
    assert sorted((p["concurrency"], p["mapping"]) for p in doc["points"]) == [
        (1, "tp=2,ep=1,dp=1,pp=1"), (4, "tp=2,ep=1,dp=1,pp=1")]


@pytest.mark.parametrize("argv, message", [
    (["--mapping", "tp=3"], "tp=3 must divide the 4 attention heads"),
    (["--mapping", "tp=2", "--chips", "4"], "--chips 4 disagrees with mapping tp=2,ep=1,dp=1,pp=1"),
])
def test_sweep_refuses_a_mapping_before_simulating(capsys, argv, message):
    assert main(["sweep", *TINY, "--concurrency", "1", *argv, "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_serve_with_mtp_reports_the_acceptance_model_and_what_it_bought(capsys):
    base = ["serve", *TINY, "--concurrency", "1", "--mapping", "tp=1", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--mtp", "2", "--mtp-acceptance", "0.9,0.8"]) == 0
    mtp = json.loads(capsys.readouterr().out)
    assert plain["mtp"] is None and plain["draft_tokens"] == 0 and plain["tokens_per_decode_step"] == 1.0
    assert mtp["mtp"] == {"draft_tokens": 2, "acceptance": [0.9, 0.8],
                          "expected_tokens_per_step": pytest.approx(1 + 0.9 + 0.72)}
    assert mtp["draft_tokens"] == 2 and 1.0 < mtp["tokens_per_decode_step"] <= 3.0
    assert mtp["interactivity_tok_s_user"] > plain["interactivity_tok_s_user"]


@pytest.mark.parametrize("argv, message", [
    (["--mtp", "9"], "--mtp 9: mtp=9: draft tokens per step must be an integer from 0 to 8"),
    (["--mtp", "1", "--mtp-acceptance", "0.9,0.8"], "2 mtp acceptance values for 1 draft tokens"),
    (["--mtp", "1", "--mtp-acceptance", "1.5"], "must be a probability in [0, 1]"),
])
def test_mtp_errors_are_one_line(capsys, argv, message):
    assert main(["serve", *TINY, "--concurrency", "1", "--mapping", "tp=1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_sweep_and_compare_report_where_a_kernel_bounded_the_points(capsys, tmp_path):
    # A GPU-like scratchpad for the tiny model: its routed-expert kernel takes 64 tokens per launch
    # and refuses 128, so a 128-token prompt's experts run in pieces.
    small = tmp_path / "small.toml"
    small.write_text('inherits = "tiny"\nname = "small"\n[sram]\n'
                     'scratchpad_bytes = { value = "96KiB", assumed = "GPU-like, for a tiny model" }\n')
    argv = ["sweep", *TINY, "--preset", str(small), "--mapping", "tp=1", "--concurrency", "1", "--json",
            "--workers", "1"]
    assert main(argv) == 0
    (line,) = json.loads(capsys.readouterr().out)["kernel_limits"]
    assert "refused 128 received tokens per launch on small" in line
    assert main([*argv[:-3], "--workers", "1"]) == 0  # the table, then the note
    assert "note: moe: the routed-expert kernel refused" in capsys.readouterr().out
    assert main(["compare", *TINY, "--presets", f"jalapeno-v1,{small}", "--concurrency", "1", "--peak",
                 "--finalists", "1", "--json", "--workers", "1"]) == 0
    limits = json.loads(capsys.readouterr().out)["kernel_limits"]
    assert limits["jalapeno-v1"] == [] and "refused 128" in limits[str(small)][0]
