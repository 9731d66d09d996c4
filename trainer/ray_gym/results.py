"""One sealed attempt as NeMo RL's per-row result, in the types NeMo RL reads (its `NemoGym` actor's).

NeMo RL's `run_async_nemo_gym_rollout` (`nemo_rl/experience/rollouts.py`) and the single controller's
`_result_to_completion` (`nemo_rl/experience/rollout_manager.py`) read, per row:

- `message_log`: per model call a `user` message (the prompt tokens not seen before) and an
  `assistant` message (the generated tokens, `generation_logprobs`, and the two flags grpo.py's
  reward penalties read: `is_invalid_tool_call`, `has_malformed_thinking`); `token_ids` and
  `generation_logprobs` are torch tensors, and with router replay each message carries its slice of
  `routed_experts` (`[tokens, moe_layers, topk]`);
- `input_message_log`: the first message;
- `full_result`: the Gym's reply with the row's task fields, where NeMo RL looks for
  `instance_config.mask_sample` (the sample stays in its group for advantages, out of the loss) and
  `reward`; the row's own `_ng_rollout_id` (when NeMo RL set one) is kept, and the ledger's attempt is
  named beside it (`_ledger_rollout_id`, `_ledger_attempt_index`).

Built from what the log holds: the reply and the attempt's token records, read by the seal's claims
from the payload plane as arrays (`payloads.token_arrays.TokenArrays`, views of the stored payload):
each message's tensors are made from those arrays in one vectorised copy each (int64 ids, float32
logprobs, the dtypes NeMo RL's tensors have), never through a Python object per token.  The rules
are NeMo RL's, restated here from its documented behaviour: a model call with no generated tokens is
no turn; turns must extend one another; a NaN logprob is refused; a tool-call pattern in the final
text marks an invalid tool call; a thinking tag in a final answer, or repeated in a reasoning
summary, marks malformed thinking.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from payloads.token_arrays import TokenArrays, decode_arrays
from protocol.lineage import LineageError
from protocol.token_codec import TokenCodecError, encode_records
from protocol.wire import TokenEntry
from trainer.ray_gym.rows import PER_ROW_KEYS
from trainer.settings import log as logger

LEDGER_ROLLOUT_ID: Final = "_ledger_rollout_id"
LEDGER_ATTEMPT_INDEX: Final = "_ledger_attempt_index"
# The reply's own identity keys on the ledger's wire (the attempt, not NeMo RL's row).
_WIRE_IDS: Final = ("_ng_rollout_id", "_ng_attempt_index")
# Token arrays NeMo RL's actor takes off the reply's output items before it hands `full_result` on.
_TOKEN_ARRAYS: Final = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts")
DEFAULT_INVALID_TOOL_CALL_PATTERNS: Final = (
    "<tool_call>",
    "</tool_call>",
    "<function_call>",
    "</function_call>",
)
DEFAULT_THINKING_TAGS: Final = ("<think>", "</think>")
# The router-replay envelope NeMo RL's model server writes: "nrlre1:<dtype>:<S>x<L>x<K>:<base64>".
_ROUTES_MAGIC: Final = "nrlre1"
_ROUTES_DTYPES: Final = ("int8", "int16", "int32")


class ResultDataError(ValueError):
    """A sealed attempt NeMo RL could not train on (no generated turn, turns that do not extend one
    another, NaN logprobs, malformed routes): deterministic, so NeMo RL classes it as data."""


@dataclass(frozen=True)
class ResultRules:
    """The `NemoGymConfig` keys that shape a result (NeMo RL's names)."""

    invalid_tool_call_patterns: tuple[str, ...] = DEFAULT_INVALID_TOOL_CALL_PATTERNS
    thinking_tags: tuple[str, ...] = DEFAULT_THINKING_TAGS
    routed_experts_dtype: str = "int16"
    require_routed_experts: bool = False
    token_capture: bool = False

    @classmethod
    def of(cls, cfg: Mapping[str, Any]) -> ResultRules:
        dtype = str(cfg.get("routed_experts_dtype") or "int16")
        if dtype not in _ROUTES_DTYPES:
            raise ValueError(f"routed_experts_dtype {dtype!r} is none of {', '.join(_ROUTES_DTYPES)}")
        capture = cfg.get("token_capture") or {}
        return cls(
            invalid_tool_call_patterns=tuple(
                cfg.get("invalid_tool_call_patterns") or DEFAULT_INVALID_TOOL_CALL_PATTERNS
            ),
            thinking_tags=tuple(cfg.get("thinking_tags") or DEFAULT_THINKING_TAGS),
            routed_experts_dtype=dtype,
            require_routed_experts=bool(cfg.get("require_routed_experts")),
            token_capture=bool(isinstance(capture, Mapping) and capture.get("enabled")),
        )


def flags(item: Mapping[str, Any], rules: ResultRules) -> tuple[bool, bool]:
    """(is_invalid_tool_call, has_malformed_thinking) of the output item that ended a model call."""
    content, summary = item.get("content"), item.get("summary")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        if isinstance(text, str):
            # A final answer: any thinking tag in it leaked out of the reasoning.
            return (
                any(p in text for p in rules.invalid_tool_call_patterns),
                any(t in text for t in rules.thinking_tags),
            )
    if item.get("type") == "reasoning" and isinstance(summary, list) and summary:
        first = summary[0]
        text = first.get("text") if isinstance(first, dict) else None
        if isinstance(text, str):
            # A reasoning summary holds one pair of tags; more is malformed.
            return (
                any(p in text for p in rules.invalid_tool_call_patterns),
                any(text.count(t) > 1 for t in rules.thinking_tags),
            )
    return False, False


def decode_routes(raw: Any, dtype: str) -> Any:
    """The routed experts of a model call as a `[tokens, moe_layers, topk]` tensor of `dtype`, from
    the envelope string, a nested list, or the integer array the stored records hold them in (form
    version 3: copied once, the stored bytes being read-only)."""
    import numpy as np
    import torch

    target = getattr(torch, dtype)
    if isinstance(raw, np.ndarray):
        tensor = torch.from_numpy(np.array(raw)).to(target)
    elif not isinstance(raw, str):
        tensor = torch.as_tensor(raw, dtype=target)
    else:
        magic, wire_dtype, shape_text, data = [*raw.split(":", 3), "", "", ""][:4]
        if magic != _ROUTES_MAGIC or wire_dtype not in _ROUTES_DTYPES:
            raise ResultDataError(f"routed_experts is not a {_ROUTES_MAGIC} envelope of int8/16/32")
        try:
            shape = tuple(int(d) for d in shape_text.split("x"))
            array = np.frombuffer(base64.b64decode(data, validate=True), dtype=np.dtype(wire_dtype))
            tensor = torch.from_numpy(array.copy().reshape(shape)).to(target)
        except ValueError as exc:
            raise ResultDataError(f"routed_experts envelope does not decode: {exc}") from None
    if tensor.dim() != 3:
        raise ResultDataError(
            f"routed_experts has shape {tuple(tensor.shape)}, not [tokens, moe_layers, topk]"
        )
    return tensor


def _token_item(head: Mapping[str, Any]) -> dict[str, Any]:
    items = head.get("output_items") or []
    if not items:
        return {}
    index = head.get("token_item_index")
    item = items[index if index is not None else len(items) - 1]
    return item if isinstance(item, dict) else {}


Tokens = TokenArrays | Sequence[TokenEntry]


def as_arrays(tokens: Tokens) -> TokenArrays:
    """The attempt's token records as arrays: as read from the store, or (records built in memory, the
    tests' and the JSON form's way) through the binary form once.  `ResultDataError` for records
    that have none (a NaN or infinite logprob)."""
    if isinstance(tokens, TokenArrays):
        if not tokens.resolved:
            raise ResultDataError(
                "the token records refer to their reply's output items and were read without the reply"
            )
        return tokens
    try:
        return decode_arrays(encode_records([t.record() for t in tokens]))
    except TokenCodecError as exc:
        raise ResultDataError(f"token records: {exc}") from None


def whole_prompts(tokens: Tokens) -> list[npt.NDArray[np.int64]]:
    """Every call's full prompt (int64), delta prompts rebuilt from their parent chains
    (`TokenArrays.full_prompts`); `ResultDataError` naming the call whose chain is broken."""
    try:
        return as_arrays(tokens).full_prompts()
    except LineageError as exc:
        raise ResultDataError(str(exc)) from None


def message_log(tokens: Tokens, rules: ResultRules) -> list[dict[str, Any]]:
    """NeMo RL's message log of one attempt (see the module doc); `ResultDataError` when it has none."""
    import torch

    arrays = as_arrays(tokens)
    log: list[dict[str, Any]] = []
    seen: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)
    for r, prompt in enumerate(whole_prompts(arrays)):
        head = arrays.records[r]
        call_id = head.get("model_call_id")
        if not arrays.layout.span(r, "generation_token_ids").count:
            continue  # no turn: nothing was generated (NeMo RL skips it the same way)
        generated = arrays.generation(r).astype(np.int64)
        if prompt.size < seen.size or not np.array_equal(prompt[: seen.size], seen):
            raise ResultDataError(
                f"model call {call_id} does not extend the turns before it "
                f"(its prompt's first {seen.size} tokens differ): truncated or re-tokenized history"
            )
        logprobs = arrays.logprobs(r)
        if np.isnan(logprobs).any():
            raise ResultDataError(f"model call {call_id}: generation logprobs contain NaN")
        start, end = seen.size, prompt.size + generated.size
        routes = None
        held_routes = arrays.routes(r)
        if held_routes is not None:
            routes = decode_routes(held_routes, rules.routed_experts_dtype)
            if routes.shape[0] < end:
                raise ResultDataError(
                    f"model call {call_id}: {routes.shape[0]} routed_experts rows for {end} tokens"
                )
            if log and seen.size and isinstance(log[-1].get("routed_experts"), torch.Tensor):
                # The last generated token's route is known only from the next call's prefill.
                log[-1]["routed_experts"][-1] = routes[seen.size - 1]
        elif rules.require_routed_experts:
            # NeMo RL fills routeless messages in with its missing-route sentinel; say so once per call.
            logger.warning(
                "model call %s has no routed_experts (router replay is on): its messages carry no routes",
                call_id,
            )
        # Arrays of their own (prompts rebuilt as int64, ids widened to int64, logprobs copied as
        # float32): the tensors never alias the payload's buffer.
        user: dict[str, Any] = {"role": "user", "content": "", "token_ids": torch.from_numpy(prompt[start:])}
        invalid, malformed = flags(_token_item(head), rules)
        assistant: dict[str, Any] = {
            "role": "assistant",
            "content": "",
            "token_ids": torch.from_numpy(generated),
            "generation_logprobs": torch.from_numpy(logprobs.astype(np.float32)),
            "is_invalid_tool_call": invalid,
            "has_malformed_thinking": malformed,
        }
        if routes is not None:
            user["routed_experts"] = routes[start : len(prompt)]
            assistant["routed_experts"] = routes[len(prompt) : end]
        log += [user, assistant]
        seen = np.concatenate([prompt, generated])
    if not log:
        raise ResultDataError(
            "the attempt produced no generated tokens (the prompt may exceed the model's max_model_len, "
            "or every output item was a tool call or reasoning without generation)"
        )
    return log


