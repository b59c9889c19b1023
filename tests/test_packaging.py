"""The release scripts' refusals (scripts/bootstrap.sh, scripts/build_wheel.sh, setup.py without an
importable torch): each says why and changes nothing. Their working paths run in CI: bootstrap.sh on every fresh machine, build_wheel.sh
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
