"""make demo's verdicts come from its measured numbers (no model needed here)."""

from specjax.demo import Outcome, explain, verdict


def test_verdicts_and_advice_follow_the_numbers():
    assert [verdict(s) for s in (0.9, 1.0, 1.2)] == [
        "slower than plain",
        "about even with plain",
        "faster than plain",
    ]
    edits = {"NGram(k=8)": Outcome(2.1, 3.9, 1.86)}
    chat = {"NGram(k=8)": Outcome(1.0, 1.05, 1.05), "EAGLE-3 chain k=1": Outcome(1.15, 1.3, 1.13)}
    text = explain(edits, chat)
    assert "NGram(k=8) ran 2.10x plain decoding" in text
    assert "EAGLE-3 chain k=1: 1.15x, faster than plain" in text
    assert "EAGLE-3 chain k=1 on open-ended text (the fastest here, 1.15x)" in text
    slow = {"NGram(k=8)": Outcome(1.02, 1.05, 1.03), "EAGLE-3 chain k=1": Outcome(0.9, 1.3, 1.44)}
    assert "plain decoding for short open-ended chat on a CPU" in explain(edits, slow)
