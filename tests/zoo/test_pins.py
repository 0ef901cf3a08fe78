"""The zoo corpora are pinned: this machine holds every pinned document, unpinned text is left out, missing text
is reported and too much of it refused, and ``MOETOOL_CORPUS=machine`` opts out."""

from __future__ import annotations

import pytest

from moetool.errors import MoetoolError
from moetool.zoo import pins
from moetool.zoo.corpora import DOMAINS, make_splits, pinned_documents


@pytest.fixture
def pin_file(tmp_path, monkeypatch):
    """Point the pins at a temporary file the test writes."""
    path = tmp_path / "corpora.lock.json"
    monkeypatch.setattr(pins, "PIN_FILE", path)
    yield path
    pins._load.cache_clear()


@pytest.mark.parametrize("domain", DOMAINS)
def test_this_machine_holds_the_pinned_documents(domain):
    """Every document used is pinned, and what is missing stays under the refusal bar. Not "nothing missing": an
    install resolved on another day may carry a package whose licence file changed (only torch is pinned), and
    that is what the warning is for."""
    docs, status = pinned_documents(domain)
    want = pins.pinned(domain)
    assert want is not None and status.mode == "pinned"
    assert {pins.digest(d) for d in docs} <= set(want) and len(docs) == status.used
    assert status.used + status.missing == len(want)
    assert sum(len(d) for d in docs) + status.missing_chars == sum(want.values()) == status.pinned_chars
    assert status.missing_chars <= pins.MAX_MISSING * status.pinned_chars
    assert (status.warning is None) == (status.missing == 0)


def test_unpinned_documents_are_left_out_and_missing_ones_reported(pin_file):
    docs = [f"document number {i} " * 10 for i in range(10)]
    pins.write_pins({"code": docs[:9]}, pin_file)
    kept, status = pins.select("code", [*docs[1:], docs[1]], "how to get it")  # docs[0] missing, docs[9] unpinned
    assert kept == docs[1:9]  # the duplicate is used once
    assert status.missing == 1 and status.missing_chars == len(docs[0]) and status.ignored == 2
    assert "1 pinned document(s)" in (status.warning or "") and "'code'" in (status.warning or "")


def test_too_much_missing_text_is_refused_with_the_way_out(pin_file):
    docs = [f"text {i} " * 20 for i in range(5)]
    pins.write_pins({"legal": docs}, pin_file)
    with pytest.raises(
        MoetoolError, match=r"corpus 'legal': 2 of its 5 pinned.*install the thing.*MOETOOL_CORPUS=machine"
    ):
        pins.select("legal", docs[:3], "install the thing")


def test_machine_mode_uses_the_text_as_found(monkeypatch):
    monkeypatch.setenv("MOETOOL_CORPUS", "machine")
    assert pins.pinned("code") is None and pins.pin_id() == "machine"
    kept, status = pins.select("code", ["a" * 100, "b" * 100], "")
    assert kept == ["a" * 100, "b" * 100] and status.mode == "machine" and status.missing == 0
    monkeypatch.setenv("MOETOOL_CORPUS", "everything")
    with pytest.raises(MoetoolError, match="MOETOOL_CORPUS='everything'"):
        pins.pinned("code")


def test_splits_carry_the_pin_status_and_are_the_same_twice():
    a = make_splits(0, 60_000, 0.1, ("code",))
    b = make_splits(0, 60_000, 0.1, ("code",))
    assert a["code"].train == b["code"].train and a["code"].valid == b["code"].valid
    assert a["code"].corpus is not None and a["code"].corpus.mode == "pinned"
    assert a["code"].corpus.sha256 == b["code"].corpus.sha256


def test_a_different_pin_file_changes_the_pin_id(pin_file):
    pins.write_pins({"code": ["x" * 100]}, pin_file)
    first = pins.pin_id()
    pins.write_pins({"code": ["y" * 100]}, pin_file)
    assert pins.pin_id() != first
