"""The proto's comments are the contract's documentation: every element of it has one.

A caller in another language reads generation.proto and admin.proto, not our Python: every
service, RPC, message, field, enum and enum value needs a leading comment (its meaning, unit,
range and default). protoc's source info says which elements have one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[1]
PROTOS = sorted((ROOT / "proto").rglob("*.proto"))

# Path components of descriptor.proto (SourceCodeInfo.Location.path).
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM = 2, 3, 4
ENUM_VALUE, SERVICE_METHOD = 2, 2

Element = tuple[tuple[int, ...], str]  # (source path, what it is: "field GenerateRequest.n")


def descriptor_set(
    tmp_path: Path, include: Path, *protos: Path
) -> descriptor_pb2.FileDescriptorSet:
    """protoc's descriptors of `protos`, with their source info (comments included)."""
    out = tmp_path / "descriptors.pb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{include}",
            "--include_source_info",
            f"--descriptor_set_out={out}",
            *map(str, protos),
        ],
        check=True,
        timeout=60,
    )
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _enum_elements(
    enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...], scope: str
) -> list[Element]:
    name = f"{scope}{enum.name}"
    elements = [(path, f"enum {name}")]
    for i, value in enumerate(enum.value):
        elements.append(((*path, ENUM_VALUE, i), f"enum value {name}.{value.name}"))
    return elements


def _message_elements(
    message: descriptor_pb2.DescriptorProto, path: tuple[int, ...], scope: str
) -> list[Element]:
    name = f"{scope}{message.name}"
    elements = [(path, f"message {name}")]
    for i, field in enumerate(message.field):
        elements.append(((*path, MESSAGE_FIELD, i), f"field {name}.{field.name}"))
    for i, nested in enumerate(message.nested_type):
        if nested.options.map_entry:  # a map field's entry: protoc's, not in the source
            continue
        elements += _message_elements(nested, (*path, MESSAGE_NESTED, i), f"{name}.")
    for i, enum in enumerate(message.enum_type):
        elements += _enum_elements(enum, (*path, MESSAGE_ENUM, i), f"{name}.")
    return elements


def elements(file: descriptor_pb2.FileDescriptorProto) -> list[Element]:
    """Every element of a file that a caller relies on, with its source path."""
    found: list[Element] = []
    for i, message in enumerate(file.message_type):
        found += _message_elements(message, (FILE_MESSAGE, i), "")
    for i, enum in enumerate(file.enum_type):
        found += _enum_elements(enum, (FILE_ENUM, i), "")
    for i, service in enumerate(file.service):
        found.append(((FILE_SERVICE, i), f"service {service.name}"))
        for j, method in enumerate(service.method):
            found.append(
                ((FILE_SERVICE, i, SERVICE_METHOD, j), f"rpc {service.name}.{method.name}")
            )
    return found


def undocumented(file: descriptor_pb2.FileDescriptorProto) -> list[str]:
    comments = {
        tuple(location.path): location.leading_comments.strip()
        for location in file.source_code_info.location
    }
    return [what for path, what in elements(file) if not comments.get(path)]


def test_there_are_protos_to_check():
    assert {p.name for p in PROTOS} >= {"generation.proto", "admin.proto"}


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_every_element_of_the_contract_has_a_leading_comment(proto, tmp_path):
    (file,) = descriptor_set(tmp_path, ROOT / "proto", proto).file
    assert len(elements(file)) > 10
    assert undocumented(file) == []


def test_an_element_without_a_comment_is_found(tmp_path):
    bare = tmp_path / "proto" / "bare.proto"
    bare.parent.mkdir()
    bare.write_text(
        'syntax = "proto3";\n'
        "// Documented.\n"
        "message Thing {\n"
        "  // Documented.\n"
        "  uint32 size = 1;\n"
        "  string name = 2;  // a trailing comment is not a leading one\n"
        "}\n"
    )
    (file,) = descriptor_set(tmp_path, bare.parent, bare).file
    assert undocumented(file) == ["field Thing.name"]
