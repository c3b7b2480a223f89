"""gptplan.paddlenlp_light: in a process that opted in, PaddleNLP's models and tokenizers
without its package __init__ (Taskflow, scikit-learn, the server...): the same classes, the same
version string, Paddle's signal handlers off as PaddleNLP leaves them; the whole import where
the light one fails and in any process that did not opt in."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_light_import_builds_every_family_and_leaves_the_rest_of_paddlenlp_out():
    proc = run_python("""
        import sys
        from gptplan import families, paddlenlp_light
        from runner import model

        paddlenlp_light.enable()
        transformers = paddlenlp_light.load()
        assert paddlenlp_light.is_light()
        for name in families.names():
            spec = families.get(name)
            for path in (spec.config_class, spec.causal_lm_class, spec.pipeline_class):
                if path:
                    assert model._import(path) is not None, path
        assert transformers.AutoModelForCausalLM and transformers.GPTChineseTokenizer
        from paddlenlp.utils.log import logger  # submodules import as usual
        import paddlenlp
        print("VERSION", paddlenlp.__version__)
        print("LEFT_OUT", [m for m in ("sklearn", "paddlenlp.taskflow", "paddlenlp.server",
                                       "paddlenlp.dataaug", "paddlenlp.trainer")
                           if m in sys.modules])
        # tensor parallel's seeds: the Trainer package (it imports scikit-learn), on demand
        assert callable(paddlenlp_light.trainer_utils().set_hyrbid_parallel_seed)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LEFT_OUT []" in proc.stdout, proc.stdout
    full = run_python("import paddlenlp; print('VERSION', paddlenlp.__version__)")
    assert full.returncode == 0, full.stderr[-3000:]
    version = [line for line in full.stdout.splitlines() if line.startswith("VERSION")]
    assert version and version[0] in proc.stdout.splitlines()


def test_paddles_signal_handlers_are_off_as_paddlenlp_leaves_them():
    """Paddle's import installs C handlers that turn SIGTERM into a C++ stack dump and an
    abort; PaddleNLP's __init__ turns them off, and so must the light import."""
    for setup in (
        "from gptplan import paddlenlp_light; paddlenlp_light.enable(); paddlenlp_light.load()",
        "import paddlenlp",
    ):
        proc = run_python(f"""
            import os, signal
            {setup}
            os.kill(os.getpid(), signal.SIGTERM)
        """)
        assert proc.returncode == -15, (setup, proc.returncode, proc.stderr[-2000:])
        assert "Signal" not in proc.stderr and "C++ Traceback" not in proc.stderr


def test_a_failing_light_import_falls_back_to_the_whole_package():
    proc = run_python("""
        import builtins, importlib, sys
        from gptplan import paddlenlp_light

        paddlenlp_light.enable()
        real = importlib.import_module
        def refuse(name, *args, **kwargs):
            if name == "paddlenlp.data" and "paddlenlp" in sys.modules and getattr(
                    sys.modules["paddlenlp"], "_gptplan_light", False):
                raise ImportError("simulated: another PaddleNLP")
            return real(name, *args, **kwargs)
        importlib.import_module = refuse
        transformers = paddlenlp_light.load()
        importlib.import_module = real
        assert not paddlenlp_light.is_light()
        assert "paddlenlp.taskflow" in sys.modules  # the whole package, its own way
        assert transformers.GPTForCausalLM
        print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_a_process_that_did_not_opt_in_imports_paddlenlp_whole():
    """A user's process (or the test runner) that imports runner or gptplan code keeps
    PaddleNLP's usual import: the Trainer imports directly, as it always did."""
    proc = run_python("""
        import sys
        from gptplan import paddlenlp_light
        from runner import model

        assert model._import("paddlenlp.transformers.gpt.modeling:GPTForCausalLM")
        assert not paddlenlp_light.is_light() and "paddlenlp.taskflow" in sys.modules
        from paddlenlp.trainer import TrainingArguments
        print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
