"""The committed control-plane stubs are exactly what the .proto generates."""

from __future__ import annotations

from pathlib import Path

from tierserve.proto import generate


def test_regenerating_the_stubs_gives_no_diff(tmp_path: Path) -> None:
    committed = Path(generate.__file__).parent
    for fresh in generate.generate(tmp_path):
        assert fresh.read_text() == (committed / fresh.name).read_text(), f"{fresh.name} is stale: regenerate it"


def test_stubs_import_and_round_trip() -> None:
    from tierserve.proto import tierserve_pb2 as pb

    dest = pb.KVDestination(reservation_id="r", pages=[3, 4], identity=pb.KVIdentity(page_size=16))
    assert pb.KVDestination.FromString(dest.SerializeToString()) == dest
