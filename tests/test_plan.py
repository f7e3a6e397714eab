"""The launch plan: a pure function of host-known facts, with overrides."""

import pytest

from fastkda.plan import V_SLICE_CHOICES, choose_plan, parse_v_slices, requested_v_slices


@pytest.mark.parametrize("sms", [78, 132, 188])
def test_slices_never_decrease_as_parallelism_drops(sms):
    for heads in (1, 4, 8, 12, 16, 24, 48, 96):
        previous = None
        for num_seqs in range(64, 0, -1):
            plan = choose_plan(num_seqs, heads, 8192, 128, sms)
            assert plan.v_slices in V_SLICE_CHOICES
            assert previous is None or plan.v_slices >= previous
            previous = plan.v_slices


def test_slices_respect_value_width():
    assert choose_plan(1, 1, 8192, 64, 132).v_slices * 16 <= 64
    with pytest.raises(ValueError, match="narrower"):
        choose_plan(1, 1, 8192, 32, 132, v_slices=4)


def test_rule_boundaries():
    """The H200 sweep's rule: the most slices of at least 32 columns whose s·N·H programs fit one per SM."""
    assert choose_plan(2, 12, 8192, 128, 132).v_slices == 4  # 4*12*2 = 96 <= 132
    assert choose_plan(3, 12, 8192, 128, 132).v_slices == 2  # 4*36 = 144 > 132, 2*36 = 72
    assert choose_plan(5, 12, 8192, 128, 132).v_slices == 2  # 2*60 = 120 <= 132
    assert choose_plan(6, 12, 8192, 128, 132).v_slices == 1  # 2*72 = 144 > 132
    assert choose_plan(4, 16, 8192, 128, 132).v_slices == 2  # 2*64 = 128
    assert choose_plan(1, 96, 8192, 128, 132).v_slices == 1  # 2*96 = 192 > 132
    assert choose_plan(5, 12, 8192, 64, 132).v_slices == 2  # V = 64: two 32-wide slices at most, 120 programs
    assert choose_plan(6, 12, 8192, 64, 132).v_slices == 1
    assert "2 slices would be 144 programs > 132 SMs" in choose_plan(6, 12, 8192, 128, 132).reason
    assert "one per SM" in choose_plan(5, 12, 8192, 128, 132).reason


def test_who_forms_w_and_u():
    """The recurrence forms w and u from one (sequence, head) pair per two columns of slice width, never in 32-wide
    slices (H200: H96 B1 and H12 N4 at two slices gain, H12 N1 at one slice loses)."""
    assert choose_plan(1, 96, 8192, 128, 132).w_u_in_recurrence  # 96 pairs, 128 columns
    assert choose_plan(4, 12, 8192, 128, 132).w_u_in_recurrence  # two 64-wide slices, 48 pairs
    assert not choose_plan(1, 12, 8192, 128, 132, v_slices=1).w_u_in_recurrence  # 12 pairs for 128 columns
    assert not choose_plan(1, 32, 8192, 128, 132, v_slices=1).w_u_in_recurrence  # 32 pairs, 2 * 32 < 128
    assert choose_plan(1, 64, 8192, 128, 132).w_u_in_recurrence  # 64 pairs
    assert not choose_plan(1, 12, 8192, 128, 132).w_u_in_recurrence  # four 32-wide slices
    assert not choose_plan(64, 96, 8192, 128, 132, v_slices=4).w_u_in_recurrence
    assert "forming w and u itself" in choose_plan(1, 96, 8192, 128, 132).reason
    assert "forming w and u in the solve kernel" in choose_plan(1, 12, 8192, 128, 132).reason


def test_override_precedence(monkeypatch):
    monkeypatch.setenv("FASTKDA_V_SLICES", "4")
    assert requested_v_slices("auto") == 4
    assert requested_v_slices(2) == 2  # the argument wins
    assert choose_plan(64, 96, 8192, 128, 132).v_slices == 4
    monkeypatch.setenv("FASTKDA_V_SLICES", " AUTO ")
    assert requested_v_slices("auto") == "auto"


@pytest.mark.parametrize("bad", [0, 3, 8, "two", 2.0, True, None, ""])
def test_bad_values_are_rejected(bad):
    with pytest.raises(ValueError, match="v_slices"):
        parse_v_slices(bad, "v_slices")


def test_bad_environment_is_rejected(monkeypatch):
    monkeypatch.setenv("FASTKDA_V_SLICES", "3")
    with pytest.raises(ValueError, match="FASTKDA_V_SLICES"):
        requested_v_slices("auto")


def test_decode_plan_uses_narrow_slices_and_honours_overrides(monkeypatch):
    from fastkda.plan import choose_decode_plan

    assert choose_decode_plan(256, 96, 128, 132).v_slices == 8  # 16-column slices
    assert choose_decode_plan(1, 12, 64, 132).v_slices == 4
    assert choose_decode_plan(1, 12, 128, 132, v_slices=1).v_slices == 1
    monkeypatch.setenv("FASTKDA_V_SLICES", "2")
    assert choose_decode_plan(1, 12, 128, 132).v_slices == 2
    with pytest.raises(ValueError, match="narrower"):
        choose_decode_plan(1, 12, 32, 132, v_slices=4)
