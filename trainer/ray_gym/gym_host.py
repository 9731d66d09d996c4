"""Starts NeMo Gym's servers the way NeMo RL's `NemoGym._spinup` does, in a process of its own.

Run by the interpreter that has `nemo_gym` (NeMo RL's Gym venv, or this one), never imported:

    python gym_host.py < one JSON line: {"global_config": {...}, "dotenv_path": null | "..."}

It builds Gym's `GlobalConfigDictParserConfig` from the global config dict `LedgerGym` resolved
(NeMo RL's own keys: policy model name, key and base URLs, the head server, port range, ...), calls
Gym's `RunHelper().start(...)` (the head server in this process, one subprocess per server, each
waited for), prints one JSON line (`{"ready": true}`, or `{"error": "..."}`), then watches its servers
(`RunHelper.poll`, as `gym env start` does) until its standard input closes (the actor that started
it ended, however it ended) or it is sent SIGTERM/SIGINT, and shuts the servers down.  A server that
dies is reported on one JSON line (`{"died": "..."}`) and the host exits non-zero.

Only the standard library and `nemo_gym` are imported here: this file runs in Gym's environment.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

POLL_S = 1.0


# The actor reads this host's answers from the real stdout; everything Gym and its servers print goes
# to stderr (the actor's log file), so a pipe nobody drains can never block a server.
_ANSWERS = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr


def _say(**fields: Any) -> None:
    _ANSWERS.write(json.dumps(fields) + "\n")
    _ANSWERS.flush()


def main() -> int:
    request = json.loads(sys.stdin.readline())
    stop = threading.Event()

    def _eof() -> None:
        sys.stdin.read()  # returns when the parent closes the pipe or dies
        stop.set()

    threading.Thread(target=_eof, name="parent-watch", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    from nemo_gym.cli import RunHelper  # type: ignore[import-not-found, unused-ignore]
    from nemo_gym.global_config import (  # type: ignore[import-not-found, unused-ignore]
        GlobalConfigDictParserConfig,
    )
    from omegaconf import DictConfig  # type: ignore[import-not-found, unused-ignore]

    config = dict(request["global_config"])
    if not config.get("ray_head_node_address"):
        # No cluster to join (the actor's Ray runs another Python): Gym would start a whole Ray of its
        # own, dashboard and all; a small one serves the servers that use Ray the same way.
        import ray  # type: ignore[import-not-found, unused-ignore]

        ray.init(include_dashboard=False, num_cpus=1, log_to_driver=False)
        config["ray_head_node_address"] = ray.get_runtime_context().gcs_address
    dotenv = request.get("dotenv_path")
    helper = RunHelper()
    try:
        helper.start(
            global_config_dict_parser_config=GlobalConfigDictParserConfig(
                dotenv_path=Path(dotenv) if dotenv else None,
                initial_global_config_dict=DictConfig(config),
                skip_load_from_cli=True,
                skip_load_from_dotenv=not dotenv,
            )
        )
    except BaseException as exc:  # reported to the actor, which raises it
        _say(error=f"{type(exc).__name__}: {exc}"[:2000])
        return 2
    _say(ready=True)
    code = 0
    while not stop.wait(POLL_S):
        try:
            helper.poll()
        except RuntimeError as exc:
            _say(died=str(exc)[:2000])
            code = 3
            break
    helper.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
