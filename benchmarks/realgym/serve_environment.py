"""The real `legacy_agent` environment server with the participant mounted (runs in the nemo-gym 0.7.0
env, started like its own app.py: NEMO_GYM_CONFIG_DICT and NEMO_GYM_CONFIG_PATH set).  This is the path
a 0.7.0 deployment puts in front of an agent that still owns its episode through `/run`: the trainer
talks to the environment server, which relays `/run` to the agent.  The participant wraps the relay,
so the agent behind it stays a plain one; `mount_participant` is the one added call.

    PARTICIPANT_STATE_DIR=DIR python serve_environment.py
"""

from __future__ import annotations

import os
from pathlib import Path

from environment_servers.legacy_agent.app import LegacyAgentEnvironmentServer
from fastapi import FastAPI

from participant import mount_participant


class ParticipatingLegacyAgent(LegacyAgentEnvironmentServer):
    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        mount_participant(
            app, agent_name=self.config.name, state_dir=Path(os.environ["PARTICIPANT_STATE_DIR"])
        )
        return app


if __name__ == "__main__":
    ParticipatingLegacyAgent.run_webserver()
