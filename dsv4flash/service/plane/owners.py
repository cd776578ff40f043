"""Which tenant owns each training run: `<root>/service/owners.json`, rewritten atomically.

Runs are lifecycle policies; their checkpoints, samplers and futures belong to the run's tenant. A run with no
owner entry (a crash between creating the policy and recording its owner, or a policy made outside the server)
is visible to nobody through the server.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from dsv4flash.atomic_io import write_bytes_atomic


class RunOwners:
    """run id -> tenant, persisted next to the store."""

    def __init__(self, root: str | Path) -> None:
        self.path = Path(root) / "service" / "owners.json"
        self._lock = threading.Lock()
        self._owner: dict[str, str] = {}
        if self.path.exists():
            try:
                self._owner = {str(k): str(v) for k, v in json.loads(self.path.read_text())["runs"].items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{self.path}: not a run-owner registry (expected {{\"runs\": {{run: tenant}}}}): "
                                 f"{exc}") from exc

    def owner(self, run_id: str) -> str | None:
        """The tenant of a run, or None."""
        with self._lock:
            return self._owner.get(run_id)

    def claim(self, run_id: str, tenant: str) -> None:
        """Record a new run's tenant; a run already owned by another tenant raises."""
        with self._lock:
            current = self._owner.get(run_id)
            if current is not None and current != tenant:
                raise PermissionError(f"training run {run_id} belongs to another tenant")
            if current is None:
                self._owner[run_id] = tenant
                write_bytes_atomic(self.path, json.dumps({"runs": self._owner}, indent=1, sort_keys=True).encode())

    def runs_of(self, tenant: str) -> set[str]:
        """Every run of a tenant."""
        with self._lock:
            return {run for run, who in self._owner.items() if who == tenant}
