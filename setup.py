"""Package discovery only; everything else is in pyproject.toml.

`tui/` installs as `minivllm.tui`. setuptools' `packages.find` cannot add that prefix, so
the packages are found here: a new subpackage (such as `tui/widgets`) is never left out of
the wheel.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["minivllm", "minivllm.*"])
packages += [f"minivllm.{name}" for name in find_packages(include=["tui", "tui.*"])]

setup(packages=packages)
