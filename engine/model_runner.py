"""Model runner: owns the weights and the paged KV tensors, runs one scheduled step, samples.

Every tensor lives on the engine's one device (engine/device.py says where each is placed).
Per step the host builds the batch metadata once (engine/input_batch.py), the forward pass
runs on the device with the attention backend chosen at start-up, and the sampled ids come
back in the step's only device->host transfer.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from pdserve.common.hashing import model_fingerprint
from pdserve.engine import kv_cache_sizing
from pdserve.engine.attention import ForwardContext, select_attention_backend, set_forward_context
from pdserve.engine.config import EngineConfig
from pdserve.engine.device import Platform, resolve_device
from pdserve.engine.input_batch import InputBatchBuilder, StepInputs
from pdserve.engine.loader import iterate_weights
from pdserve.engine.lora.manager import LoRAManager
from pdserve.engine.models import build_model
from pdserve.engine.parallel import setup as parallel_setup
from pdserve.engine.prompt_logprobs import compute_prompt_logprobs
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pdserve.engine.kv_connector import KVConnectorBase
    from pdserve.engine.parallel.group import RankGroup

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

    def __init__(self, config: EngineConfig, connector: KVConnectorBase | None = None,
                 group: RankGroup | None = None, connector_factory: Any = None) -> None:
        """`group`: given on ranks other than 0 (engine/parallel/worker.py); rank 0 of a parallel engine
        starts the other ranks itself, each making its KV connector with `connector_factory`."""
        self.config = config
        self.connector = connector
        model_dir = config.model.model
        self.hf_config = load_hf_config(model_dir)
        cfg = self.hf_config
        self.platform = Platform(resolve_device(config.device.device))
        self.device = device = self.platform.device
        self.dtype = resolve_dtype(config.model.dtype, cfg)
        # The whole model's counts (the fingerprint and the store's objects are layout-free); this rank's
        # share of them is self.shard (engine/parallel/setup.py).
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.block_size = config.cache.block_size
        self.max_model_len = self._max_model_len()

        snapshot = kv_cache_sizing.MemorySnapshot.take(self.platform) if self.platform.is_cuda else None
        self.shard = shard = parallel_setup.RankShard.make(config, cfg, self.platform, group,
                                                                  connector_factory)
        with shard.stop_ranks_on_error():  # a parallel engine that fails to start leaves no rank behind
            with torch.device(device):  # parameters and buffers are created on the engine's device
                self.model = build_model(shard.hf_config, self.dtype, max_positions=self.max_model_len,
                                         shard=shard.model_shard)
            self.model.load_weights(shard.weights(iterate_weights(model_dir, device)))
            self.model.eval()
            # LoRA wraps the linear layers once the base weights are packed (EngineConfig refuses it with -tp/-pp)
            self.lora = LoRAManager(config.lora, self.model, cfg.hidden_size, device, self.dtype) if config.lora.enable_lora \
                else None
            self.driver = shard.driver(self.model, self.dtype, self)
            self.attn_backend = select_attention_backend(device, config.device.attention_backend)
            self.sampler = Sampler(config.model.seed, device)
            sc = config.scheduler
            self.inputs = InputBatchBuilder(self.platform, self.block_size, sc.max_num_batched_tokens, sc.max_num_seqs,
                                            -(-self.max_model_len // self.block_size))

            dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
            kv_heads, layers = shard.num_kv_heads, shard.num_layers  # this rank's
            self.bytes_per_block_layer = 2 * self.block_size * kv_heads * self.head_dim * dtype_bytes
            budget = kv_cache_sizing.fixed_budget(config.cache, self.platform)
            if budget is None:
                budget = self._profile_kv_budget(snapshot)
            self.kv_cache_memory = budget
            self.num_blocks = budget // (layers * self.bytes_per_block_layer)
            if self.num_blocks < 1:
                raise ValueError(f"kv_cache_memory={budget} bytes is less than one block for "
                                 f"all layers ({layers * self.bytes_per_block_layer} bytes)")
            logger.info("%sKV block size: 2 x %d tokens x %d kv heads x %d head dim x %d bytes (%s) = %d "
                        "bytes/block/layer", shard.prefix, self.block_size, kv_heads, self.head_dim, dtype_bytes,
                        str(self.dtype).removeprefix("torch."), self.bytes_per_block_layer)
            logger.info("%sKV cache: %d bytes budget // (%d layers x %d bytes/block/layer) = %d blocks (%d tokens, "
                        "%.1f MiB) on %s", shard.prefix, budget, layers, self.bytes_per_block_layer,
                        self.num_blocks, self.num_blocks * self.block_size,
                        self.num_blocks * layers * self.bytes_per_block_layer / 2**20, self.platform.describe())
            self.num_blocks = shard.agree_num_blocks(self.num_blocks)
            self.kv_caches = shard.allocate_kv_caches(self.num_blocks, self.block_size, self.head_dim, self.dtype)
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

    # ---- memory profiling (CUDA) ----
    def _profile_kv_budget(self, snapshot: kv_cache_sizing.MemorySnapshot) -> int:
        """Run one max-batch forward over a one-block scratch cache; the KV gets what is left of the budget."""
        device = self.device
        after_load = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        sc = self.config.scheduler
        num_tokens = min(sc.max_num_batched_tokens, sc.max_num_seqs * self.max_model_len)
        num_reqs = min(sc.max_num_seqs, num_tokens)
        scratch = self.platform.allocate_kv_caches(self.num_layers, 1, self.block_size, self.num_kv_heads,
                                                   self.head_dim, self.dtype)
        with torch.inference_mode():
            inputs = self._dummy_batch(num_tokens, num_reqs)
            hidden = self._forward(inputs, scratch)
            self.compute_logits(hidden[inputs.logits_indices]).argmax(dim=-1)  # the logits' memory too
        del scratch, hidden
        profile = kv_cache_sizing.measure_profile(
            self.platform, snapshot, after_load, torch.cuda.max_memory_allocated(device),
            kv_cache_sizing.utilization(self.config.cache),
            profiled=f"one forward of {num_tokens} tokens in {num_reqs} sequences")
        logger.info("%s", profile.describe())
        profile.check(device)
        return profile.kv_budget

    def _dummy_batch(self, num_tokens: int, num_reqs: int) -> StepInputs:
        """num_reqs sequences sharing num_tokens prompt tokens, every one sampled; all slots in block 0."""
        sizes = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
        requests = [Request(f"profile-{i}", [0] * n, SamplingParams(max_tokens=1)) for i, n in enumerate(sizes)]
        so = SchedulerOutput(scheduled_requests=requests,
                             num_scheduled_tokens={r.request_id: r.num_tokens for r in requests},
                             block_tables={r.request_id: [0] * -(-r.num_tokens // self.block_size) for r in requests},
                             total_num_scheduled_tokens=num_tokens)
        inputs = self.inputs.prepare(so)
        inputs.attn_metadata.slot_mapping.remainder_(self.block_size)  # every write lands in block 0
        return inputs

    # ---- one step ----
    def _forward(self, inputs: StepInputs, kv_caches: list[torch.Tensor], connector: KVConnectorBase | None = None,
                 connector_metadata: Any = None, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the whole batch, or of `keep_rows` only."""
        ctx = ForwardContext(attn_metadata=inputs.attn_metadata, kv_caches=kv_caches, attn_backend=self.attn_backend,
                             connector=connector, connector_metadata=connector_metadata)
        with set_forward_context(ctx):
            if self.driver is None:
                return self.model(inputs.input_ids, inputs.positions, keep_rows)
            return self.driver.forward(parallel_setup.step_layout(inputs, keep_rows),
                                       lambda carry: self.model(inputs.input_ids, inputs.positions, keep_rows, carry))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits of hidden rows (gathered over the tensor-parallel ranks)."""
        if self.driver is None:
            return self.model.compute_logits(hidden)
        return self.driver.compute_logits(self.model, hidden)

    def make_connector(self, factory: Any) -> KVConnectorBase | None:
        """The engine's connector, `factory(config, self)`; with other ranks, one that drives theirs too
        (engine/parallel/kv_ranks.py). If it cannot be made, the other ranks stop."""
        with self.shard.stop_ranks_on_error():
            return self.shard.connector(factory(self.config, self), self.driver)

    def shutdown(self) -> None:
        """Stop the other ranks of a parallel engine (nothing to do for one process)."""
        if self.driver is not None:
            self.driver.close()

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.blocks_to_copy:  # before anything writes this step (the connector's loads included)
            self.copy_blocks(so.blocks_to_copy)
        connector = self.connector
        if not so.scheduled_requests:  # nothing to compute: only the connector's background I/O moves
            output = ModelRunnerOutput()
            if connector is not None and so.kv_connector_metadata is not None:
                connector.start_load_kv(so.kv_connector_metadata)
                self._finish_connector_step(so, output)
            return output
        inputs = self.inputs.prepare(so)
        if self.lora is not None:
            self.lora.prepare(inputs)
        if connector is not None:
            connector.start_load_kv(so.kv_connector_metadata)
        # Only the sampled rows go past the last layer's attention (docs/architecture.md, "Last-layer
        # rows"), unless prompt logprobs need every row or every row is sampled anyway.
        prompt_logprobs = any(r.needs_prompt_logprobs for r in inputs.requests)
        all_rows = prompt_logprobs or len(inputs.sample_rows) == so.total_num_scheduled_tokens
        hidden = self._forward(inputs, self.kv_caches, connector, so.kv_connector_metadata,
                               None if all_rows else inputs.logits_indices)
        sampled = hidden[inputs.logits_indices] if all_rows else hidden  # one row per sample_rows entry
        output = ModelRunnerOutput()
        if connector is not None:
            self._finish_connector_step(so, output)
        failed = output.failed_load_req_ids
        # Rows whose KV load failed are recomputed by the scheduler: their token would be wrong.
        reqs = [inputs.requests[b] for b in inputs.sample_rows]
        keep = [i for i, r in enumerate(reqs) if r.request_id not in failed]
        if prompt_logprobs:
            self._prompt_logprobs(so, inputs, hidden, output)
        if keep:
            logits = self.compute_logits(sampled if len(keep) == len(reqs) else sampled[keep])
            kept = [reqs[i] for i in keep]
            # Choice 0 of an n > 1 request finishing its prompt: its forks sample from the same logits.
            forked = [(row, f) for row, r in enumerate(kept) for f in r.forks]
            if forked:
                logits = torch.cat([logits, logits[[row for row, _ in forked]]])
                kept += [f for _, f in forked]
            tokens, logprobs = self.sampler(logits, kept)
            for req, token, logprob in zip(kept, tokens, logprobs):
                output.sampled_token_ids[req.request_id] = token
                if logprob is not None:
                    output.logprobs[req.request_id] = logprob
            for row, top in self.sampler.top_logprobs(logits, kept).items():
                output.top_logprobs[kept[row].request_id] = top
        return output

    def _prompt_logprobs(self, so: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor,
                         output: ModelRunnerOutput) -> None:
        """Logprobs of the prompt tokens this step computed (such requests never load KV, so none failed)."""
        reqs = inputs.requests  # batch order (single-token requests first), which `hidden` follows
        num_new = [so.num_scheduled_tokens[r.request_id] for r in reqs]
        query_starts = inputs.attn_metadata.query_start_loc_cpu[:-1]
        output.prompt_logprobs.update(compute_prompt_logprobs(
            self.compute_logits, hidden, reqs, [r.num_computed_tokens for r in reqs], num_new, query_starts))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (every layer, K and V) from source to destination ids, on the device."""
        if self.driver is not None:
            self.driver.copy_blocks(pairs)
        kv_caches = [kv for kv in self.kv_caches if kv is not None]  # a pipeline stage holds its layers only
        device = kv_caches[0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long).to(device, non_blocking=True)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long).to(device, non_blocking=True)
        for kv in kv_caches:
            kv.index_copy_(1, dst, kv.index_select(1, src))

    def _finish_connector_step(self, so: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """Hand this step's saves to the background, then collect what the connector's I/O finished."""
        connector = self.connector
        connector.wait_for_save()
        sending, recving = connector.get_finished(so.finished_req_ids)
        output.finished_sending = set(sending or ())
        output.finished_recving = set(recving or ())
        output.failed_load_req_ids = set(connector.get_failed_loads())
