"""`python -m gym_agent serve --name NAME --port PORT ...`: the same command as `ledger gym serve`."""

from cli.gym import app

app(prog_name="python -m gym_agent")
