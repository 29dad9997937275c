"""The legality checker: every check reads the table, and every failure says what and where."""

import dataclasses
import subprocess
import sys
import warnings

import pytest

from jalapeno_emu.errors import IllegalInstruction
from jalapeno_emu.isa import TABLE, by_mnemonic, check_instruction, check_legality
from jalapeno_emu.isa.legality import canonical, check_rule
from jalapeno_emu.isa.program import Engine, Instruction, Program, Tile
from jalapeno_emu.isa.table import InstrSpec, OperandSpec, Space
from tests.isa.forms import engines_for, legal_form

SRAM, HBM, ACC = Space.SRAM, Space.HBM, Space.ACC
C0_MXU, C0_VPU, C0_DMA = Engine(0, "mxu"), Engine(0, "vpu"), Engine(0, "dma", 0)


def _t(space, off, dtype, rows, cols, core=0, stride=-1):
    return Tile(space, core, off, dtype, rows, cols, stride)


def _matmul(**changes):
    args = {"acc": _t(ACC, 0, "f32", 32, 64), "a": _t(SRAM, 0, "fp4", 32, 64),
            "b": _t(SRAM, 0x400, "fp4", 64, 64), "a_scale": _t(SRAM, 0x800, "e8m0", 32, 2),
            "b_scale": _t(SRAM, 0x880, "e8m0", 2, 64),
            "mode": "overwrite"}
    args.update(changes)
    return Instruction("mxu.matmul", C0_MXU, tuple(args.items()), "gemm.py:42")


def _fails(ins, match, index=None):
    with pytest.raises(IllegalInstruction, match=match) as info:
        check_instruction(ins, index=index)
    return info.value


@pytest.mark.parametrize("spec", TABLE, ids=lambda s: s.mnemonic)
def test_every_row_has_a_legal_form_on_each_engine_kind_it_allows(spec):
    for engine in engines_for(spec):
        check_instruction(legal_form(spec, engine))


@pytest.mark.parametrize("spec", TABLE, ids=lambda s: s.mnemonic)
def test_every_row_refuses_the_engines_its_unit_does_not_run_on(spec):
    ins = legal_form(spec)
    for engine in (Engine(0, "dma", 0), Engine(0, "mxu"), Engine(0, "vpu"), Engine(-1, "link")):
        if spec.unit in ("any", engine.unit):
            check_instruction(dataclasses.replace(ins, engine=engine))
        else:
            _fails(dataclasses.replace(ins, engine=engine), f"{spec.mnemonic} runs on a {spec.unit} engine")


def test_the_brief_example_matmul_is_legal_and_rule_failures_quote_values():
    check_instruction(_matmul())
    err = _fails(_matmul(b=_t(SRAM, 0x400, "fp4", 32, 64), b_scale=_t(SRAM, 0x880, "e8m0", 1, 64)),
                 r"rule `a\.cols == b\.rows` fails: a\.cols=64, b\.rows=32", index=5)
    assert err.index == 5 and err.engine == "c0.mxu" and err.source == "gemm.py:42"
    assert "instruction #5 on c0.mxu (gemm.py:42)" in str(err) and "isa/README.md" in err.hint


def test_rule_messages_show_absent_tiles_and_strings():
    _fails(_matmul(a_scale=None), r"rule `\(a\.dtype == 'bf16'\) == \(a_scale is None\)` fails: "
                                  r"a\.dtype='fp4', a_scale=None")
    _fails(_matmul(a_scale=_t(SRAM, 0x800, "e8m0", 32, 1)),
           r"a_scale\.shape=\(32, 1\), a\.rows=32, a\.cols=64")


def test_unknown_mnemonic_suggests_close_matches():
    err = _fails(Instruction("mxu.matmull", C0_MXU, ()), "unknown mnemonic 'mxu.matmull'")
    assert err.hint.startswith("did you mean mxu.matmul")  # mxu.matmul_t is close too


def test_wrong_unit_hint_names_the_engine_to_use():
    err = _fails(dataclasses.replace(_matmul(), engine=Engine(3, "vpu")),
                 "runs on a mxu engine, not on c3.vpu")
    assert err.hint == "issue it to c3.mxu"
    link = Instruction("link.send", C0_DMA, (("src", _t(HBM, 0, "f32", 1, 64)), ("peer", 0), ("tag", 1)))
    assert _fails(link, "runs on a link engine").hint == "issue it to link"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((("sem", 1), ("count", 1), ("extra", 2)), "sem.signal has no operand 'extra'"),
        ((("count", 1),), "sem.signal is missing operand sem"),
        ((("sem", 1), ("sem", 2)), "operand sem is given twice"),
        ((("sem", 1.0),), "operand sem must be an integer, got 1.0"),
        ((("sem", True),), "operand sem must be an integer, got True"),
        ((("sem", -1),), r"sem=-1 must be a semaphore id in \[0, 4294967295\]"),
        ((("sem", 1), ("count", 2**63)), "count=9223372036854775808 must be a signed 64-bit integer"),
        ((("sem", 1), ("count", 0)), r"rule `count >= 1` fails: count=0"),
        ((("sem", 1), ("count", "2")), "operand count must be an integer, got '2'"),
    ],
)
def test_operand_names_kinds_and_ranges(args, match):
    _fails(Instruction("sem.signal", C0_VPU, args), match)


