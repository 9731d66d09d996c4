"""The participant library on its own: mounted onto a small FastAPI Gym-like agent (its code untouched),
served by uvicorn on loopback; and the trainer's reduced mode against the same agent without it."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from participant import mount_participant, read_evidence
from payloads.token_arrays import TokenArrays
from protocol.routes import RoutesText
from protocol.tokens import token_records_from_reply
from protocol.wire import ADOPT_ONLY_HEADER, RunRequest, TokenEntry, gym_reply
from tests.gym.conftest import token_entries
from trainer.gym import GoneError, GymClient, NotFoundError, verify_receipt
from trainer.gym.errors import AgentServerError
from trainer.gym.reduced import REDUCED_GENERATION, NotParticipantError


def gym_like_agent(calls: list[dict[str, Any]]) -> FastAPI:
    """A Gym agent as the real one answers: `{responses_create_params, response, reward}` plus the row's
    own fields, token arrays on the one item each model call returned."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"mine": "yes"}

    @app.post("/run")
    async def run(request: Request) -> JSONResponse:
        body = await request.json()
        calls.append(body)
        if body.get("expected_answer") == "fail":
            # A Gym server's answer to an exception: HTTP 500 with the error as a JSON string.
            return JSONResponse("RuntimeError('model server answered 500')", status_code=500)
        call = {"type": "function_call", "id": "fc", "call_id": "c1", "name": "f", "arguments": "{}"}
        message = {"type": "message", "id": "m", "role": "assistant", "content": []}
        output = [
            {
                **call,
                "prompt_token_ids": [1],
                "generation_token_ids": [2, 3],
                "generation_log_probs": [-1.0, -2.0],
            },
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"type": "reasoning", "id": "r", "summary": []},
            {
                **message,
                "prompt_token_ids": [4],
                "generation_token_ids": [5],
                "generation_log_probs": [-0.5],
                "routed_experts": [[[1, 2]]],
            },
        ]
        return JSONResponse(
            {
                **body,
                "response": {"id": f"resp-{len(calls)}", "model": "m", "output": output},
                "reward": 1,
            }
        )

    return app


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def row(rid: str, n: int = 0, answer: str = "42") -> RunRequest:
    """A NeMo RL row: the Gym's own fields ride along, the task's at the top level."""
    return RunRequest.model_validate(
        {
            "_ng_rollout_id": rid,
            "_ng_attempt_index": n,
            "responses_create_params": {"input": "hi"},
            "agent_ref": {"type": "responses_api_agents", "name": "a"},
            "_ng_task_index": 3,
            "_ng_rollout_index": 1,
            "expected_answer": answer,
        }
    )


async def test_mounted_agent_answers_the_protocol(tmp_path: Path) -> None:
    calls: list[dict[str, Any]] = []
    app = gym_like_agent(calls)
    participant = mount_participant(app, agent_name="a", state_dir=tmp_path)
    with serve(app) as url:
        async with GymClient(url, "a") as client:
            caps = await client.connect()
            assert client.reduced is None and "checkpoint_participation" in caps.features
            reply = await client.run(row("g_g0"))
            # The agent saw the row as sent, extras included; the reply keeps them.
            assert calls[0]["agent_ref"] == {"type": "responses_api_agents", "name": "a"}
            assert reply.model_extra is not None and reply.model_extra["_ng_task_index"] == 3
            receipt = await client.completion_receipt("g_g0", 0)
            verify_receipt(reply, receipt)
            assert receipt.execution_generation == participant.generation >= 1
            tokens = await token_entries(client, "g_g0")
            assert (
                [t.model_call_id for t in tokens]
                == ["call-1", "call-2"]
                == ["call-1", receipt.terminal_model_call_id]
            )
            # A call's output items exclude the tool output and keep no token arrays.
            assert [i["type"] for i in tokens[1].output_items] == ["reasoning", "message"]
            assert tokens[1].token_item_index == 1 and tokens[1].routed_experts == [[[1, 2]]]
            assert all("generation_token_ids" not in i for t in tokens for i in t.output_items)
            # A re-sent /run replays; the agent ran it once.
            assert (await client.run(row("g_g0"))).digest() == reply.digest()
            assert len(calls) == 1
            [ack] = await client.acknowledge([receipt])
            assert ack.acknowledged
            # The agent's own routes are its own.
            assert httpx.get(url + "/health").json() == {"mine": "yes"}
    evidence = read_evidence(tmp_path)
    assert (
        evidence.counts()["executions"] == 1 and not evidence.stranded and evidence.duplicate_executions == 0
    )


