"""The CLI starts without JAX: ``--help``, ``chip``, ``asm`` and ``disasm`` took 3-4 s of start-up
importing it (and ml_dtypes' extension through ``mx``) for nothing; commands that compute load it
when they run."""

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
                         check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_the_command_line_and_the_timing_pass_import_no_jax():
    loaded = _modules_after("import jalapeno_emu, jalapeno_emu.cli.main, jalapeno_emu.emu.timing, "
                            "jalapeno_emu.emu.check, jalapeno_emu.isa.asm, jalapeno_emu.chip")
    assert "jax" not in loaded and "jalapeno_emu.mx" not in loaded


def test_the_lazy_names_still_resolve():
    loaded = _modules_after("import jalapeno_emu as je, jalapeno_emu.emu as emu\n"
                            "assert je.mx.quantize.__module__ == 'jalapeno_emu.mx.quantize'\n"
                            "assert emu.run_functional.__name__ == 'run_functional'\n"
                            "assert 'Timeline' in dir(emu)")
    assert "jax" in loaded


def test_timing_a_layer_on_the_kernels_loads_no_jax():
    # The kernels' references and input generators need JAX; building and timing their programs
    # (model, layer, serve, sweep and their worker processes) must not pay its import.
    loaded = _modules_after(
        "from jalapeno_emu.chip import load_preset\n"
        "from jalapeno_emu.model import Step, load_model_config\n"
        "from jalapeno_emu.model.timing import time_layer\n"
        "import jalapeno_emu.kernels as k; k.all_kernels()\n"
        "t = time_layer(load_model_config('tiny-gpt-oss'), 0, Step('decode', 2, context=64), "
        "load_preset('jalapeno-v1'), fusion='step')\n"
        "assert t.time_s > 0")
    assert "jax" not in loaded
    # Nor ml_dtypes (0.5 s a process, each sweep worker's): formats and kernels load it on use.
    assert "ml_dtypes" not in loaded


def test_mx_formats_load_without_jax_and_the_rest_on_first_use():
    loaded = _modules_after("import jalapeno_emu.mx as mx\n"
                            "assert mx.element_format('fp4').bits == 4\n"
                            "assert 'quantize' in dir(mx)")
    assert "jax" not in loaded and "ml_dtypes" not in loaded
    loaded = _modules_after("import jalapeno_emu.mx as mx\n"
                            "assert mx.element_format('fp4').ml_dtype.__name__ == 'float4_e2m1fn'\n"
                            "assert mx.element_format('int8').ml_dtype.__name__ == 'int8'")
    assert "ml_dtypes" in loaded
    # a submodule loaded first must not take the place of the function of its name
    loaded = _modules_after("import jalapeno_emu.mx.quantize, jalapeno_emu.mx.matmul\n"
                            "import jalapeno_emu.mx as mx\n"
                            "assert callable(mx.quantize) and callable(mx.matmul)")
    assert "jax" in loaded


def _console(args: list[str], prelude: str = "") -> subprocess.CompletedProcess:
    code = (f"import sys\n{prelude}\nfrom jalapeno_emu.cli.main import console\n"
            f"sys.argv = ['jalapeno-emu', *{args!r}]\nconsole()")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)


def test_the_console_script_exits_at_once_with_its_status_its_output_and_its_exit_handlers():
    # exit handlers still run, and piped output is flushed before the process ends
    handler = "import atexit; atexit.register(lambda: print('handlers ran'))"
    ok = _console(["chip", "show", "tiny", "--json"], handler)
    assert ok.returncode == 0 and ok.stdout.rstrip().endswith("handlers ran")
    assert '"name": "tiny"' in ok.stdout and ok.stdout.index("}") < ok.stdout.index("handlers ran")
    bad = _console(["chip", "show", "no-such-chip"], handler)
    assert bad.returncode == 2 and "error:" in bad.stderr and "handlers ran" in bad.stdout
    # a thread still running: the ordinary exit, which waits for it
    waits = _console(["chip", "show", "tiny"], "import threading, time\n"
                     "threading.Thread(target=lambda: (time.sleep(0.5), print('thread done'))).start()")
    assert waits.returncode == 0 and "thread done" in waits.stdout


def test_a_profiled_run_exits_the_ordinary_way_so_the_profiler_can_write(tmp_path):
    # under a profiler, code after the command (the profiler's own dump) must still run
    code = ("import sys, cProfile\npr = cProfile.Profile(); pr.enable()\n"
            "from jalapeno_emu.cli.main import console\n"
            "sys.argv = ['jalapeno-emu', 'chip', 'show', 'tiny']\n"
            "try:\n    console()\nfinally:\n    pr.disable(); print('profile kept')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("profile kept")
    # `python -m cProfile -o F -m jalapeno_emu.cli.main ...` writes F
    out = tmp_path / "run.prof"
    run = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(out), "-m", "jalapeno_emu.cli.main",
                          "chip", "show", "tiny"], capture_output=True, text=True, check=False)
    assert run.returncode == 0 and out.stat().st_size > 0
