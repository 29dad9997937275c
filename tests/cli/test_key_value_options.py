"""Issue 13: ``--shape`` and ``--set`` take ``k=v k=v``, repeated flags and ``k=v,k=v`` alike."""

import json

import pytest

from jalapeno_emu.cli.main import build_parser, main
from jalapeno_emu.cli.options import split_items
from jalapeno_emu.kernels import get_kernel

FORMS = {
    "repeated": ["--shape", "m=1", "--shape", "n=64", "--shape", "act_fmt=e4m3"],
    "one-flag": ["--shape", "m=1", "n=64", "act_fmt=e4m3"],
    "commas": ["--shape", "m=1,n=64,act_fmt=e4m3"],
    "mixed": ["--shape", "m=1", "n=64", "--shape", "act_fmt=e4m3"],
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_shape_form_gives_the_same_shape(form):
    args = build_parser().parse_args(["kernel", "gemm", *FORMS[form], "--timing-only"])
    assert args.name == "gemm" and args.timing_only
    assert args.shape == ["m=1", "n=64", "act_fmt=e4m3"]
    shape = get_kernel("gemm").shape(texts=args.shape)
    assert (shape["m"], shape["n"], shape["act_fmt"]) == (1, 64, "fp8e4")


COMMANDS = {  # every command with --set, positional arguments first
    "chip show": ["chip", "show", "tiny"],
    "bench hbm": ["bench", "hbm"],
    "bench mxu": ["bench", "mxu"],
    "run": ["run", "k.jasm"],
    "kernel": ["kernel", "gemm"],
    "layer": ["layer", "--model", "tiny-gpt-oss", "--phase", "decode"],
    "model": ["model", "--model", "tiny-gpt-oss", "--phase", "decode"],
}
SETS = [
    ["--set", "core.count=4", "hbm.efficiency=0.5"],
    ["--set", "core.count=4", "--set", "hbm.efficiency=0.5"],
    ["--set", "core.count=4,hbm.efficiency=0.5"],
]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_set_form_gives_the_same_overrides(command):
    for sets in SETS:
        args = build_parser().parse_args([*COMMANDS[command], *sets])
        assert args.overrides == ["core.count=4", "hbm.efficiency=0.5"], sets
    assert build_parser().parse_args(COMMANDS[command]).overrides == []  # and the default is fresh


def test_chip_show_output_is_the_same_for_each_set_form(capsys):
    outputs = []
    for sets in SETS:
        assert main(["chip", "show", "tiny", *sets, "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1] == outputs[2]


def test_commas_split_only_a_list_of_key_values():
    assert split_items("m=1,n=2") == ["m=1", "n=2"]
    assert split_items("m=1") == ["m=1"]
    assert split_items("name=a,b") == ["name=a,b"]  # 'b' is no item: left to the key's parser
    assert split_items("m=1,") == ["m=1,"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["kernel", "gemm", "--shape", "m"], "'m' must look like key=value, e.g. m=1"),
        # A positional written after the list would be swallowed by it: said so, not misparsed.
        (["kernel", "--shape", "m=1", "gemm"], "'gemm' must look like key=value, e.g. m=1; arguments "
                                               "that are not key=value go before --shape"),
        (["chip", "show", "--set", "core.count=4", "tiny"],
         "arguments that are not key=value go before --set"),
        (["kernel", "gemm", "--shape", "act_fmt=fp16"], "fp8e4 (or e4m3), fp4 (or e2m1)"),
    ],
)
def test_bad_items_are_one_line_errors(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and message in captured.err, captured.err
    assert captured.err.strip().count("\n") == 0 and captured.out == ""
