"""`make gpu-check` selects its tests with `-k "cuda and not cudasim"`;
tools/count_cuda_tests.py counts the suite's CUDA-parametrized tests and fails
the run when that selection misses any. Collection needs no GPU, so the
counting is checked here: on the method test files (each must contribute CUDA
tests, all selected) and on a made-up suite whose CUDA ids the selection misses."""
import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTER = os.path.join(ROOT, "tools", "count_cuda_tests.py")
METHOD_FILES = ["test_d2cache.py", "test_dare.py", "test_kvq_decode.py", "test_trace.py",
                "test_kvq_select.py", "test_decode.py", "test_dream_confidence_threshold.py"]


def _count(*args, cwd=ROOT):
    r = subprocess.run([sys.executable, COUNTER, "--json", "--check", *args], capture_output=True,
                       text=True, cwd=cwd, timeout=600)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def test_every_method_file_has_cuda_tests_and_gpu_check_selects_them():
    rc, result = _count(*[os.path.join(ROOT, "python_tests", f) for f in METHOD_FILES])
    assert rc == 0 and result["problems"] == [] and result["unselected"] == []
    counts = {os.path.basename(f): n for f, n in result["files"].items()}
    assert sorted(counts) == sorted(METHOD_FILES)
    for name, n in counts.items():
        assert n["cuda"] > 0 and n["selected"] == n["cuda"], (name, n)


def test_a_selection_that_misses_cuda_tests_fails(tmp_path):
    """Ids that hide the device ("gpu") leave a CUDA test unselected; a test named
    for CUDA without the parameter is selected but is not one of them."""
    (tmp_path / "test_made_up.py").write_text(textwrap.dedent('''\
        import pytest

        @pytest.mark.parametrize("device", ["cpu", "cuda"])
        def test_named(device):
            pass

        @pytest.mark.parametrize("model_device", ["cpu", "cuda"], ids=["host", "gpu"])
        def test_hidden(model_device):
            pass

        def test_cuda_build_flag():
            pass

        @pytest.mark.slow
        @pytest.mark.parametrize("backend", ["cpu", "sim", "cuda"])
        def test_slow(backend):
            pass
        '''))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    rc, result = _count(str(tmp_path), cwd=str(tmp_path))
    assert rc == 1
    assert (result["cuda"], result["selected"]) == (2, 2)      # the slow test is not counted
    assert result["unselected"] == ["test_made_up.py::test_hidden[gpu]"]
    assert result["problems"] == ['1 of the 2 CUDA-parametrized tests are not selected by '
                                  '-k "cuda and not cudasim", e.g. test_made_up.py::test_hidden[gpu]']
    rc, result = _count(str(tmp_path), "-k", "nothing_matches", cwd=str(tmp_path))
    assert rc == 1 and result["selected"] == 0
    assert result["problems"][0] == '-k "nothing_matches" selects no test'
