"""Who may use a node: TLS and a shared API key on the gRPC hop from pd-proxy, the key on HTTP.

A node's gRPC port runs requests on its engine, so whoever can reach it can use the node. Two
independent guards, both optional:
  * TLS: the node serves with --grpc-tls-cert/--grpc-tls-key; given --grpc-tls-ca as well, it
    requires a client certificate signed by that CA (mutual TLS). The proxy verifies the nodes'
    certificates against its --grpc-tls-ca and, for mutual TLS, presents its own
    --grpc-tls-cert/--grpc-tls-key.
  * A shared secret: the node's --api-key; every RPC must carry `authorization: Bearer KEY`
    metadata (the proxy sends its --node-api-key), or it fails UNAUTHENTICATED.
A node with neither says so in one warning line at start-up. See deploy/README.md.
"""
from __future__ import annotations

import argparse
import hmac
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc
from aiohttp import web

from pdserve.common import env
from pdserve.serving import protocol as oai

logger = logging.getLogger(__name__)

_METADATA_KEY = "authorization"


@dataclass(frozen=True)
class GrpcSecurity:
    """One side's TLS files (PEM paths) and API key; all None: plaintext, no key."""

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    api_key: str | None = None
    server_name: str | None = None  # client side: the name node certificates must carry (default: the address)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)

    def _read(self, path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror or e}") from None

    def check(self, server: bool) -> None:
        """One-line ValueError for an unusable combination or an unreadable file."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
        if server and self.tls_ca and not self.tls_cert:
            raise ValueError("--grpc-tls-ca on a node needs --grpc-tls-cert and --grpc-tls-key (the node's own "
                             "certificate)")
        if not server and self.tls_cert and not self.tls_ca:
            raise ValueError("--grpc-tls-cert on the proxy is its client certificate for mutual TLS; give "
                             "--grpc-tls-ca too (the CA that signed the nodes' certificates)")
        for path in (self.tls_cert, self.tls_key, self.tls_ca):
            self._read(path)
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty")

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert:
            return None
        ca = self._read(self.tls_ca)
        return grpc.ssl_server_credentials([(self._read(self.tls_key), self._read(self.tls_cert))],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.tls_ca),
                                            private_key=self._read(self.tls_key),
                                            certificate_chain=self._read(self.tls_cert))

    def describe_server(self, address: str) -> tuple[int, str]:
        """(log level, the one start-up line about who can use the gRPC port at `address`)."""
        if self.tls_ca and self.api_key:
            return logging.INFO, f"gRPC {address}: mutual TLS (client certificates from --grpc-tls-ca) and API key"
        if self.tls_ca:
            return logging.INFO, f"gRPC {address}: mutual TLS (client certificates from --grpc-tls-ca)"
        if self.api_key and self.tls_cert:
            return logging.INFO, f"gRPC {address}: TLS and API key"
        if self.api_key:
            return logging.WARNING, (f"gRPC {address}: API key required, but sent in clear text (no "
                                     "--grpc-tls-cert/--grpc-tls-key)")
        how = "TLS-encrypted but" if self.tls_cert else "plaintext and"
        return logging.WARNING, (f"gRPC {address} is {how} unauthenticated: anyone who can reach it can run "
                                 "requests on this node (set --api-key, or --grpc-tls-ca for mutual TLS)")


# ---------------------------------------------------------------- HTTP (nodes and proxy)

def bearer(key: str) -> str:
    return f"Bearer {key}"


def check_http_api_key(request: web.Request, api_key: str | None) -> None:
    """401 in OpenAI's shape when /v1/* lacks `Authorization: Bearer <api_key>` (no key: open)."""
    if api_key and request.path.startswith("/v1/") and not hmac.compare_digest(
            request.headers.get("Authorization", "").encode(), bearer(api_key).encode()):
        raise oai.APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def http_api_key_middleware(api_key: str):
    """aiohttp middleware applying check_http_api_key; append it after the error middleware."""
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        check_http_api_key(request, api_key)
        return await handler(request)
    return middleware


# ---------------------------------------------------------------- gRPC, node side


class ApiKeyServerInterceptor(grpc.aio.ServerInterceptor):
    """Fails every RPC whose metadata lacks `authorization: Bearer <key>` with UNAUTHENTICATED."""

    def __init__(self, api_key: str) -> None:
        self._expected = bearer(api_key).encode()

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        sent = dict(details.invocation_metadata or ()).get(_METADATA_KEY, "")
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._expected):
            return handler
        if handler is None:
            return None
        message = "missing or wrong API key (authorization metadata)"

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # an async generator, like the handler it replaces

        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
        return grpc.unary_unary_rpc_method_handler(deny, **kw)


def add_node_security_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("who may use this node (see deploy/README.md)")
    g.add_argument("--grpc-tls-cert", default=None, metavar="PEM", help="serve gRPC over TLS with this certificate")
    g.add_argument("--grpc-tls-key", default=None, metavar="PEM", help="private key of --grpc-tls-cert")
    g.add_argument("--grpc-tls-ca", default=None, metavar="PEM",
                   help="require client certificates signed by this CA (mutual TLS)")
    g.add_argument("--api-key", default=env.optional(env.API_KEY),
                   help="require this key on every gRPC call (pd-proxy --node-api-key) and as "
                        f"`Authorization: Bearer KEY` on /v1/* (default: ${env.API_KEY.name})")


def node_security(args: argparse.Namespace) -> GrpcSecurity:
    return GrpcSecurity(args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_ca, args.api_key)


def node_interceptors(security: GrpcSecurity) -> list[grpc.aio.ServerInterceptor]:
    return [ApiKeyServerInterceptor(security.api_key)] if security.api_key else []


# ---------------------------------------------------------------- gRPC, proxy side

class _ApiKeyMetadata:
    """Adds `authorization: Bearer <key>` to a call's metadata (plaintext and TLS channels alike)."""

    def __init__(self, api_key: str) -> None:
        self._pair = (_METADATA_KEY, bearer(api_key))

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), self._pair))


class _UnaryUnaryApiKey(_ApiKeyMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


# A separate class per call type: grpc.aio files each interceptor under one type only.
class _UnaryStreamApiKey(_ApiKeyMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def add_proxy_security_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("gRPC security (proxy to nodes)")
    g.add_argument("--grpc-tls-ca", default=None, metavar="PEM",
                   help="connect to nodes over TLS, verifying their certificates against this CA")
    g.add_argument("--grpc-tls-cert", default=None, metavar="PEM",
                   help="client certificate for nodes that require mutual TLS")
    g.add_argument("--grpc-tls-key", default=None, metavar="PEM", help="private key of --grpc-tls-cert")
    g.add_argument("--grpc-tls-server-name", default=None, metavar="NAME",
                   help="name the nodes' certificates carry, when it is not the address in --prefill/--decode")
    g.add_argument("--node-api-key", default=env.optional(env.NODE_API_KEY),
                   help=f"key sent to the nodes (their --api-key) on every call (default: ${env.NODE_API_KEY.name})")


def proxy_security(args: argparse.Namespace) -> GrpcSecurity:
    return GrpcSecurity(args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_ca, args.node_api_key,
                        args.grpc_tls_server_name)


def node_channel(address: str, security: GrpcSecurity, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
    """The proxy's channel to one node: TLS when configured, the API key on every call when set."""
    interceptors = [_UnaryUnaryApiKey(security.api_key), _UnaryStreamApiKey(security.api_key)] \
        if security.api_key else None
    credentials = security.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    if security.server_name:
        options = [*options, ("grpc.ssl_target_name_override", security.server_name)]
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
