"""`Policy`: a loaded causal LM plus the one sampling/scoring math shared by generation and the scorers.

Generation logprobs are `log_softmax(final_hidden @ W.T (+ b)) / temperature)` at the sampled token, in
fp32; `logprobs()` recomputes them for a whole sequence with the same formula, so a scorer that gets the
same weights reproduces the generation-time logprobs up to float rounding.
"""

from __future__ import annotations

import hashlib
from dataclasses import fields
from typing import NamedTuple

import torch
import torch.nn.functional as F

from workers.policy.model import TinyCausalLM, TinyConfig

DEFAULT_POLICY_SPEC = "tiny"


def parse_policy_spec(spec: str) -> TinyConfig:
    """`"tiny"`, `"tiny:seed=1"`, `"tiny:seed=1,hidden=128"` -> a model config; anything else is refused."""
    name, _, options = spec.partition(":")
    if name != "tiny":
        raise ValueError(f"unknown policy {name!r} in spec {spec!r}; only 'tiny' is defined")
    known = {f.name for f in fields(TinyConfig)}
    values: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in options.split(","))):
        key, sep, raw = part.partition("=")
        if not sep or key not in known:
            raise ValueError(f"bad option {part!r} in policy spec {spec!r}; known options: {sorted(known)}")
        try:
            values[key] = int(raw)
        except ValueError:
            raise ValueError(
                f"option {key!r} of policy spec {spec!r} must be an integer, got {raw!r}"
            ) from None
    return TinyConfig(**values)


def _weights_digest(model: TinyCausalLM) -> str:
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().contiguous().float().numpy().tobytes())
    return h.hexdigest()


class SampleResult(NamedTuple):
    """`(token_ids, logprobs)`: unpacks like a tuple, reads like a record."""

    token_ids: list[int]
    logprobs: list[float]


class Policy:
    """A causal LM with a stable version string; inference only."""

    def __init__(self, model: TinyCausalLM, spec: str) -> None:
        self.model = model
        self.spec = spec
        # The version names the weights, not the spec text: two specs giving equal weights are one policy.
        self._version = f"tiny-{_weights_digest(model)[:16]}"

    @property
    def policy_version(self) -> str:
        return self._version

    @property
    def config(self) -> TinyConfig:
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.model.config.max_seq_len

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head_weight

    @property
    def lm_head_bias(self) -> torch.Tensor | None:
        return self.model.lm_head_bias

    def final_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.final_hidden(ids)

    @staticmethod
    def _check_temperature(temperature: float) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")

    def _next_logprobs(self, hidden_rows: torch.Tensor, temperature: float) -> torch.Tensor:
        logits = F.linear(hidden_rows, self.lm_head_weight, self.lm_head_bias).float()
        return torch.log_softmax(logits / temperature, dim=-1)

    def sample(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        generator: torch.Generator,
        temperature: float = 1.0,
    ) -> SampleResult:
        """Samples up to `max_new_tokens` tokens after `prompt_ids`; returns them with their logprobs.

        Each step recomputes the whole prefix: at this size that costs well under a millisecond and
        keeps the math identical to a scorer's single full-sequence pass (no KV-cache numerics).
        """
        self._check_temperature(temperature)
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if len(prompt_ids) + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds {self.max_seq_len}"
            )
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token outside the vocabulary 0..{self.vocab_size - 1}")
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        tokens: list[int] = []
        logprobs: list[float] = []
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                hidden = self.model.final_hidden(ids)[-1:]
                logp = self._next_logprobs(hidden, temperature)[0]
                token = int(torch.multinomial(logp.exp(), 1, generator=generator).item())
                tokens.append(token)
                logprobs.append(float(logp[token].item()))
                ids = torch.cat([ids, torch.tensor([token], dtype=torch.long)])
        return SampleResult(token_ids=tokens, logprobs=logprobs)

    def logprobs(
        self, prompt_ids: list[int], generation_ids: list[int], temperature: float = 1.0
    ) -> torch.Tensor:
        """Reference scorer: `log p(generation[i] | prompt + generation[:i])` for each i, fp32, `[G]`."""
        self._check_temperature(temperature)
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if not generation_ids:
            return torch.empty(0, dtype=torch.float32)
        ids = torch.tensor(prompt_ids + generation_ids, dtype=torch.long)
        p, g = len(prompt_ids), len(generation_ids)
        with torch.inference_mode():
            hidden = self.model.final_hidden(ids[:-1])[p - 1 : p - 1 + g]
            logp = self._next_logprobs(hidden, temperature)
            targets = torch.tensor(generation_ids, dtype=torch.long)
            return logp.gather(1, targets[:, None])[:, 0]


def load_policy(spec: str = DEFAULT_POLICY_SPEC) -> Policy:
    """Builds the policy named by `spec` ("tiny", "tiny:seed=1", ...); a different seed is a changed policy."""
    return Policy(TinyCausalLM(parse_policy_spec(spec)), spec)
