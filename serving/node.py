"""The P/D node launcher behind `pd-prefill` and `pd-decode`: pd-serve's HTTP server plus the gRPC servicer.

Shared by both roles; `prefill_node` and `decode_node` only pick the defaults (NodeRole).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
from typing import Any, Callable
from urllib.parse import urlsplit

import grpc

from pdserve.engine.config import KVRole, KVTransferConfig
from pdserve.kvstore import registry
from pdserve.kvstore.registry import ServedBy
from pdserve.protos import KEEPALIVE_SERVER_OPTIONS, MESSAGE_LIMITS
from pdserve.protos import pdserve_pb2_grpc as pb_grpc
from pdserve.serving.announce import (Announcer, add_fleet_args, advertised_host, check_registry, host_port,
                                      node_announcer)
from pdserve.serving.auth import GrpcSecurity, add_node_security_args, http_api_key_middleware, node_interceptors, node_security
from pdserve.serving.cli import ArgumentParser, add_engine_args, add_log_file, add_server_args, config_default
from pdserve.serving.errors import StartupError
from pdserve.serving.http import listen_socket
from pdserve.serving.kv_events import KVEventPublisher, node_publisher
from pdserve.serving.kv_transfer_flag import apply_kv_transfer_config, check_connector_store, parse_kv_transfer_config
from pdserve.serving.node_grpc import NodeServicer
from pdserve.serving.server import run_node, serve
from pdserve.serving.startup import check_model_dir

logger = logging.getLogger(__name__)


def default_kv_store() -> str:
    """file:// store under the user's pdserve cache directory (shared by nodes on one host)."""
    from pdserve.common.paths import kvstore_dir

    return kvstore_dir().resolve().as_uri()


@dataclasses.dataclass(frozen=True)
class NodeRole:
    """What distinguishes `pd-prefill` from `pd-decode`: defaults only."""

    name: str  # prefill | decode
    kv_role: str  # kv_producer | kv_consumer
    http_port: int
    grpc_port: int


def build_parser(role: NodeRole) -> ArgumentParser:
    parser = ArgumentParser(prog=f"pd-{role.name}", description=f"pdserve {role.name} node: OpenAI HTTP API plus "
                            "the gRPC control plane for pd-proxy, with a KV connector")
    add_server_args(parser, default_port=role.http_port)
    g = parser.add_argument_group("P/D node")
    g.add_argument("--grpc-port", type=int, default=role.grpc_port,
                   help=f"gRPC port for pd-proxy (default {role.grpc_port}; 0 picks a free one)")
    lmcache = registry.scheme_names(registry.entries(ServedBy.LMCACHE))
    g.add_argument("--kv-store", default=None, help=f"shared KV store: {registry.url_forms()} ({lmcache} through "
                   "LMCache); default file:// under ~/.cache/pdserve/kvstore")
    g.add_argument("--lmcache-config", default=None, help="LMCache YAML config (instead of --kv-store)")
    g.add_argument("--chunk-size", type=int, default=None,
                   help=f"tokens per stored chunk (default {config_default(KVTransferConfig, 'chunk_size')})")
    g.add_argument("--kv-role", choices=[*(r.value for r in KVRole), "producer", "consumer", "both"],
                   default=None, help=f"KV connector role, vLLM's kv_role (default {role.kv_role}; "
                   "producer, consumer and both are accepted too)")
    g.add_argument("--kv-load-timeout", dest="load_timeout_s", type=float, default=None,
                   help="seconds to wait for the store before recomputing "
                        f"(default {config_default(KVTransferConfig, 'load_timeout_s'):g})")
    g.add_argument("--kv-transfer-config", type=parse_kv_transfer_config, default=None,
                   help="vLLM's KV transfer JSON instead of the flags above, e.g. '{\"kv_connector\": "
                   "\"StoreConnector\", \"kv_role\": \"kv_producer\", \"kv_connector_extra_config\": "
                   "{\"kv_store\": \"redis://host:6379/0\"}}' (connectors: StoreConnector, "
                   "SharedStorageConnector, LMCacheConnectorV1; docs/configuration.md)")
    g.add_argument("--role", choices=[role.name, "auto"], default=role.name,
                   help=f"auto: start as {role.name} and switch between prefill and decode when the proxy's planner "
                        "says so (SetRole: drains, keeps its engine and prefix cache, re-announces in --fleet-registry; "
                        "its --kv-role defaults to kv_both). Default: " + role.name)
    g.add_argument("--log-file", default=None, help="also write the log here (for pd-kv-hits)")
    g.add_argument("--kv-events", default=None, metavar="redis://HOST:PORT/DB",
                   help="publish what enters and leaves this node's prefix cache (and what it commits to the store) "
                        "as chunk keys on this Redis's stream, for a pd-proxy --policy kv-aware --kv-events with the "
                        "same URL (vLLM's --kv-events-config; docs/operations.md). The node is named by "
                        "--advertise-address or --host and its gRPC port, as the proxy dials it")
    add_node_security_args(parser)
    add_fleet_args(parser)
    add_engine_args(parser)
    return parser


def check_store(url: str, timeout_s: float = 3.0) -> None:
    """Fail start-up with one line when the store cannot be reached (before loading any weights)."""
    entry = registry.lookup(url)
    if entry is not None and entry.served_by is ServedBy.LMCACHE:  # LMCache's protocol: a TCP connect is our check
        try:
            address = entry.address(url)
        except ValueError as e:  # a port that is no number, a URL naming no server
            raise StartupError(f"KV store {url} unusable: {e}") from None
        try:
            socket.create_connection(address, timeout=timeout_s).close()
        except OSError as e:
            raise StartupError(f"LMCache server {urlsplit(url).netloc} unreachable: {e.strerror or e}") from None
        return
    from pdserve.kvstore import StoreError, open_store

    try:  # one real round trip: redis connects lazily
        with open_store(url, timeout=timeout_s, fingerprint="0" * 32) as store:
            store.lookup(["0" * 32])
            unbounded, bound = store.bounds_warning(), store.bounds_note()
    except (StoreError, ValueError, OSError) as e:
        raise StartupError(f"KV store {url} unusable: {e}") from None
    if unbounded:
        logger.warning(unbounded)
    if bound:  # the file store's default bound (kvstore/fs_space.py): which one this node's store got
        logger.info(bound)