async def test_the_reply_kept_is_the_agents_own_body_validated(tmp_path: Path) -> None:
    """The participant keeps the reply as it parsed it, its token arrays not copied: what it answers, and
    the digest its receipt names, are those of the agent's own body validated the copying way (the
    integer reward a float, the small logprobs in json's form)."""

    def agent() -> FastAPI:
        app = FastAPI()

        @app.post("/run")
        async def run(request: Request) -> JSONResponse:
            item = {"type": "message", "id": "m", "role": "assistant", "content": [],
                    "prompt_token_ids": [1, 2], "generation_token_ids": [3, 4, 5],
                    "generation_log_probs": [-1e-05, -2.5e-07, -0.125], "routed_experts": [[[0, 1]]] * 3}  # fmt: skip
            body = {**(await request.json()), "response": {"id": "r", "model": "m", "output": [item]}}
            return JSONResponse({**body, "reward": 1})

        return app

    with serve(agent()) as plain:
        own = httpx.post(plain + "/run", json=row("k_g0").model_dump(mode="json", by_alias=True)).json()
    expected = gym_reply(own, "k_g0", 0).payload()
    mounted = agent()
    mount_participant(mounted, agent_name="a", state_dir=tmp_path)
    with serve(mounted) as url:
        async with GymClient(url, "a") as client:
            reply = await client.run(row("k_g0"))
            receipt = await client.completion_receipt("k_g0", 0)
    assert reply.payload() == expected and type(reply.reward) is float
    verify_receipt(reply, receipt)
    assert receipt.result_digest == gym_reply(expected, "k_g0", 0).digest()


async def test_a_moe_replys_router_choices_are_held_as_their_text_and_answered_as_lists(
    tmp_path: Path,
) -> None:
    """A mounted agent's reply with router choices of many tokens (a MoE model's, one list a token) is
    parsed with them held as their text (`protocol.routes.RoutesText`: no small list a token), and
    everything the participant answers is what the lists give: the reply, its digest, the token
    records as JSON and in the trainer's binary form."""
    routes = [[[t % 61, (t * 7) % 64]] for t in range(300)]

    def agent() -> FastAPI:
        app = FastAPI()

        @app.post("/run")
        async def run(request: Request) -> JSONResponse:
            item = {"type": "message", "id": "m", "role": "assistant", "content": [],
                    "prompt_token_ids": [1, 2], "generation_token_ids": list(range(300)),
                    "generation_log_probs": [-0.5] * 300, "routed_experts": routes}  # fmt: skip
            body = {**(await request.json()), "response": {"id": "r", "model": "m", "output": [item]}}
            return JSONResponse({**body, "reward": 1})

        return app

    with serve(agent()) as plain:
        own = httpx.post(plain + "/run", json=row("e_g0").model_dump(mode="json", by_alias=True)).json()
    expected = gym_reply(own, "e_g0", 0)
    mounted = agent()
    participant = mount_participant(mounted, agent_name="a", state_dir=tmp_path)
    with serve(mounted) as url:
        async with GymClient(url, "a") as client:
            completed = await client.run_completed(row("e_g0"))
            receipt = await client.completion_receipt("e_g0", 0)
            as_json = httpx.get(url + "/token_capture/" + receipt.manifest_capture_key).json()
            [held] = participant.registry.token_capture(receipt.manifest_capture_key)
    assert type(held.routed_experts) is RoutesText  # held as text, not as 300 lists
    assert completed.reply.payload() == expected.payload()
    verify_receipt(completed.reply, receipt)
    assert receipt.result_digest == expected.digest()
    [record] = as_json
    assert record["routed_experts"] == routes
    assert isinstance(completed.tokens, TokenArrays)
    assert [r["routed_experts"] for r in completed.tokens.to_records()] == [routes]


