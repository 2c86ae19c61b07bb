"""Package discovery only; everything else is in pyproject.toml.

`kernels/` and `tui/` install as `minivllm.kernels` and `minivllm.tui` (DESIGN.md: a
top-level `kernels` would shadow Hugging Face's). setuptools' `packages.find` cannot add
that prefix, so the packages are found here: a new subpackage (such as `tui/widgets`) is
never left out of the wheel.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["minivllm", "minivllm.*"])
for folder in ("kernels", "tui"):
    packages += [f"minivllm.{name}" for name in find_packages(include=[folder, f"{folder}.*"])]

setup(packages=packages)
