"""What an exercise check says (issue 44, part 3): a list asked is a list, not a tensor; a wrong
value deep in a nested answer is named as the learner knows it (rank 1's ``rank_buffer[0]``),
not by indices into a structure the learner never sees (``[1][2][0]``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import notebook as hn

LISTS = [[[0.0, 1.0], [2.0, 3.0], [100.0, 100.0], [100.0, 100.0]],
         [[0.0, 1.0], [2.0, 3.0], [100.0, 100.0], [101.0, 101.0]]]
FIELDS = ("weight", "bias", "rank_buffer", "rank_attribute")


@pytest.mark.parametrize("given", [torch.tensor([7.5]), np.array([7.5])], ids=["tensor", "array"])
def test_a_tensor_is_not_a_list(given, capsys):
    """00a ex1 asks for a list from every rank; a function returning a tensor is a wrong type."""
    hn.check_answer("ex1", [given, given], [[7.5], [7.5]])
    out = capsys.readouterr().out
    assert out.startswith("ex1: not yet: expected a list of 1 value at [0], you gave a "), out
    assert ".tolist()" in out, out
    with pytest.raises(AssertionError, match="expected a list"):
        hn.check_answer("ex1", given, [7.5], strict=True)
    hn.check_answer("ex1", [[7.5], (7.5,)], [[7.5], [7.5]])  # a number may be a scalar tensor:
    hn.check_answer("ex1", torch.tensor(5.0), 5.0)
    hn.check_answer("ex1", [np.float64(5.0)], [5.0])
    assert capsys.readouterr().out == "ex1: correct\n" * 3


def test_labels_name_the_place_as_the_learner_knows_it(capsys):
    wrong = [[row[:] for row in rank] for rank in LISTS]
    wrong[1][2][0] = 101.0
    hn.check_answer("ex4", wrong, LISTS, labels=("rank {}'s", FIELDS))
    hn.check_answer("ex4", wrong, LISTS)
    hn.check_answer("ex1", [[7.5], [9.0]], [[7.5], [7.5]], labels=("rank {}'s result",))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ex4: not yet: 101.0 at rank 1's rank_buffer[0] is too large.", lines
    assert lines[1] == "ex4: not yet: 101.0 at [1][2][0] is too large.", lines
    assert lines[2] == "ex1: not yet: 9.0 at rank 1's result[0] is too large.", lines
    with pytest.raises(AssertionError, match="rank 1's rank_buffer"):
        hn.check_answer("ex4", wrong, LISTS, labels=("rank {}'s", FIELDS), strict=True)


def test_learner_messages_name_no_ci_script(capsys, monkeypatch):
    """What a learner reads from a parameter check, a wrong type or a GPU claim on a CPU machine
    names no script of the course's CI (the handout is not a checkout of the repository); a GPU
    claim there is recorded in UNPROVEN, not proven."""
    messages = []
    with pytest.raises(ValueError) as info:
        hn.check_value("world_size", 1, False, "at least 2")
    messages.append(str(info.value))
    with pytest.raises(TypeError) as info:
        hn.check_parameters(world_size=("2", int))
    messages.append(str(info.value))
    monkeypatch.setattr(hn, "_cuda_devices", lambda: 0)
    monkeypatch.setattr(hn, "UNPROVEN", [])
    assert hn.gpu_claim("real DP on GPUs") is False and hn.cpu_claim("DP on CPU") is True
    messages.append(capsys.readouterr().out)
    assert messages[-1].startswith("not proven here: needs a GPU (found 0); a GPU run proves it."), messages
    assert hn.UNPROVEN == [{"claim": "real DP on GPUs", "needs": "GPU",
                            "why": "needs a GPU (found 0); a GPU run proves it"}]
    for text in messages:
        assert "parameters cell" in text or "not proven here" in text, text
        assert "ci/" not in text and "gpu_check" not in text and "run_notebooks" not in text, text


def test_a_sealed_check_says_the_same_without_the_expected_value(capsys):
    """issue 52: the handout's checks (``sealed_check``) give ``check_answer`` digests only; it still
    says correct, not yet and where, within the tolerance across a rounding edge."""
    printed = []
    sealed = hn.seal([[0.375, 7 / 12], {"w": True}])
    assert "0.375" not in repr(sealed) and "True" not in repr(sealed), sealed
    for given, says in [([[0.375000001, "7/12"], {"w": True}], "ex1: correct"),
                        ([[0.375, 0.5], {"w": True}], "ex1: not yet: 0.5 at [0][1] is not it."),
                        ([[0.375, 0.5833], {"w": 1}], "ex1: not yet: 0.5833 at [0][1] is not it.")]:
        hn.check_answer("ex1", given, sealed)
        printed.append(capsys.readouterr().out.strip())
        assert printed[-1] == says, printed
    hn.sealed_check("ex2", 0.0125, 0.01249, rel_tol=5e-3)  # 0.013 against 0.012 to 2 digits, yet within 5e-3
    hn.sealed_check("ex3", [[1.0]], [[1.0], [2.0]], labels=("rank {}'s",))
    assert capsys.readouterr().out.splitlines() == ["ex2: correct", "ex3: not yet: expected 2 values, you gave 1."]
