"""What the tables and status lines show people (issue 13): times in µs rather than ``time_s
6.054e-06``, why a kernel takes its time, ``key=value`` settings rather than Python dicts, a line
saying where a trace went, headers that are not cut at 80 columns, and ``layer`` on a layer where
the context matters. ``--json`` keeps seconds."""

import json

import pytest
from rich.table import Table

from jalapeno_emu.cli.app import App
from jalapeno_emu.cli.human import key_values, mb, pct, us
from jalapeno_emu.cli.main import main

LAYER = ["--model", "tiny-gpt-oss", "--phase", "decode", "--context", "64", "--preset", "tiny"]


@pytest.fixture(autouse=True)
def _output_not_a_terminal(monkeypatch):
    """Captured output as a pipe sees it: no $COLUMNS (a test runner's workers may inherit one
    from the terminal that started them, and narrow tables cut the words checked here)."""
    monkeypatch.delenv("COLUMNS", raising=False)


def test_numbers_read_in_the_units_of_the_tables():
    assert (us(6.0538e-06), us(2e-06), us(0.015e-6), us(1234.5e-6)) == ("6.054", "2", "0.015", "1,234")
    assert (mb(95232), pct(0.0981), pct(0.00165), pct(5.95e-05), pct(0)) == \
        ("0.09523", "9.8%", "0.17%", "0.006%", "0.0%")
    assert key_values({"m": 16, "bias": True}) == "m=16 bias=True"


def test_the_kernel_table_is_in_microseconds_and_says_why(capsys, tmp_path):
    trace = tmp_path / "t.json"
    assert main(["kernel", "gemm", "--timing-only", "--trace", str(trace)]) == 0
    out, err = capsys.readouterr()
    assert "time_s" not in out and "e-0" not in out and " µs" in out
    for text in ("critical engine", "cores used", "2 of 2", "busiest dma engine busy",
                 "fixed costs on the critical path", "DMA set-up", "MXU utilisation",
                 "of the formats' peak", "\nwhy: ", "kernel notes: "):
        assert text in out, text
    assert f"trace written to {trace}: open it in https://ui.perfetto.dev" in out
    # the status line shows the shape as key=value, not as a dict
    assert "gemm m=16 n=256 k=512" in err and "{" not in err


def test_with_json_the_trace_line_goes_to_stderr_and_the_figures_stay_in_seconds(capsys, tmp_path):
    trace = tmp_path / "t.json"
    assert main(["kernel", "rmsnorm", "--timing-only", "--json", "--trace", str(trace)]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert 0 < doc["time_s"] < 1e-3 and f"trace written to {trace}" in err
    assert json.loads(trace.read_text())["traceEvents"]


def test_run_prints_microseconds_and_the_trace_line(capsys, tmp_path):
    from tests.cli.test_run import EXAMPLE

    trace = tmp_path / "t.json"
    assert main(["run", str(EXAMPLE), "--timing-only", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "time_s" not in out and " µs" in out and "\nwhy: latency-bound" in out
    assert f"trace written to {trace}" in out


def test_layer_defaults_to_the_first_full_attention_layer_and_shows_cores_and_why(capsys, tmp_path):
    trace = tmp_path / "l.json"
    assert main(["layer", *LAYER, "--fusion", "none", "--trace", str(trace)]) == 0
    out, err = capsys.readouterr()
    # tiny-gpt-oss alternates sliding (even) and full (odd) layers: layer 1 is the first full one
    assert "layer 1 (full moe, the first full-attention layer)" in out
    assert "cores" in out and "critical engine" in out and "\nwhy: " in out
    assert "trace written to" in out and "the first full-attention layer" in err
    assert main(["layer", *LAYER, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layer"] == 1
    assert main(["layer", *LAYER, "--layer", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"].startswith("sliding")


def test_model_table_shows_cores_and_why(capsys):
    assert main(["model", *LAYER]) == 0
    out = capsys.readouterr().out
    assert "cores" in out and "/2" in out and "\nwhy: " in out


def test_wide_tables_keep_their_headers_when_output_is_not_a_terminal(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    app = App()
    table = Table()
    for i in range(9):
        table.add_column(f"tok/s/user {i}")
    table.add_row(*["1,234,567"] * 9)
    app.console.print(table)
    out = capsys.readouterr().out
    assert all(f"tok/s/user {i}" in out for i in range(9)) and "…" not in out


@pytest.mark.parametrize("columns", ["60"])
def test_an_explicit_columns_setting_is_kept(monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    assert App().console.width == int(columns)


def _wide_table(columns: int) -> Table:
    table = Table(title="serving")
    for i in range(columns):
        table.add_column(f"tok/s/user {i}", justify="right")
    table.add_row(*[f"{1_234_567 + i:,}" for i in range(columns)])
    table.add_row(*[f"{7_654_321 + i:,}" for i in range(columns)])
    return table


def test_a_table_too_wide_for_a_narrow_terminal_prints_as_records(capsys, monkeypatch):
    # rich would cut every header and number to "tok/s…" / "1,234…" at 60 columns.
    monkeypatch.setenv("COLUMNS", "60")
    App().console.print(_wide_table(9))
    out = capsys.readouterr().out
    assert "…" not in out and "serving" in out
    for i in range(9):
        # each header once per row, each cell whole, in row order
        assert out.count(f"tok/s/user {i} ") == 2, out
        assert out.index(f"{1_234_567 + i:,}") < out.index(f"{7_654_321 + i:,}")


def test_a_table_that_fits_prints_as_a_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    App().console.print(_wide_table(3))
    out = capsys.readouterr().out
    assert "┃" in out or "│" in out, out  # the table's own frame: not turned into records
    assert out.count("tok/s/user 0") == 1


def test_a_whole_command_on_a_narrow_terminal_cuts_no_word(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "72")
    assert main(["model", *LAYER]) == 0
    out = capsys.readouterr().out
    # The status line ("... (fusion step)…") ends in an ellipsis of its own.
    cut = [line for line in out.splitlines() if "…" in line and "(fusion" not in line]
    assert not cut and "µs total" in out, cut
