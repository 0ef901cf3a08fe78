"""``latency_profile.json`` read back: the descriptive fields kept only where they have their type."""

from __future__ import annotations

from moetool.methods.hybrid.profile_doc import profile_from_json

EXPERTS = {"a": {"lengths": [1, 2, 3], "seconds": [1.0, 2.0, 3.5]}}


def test_keeps_descriptive_fields_of_their_type() -> None:
    doc = {"device": "phone", "runtime": "torch", "operation": "prefill", "threads": 2, "clock": "cpu"}
    prof = profile_from_json(doc | {"repeats": 3, "measured_at": "2024-01-01", "experts": EXPERTS}, ["a"], where="p")
    assert {k: prof.get(k) for k in ("runtime", "operation", "threads", "clock", "repeats", "measured_at")} == {
        "runtime": "torch",
        "operation": "prefill",
        "threads": 2,
        "clock": "cpu",
        "repeats": 3,
        "measured_at": "2024-01-01",
    }
    assert prof["format"] == 1 and prof["device"] == "phone"
    assert prof["experts"]["a"]["fit"]["max_rel_error"] < 1e-9


def test_drops_a_field_of_another_type() -> None:
    # JSON's true is not a thread count (Python's bool is an int, which let it through before)
    doc = {"device": "phone", "threads": True, "repeats": "3", "clock": 1, "experts": EXPERTS}
    prof = profile_from_json(doc, ["a"], where="p")
    assert "threads" not in prof and "repeats" not in prof and "clock" not in prof
