"""The real NeMo Gym 0.7.0 on loopback, shared by tests/realgym and `benchmarks.peer`: its environment
(`environment.py`), its resolved config (`gym_config.py`, `collector_config.py`), its servers
(`servers.py`) and the scripts they run in that environment (`stub_model.py`, `serve_agent.py`,
`serve_environment.py`)."""
