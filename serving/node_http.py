"""Generate over the node's HTTP port (the wire format: serving/delta_frames.py).

The same call as the gRPC servicer's Generate (serving/node_grpc.py owns it: validation,
heartbeats, outcome counting), put on the node's aiohttp app so the proxy's decode streams skip
grpc.aio. A proxy that leaves closes the connection; the server's handler cancellation
(serving/http.py) then closes the call's generators, which aborts the request in the engine.
"""
from __future__ import annotations

import contextlib

from aiohttp import web
from google.protobuf.message import DecodeError

from pdserve.protos import pdserve_pb2 as pb
from pdserve.serving import delta_frames as frames
from pdserve.serving.delta_frames import CallFailed
from pdserve.serving.protocol import bad_request

SERVICER = web.AppKey("pd_node_servicer", object)


def add_generate_route(app: web.Application, servicer: object) -> None:
    app[SERVICER] = servicer
    app.router.add_post(frames.PATH, _generate)


async def _generate(request: web.Request) -> web.StreamResponse:
    if request.content_type != frames.REQUEST_TYPE:
        raise bad_request(f"{frames.PATH} takes a serialized GenerateRequest ({frames.REQUEST_TYPE})")
    try:
        call = pb.GenerateRequest.FromString(await request.read())
    except DecodeError:
        raise bad_request("the body is not a serialized GenerateRequest") from None
    request["counted"] = True  # the servicer counts this call's outcome itself (not the middleware)
    response = web.StreamResponse(headers={"Content-Type": frames.STREAM_TYPE})
    await response.prepare(request)  # the headers leave with the first frame
    async with contextlib.aclosing(request.app[SERVICER].generate_deltas(call)) as deltas:
        try:
            async for delta, last in deltas:
                if last:  # the last frame and the end of the stream in one write
                    await response.write_eof(frames.delta_frame(delta))
                    return response
                await response.write(frames.delta_frame(delta))
        except CallFailed as e:
            await response.write_eof(frames.error_frame(e.code(), e.details()))
            return response
    await response.write_eof()
    return response
