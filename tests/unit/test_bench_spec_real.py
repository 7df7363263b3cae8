"""The real-acceptance speculative benchmark's prompts and its mismatch count (the run itself needs the real
model: benches/spec_real.py)."""

from benches.quoting_prompts import SOURCES, TASKS, conversations
from benches.spec_real import mismatched


def test_every_prompt_quotes_its_sources_in_full():
    convs = conversations()
    assert len(convs) == len(TASKS) >= 16
    for (name, conversation), (task, sources, instruction) in zip(convs, TASKS):
        assert name == task and len(conversation) == 1 and conversation[0]["role"] == "user"
        content = conversation[0]["content"]
        assert content.startswith(instruction + "\n\n")
        for source in sources.split("+"):
            assert SOURCES[source] in content
    # code is quoted in a fenced block
    assert "```python\n" + SOURCES["moving_average"] + "\n```" in dict(convs)["rename_moving_average"][0]["content"]
    assert [n for n, _ in conversations(4)] == [t[0] for t in TASKS[:4]]


def test_mismatched_counts_a_planted_difference():
    plain = {"a": [1, 2, 3, 4], "b": [5, 6, 7], "c": [8, 9]}
    assert mismatched(plain, {"a": [1, 2, 3, 4], "b": [5, 6, 7], "c": [8, 9]}) == []
    found = mismatched(plain, {"a": [1, 2, 0, 4], "b": [5, 6, 7], "c": [8, 9, 10]})
    assert found == [{"prompt": "a", "first_diff": 2, "reference_len": 4, "len": 4},
                     {"prompt": "c", "first_diff": 2, "reference_len": 2, "len": 3}]