def full_result(
    row: Mapping[str, Any], reply: Mapping[str, Any], rollout_id: str, attempt_index: int, mask_sample: bool
) -> dict[str, Any]:
    """The reply as NeMo RL's `full_result`: the row's fields (NeMo RL's own ids kept), then the
    reply's, token arrays off the output items, the ledger's attempt beside, and the mask where NeMo RL
    reads it."""
    full: dict[str, Any] = {k: v for k, v in row.items() if k != "_rowidx"}
    for key, value in reply.items():
        if key == "task" or key in _WIRE_IDS:
            continue
        full[key] = value
    for key in PER_ROW_KEYS:  # the row's own id wins over anything an agent echoed
        if key in row:
            full[key] = row[key]
    response = full.get("response")
    if isinstance(response, dict) and isinstance(response.get("output"), list):
        full["response"] = {
            **response,
            "output": [
                {k: v for k, v in item.items() if k not in _TOKEN_ARRAYS} if isinstance(item, dict) else item
                for item in response["output"]
            ],
        }
    instance = full.get("instance_config")
    masked = mask_sample or bool(isinstance(instance, dict) and instance.get("mask_sample"))
    full["instance_config"] = {**(instance if isinstance(instance, dict) else {}), "mask_sample": masked}
    full[LEDGER_ROLLOUT_ID] = rollout_id
    full[LEDGER_ATTEMPT_INDEX] = attempt_index
    return full


