"""Training entry point: Hydra recipes (`recipes/`, typed by `schema.py`) dispatched to the local or veRL engine.

Importing this package is cheap; `dsv4flash.train.main` holds the Hydra app (`python -m dsv4flash.train`).
"""
