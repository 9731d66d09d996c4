"""What a 200 answer holds: its media type, and its body held to its wire model.

A body that is not JSON, or fails its model, is a `BadResponseError` naming the agent and the call;
every reader of a 200 body in the client goes through `validated`, so the message reads the same
wherever the agent broke the contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from protocol.wire import validation_line
from trainer.gym.errors import BadResponseError
from trainer.gym.http_types import Reply

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def media_type(reply: Reply) -> bytes:
    content_type = next((v for k, v in reply.headers if k.lower() == b"content-type"), b"")
    return content_type.split(b";")[0].strip()


def parse(base_url: str, model: type[M], reply: Reply, what: str) -> M:
    return validated(base_url, model.model_validate_json, model.__name__, reply.body, what)


def validated(
    base_url: str, validate: Callable[[bytes | bytearray], T], name: str, body: bytes | bytearray, what: str
) -> T:
    """`validate(body)`: JSON decoding and the wire model in one pass (pydantic's, in Rust)."""
    try:
        return validate(body)
    except ValidationError as exc:
        if any(error["type"] == "json_invalid" for error in exc.errors()):
            raise BadResponseError(
                f"{base_url}{what}: HTTP 200 with a body that is not JSON: {bytes(body[:200])!r}",
                status_code=200,
            ) from None
        raise BadResponseError(
            f"{base_url} {what}: reply fails {name}: {validation_line(exc, name)}"
        ) from None
