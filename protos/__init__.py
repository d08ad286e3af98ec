"""pdserve's gRPC control plane: the proxy <-> node wire format (pdserve.proto) and its channel options."""
from __future__ import annotations

# Both ends of every channel: a long prompt's token ids (or a long prefill reply) exceeds gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 << 20
MESSAGE_LIMITS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]

# Across hosts a dead peer is silent (a partition or a power cut sends no RST): HTTP/2 keepalive pings
# every 5 s, unanswered for 5 s, fail the connection and every call on it (UNAVAILABLE) instead of
# leaving a Prefill or a stream waiting forever. The proxy's channels ping (KEEPALIVE_CLIENT_OPTIONS);
# nodes must accept pings that often, even between calls (KEEPALIVE_SERVER_OPTIONS).
KEEPALIVE_CLIENT_OPTIONS = [("grpc.keepalive_time_ms", 5000), ("grpc.keepalive_timeout_ms", 5000),
                            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
KEEPALIVE_SERVER_OPTIONS = [("grpc.keepalive_permit_without_calls", 1),
                            ("grpc.http2.min_recv_ping_interval_without_data_ms", 4000),
                            ("grpc.http2.max_ping_strikes", 0)]
