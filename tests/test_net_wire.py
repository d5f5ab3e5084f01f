"""The wire contract: stubs generated from protos/ are the checked-in ones; every protocol value
survives encode/decode; sizes the protobuf cannot bound are refused on decode."""

import filecmp

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zeroth.net import protocol as P
from zeroth import protogen
from zeroth.net import wire
from zeroth.net.proto import peer_pb2 as pb


def test_checked_in_stubs_equal_freshly_generated_ones(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the stubs")
    written = protogen.generate("net", tmp_path)
    assert {p.name for p in written} == {"peer_pb2.py", "peer_pb2_grpc.py"}
    for p in written:
        checked_in = protogen.stub_dir("net") / p.name
        assert filecmp.cmp(p, checked_in, shallow=False), (
            f"{checked_in} is stale: run `python -m zeroth.protogen net` after editing protos/zeroth/v1/peer.proto"
        )


def test_stubs_import_from_the_package_not_the_proto_path():
    text = (protogen.stub_dir("net") / "peer_pb2_grpc.py").read_text()
    assert "from zeroth.net.proto import peer_pb2" in text
    assert "from zeroth.v1" not in text
    assert pb.DESCRIPTOR.package == "zeroth.v1"


u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**63 - 1)
addresses = st.text(min_size=1, max_size=30)
keys = st.one_of(st.just(b""), st.binary(min_size=32, max_size=32))
sigs = st.binary(max_size=64)
members = st.builds(P.Member, machine=u32, address=addresses, active=st.booleans(), key=keys)
views = st.builds(P.View, iteration=u64, members=st.lists(members, max_size=5).map(tuple), next_machine_id=u32)
ballots = st.builds(P.Ballot, round=u64, leader=u32)
chains = st.one_of(st.just(b""), st.binary(min_size=32, max_size=32))
pushes = st.builds(
    P.Push,
    run_id=st.text(max_size=20),
    sender=u32,
    iteration=u64,
    count=u32,
    payload=st.binary(max_size=20),
    signature=sigs,
    previous=chains,
    relay_us=u32,
)


@st.composite
def entries(draw, complete=None):
    contributors = tuple(draw(st.lists(st.tuples(u32, st.integers(1, 2**32 - 1)), max_size=4)))
    commit = P.Commit(
        draw(st.text(max_size=10)),
        draw(u32),
        draw(u64),
        draw(ballots),
        contributors,
        draw(st.binary(min_size=32, max_size=32)),
        draw(views),
        draw(sigs),
        draw(chains),
    )
    full = draw(st.booleans()) if complete is None else complete
    payloads = tuple(draw(st.binary(max_size=8)) for _ in contributors) if full else None
    signatures = tuple(draw(sigs) for _ in contributors) if full else None
    if contributors == () and not full:
        payloads = signatures = ()  # an entry without contributors is always complete
    return P.LogEntry(commit, payloads, signatures)


@given(pushes)
def test_push_roundtrip(p):
    assert wire.push_from_pb(pb.GradientPush.FromString(wire.push_to_pb(p).SerializeToString())) == p


@given(entries())
def test_log_entry_roundtrip(e):
    assert wire.entry_from_pb(pb.LogEntry.FromString(wire.entry_to_pb(e).SerializeToString())) == e


@given(
    st.builds(
        P.PrepareReply,
        iteration=u64,
        decided=st.one_of(st.none(), entries()),
        pushes=st.lists(pushes, max_size=3).map(tuple),
        previous=st.one_of(st.just(b""), st.binary(min_size=32, max_size=32)),
    )
)
def test_prepare_reply_roundtrip(r):
    assert wire.prepare_reply_from_pb(pb.PrepareReply.FromString(wire.prepare_reply_to_pb(r).SerializeToString())) == r


@given(
    st.builds(
        P.Prepare,
        run_id=st.text(max_size=10),
        sender=u32,
        iteration=u64,
        ballot=ballots,
        signature=sigs,
        previous=chains,
        gone=st.booleans(),
    )
)
def test_prepare_roundtrip(m):
    assert wire.prepare_from_pb(wire.prepare_to_pb(m)) == m


def test_decode_refuses_what_protobuf_cannot_bound():
    with pytest.raises(P.Rejected, match="run_id"):
        wire.push_from_pb(pb.GradientPush(run_id="x" * 1000))
    with pytest.raises(P.Rejected, match="ballot or next_view"):
        wire.commit_from_pb(pb.Commit(run_id="r"))
    commit = pb.Commit(
        run_id="r", ballot=pb.Ballot(), next_view=pb.View(), contributors=[pb.Contribution(machine=1, count=1)]
    )
    bad = pb.LogEntry(commit=commit, gradients=[pb.GradientPush(sender=2, count=1, payload=b"x")])
    with pytest.raises(P.Rejected, match="does not match contributor"):
        wire.entry_from_pb(bad)
    with pytest.raises(P.Rejected, match="previous decision digest has 31 bytes"):
        wire.prepare_reply_from_pb(pb.PrepareReply(iteration=3, previous=b"x" * 31))
    for decode, msg in (
        (wire.push_from_pb, pb.GradientPush(previous=b"x" * 33)),
        (wire.prepare_from_pb, pb.PrepareRequest(ballot=pb.Ballot(), previous=b"x" * 33)),
        (wire.commit_from_pb, pb.Commit(ballot=pb.Ballot(), next_view=pb.View(), previous=b"x" * 33)),
    ):
        with pytest.raises(P.Rejected, match="previous has 33 bytes; at most 32"):
            decode(msg)


def test_one_byte_per_projected_gradient_in_a_push():
    """The payload field holds exactly one byte per projected gradient; the envelope is fixed."""
    sizes = [wire.push_to_pb(P.Push("run-0123456789ab", 3, 1234, n, b"\x80" * n)).ByteSize() for n in (1, 16, 100)]
    assert sizes[1] - sizes[0] == 15 and sizes[2] - sizes[1] == 84
    w = wire.wire_size(wire.push_to_pb(P.Push("r", 0, 0, 16, b"\x80" * 16)), kind="request", token="tok")
    assert (
        w
        == wire.push_to_pb(P.Push("r", 0, 0, 16, b"\x80" * 16)).ByteSize()
        + wire.REQUEST_OVERHEAD
        + wire.TOKEN_OVERHEAD
        + 3
    )
