"""The wheel's one build step beyond pyproject.toml: compile the native CPU kernels into the package, so an
installed server does not compile them at its first start. Where no compiler works, the wheel goes without, and
the server compiles them at run time (or says what their absence costs)."""

import importlib.util
import shutil
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
SOURCES_MODULE = ROOT / "oai_gemma" / "engine" / "ops" / "native" / "sources.py"
VERSION_MODULE = ROOT / "oai_gemma" / "version.py"


def _by_path(path: Path):
    """A module of the package by its path (stdlib only): importing the package would import torch, which the build
    need not have."""
    spec = importlib.util.spec_from_file_location(f"oai_gemma_build_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # a checkout compiles at run time, into the model cache
            return
        commit = _by_path(VERSION_MODULE).git_commit(ROOT)
        if commit:  # what `oai-gemma --version` and /v1/server_info say once installed (version.BUILD_COMMIT)
            (Path(self.build_lib) / "oai_gemma" / "BUILD_COMMIT").write_text(commit + "\n")
        sources = _by_path(SOURCES_MODULE)
        prebuilt = Path(self.build_lib) / sources.PREBUILT.relative_to(ROOT)
        shutil.rmtree(prebuilt, ignore_errors=True)  # an earlier build's library for other sources
        for family in sources.FAMILIES:
            try:
                path = sources.compile_into(prebuilt, family)
            except sources.CompileFailed as why:
                self.warn(f"the native {family} kernels are not in this wheel ({why}); the server compiles them at its first start")
            else:
                self.announce(f"compiled the native {family} kernels into {path}", level=2)


class PlatformDistribution(Distribution):
    """The wheel carries a compiled library, so it is tagged for this platform, not as pure Python."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=PlatformDistribution)
