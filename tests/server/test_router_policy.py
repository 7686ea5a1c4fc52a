"""The router's cache-aware policy: a prompt prefix keeps going to one instance, different
prefixes spread over all, and load bounds the affinity."""

from __future__ import annotations

from baton.router.policy import (
    LOAD_SLACK,
    Instance,
    PrefixAffinity,
    make_policy,
    prompt_key,
)


def _decodes(n: int) -> list[Instance]:
    return [Instance("decode", f"http://10.0.0.{i}:8000", healthy=True) for i in range(n)]


def test_a_shared_prefix_keeps_its_instance_and_prefixes_spread():
    policy, decodes = make_policy("prefix_affinity"), _decodes(2)
    system = "You are a careful assistant. " * 20  # longer than the key
    picks = {policy.choose(decodes, system + f"question {i}").url for i in range(20)}
    assert len(picks) == 1  # the key is the first PREFIX_KEY_CHARS characters: all equal
    spread = {policy.choose(decodes, f"prompt number {i} " * 3).url for i in range(40)}
    assert spread == {d.url for d in decodes}


def test_load_bounds_the_affinity():
    policy, decodes = PrefixAffinity(), _decodes(2)
    key = "def main():\n" * 40
    hot = policy.choose(decodes, key)
    hot.outstanding = LOAD_SLACK - 1
    assert policy.choose(decodes, key) is hot  # still within the slack
    hot.outstanding = LOAD_SLACK
    other = policy.choose(decodes, key)
    assert other is not hot  # one hot prefix cannot pin one instance
    assert policy.choose([], key) is None
    assert policy.choose(decodes, None) in decodes  # no prompt: least outstanding


def test_prompt_keys():
    assert prompt_key({"prompt": "abc"}) == "abc"
    assert prompt_key({"prompt": [1, 2, 3]}) == "1,2,3"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert prompt_key({"messages": chat}) == "be brief\nhi"
    assert prompt_key({"prompt": None}) is None and prompt_key({}) is None
