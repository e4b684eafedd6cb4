"""A Request stays small enough for CPython to share its attribute keys among instances."""

from __future__ import annotations

from dataclasses import fields

from engine.scheduling.request import Request


def test_a_request_has_at_most_29_fields_so_its_attribute_reads_stay_fast() -> None:
    # CPython 3.11 shares one keys table among instance dicts of up to 30 keys; a 30th field
    # gives every Request a dict of its own and doubles the cost of each attribute read.
    assert len(fields(Request)) <= 29