async def test_adopt_only_never_starts_a_try_and_evidence_survives_restarts(tmp_path: Path) -> None:
    calls: list[dict[str, Any]] = []
    first = gym_like_agent(calls)
    g1 = mount_participant(first, agent_name="a", state_dir=tmp_path).generation
    with serve(first) as url:
        async with GymClient(url, "a") as client:
            await client.run(row("x_g0"))
            answer = httpx.post(
                url + "/run",
                json=row("never_g0").model_dump(mode="json", by_alias=True),
                headers={ADOPT_ONLY_HEADER: "1"},
            )
            assert answer.status_code == 404 and answer.json()["error"] == "not_found"
            assert len(calls) == 1
    # A restart: the new process (the next generation) has no record of x_g0 and will not run it on
    # adoption.
    second = gym_like_agent(calls)
    restarted = mount_participant(second, agent_name="a", state_dir=tmp_path)
    g2 = restarted.generation
    assert g2 == g1 + 1
    with serve(second) as url:
        async with GymClient(url, "a") as client:
            with pytest.raises(GoneError):  # its predecessor's try: done for good here
                await client.run(row("x_g0"), adopt_only=True)
            assert len(calls) == 1
            retired = await client.retire("x_g0", 0)
            assert retired.done and retired.execution_generation == g2
            assert retired.execution_incarnation == restarted.incarnation
            with pytest.raises(NotFoundError):  # a try nobody ever ran: adopt-only never starts it
                await client.run(row("other_g0"), adopt_only=True)
            # The first process completed x_g0 and nobody released it before the restart took it.
    evidence = read_evidence(tmp_path)
    assert evidence.generations == [g1] and evidence.newest_generation == g2
    assert all(t.started == [g1] for t in evidence.tries.values())  # the restarted one started nothing
    x = evidence.tries[("x_g0", 0)]
    assert x.started == [g1] and x.completed == [g1] and x.outstanding
    assert evidence.duplicate_executions == 0 and not evidence.stranded
    assert [t.rollout_id for t in evidence.lost_in_restart] == ["x_g0"]


async def test_a_restarted_agent_never_runs_a_try_again(tmp_path: Path) -> None:
    """A try its predecessor ran is refused (410) by the restarted process, even without the adopt-only
    mark: the agent executes each try at most once over all its lives."""
    calls: list[dict[str, Any]] = []
    generations = []
    for life in range(2):
        app = gym_like_agent(calls)
        generations.append(mount_participant(app, agent_name="a", state_dir=tmp_path).generation)
        with serve(app) as url:
            async with GymClient(url, "a") as client:
                if life == 0:
                    await client.run(row("twice_g0"))
                else:
                    with pytest.raises(GoneError):
                        await client.run(row("twice_g0"))
    assert len(calls) == 1
    evidence = read_evidence(tmp_path)
    assert not evidence.executed_twice and evidence.duplicate_executions == 0
    assert not evidence.stranded  # generation 1's copy went with it
    assert [t.rollout_id for t in evidence.lost_in_restart] == ["twice_g0"]


@pytest.mark.parametrize(
    ("field", "needle"),
    [
        ('"seed": 1180591620717411303424', "outside the 64-bit range"),
        ('"meta": {"x": [NaN]}', "which JSON cannot carry"),
        ('"meta": 1e999', "which JSON cannot carry"),
        ('"reward": NaN', "finite number"),
    ],
    ids=["integer-past-64-bits", "nested-NaN", "1e999", "NaN-reward"],
)
async def test_a_reply_with_a_number_json_cannot_carry_fails_the_try_at_the_agent(
    tmp_path: Path, field: str, needle: str
) -> None:
    """A wrapped agent answering such a number (Python's json writes them all) gives no reply.  Before,
    an integer past 64 bits completed the try with a reply orjson could never write: every `/run` of it
    a 500, the result stranded at the agent for ever; a nested NaN reached the trainer as `null`."""
    app = FastAPI()

    @app.post("/run")
    async def run(request: Request) -> Response:
        row = {**(await request.json()), "response": {"id": "r1", "model": "m", "output": []}, "reward": 1}
        return Response(json.dumps(row)[:-1] + ", " + field + "}", media_type="application/json")

    mount_participant(app, agent_name="a", state_dir=tmp_path)
    with serve(app) as url:
        async with GymClient(url, "a") as client:
            await client.connect()
            with pytest.raises(AgentServerError, match="execution_failed") as failed:
                await client.run(row("n_g0"))
    assert needle in str(failed.value) and "answered no reply" in str(failed.value)
    assert "\n" not in str(failed.value)  # one line, not pydantic's several
    evidence = read_evidence(tmp_path)
    assert evidence.counts()["failed"] == 1 and not evidence.stranded


