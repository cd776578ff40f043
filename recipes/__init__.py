"""The Hydra config tree of `python -m dsv4flash.train`, importable as `dsv4flash_recipes` (searchpath `pkg://`)."""
