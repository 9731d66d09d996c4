"""The image and the compose file keep their promises: every extra the image's commands use is
installed and its torch build is checked; no compose agent listens beyond loopback without a token,
and the trainer sends the same one."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "LEDGER_GYM_TOKEN"


def test_the_image_installs_every_extra_and_checks_its_torch_build() -> None:
    text = (ROOT / "Dockerfile").read_text()
    [extras] = re.findall(r"-e '\.\[([a-z,]+)\]'", text)
    assert {"all", "ray", "metrics", "otel"} <= set(extras.split(","))
    assert "ARG TORCH_BUILD=cpu" in text and "torch.version.cuda" in text


def test_the_image_copies_every_package_the_project_installs() -> None:
    """An editable install of a package the image never copied imports nowhere: a command in the
    image would fail at its first import of it."""
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    packages = {name.rstrip("*") for name in found["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "Dockerfile").read_text(), re.MULTILINE))
    assert packages <= copied, sorted(packages - copied)


def test_compose_agents_beyond_loopback_want_the_token_the_trainer_sends() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    agents = {n: s for n, s in services.items() if s.get("command", [])[1:3] == ["gym", "serve"]}
    assert agents
    for name, service in agents.items():
        argv = service["command"]
        host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
        if host != "127.0.0.1":
            assert TOKEN in service.get("environment", {}), name
            assert "--token" not in argv  # never on a command line (a process listing shows it)
    trainers = [s for s in services.values() if s.get("command", [])[1:2] == ["simulate"]]
    assert trainers and all(TOKEN in s.get("environment", {}) for s in trainers)
