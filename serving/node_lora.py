"""The LoRA adapters of a P/D node as the gRPC wire names them (protos: LoRAAdapter, name + fingerprint).

The node serves adapters by name exactly as pd-serve does (serving/lora_modules.py: --lora-modules,
/v1/load_lora_adapter); this adds what the proxy needs: each adapter's content fingerprint, reported in the
Health reply (the proxy routes an adapter's requests only to nodes that serve it, and a request's decode
only to nodes serving the weights its prefill ran under), and checked on every call that pins one.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pdserve.protos import pdserve_pb2 as pb
from pdserve.serving.protocol_fields import APIError

if TYPE_CHECKING:
    from pdserve.engine.lora.adapter import LoRAAdapter
    from pdserve.engine.lora.request import LoRARequest


class NodeLoRAs:
    """Resolves a call's LoRAAdapter to the node's LoRARequest; fingerprints cached per load (lora_int_id)."""

    def __init__(self, server: Any) -> None:
        self.server = server  # serving.server.OpenAIServer: its `loras` table is the one the HTTP API changes
        self._fingerprints: dict[int, str] = {}

    def _loaded(self, request: LoRARequest) -> LoRAAdapter | None:
        manager = self.server.engine.model_runner.lora
        try:  # the step thread may be changing the LRU right now: a miss only means a read below
            loaded = manager.loaded()
        except RuntimeError:
            return None
        return next((a for a in loaded if a.int_id == request.lora_int_id and a.path == request.lora_path), None)

    async def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter's weights as the engine holds them, or read from its directory (off the event loop;
        an adapter the engine dropped from memory beyond --max-cpu-loras)."""
        adapter = self._loaded(request)
        if adapter is None:
            try:
                adapter = await asyncio.to_thread(self.server.engine.model_runner.lora.read, request)
            except ValueError as e:  # its directory changed or vanished since it was loaded
                raise APIError(404, f"The lora adapter '{request.lora_name}' cannot be read: {e}",
                               type="NotFoundError", param="model", code="lora_not_found") from None
        self._fingerprints[request.lora_int_id] = adapter.fingerprint
        return adapter

    async def fingerprint(self, request: LoRARequest) -> str:
        known = self._fingerprints.get(request.lora_int_id)
        return known if known is not None else (await self.adapter(request)).fingerprint

    async def resolve(self, lora: pb.LoRAAdapter | None) -> LoRARequest | None:
        """The LoRARequest a call names (None: the base model): vLLM's 404 for a name this node does not
        serve, and for one it serves with other weights than the call pins."""
        if lora is None or not lora.name:
            return None
        _, request = self.server.loras.resolve(lora.name)
        if request is not None and lora.fingerprint and lora.fingerprint != await self.fingerprint(request):
            raise APIError(404, f"The lora adapter '{lora.name}' is served here with other weights "
                           f"(fingerprint {(await self.fingerprint(request))[:12]}, not {lora.fingerprint[:12]})",
                           type="NotFoundError", param="model", code="lora_not_found")
        return request

    async def served(self) -> list[pb.LoRAAdapter]:
        """Every adapter served by name, with its fingerprint (the Health reply)."""
        out = []
        for name, request in list(self.server.loras.adapters.items()):
            try:
                out.append(pb.LoRAAdapter(name=name, fingerprint=await self.fingerprint(request)))
            except APIError:  # unreadable now: not reported, so the proxy routes it elsewhere
                continue
        self._fingerprints = {k: v for k, v in self._fingerprints.items()
                              if k in {r.lora_int_id for r in self.server.loras.adapters.values()}}
        return out
