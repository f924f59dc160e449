"""The wheel's build step beyond pyproject.toml: eaglex's kernel library (kernels/, tools/build_kernels.sh) compiled
with this machine's compiler and shipped beside eaglex/runtime/kernels.py. Where it cannot be built, the wheel
says so in one line and goes without it: its engines then run on ONNX Runtime's stock ops."""
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
LIBRARY = "libeaglex_kernels.so"


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        out = HERE / "build" / "kernels"
        built = subprocess.run([str(HERE / "tools" / "build_kernels.sh"), str(out)], cwd=HERE).returncode == 0
        if built and (out / LIBRARY).is_file():
            dest = Path(self.build_lib) / "eaglex" / "runtime" / LIBRARY
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(out / LIBRARY, dest)


setup(cmdclass={"build_py": BuildPyWithKernels})
