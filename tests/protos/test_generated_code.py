"""The committed gRPC code is what grpcio-tools 1.78.0 generates from protos/pdserve.proto."""
from __future__ import annotations

from importlib.metadata import version

from pdserve.protos import generate as gen


def test_grpc_tools_is_the_pinned_version():
    # newer grpcio-tools emit protobuf-7 code that does not import under the protobuf 6 runtime
    assert version("grpcio-tools") == "1.78.0"


def test_committed_generated_code_is_current(tmp_path):
    fresh = gen.generate(tmp_path)
    for path in fresh:
        committed = gen.REPO / "protos" / path.name
        assert committed.read_text() == path.read_text(), \
            f"{committed} is stale: run `python -m pdserve.protos.generate` and commit the result"


def test_generated_messages_round_trip():
    from pdserve.protos import pdserve_pb2 as pb

    req = pb.GenerateRequest(request_id="r1", prompt=pb.Prompt(token_ids=pb.TokenIds(ids=[5, 6, 7])),
                             params=pb.SamplingParams(max_tokens=3, seed=4), cache_salt="t")
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back.prompt.WhichOneof("kind") == "token_ids" and list(back.prompt.token_ids.ids) == [5, 6, 7]
    assert back.params.HasField("seed") and back.params.seed == 4
    assert not pb.SamplingParams().HasField("seed")
