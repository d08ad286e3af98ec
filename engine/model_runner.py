"""Model runner: owns the weights and the paged KV tensors, runs one scheduled step, samples."""
from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

import torch

from common.hashing import model_fingerprint
from engine.attention import AttentionMetadata, ForwardContext, set_forward_context
from engine.config import EngineConfig
from engine.loader import iterate_weights
from engine.models import build_model
from engine.prompt_logprobs import compute_prompt_logprobs
from engine.sampler import Sampler
from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from engine.kv_connector import KVConnectorBase

logger = logging.getLogger(__name__)

# Config entries that say where or with what the checkpoint was written, not what the model is:
# they must not split the fingerprint between nodes that load the same model from different paths.
_NON_IDENTITY_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")


def load_hf_config(model_dir: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read a Hugging Face config from {model_dir!r}: {str(exc).splitlines()[0]}") from None


def resolve_dtype(requested: str, hf_config: Any) -> torch.dtype:
    """'auto' means the checkpoint's dtype (float32 when the config does not say)."""
    if requested != "auto":
        return getattr(torch, requested)
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    return value if isinstance(value, torch.dtype) else getattr(torch, str(value).replace("torch.", ""))


class ModelRunner:
    """Flattens a SchedulerOutput into one batch, runs the model over paged KV, samples tokens."""

    def __init__(self, config: EngineConfig, connector: KVConnectorBase | None = None) -> None:
        self.config = config
        self.connector = connector
        model_dir = config.model.model
        self.hf_config = load_hf_config(model_dir)
        cfg = self.hf_config
        self.dtype = resolve_dtype(config.model.dtype, cfg)
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.block_size = config.cache.block_size
        self.max_model_len = self._max_model_len()

        self.model = build_model(cfg, self.dtype, max_positions=self.max_model_len)
        self.model.load_weights(iterate_weights(model_dir))
        self.model.eval()
        self.sampler = Sampler(config.model.seed)

        dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        self.bytes_per_block_layer = 2 * self.block_size * self.num_kv_heads * self.head_dim * dtype_bytes
        self.num_blocks = config.cache.kv_cache_memory // (self.num_layers * self.bytes_per_block_layer)
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory={config.cache.kv_cache_memory} bytes is less than one block for "
                             f"all layers ({self.num_layers * self.bytes_per_block_layer} bytes)")
        logger.info("KV block size: 2 x %d tokens x %d kv heads x %d head dim x %d bytes (%s) = %d bytes/block/layer",
                    self.block_size, self.num_kv_heads, self.head_dim, dtype_bytes, str(self.dtype).removeprefix(
                        "torch."), self.bytes_per_block_layer)
        logger.info("KV cache: %d bytes budget // (%d layers x %d bytes/block/layer) = %d blocks (%d tokens, "
                    "%.1f MiB)", config.cache.kv_cache_memory, self.num_layers, self.bytes_per_block_layer,
                    self.num_blocks, self.num_blocks * self.block_size,
                    self.num_blocks * self.num_layers * self.bytes_per_block_layer / 2**20)
        # Zeroed, not empty: padded attention reads of unused slots must be finite.
        self.kv_caches = [torch.zeros(2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                                      dtype=self.dtype) for _ in range(self.num_layers)]
        identity = {k: v for k, v in cfg.to_dict().items() if k not in _NON_IDENTITY_KEYS}
        self.fingerprint = model_fingerprint(identity, str(self.dtype), self.num_layers, self.num_kv_heads,
                                             self.head_dim)
        if connector is not None:
            connector.register_kv_caches(self.kv_caches)

    def _max_model_len(self) -> int:
        cfg = self.hf_config
        limit = cfg.max_position_embeddings
        requested = self.config.model.max_model_len or limit
        if requested > limit:
            raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}")
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        if window and window < requested:
            # Within the window sliding attention equals full attention: cap the length, stay exact.
            logger.info("max_model_len capped from %d to the model's sliding window of %d tokens", requested, window)
            requested = window
        return requested

    def prepare_inputs(self, so: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """input_ids, positions, attention metadata, and the batch rows that need a sampled token."""
        ids: list[int] = []
        num_new: list[int] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for b, req in enumerate(so.scheduled_requests):
            n = so.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            ids.extend(req.all_token_ids[start:start + n])
            num_new.append(n)
            starts.append(start)
            tables.append(so.block_tables[req.request_id])
            if start + n == req.num_tokens:
                sample_rows.append(b)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        n_new = torch.tensor(num_new)
        first = torch.tensor(starts)
        req_of_token = torch.repeat_interleave(torch.arange(len(num_new)), n_new)
        query_start_loc = torch.zeros(len(num_new) + 1, dtype=torch.int32)
        torch.cumsum(n_new, 0, out=query_start_loc[1:])
        positions = torch.arange(len(ids)) - query_start_loc[:-1].long()[req_of_token] + first[req_of_token]
        slot_mapping = (block_tables[req_of_token, positions // self.block_size].long() * self.block_size
                        + positions % self.block_size)
        meta = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables,
                                 query_start_loc=query_start_loc, seq_lens=(first + n_new).to(torch.int32))
        return torch.tensor(ids), positions, meta, sample_rows

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if not so.scheduled_requests:
            return ModelRunnerOutput()
        input_ids, positions, meta, sample_rows = self.prepare_inputs(so)
        if so.blocks_to_copy:  # before anything writes this step (the connector's loads included)
            self.copy_blocks(so.blocks_to_copy)
        connector = self.connector
        if connector is not None:
            connector.start_load_kv(so.kv_connector_metadata)
        ctx = ForwardContext(attn_metadata=meta, kv_caches=self.kv_caches, connector=connector,
                             connector_metadata=so.kv_connector_metadata)
        with set_forward_context(ctx):
            hidden = self.model(input_ids, positions)
        failed: set[str] = set()
        if connector is not None:
            connector.wait_for_save()
            failed = set(connector.get_failed_loads())
        # Rows whose KV load failed are recomputed by the scheduler: their token would be wrong.
        reqs = [so.scheduled_requests[b] for b in sample_rows]
        keep = [i for i, r in enumerate(reqs) if r.request_id not in failed]
        output = ModelRunnerOutput(failed_load_req_ids=failed)
        if any(r.needs_prompt_logprobs for r in so.scheduled_requests):
            self._prompt_logprobs(so, hidden, output)
        if keep:
            last_rows = meta.query_start_loc[1:].long()[[sample_rows[i] for i in keep]] - 1
            logits = self.model.compute_logits(hidden[last_rows])
            kept = [reqs[i] for i in keep]
            # Choice 0 of an n > 1 request finishing its prompt: its forks sample from the same logits.
            forked = [(row, f) for row, r in enumerate(kept) for f in r.forks]
            if forked:
                logits = torch.cat([logits, logits[[row for row, _ in forked]]])
                kept += [f for _, f in forked]
            tokens, logprobs = self.sampler(logits, kept)
            for req, token, logprob in zip(kept, tokens, logprobs):
                output.sampled_token_ids[req.request_id] = token
                output.logprobs[req.request_id] = logprob
            for row, top in self.sampler.top_logprobs(logits, kept).items():
                output.top_logprobs[kept[row].request_id] = top
        return output

    def _prompt_logprobs(self, so: SchedulerOutput, hidden: torch.Tensor, output: ModelRunnerOutput) -> None:
        """Logprobs of the prompt tokens this step computed (such requests never load KV, so none failed)."""
        reqs = so.scheduled_requests
        num_new = [so.num_scheduled_tokens[r.request_id] for r in reqs]
        query_starts = list(itertools.accumulate(num_new, initial=0))[:-1]
        output.prompt_logprobs.update(compute_prompt_logprobs(
            self.model.compute_logits, hidden, reqs, [r.num_computed_tokens for r in reqs], num_new, query_starts))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (every layer, K and V) from source to destination ids, on the device."""
        device = self.kv_caches[0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long).to(device, non_blocking=True)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long).to(device, non_blocking=True)
        for kv in self.kv_caches:
            kv.index_copy_(1, dst, kv.index_select(1, src))
