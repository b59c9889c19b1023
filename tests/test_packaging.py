"""The release scripts' refusals (scripts/bootstrap.sh, scripts/build_wheel.sh, setup.py without an
importable torch): each says why and changes nothing. setup.py's builds are incremental, and a
CPU run's test summary says what its skipped cases are. Their working paths run in CI: bootstrap.sh on every fresh machine, build_wheel.sh
cpu in scripts/check_packaging.sh, whose wheel the whole suite is then run against."""

import os
import subprocess
import sys
import venv

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")


def _run(args, env=None, timeout=120):
    env = env if env is not None else {**os.environ, "PYTHON": sys.executable}  # the scripts' interpreter: this one
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_bootstrap_installs_no_torch_when_no_cpu_build_is_reachable(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PYTHON=python, PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull)  # no index, no local wheels
    done = _run([os.path.join(SCRIPTS, "bootstrap.sh")], env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no CPU build of torch==2.13.0 is reachable" in done.stderr and "nothing installed" in done.stderr
    assert subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0


def _variant_this_torch_cannot_build() -> tuple[str, str]:
    kind = "rocm" if torch.version.hip else "cuda" if torch.version.cuda else "cpu"
    return ("rocm", kind) if kind != "rocm" else ("cuda", kind)


def test_build_wheel_refuses_a_variant_the_installed_torch_cannot_build(tmp_path):
    variant, kind = _variant_this_torch_cannot_build()
    done = _run([os.path.join(SCRIPTS, "build_wheel.sh"), variant, ROOT, str(tmp_path / "dist")])
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"a {variant} wheel needs a {'ROCm' if variant == 'rocm' else 'CUDA'} build of torch; this torch is {kind}" \
        in done.stderr
    assert not (tmp_path / "dist").exists()


@pytest.mark.parametrize("args", [[], ["metal"]])
def test_build_wheel_names_the_variants(args, tmp_path):
    done = _run([os.path.join(SCRIPTS, "build_wheel.sh"), *args])
    assert done.returncode != 0
    assert "cpu|cuda|rocm" in done.stderr or "variant must be cpu, cuda or rocm, got 'metal'" in done.stderr



def test_setup_py_without_an_importable_torch_says_to_build_without_isolation(tmp_path):
    # What an isolated build (`pip install .` without --no-build-isolation) sees: torch is not a
    # build requirement, so it is not importable there.
    shadow = tmp_path / "torch"
    shadow.mkdir()
    (shadow / "__init__.py").write_text('raise ImportError("No module named torch")\n')
    done = subprocess.run([sys.executable, os.path.join(ROOT, "setup.py"), "--version"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "pip install --no-build-isolation ." in done.stderr and "RL_ENGINE_EXT_NO_NATIVE=1" in done.stderr


def test_setup_py_compiles_in_the_trees_build_folder_whatever_the_command(tmp_path):
    """An editable install (pip install -e .) builds in the tree's build/temp.* folder, where ninja's
    objects of the last build are, not in the temporary folder setuptools gives it: a rebuild of an
    unchanged tree compiles nothing (scripts/bootstrap.sh)."""
    import setuptools  # noqa: F401  (first: distutils is then setuptools' own, as in setup.py and pip's build)
    from distutils.core import run_setup

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        dist = run_setup(os.path.join(ROOT, "setup.py"), script_args=["build_ext"], stop_after="commandline")
    finally:
        os.chdir(cwd)
    if not dist.ext_modules:
        pytest.skip("no native build here (RL_ENGINE_EXT_NO_NATIVE=1)")
    dist.get_command_obj("build").build_temp = str(tmp_path)  # what setuptools' editable_wheel sets
    build_ext = dist.get_command_obj("build_ext")
    build_ext.editable_mode = True
    build_ext.ensure_finalized()
    assert os.path.dirname(build_ext.build_temp) == os.path.join(ROOT, "build")
    assert os.path.basename(build_ext.build_temp).startswith("temp.")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA cases run here")
def test_summary_counts_the_skipped_cuda_cases_and_torch_jit_stays_quiet():
    """pytest's summary on a machine without CUDA says how many CUDA cases it skipped and why
    (tests/conftest.py), and the deprecated torch.jit calls inside torch that torch.compile and
    forward-mode AD trigger print no warning."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(ROOT, "tests", "test_registry.py"),
         "-k", "rms_norm and (meta_tensors_give or graph_recorded_only or torch_compile_fullgraph)"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 CUDA cases skipped: no CUDA device" in done.stdout and "6 skipped" in done.stdout, done.stdout  # rms_norm, add_rms_norm
    assert "DeprecationWarning" not in done.stdout + done.stderr, done.stdout + done.stderr
