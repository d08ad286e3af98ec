"""What a model runner needs to know about its rank, in one place: `RankShard`.

For one process it is the identity (the whole model, every layer's KV). For a parallel engine it holds the
layout, the narrowed config and the weight slicing (engine/parallel/sharding.py), this rank's KV heads and
layers for the KV cache, and the agreement on num_blocks: every rank sizes its own cache from the same
budget (`--kv-cache-memory` is per rank, as vLLM's KV space is per worker), and the engine takes the
minimum, since rank 0's block tables address every rank's cache.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.device import Platform
from pdserve.engine.parallel.driver import ParallelDriver, start_ranks
from pdserve.engine.parallel.group import ModelShard, RankGroup
from pdserve.engine.parallel.kv_ranks import RankConnector
from pdserve.engine.parallel.layout import ModelDims, ParallelLayout
from pdserve.engine.parallel.sharding import shard_config, shard_weights
from pdserve.engine.parallel.stage import StageExecutor
from pdserve.engine.parallel.step_codec import StepLayout

logger = logging.getLogger(__name__)


class RankShard:
    def __init__(self, platform: Platform, hf_config: Any, layout: ParallelLayout | None = None,
                 group: RankGroup | None = None, ranks: Any = None) -> None:
        self.platform, self.layout, self.group, self.ranks = platform, layout, group, ranks
        dims = ModelDims.from_hf(hf_config)
        self.dims = dims
        self.hf_config = hf_config if layout is None else shard_config(hf_config, layout)
        self.model_shard = None if group is None else ModelShard.of(group)
        self.layers = (0, dims.num_layers) if layout is None else layout.layers
        kv0, kv1 = (0, dims.num_kv_heads) if layout is None else layout.kv_heads
        self.num_kv_heads = kv1 - kv0
        self.num_layers = self.layers[1] - self.layers[0]
        self.prefix = "" if layout is None else f"rank {layout.rank}: "

    @classmethod
    def make(cls, config: EngineConfig, hf_config: Any, platform: Platform, group: RankGroup | None,
             connector_factory: Any = None) -> RankShard:
        par = config.parallel
        if group is None and par.world_size == 1:
            return cls(platform, hf_config)
        if platform.is_cuda:
            raise ValueError("tensor_parallel_size / pipeline_parallel_size > 1 run on the CPU (gloo) in this "
                             "version; use --device cpu")
        if group is not None:
            return cls(platform, hf_config, group.layout, group)
        layout = ParallelLayout(par.tensor_parallel_size, par.pipeline_parallel_size, 0,
                                ModelDims.from_hf(hf_config))
        factory = None
        if config.kv_transfer.enabled and connector_factory is not None:
            factory = f"{connector_factory.__module__}:{connector_factory.__qualname__}"
        ranks, group = start_ranks(config, layout, factory)
        return cls(platform, hf_config, layout, group, ranks)

    @contextlib.contextmanager
    def stop_ranks_on_error(self) -> Iterator[None]:
        """Rank 0: the other ranks are killed if the engine fails to start (they would wait for it until
        their collective timeout); a collective broken by a rank's exit names the rank."""
        try:
            yield
        except RuntimeError as e:
            if self.ranks is None:
                raise
            failure = self.ranks.failed(e, "starting the ranks failed", wait_s=0.5)
            self.ranks.kill()
            raise failure from None
        except BaseException:
            if self.ranks is not None:
                self.ranks.kill()
            raise

    def weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(weights) if self.layout is None else shard_weights(weights, self.layout)

    def driver(self, model: Any, dtype: torch.dtype, owner: Any) -> ParallelDriver | None:
        """Rank 0's driver of a parallel engine (stopped with `owner` at the latest); None elsewhere."""
        if self.ranks is None:
            return None
        stage = StageExecutor(self.group, self.hf_config.hidden_size, dtype, model.carries_residual)
        driver = ParallelDriver(self.ranks, self.group, stage)
        weakref.finalize(owner, driver.close)
        return driver

    def connector(self, connector: Any, driver: ParallelDriver | None) -> Any:
        """Rank 0's connector as its scheduler sees it: its own plus the other ranks' (kv_ranks.py)."""
        if connector is None or driver is None:
            return connector
        driver.kv = RankConnector(connector, self.layout, driver.send_connector_step,
                                  driver.collect_reports, driver.share_failed_loads)
        return driver.kv

    def agree_num_blocks(self, num_blocks: int) -> int:
        if self.group is None:
            return num_blocks
        agreed = self.group.min_over_ranks(num_blocks)
        if self.layout.rank == 0:
            logger.info("KV cache: %d blocks on every rank (the minimum over %d ranks; this rank's own: %d)",
                        agreed, self.layout.world_size, num_blocks)
        return agreed

    def allocate_kv_caches(self, num_blocks: int, block_size: int, head_dim: int,
                           dtype: torch.dtype) -> list[torch.Tensor | None]:
        """One tensor per model layer; None for the layers other pipeline stages hold."""
        lo, hi = self.layers
        mine = self.platform.allocate_kv_caches(hi - lo, num_blocks, block_size, self.num_kv_heads, head_dim, dtype)
        return [None] * lo + mine + [None] * (self.dims.num_layers - hi)


def step_layout(inputs: Any, keep_rows: torch.Tensor | None) -> StepLayout:
    meta = inputs.attn_metadata
    return StepLayout(inputs.input_ids, inputs.positions, meta.slot_mapping, meta.query_start_loc_cpu,
                      meta.seq_lens_cpu, meta.block_tables, keep_rows)
