"""The policy model shared by the reference Gym agent (generation) and the logprob workers (scoring)."""

from workers.policy.model import TinyCausalLM, TinyConfig
from workers.policy.policy import DEFAULT_POLICY_SPEC, Policy, SampleResult, load_policy, parse_policy_spec

__all__ = [
    "DEFAULT_POLICY_SPEC",
    "Policy",
    "SampleResult",
    "TinyCausalLM",
    "TinyConfig",
    "load_policy",
    "parse_policy_spec",
]