def test_tile_space_dtype_and_enum_choices():
    s = _t(SRAM, 0, "f32", 8, 8)
    _fails(Instruction("vec.unary", C0_VPU, (("op", "exp"), ("dst", _t(HBM, 0, "f32", 8, 8)), ("src", s))),
           "operand dst is in hbm, but vec.unary takes it from sram")
    _fails(Instruction("vec.unary", C0_VPU, (("op", "exp"), ("dst", _t(SRAM, 0, "i32", 8, 8)), ("src", s))),
           "operand dst has dtype i32, not one of f32, bf16, f16")
    err = _fails(Instruction("vec.unary", C0_VPU, (("op", "exq"), ("dst", s), ("src", s))),
                 "operand op='exq' is not one of copy, exp")
    assert err.hint == "did you mean exp?" and err.operand == "op"
    _fails(Instruction("vec.unary", C0_VPU, (("op", 1), ("dst", s), ("src", s))), "must be one of copy")
    _fails(Instruction("vec.unary", C0_VPU, (("op", "exp"), ("dst", 5), ("src", s))),
           "dst must be a tile, got 5")
    _fails(Instruction("vec.clamp", C0_VPU, (("dst", s), ("src", s), ("lo", "x"), ("hi", 1.0))),
           "operand lo must be a number")
    _fails(Instruction("dma.load", C0_DMA, (("dst", s), ("src", _t(HBM, 0, "f32", 8, 8, core=2)))),
           "HBM tile with core 2")


def test_numbers_of_any_integral_or_real_type_are_accepted():
    np = pytest.importorskip("numpy")
    s = _t(SRAM, 0, "f32", 8, 8)
    check_instruction(Instruction("sem.signal", C0_VPU, (("sem", np.int64(3)), ("count", np.int32(2)))))
    check_instruction(Instruction("vec.clamp", C0_VPU,
                                  (("dst", s), ("src", s), ("lo", -7), ("hi", np.float32(7)))))


def test_optional_operands_may_be_omitted_and_canonical_fills_them_in_table_order():
    s = _t(SRAM, 0, "bf16", 32, 32)
    ins = Instruction("mxu.matmul", C0_MXU, (("b", s), ("a", s), ("acc", _t(ACC, 0, "f32", 32, 32))))
    check_instruction(ins)
    assert canonical(ins).args == (("acc", _t(ACC, 0, "f32", 32, 32)), ("a", s), ("b", s), ("a_scale", None),
                                   ("b_scale", None), ("mode", "accumulate"))
    assert canonical(Instruction("sem.signal", C0_MXU, (("sem", 2), ("count", None)))).args == (
        ("sem", 2), ("count", 1))


@pytest.mark.parametrize(
    ("engine", "match"),
    [
        (Engine(-1, "mxu"), "engine core -1 must be a non-negative integer"),
        (Engine(0, "dma", -2), "engine queue -2 must be a non-negative integer"),
        (Engine(0, "mxu", 1), "only DMA engines have queues"),
        (Engine(0, "link"), "the link engine is chip-level"),
        (Engine(0, "tpu"), "engine unit 'tpu' is not one of"),
    ],
)
def test_check_legality_rejects_malformed_engines_with_the_index(engine, match):
    good = Instruction("sem.signal", C0_MXU, (("sem", 0), ("count", 1)))
    program = Program("p", (good, dataclasses.replace(good, engine=engine)))
    with pytest.raises(IllegalInstruction, match=match) as info:
        check_legality(program)
    assert info.value.index == 1


def test_check_legality_accepts_legal_programs():
    check_legality(Program("p", tuple(legal_form(s) for s in TABLE)))


def test_rules_cannot_run_code():
    spec = InstrSpec("x.y", 0xFE, "any", (OperandSpec("a", "imm"),), "sync", "")
    for rule in ("__import__('os').system('true')", "a.__class__", "[a][0] == 1", "(lambda: 1)()",
                 "a if a else 1", "b == 1", "a ** 2 == 1"):
        with pytest.raises(ValueError):
            check_rule(spec, rule, {"a": 1, "core": 0})
    assert check_rule(spec, "-a < 0 and not a == 2", {"a": 1, "core": 0}) is None


def test_a_rule_that_cannot_evaluate_is_reported_not_raised():
    spec = InstrSpec("x.y", 0xFE, "any", (OperandSpec("t", "tile", optional=True),), "sync", "")
    text = check_rule(spec, "t.rows == 1", {"t": None, "core": 0})
    assert text.startswith("rule `t.rows == 1` fails: t=None (AttributeError")


def test_every_table_rule_compiles_and_names_only_operands():
    for spec in TABLE:
        env = dict(legal_form(spec).args, core=0)
        for rule in spec.rules:
            assert check_rule(spec, rule, env) is None, (spec.mnemonic, rule)


def test_by_mnemonic_and_the_package_exports():
    import jalapeno_emu.isa as isa

    assert by_mnemonic("mxu.matmul").opcode == 0x10
    for name in isa.__all__:
        assert getattr(isa, name) is not None, name


def test_importing_program_first_does_not_cycle():
    code = ("import jalapeno_emu.isa.program as p; import jalapeno_emu.isa as isa; "
            "print(len(isa.assemble('c0.mxu: sem.signal 1').instructions))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr[-2000:]


def test_the_old_name_check_program_warns_and_still_checks():
    # jalapeno_emu.isa.check_program was the legality checker's name, and jalapeno_emu.emu has a
    # check_program too (the full checker): the old name keeps working, with a warning naming both.
    import jalapeno_emu.isa as isa

    program = Program("p", tuple(legal_form(s) for s in TABLE))
    with pytest.warns(DeprecationWarning, match=r"isa\.check_legality.*emu\.check_program"):
        isa.check_program(program)
    bad = Program("p", (Instruction("sem.signal", Engine(0, "dma", 0), (("sem", -1), ("count", 1))),))
    with pytest.warns(DeprecationWarning), pytest.raises(IllegalInstruction):
        isa.check_program(bad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        isa.check_legality(program)  # the new name does not warn