def decode_strings(full: dict[str, Any], tokens: Tokens, tokenizer: Any) -> None:
    """With a tokenizer (NeMo RL passes one): each generating output item gets `prompt_str` and
    `generation_str`, as NeMo RL's actor writes them for its logs."""
    if tokenizer is None or not hasattr(tokenizer, "batch_decode"):
        return
    arrays = as_arrays(tokens)
    calls = [r for r in range(len(arrays)) if arrays.layout.span(r, "generation_token_ids").count]
    if not calls:
        return
    wholes = whole_prompts(arrays)
    prompts = tokenizer.batch_decode([wholes[r].tolist() for r in calls])
    generations = tokenizer.batch_decode([arrays.generation(r).tolist() for r in calls])
    output = (full.get("response") or {}).get("output")
    by_id = {item.get("id"): item for item in output or [] if isinstance(item, dict) and item.get("id")}
    for r, prompt, generation in zip(calls, prompts, generations, strict=True):
        item = by_id.get(_token_item(arrays.records[r]).get("id"))
        if item is not None:
            item["prompt_str"], item["generation_str"] = prompt, generation


def row_result(
    row: Mapping[str, Any],
    reply: Mapping[str, Any],
    tokens: Tokens,
    *,
    rollout_id: str,
    attempt_index: int,
    mask_sample: bool,
    rules: ResultRules,
    tokenizer: Any = None,
) -> dict[str, Any]:
    arrays = as_arrays(tokens)
    log = message_log(arrays, rules)
    full = full_result(row, reply, rollout_id, attempt_index, mask_sample)
    decode_strings(full, arrays, tokenizer)
    result: dict[str, Any] = {"message_log": log, "input_message_log": log[:1], "full_result": full}
    if "_ng_rollout_id" in row:
        # NeMo RL's per-row id, where its recovery reads it.
        result["rollout_id"] = row["_ng_rollout_id"]
    return result
