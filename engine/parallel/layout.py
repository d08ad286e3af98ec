"""Who holds what: a rank's pipeline stage (its layers) and tensor shard (its heads, MLP units, vocabulary rows).

Ranks are numbered stage-major, as in vLLM: rank = pp_rank * tp + tp_rank. Layers split evenly across stages;
when the count does not divide, the stages before the last get one more each (vLLM's `get_pp_indices`: the
last stage also runs the final norm). Query heads, MLP units and the vocabulary (padded to a multiple of
tp) split evenly; KV heads split too, or, when tp exceeds their count, each rank holds the one its query
heads use (vLLM's replication: tp must then be a multiple of the KV head count).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def pp_layer_ranges(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[lo, hi) of each stage; stages before the last take the remainder, one layer each."""
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers")
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


@dataclass(frozen=True)
class ModelDims:
    """The full model's sizes that sharding divides (from the Hugging Face config)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_hf(cls, cfg: Any) -> ModelDims:
        heads = cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, heads, getattr(cfg, "num_key_value_heads", None) or heads,
                   getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, cfg.intermediate_size, cfg.vocab_size)


def tp_problem(d: ModelDims, tp: int) -> str | None:
    """Why `tp` ranks cannot split this model's heads and MLP; None when they can."""
    if d.num_heads % tp:
        return f"tensor_parallel_size={tp} must divide the model's {d.num_heads} attention heads"
    if d.num_kv_heads >= tp and d.num_kv_heads % tp:
        return f"tensor_parallel_size={tp} must divide the model's {d.num_kv_heads} KV heads"
    if d.num_kv_heads < tp and tp % d.num_kv_heads:
        return (f"tensor_parallel_size={tp} must be a multiple of the model's {d.num_kv_heads} KV heads to "
                "replicate them")
    if d.intermediate_size % tp:
        return f"tensor_parallel_size={tp} must divide the MLP's {d.intermediate_size} units"
    return None


def valid_tp_sizes(d: ModelDims) -> list[int]:
    """Every tensor_parallel_size this model takes (each divides its attention heads, so none exceeds them)."""
    return [tp for tp in range(1, d.num_heads + 1) if tp_problem(d, tp) is None]


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    rank: int
    dims: ModelDims

    def __post_init__(self) -> None:
        problem = tp_problem(self.dims, self.tp)
        if problem is not None:  # says which sizes would do: SmolLM2's 9 heads take 1 and 3 only
            raise ValueError(f"{problem}; this model takes tensor_parallel_size (-tp) "
                             f"{' or '.join(map(str, valid_tp_sizes(self.dims)))}")
        pp_layer_ranges(self.dims.num_layers, self.pp)  # raises when pp exceeds the layer count

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_ranks(self, pp_rank: int) -> list[int]:
        return [pp_rank * self.tp + t for t in range(self.tp)]

    @property
    def layers(self) -> tuple[int, int]:
        return pp_layer_ranges(self.dims.num_layers, self.pp)[self.pp_rank]

    @property
    def num_local_layers(self) -> int:
        lo, hi = self.layers
        return hi - lo

    @property
    def heads(self) -> tuple[int, int]:
        n = self.dims.num_heads // self.tp
        return self.tp_rank * n, (self.tp_rank + 1) * n

    @property
    def kv_heads(self) -> tuple[int, int]:
        """[h0, h1) of the model's KV heads this rank holds (one replicated head when tp > KV heads)."""
        kv, tp, r = self.dims.num_kv_heads, self.tp, self.tp_rank
        if kv < tp:
            head = r // (tp // kv)
            return head, head + 1
        n = kv // tp
        return r * n, (r + 1) * n

    @property
    def kv_writer(self) -> bool:
        """Whether this rank writes its KV heads to a store: of replicas, only the first does."""
        kv, tp = self.dims.num_kv_heads, self.tp
        return kv >= tp or self.tp_rank % (tp // kv) == 0

    @property
    def intermediate(self) -> tuple[int, int]:
        n = self.dims.intermediate_size // self.tp
        return self.tp_rank * n, (self.tp_rank + 1) * n

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.dims.vocab_size // self.tp)

    @property
    def vocab(self) -> tuple[int, int]:
        """[v0, v1) rows of the padded vocabulary (v1 may pass vocab_size: padding rows are zero)."""
        n = self.vocab_per_rank
        return self.tp_rank * n, (self.tp_rank + 1) * n

    def describe_rank(self, rank: int) -> str:
        other = ParallelLayout(self.tp, self.pp, rank, self.dims)
        lo, hi = other.layers
        h0, h1 = other.heads
        k0, k1 = other.kv_heads
        v0, v1 = other.vocab
        parts = [f"rank {rank} (pp {other.pp_rank}, tp {other.tp_rank}): layers [{lo}, {hi})",
                 f"q heads [{h0}, {h1})", f"kv heads [{k0}, {k1}){'' if other.kv_writer else ' (replica)'}"]
        if other.is_first_stage:
            parts.append(f"embedding and LM head vocab rows [{v0}, {min(v1, self.dims.vocab_size)})")
        if other.is_last_stage:
            parts.append("final norm")
        return ", ".join(parts)

    def describe(self) -> list[str]:
        """The start-up layout lines: one for the whole, one per rank."""
        return [f"parallel layout: tensor_parallel_size {self.tp} x pipeline_parallel_size {self.pp} = "
                f"{self.world_size} ranks over {self.dims.num_layers} layers, {self.dims.num_heads} q heads, "
                f"{self.dims.num_kv_heads} kv heads"] + [self.describe_rank(r) for r in range(self.world_size)]
