from __future__ import annotations

import pytest
import torch

from workers.policy import TinyConfig, load_policy, parse_policy_spec


def test_same_seed_same_weights_and_version() -> None:
    a, b = load_policy("tiny"), load_policy("tiny:seed=0")
    assert a.policy_version == b.policy_version
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_other_seed_is_a_changed_policy() -> None:
    assert load_policy("tiny").policy_version != load_policy("tiny:seed=1").policy_version


def test_building_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_policy("tiny:seed=5")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("spec", ["huge", "tiny:seed", "tiny:depth=3", "tiny:seed=x"])
def test_bad_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_policy_spec(spec)


def test_spec_options() -> None:
    assert parse_policy_spec("tiny:seed=2,hidden=32,heads=2") == TinyConfig(seed=2, hidden=32, heads=2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generation_logprobs_match_a_full_sequence_rescore(temperature: float) -> None:
    policy = load_policy()
    prompt = [5, 17, 300, 42, 9, 511, 0, 128]
    sample = policy.sample(prompt, 12, torch.Generator().manual_seed(7), temperature)
    assert len(sample.token_ids) == len(sample.logprobs) == 12
    assert all(lp <= 0 for lp in sample.logprobs)

    # The scorer's formula: log_softmax(final_hidden @ W.T / temperature) at the target tokens.
    ids = torch.tensor(prompt + sample.token_ids)
    hidden = policy.final_hidden(ids)[len(prompt) - 1 : -1]
    logp = torch.log_softmax((hidden @ policy.lm_head_weight.T).float() / temperature, dim=-1)
    rescored = logp.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
    assert (rescored - torch.tensor(sample.logprobs)).abs().max().item() < 1e-5
    assert (policy.logprobs(prompt, sample.token_ids, temperature) - rescored).abs().max().item() < 1e-5


def test_sampling_is_deterministic_per_generator_seed() -> None:
    policy = load_policy()
    one = policy.sample([1, 2, 3], 10, torch.Generator().manual_seed(3))
    two = policy.sample([1, 2, 3], 10, torch.Generator().manual_seed(3))
    other = policy.sample([1, 2, 3], 10, torch.Generator().manual_seed(4))
    assert one == two
    assert one.token_ids != other.token_ids


def test_sample_refuses_bad_input() -> None:
    policy = load_policy()
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError):
        policy.sample([], 4, gen)
    with pytest.raises(ValueError):
        policy.sample([policy.vocab_size], 4, gen)
    with pytest.raises(ValueError):
        policy.sample([1], 4, gen, temperature=0.0)
    with pytest.raises(ValueError):
        policy.sample([1] * policy.max_seq_len, 1, gen)
