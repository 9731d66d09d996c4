"""`python -m gym_agent serve --name NAME --port PORT ...`: the same command as `ledger gym serve`."""

from gym_agent.cli import app

app(prog_name="python -m gym_agent")
