"""Package layout: `dsv4flash` plus the checkpoint bridge folder `bridge/` imported as `dsv4flash_bridge`."""
from setuptools import find_packages, setup

_core = find_packages(include=["dsv4flash", "dsv4flash.*"])
# `bridge/` is a top-level folder, but a package named plain `bridge` would clash with other
# installs, so it is mapped to its own import name.
_bridge = ["dsv4flash_bridge" + name[len("bridge"):] for name in find_packages(include=["bridge", "bridge.*"])]

# The Hydra config tree `recipes/` ships as package data of `dsv4flash_recipes` (read as pkg://dsv4flash_recipes).
_recipes = ["dsv4flash_recipes" + name[len("recipes"):] for name in find_packages(include=["recipes", "recipes.*"])]

setup(packages=_core + _bridge + _recipes,
      package_dir={"dsv4flash_bridge": "bridge", "dsv4flash_recipes": "recipes"})
