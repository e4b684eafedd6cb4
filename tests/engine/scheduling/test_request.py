"""A Request keeps its attributes in slots: the hot path's reads stay fast however many fields it
gains (an instance dict of more than 30 keys is not shared among instances in CPython 3.11, and
every read on it costs about twice as much)."""

from __future__ import annotations

from dataclasses import fields

from engine.scheduling.request import Request


def test_a_request_keeps_every_field_in_a_slot_and_has_no_instance_dict() -> None:
    assert set(Request.__slots__) == {f.name for f in fields(Request)}
    assert "__dict__" not in dir(Request)