async def test_a_checkpoint_that_cannot_be_written_is_a_json_500(tmp_path: Path) -> None:
    state = tmp_path / "state"
    app = gym_like_agent([])
    mount_participant(app, agent_name="a", state_dir=state)
    (state / "checkpoints").write_text("a file where the directory should be")
    with serve(app) as url:
        assert httpx.post(url + "/checkpoint/prepare", json={"checkpoint_id": "c1"}).status_code == 200
        answer = httpx.post(url + "/checkpoint/commit", json={"checkpoint_id": "c1"})
        assert answer.status_code == 500
        assert answer.json()["error"] == "checkpoint_write_failed"
        assert httpx.get(url + "/status").json()["phase"] == "prepared"  # nothing published
        assert httpx.post(url + "/checkpoint/abort", json={"checkpoint_id": "c1"}).json()["phase"] == "idle"


async def test_reduced_mode_against_a_plain_agent(tmp_path: Path) -> None:
    calls: list[dict[str, Any]] = []
    with serve(gym_like_agent(calls)) as url:
        async with GymClient(url, "a") as client:
            await client.connect()
            assert client.reduced is not None and not client.checkpoint_participant
            reply = await client.run(row("p_g0"))
            # The row reached the agent as NeMo RL sends it: the task's fields at the top level.
            assert calls[-1]["expected_answer"] == "42" and "task" not in calls[-1]
            receipt = await client.completion_receipt("p_g0", 0)
            verify_receipt(reply, receipt)
            assert receipt.execution_generation == REDUCED_GENERATION
            assert len(await client.token_capture("p_g0")) == 2
            retired = await client.retire("p_g0", 0)
            assert retired.completed_unacknowledged
            # Adoption replays the trainer's own copy: no second POST.
            assert (await client.run(row("p_g0"), adopt_only=True)).digest() == reply.digest()
            assert len(calls) == 1
            with pytest.raises(NotFoundError):
                await client.run(row("q_g0"), adopt_only=True)
            assert (await client.retire("q_g0", 0)).tombstoned
            # POSTed, and the agent answered 500: done there (it keeps nothing), never "not started".
            with pytest.raises(AgentServerError):
                await client.run(row("f_g0", answer="fail"))
            failed = await client.retire("f_g0", 0)
            assert (failed.done, failed.tombstoned) == (True, False)
            assert "500" in client.reduced.retire_detail("f_g0", 0)
            assert client.reduced.retire_detail("q_g0", 0) == ""  # never POSTed
            calls.pop()
            with pytest.raises(NotParticipantError):
                await client.prepare("c1")
            [ack] = await client.acknowledge([receipt])
            assert ack.acknowledged and len(calls) == 1


def test_token_records_follow_the_real_gyms_rules() -> None:
    base: dict[str, Any] = {
        "rollout_id": "k",
        "model_call_id": "call-1",
        "model": "m",
        "prompt_token_ids": [1],
        "generation_token_ids": [2],
        "generation_log_probs": [-1.0],
        "output_items": [{"type": "message"}],
        "created_at": 0.0,
    }
    assert TokenEntry.model_validate(base | {"token_item_index": 0}).token_item_index == 0
    bad: dict[str, Any]
    for bad in (
        {"token_item_index": 1},
        {"generation_log_probs": []},
        {"schema_version": 2},
    ):
        with pytest.raises(ValidationError):
            TokenEntry.model_validate(base | bad)
    reply = gym_reply(
        {"response": {"output": [{"type": "message", "generation_token_ids": [1]}]}, "reward": 0}, "k", 0
    )
    with pytest.raises(ValueError, match="lacks"):
        token_records_from_reply(reply, "k", 0.0)


def test_every_start_is_a_new_incarnation_and_a_lost_state_directory_counts_from_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer tells processes apart by incarnation (equality), never by ordering generations: a
    restart on the same state directory is the next generation, one on a fresh directory starts at 1
    again, whatever the clock says (a day ahead at the first start here), and each is a new incarnation."""
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + 86_400 * 10**9)
    monkeypatch.setattr(time, "time", lambda: real() / 1e9 + 86_400)
    first = mount_participant(gym_like_agent([]), agent_name="a", state_dir=tmp_path / "old")
    monkeypatch.undo()
    again = mount_participant(gym_like_agent([]), agent_name="a", state_dir=tmp_path / "old")
    lost = mount_participant(gym_like_agent([]), agent_name="a", state_dir=tmp_path / "new")
    assert (first.generation, again.generation, lost.generation) == (1, 2, 1)
    assert len({first.incarnation, again.incarnation, lost.incarnation}) == 3
    counter, incarnation, _checksum = (tmp_path / "old" / "generation").read_text().split(" ")
    assert (counter, incarnation) == ("2", again.incarnation)