async def serve_with_grpc(server: Any, servicer: NodeServicer, sock: socket.socket, grpc_host: str,
                          grpc_port: int, prog: str, shutdown_timeout: float,
                          security: GrpcSecurity = GrpcSecurity(),
                          announce: Callable[[int], Announcer] | None = None,
                          kv_events: Callable[[int], KVEventPublisher | None] | None = None) -> None:
    """`announce`: given the bound gRPC port, the node's fleet announcer (serving/announce.py), if it has one;
    `kv_events` likewise its KV event publisher (serving/kv_events.py), started."""
    # No SO_REUSEPORT (grpc's default): with it a second node given a taken port binds it too, says ready,
    # and the kernel splits the proxy's connections between the two processes.
    grpc_server = grpc.aio.server(options=[*MESSAGE_LIMITS, *KEEPALIVE_SERVER_OPTIONS, ("grpc.so_reuseport", 0)],
                                  interceptors=node_interceptors(security))
    pb_grpc.add_PDNodeServicer_to_server(servicer, grpc_server)
    credentials = security.server_credentials()
    try:
        address = f"{grpc_host}:{grpc_port}"
        bound = grpc_server.add_insecure_port(address) if credentials is None else \
            grpc_server.add_secure_port(address, credentials)
    except RuntimeError as e:  # taken since the start-up check
        raise StartupError(f"cannot listen on {grpc_host}:{grpc_port} (gRPC): {e}") from None
    if security.api_key:
        server.app.middlewares.append(http_api_key_middleware(security.api_key))
    logger.log(*security.describe_server(f"{grpc_host}:{bound}"))
    await grpc_server.start()
    announcer = announce(bound) if announce is not None else None
    if announcer is not None:
        announcer.start()  # announces once the engine accepts; withdraws as the drain begins
        servicer.on_role_change = announcer.change_role  # --role auto: SetRole re-announces under the new role
    publisher = kv_events(bound) if kv_events is not None else None
    try:
        await serve(server, sock, f"{prog} [gRPC {grpc_host}:{bound}]", shutdown_timeout)
    finally:
        if announcer is not None:
            await announcer.stop()
        if publisher is not None:
            await asyncio.to_thread(publisher.stop)
        await grpc_server.stop(grace=1.0)
        # The connector's threads and connections (LMCache's especially) would keep the process alive.
        await asyncio.to_thread(server.engine.shutdown)


def node_main(role: NodeRole, argv: list[str] | None = None) -> int:
    parser = build_parser(role)
    args = parser.parse_args(argv)
    connector = apply_kv_transfer_config(parser, args)
    if args.role == "auto":  # a node that may serve either role saves and loads KV alike
        if args.kv_role not in (None, KVRole.BOTH.value, "both"):
            parser.error(f"--role auto needs --kv-role kv_both (the node saves KV as prefill and loads it as "
                         f"decode), not {args.kv_role}")
        args.kv_role = KVRole.BOTH.value
    if args.kv_role is None:
        args.kv_role = role.kv_role
    if args.kv_store is None and args.lmcache_config is None:
        args.kv_store = default_kv_store()

    security = node_security(args)

    def preflight() -> None:
        try:
            security.check(server=True)
        except ValueError as e:
            raise StartupError(str(e)) from None
        if args.log_file:
            try:
                add_log_file(args.log_file)
            except OSError as e:
                raise StartupError(f"cannot write log file {args.log_file}: {e.strerror or e}") from None
        if args.model is not None:
            check_model_dir(args.model)  # cheap checks first: the store checks import torch
        if connector is not None:
            try:
                check_connector_store(connector, args.kv_store, args.lmcache_config)
            except ValueError as e:
                raise StartupError(str(e)) from None
        if args.lmcache_config and not os.access(args.lmcache_config, os.R_OK):
            raise StartupError(f"cannot read LMCache config {args.lmcache_config}")
        for what, url in (("fleet registry", args.fleet_registry), ("KV events Redis", args.kv_events)):
            if url:
                try:
                    advertised_host(args)  # both name the node by the address proxies dial
                    check_registry(url, what=what)
                except ValueError as e:
                    raise StartupError(str(e)) from None
        if args.grpc_port:  # a taken gRPC port fails here, before any weights load (the HTTP port's: run_node)
            listen_socket(args.host, args.grpc_port, "gRPC").close()
        if args.kv_store:  # last: a usable store logs its bound, and a failed start-up says one line only
            check_store(args.kv_store)

    async def run(server: Any, sock: socket.socket) -> None:
        servicer = NodeServicer(server, role.name, http_port=sock.getsockname()[1], switchable=args.role == "auto")

        def kv_events(grpc_port: int) -> KVEventPublisher | None:
            return node_publisher(args.kv_events, server.engine, host_port(advertised_host(args), grpc_port))

        await serve_with_grpc(server, servicer, sock, args.host, args.grpc_port, parser.prog, args.shutdown_timeout,
                              security, node_announcer(args, server, role.name, sock.getsockname()[1]),
                              kv_events if args.kv_events else None)

    return run_node(args, parser.prog, preflight=preflight, run=run)
