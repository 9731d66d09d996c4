"""A local Ray whose daemons listen on loopback only (tests, `ledger simulate --ray`, the benchmark).

`ray.init()` on Linux advertises the machine's outward address and its GCS, raylet and worker gRPC
servers listen on every interface, even with `_node_ip_address="127.0.0.1"` (Ray turns a loopback
address into the outward one).  Ray picks loopback for everything only when it believes it runs
outside a cluster, which `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` tells it; Ray reads that when it is
first imported, so it is set before the import here, and checked after the start by the address the
GCS advertises.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Final

LOOPBACK_ENV: Final = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK_HOSTS: Final = ("127.0.0.1", "::1", "localhost")


class RayNotLoopback(RuntimeError):
    """Ray came up on an address other than loopback (it was imported before it could be told)."""


def prepare_loopback() -> None:
    """Before `import ray`: makes the next local Ray bind and advertise loopback only."""
    os.environ[LOOPBACK_ENV] = "0"


def init_local_ray(**kwargs: Any) -> None:
    """`ray.init(**kwargs)` of a new local Ray on loopback; `RayNotLoopback` (and Ray shut down again)
    when it came up elsewhere.  `runtime_env.env_vars` gets the loopback setting too, so a worker
    that starts a Ray of its own (NeMo Gym's head server does) stays on loopback as well."""
    already = "ray" in sys.modules
    prepare_loopback()
    import ray

    runtime_env = dict(kwargs.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), LOOPBACK_ENV: "0"}
    kwargs.setdefault("include_dashboard", False)
    ray.init(runtime_env=runtime_env, **kwargs)
    address = str(ray.get_runtime_context().gcs_address or "")
    host = address.rpartition(":")[0].strip("[]")
    if host not in LOOPBACK_HOSTS:
        ray.shutdown()
        hint = " (ray was imported before prepare_loopback(); call it first)" if already else ""
        raise RayNotLoopback(f"the local Ray came up on {address}, not on loopback{hint}")
