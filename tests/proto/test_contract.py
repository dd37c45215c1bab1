"""The wire contract: generated code matches the .proto, and the scheme enum matches qcore's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from gradq.client import serde
from gradq.proto.convert import tensor_from_proto, tensor_to_proto
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.qcore import QuantConfig, Scheme, codec_for, decode, encode
from gradq.qcore.codecs import registered_schemes

REPO = Path(__file__).resolve().parents[2]


def load_generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("proto_generate", REPO / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_matches_the_proto() -> None:
    assert load_generator().drifted_files() == []


def test_drift_is_detected(tmp_path: Path) -> None:
    generator = load_generator()
    generator.PROTO_DIR = tmp_path
    for path in (REPO / "proto" / "v1").iterdir():
        if path.suffix in (".proto", ".py", ".pyi"):
            (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "aggregator.proto").write_text(
        (tmp_path / "aggregator.proto")
        .read_text()
        .replace("string dtype = 8;", "string dtype = 8;\n  uint32 extra = 99;")
    )
    assert "aggregator_pb2.py" in generator.drifted_files()


def test_scheme_enum_matches_qcore_both_ways() -> None:
    wire = {name.removeprefix("SCHEME_"): value for name, value in pb.Scheme.items() if name != "SCHEME_UNSPECIFIED"}
    assert wire == {scheme.name: scheme.value for scheme in Scheme}
    assert pb.Scheme.Value("SCHEME_UNSPECIFIED") == 0


@pytest.mark.parametrize("scheme", list(Scheme))
def test_every_scheme_round_trips_through_the_wire_message(scheme: Scheme) -> None:
    bits = 4 if scheme.is_quantized else 8
    sparse = codec_for(scheme).sparse  # its chunks are 64 elements or more
    config = QuantConfig(scheme=scheme, bits=bits, channel_size=64 if sparse else 10)
    x = np.random.default_rng(0).normal(size=95 * (7 if sparse else 1)).astype(np.float32)
    encoded = encode(x, config)
    message = pb.QuantizedTensor.FromString(tensor_to_proto(encoded).SerializeToString())
    np.testing.assert_array_equal(decode(tensor_from_proto(message)), decode(encoded))
    assert message.ByteSize() <= encoded.nbytes


@pytest.mark.parametrize("scheme", [Scheme.FLOAT32, Scheme.FLOAT16])
def test_non_finite_float_payload_is_refused_by_index(scheme: Scheme) -> None:
    message = tensor_to_proto(encode(np.ones(4, np.float32), QuantConfig(scheme=scheme)))
    values = np.array([1, 2, np.nan, 4], np.float16 if scheme is Scheme.FLOAT16 else np.float32)
    message.payload = values.tobytes()
    with pytest.raises(ValueError, match=r"tensor.payload\[2\]=nan is not finite"):
        tensor_from_proto(message)


def test_every_wire_scheme_has_a_codec_and_every_codec_a_wire_scheme() -> None:
    # The registry's completeness check lives here so qcore never imports protobuf.
    wire = {name: value for name, value in pb.Scheme.items() if name != "SCHEME_UNSPECIFIED"}
    codecs = {f"SCHEME_{scheme.name}": int(scheme) for scheme in registered_schemes()}
    assert codecs == wire
    for scheme in registered_schemes():
        assert codec_for(scheme).scheme is scheme


def test_an_unknown_scheme_is_refused_with_the_registered_ones_named() -> None:
    message = tensor_to_proto(encode(np.ones(4, np.float32), QuantConfig()))
    message.scheme = pb.Scheme.Value("SCHEME_UNSPECIFIED")
    with pytest.raises(ValueError, match=r"tensor.scheme=0 is not a known scheme; expected one of 1 \(FLOAT32\), "):
        tensor_from_proto(message)


def test_refusal_and_member_role_enums_match_the_servers_both_ways() -> None:
    from gradq.server.errors import Refusal
    from gradq.server.job_spec import MemberRole

    wire_refusals = {pb.Refusal.Name(v).removeprefix("REFUSAL_"): v for v in pb.Refusal.values()}
    assert wire_refusals == {reason.name: reason.value for reason in Refusal}
    wire_roles = {pb.MemberRole.Name(v).removeprefix("MEMBER_ROLE_"): v for v in pb.MemberRole.values()}
    assert wire_roles == {role.name: role.value for role in MemberRole}


def test_the_clients_refusals_are_the_wires_by_name_both_ways() -> None:
    wire_names = {pb.Refusal.Name(v).removeprefix("REFUSAL_") for v in pb.Refusal.values()}
    assert wire_names == {reason.name for reason in serde.Refusal}
    for value in pb.Refusal.values():
        reason = serde.refusal_name(value)
        assert reason.name == pb.Refusal.Name(value).removeprefix("REFUSAL_")
        assert reason == ("" if reason is serde.Refusal.UNSPECIFIED else reason.name)  # equal to the name sent
    assert serde.refusal_name(99) is serde.Refusal.UNSPECIFIED  # a newer aggregator's reason: none to act on
    assert serde.refusal_of_metadata([("gradq-refusal", b"NOT_JOINED")]) is serde.Refusal.NOT_JOINED
    assert serde.refusal_of_metadata([("gradq-refusal", "SOMETHING_NEW")]) is serde.Refusal.UNSPECIFIED
    assert serde.refusal_of_metadata(None) is serde.Refusal.UNSPECIFIED
