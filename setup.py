"""Only what pyproject.toml cannot say: a non-editable install (`pip install .`, the Docker images)
also builds the fast CPU forward's kernels, one library per ISA variant, into the installed
package (kernels/prebuilt), so a runtime without a C compiler serves on them. A variant the
compiler cannot build is skipped with a message; no compiler at all leaves the worker to build
at start or fall back to the reference forward (kernels/cpu_build.py). Editable installs get
theirs from `make setup`."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # the source tree, for kernels/
        from kernels import cpu_build  # stdlib only

        target = Path(self.build_lib) / "kernels"
        cpu_build.prebuild(target / "prebuilt", sources_dir=target)


setup(cmdclass={"build_py": BuildPyWithKernels})
