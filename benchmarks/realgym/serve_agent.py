"""The real `simple_agent` with the participant mounted (runs in the nemo-gym 0.7.0 env, started like the
agent's own app.py: NEMO_GYM_CONFIG_DICT and NEMO_GYM_CONFIG_PATH set).  The agent's code is not
changed: its app is built as usual, and `mount_participant` is the one added call.

    PARTICIPANT_STATE_DIR=DIR python serve_agent.py
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from responses_api_agents.simple_agent.app import SimpleAgent

from participant import mount_participant


class ParticipatingSimpleAgent(SimpleAgent):
    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        mount_participant(
            app, agent_name=self.config.name, state_dir=Path(os.environ["PARTICIPANT_STATE_DIR"])
        )
        return app


if __name__ == "__main__":
    ParticipatingSimpleAgent.run_webserver()
