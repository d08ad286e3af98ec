"""The process groups one model runner owns, and the collectives its model and its step use.

Nothing here is process-global: a `RankGroup` is made by the model runner (rank 0) or the worker loop and
handed to the model at construction (`TPOps`), so a later engine in the same process, parallel or not,
never meets this one's peers. The groups are gloo `ProcessGroupGloo` objects built straight from a
TCPStore (no `init_process_group`); every collective has the configured timeout, because a blocked gloo
call cannot be interrupted: a hung peer fails the step instead of hanging it. Only the wait of an idle
rank for rank 0's next command is unbounded (rank 0 may idle for hours); a rank's parent watch and rank
0's supervision cover a dead peer there.
"""
from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    from pdserve.engine.parallel.layout import ParallelLayout

_IDLE_WAIT = datetime.timedelta(days=365)


class RankGroup:
    def __init__(self, store: dist.Store, layout: ParallelLayout, timeout_s: float) -> None:
        self.layout = layout
        self.rank = layout.rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.world = dist.ProcessGroupGloo(dist.PrefixStore("world", store), layout.rank, layout.world_size,
                                           self.timeout)
        if layout.pp == 1:
            self.tp = self.world
        else:  # only this stage's ranks join its tensor-parallel group
            self.tp = dist.ProcessGroupGloo(dist.PrefixStore(f"tp{layout.pp_rank}", store), layout.tp_rank,
                                            layout.tp, self.timeout)

    # ---- world ----
    def broadcast(self, t: torch.Tensor, root: int = 0, idle: bool = False) -> torch.Tensor:
        """In place; `idle`: a rank waiting for rank 0's next command waits without a deadline."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        opts.timeout = _IDLE_WAIT if idle else self.timeout
        self.world.broadcast([t], opts).wait()
        return t

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.world.allreduce([t], opts).wait()
        return int(t.item())

    def any_over_ranks(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.world.allreduce([t], opts).wait()
        return bool(t.item())

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.world.send([t.contiguous()], dst, 0).wait()

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        self.world.recv([t], src, 0).wait()
        return t

    # ---- this stage's tensor-parallel ranks ----
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.tp.allreduce([t], opts).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.layout.tp)]
        self.tp.allgather([out], [t]).wait()
        return out

    def shutdown(self) -> None:
        for pg in {id(self.world): self.world, id(self.tp): self.tp}.values():
            try:
                pg.shutdown()
            except (RuntimeError, AttributeError):  # a peer already gone
                pass


class TPOps:
    """What a model does across its tensor-parallel ranks; with no group every op is the identity.

    The models call these at the three places TP needs them: the embedding (masked lookup of this rank's
    vocabulary rows, summed), after o_proj and down_proj (sum of the partial products), and the logits
    (this rank's vocabulary columns, gathered, padding cut)."""

    def __init__(self, group: RankGroup | None = None) -> None:
        self.group = group if group is not None and group.layout.tp > 1 else None
        if self.group is not None:
            self.vocab_range = group.layout.vocab
            self.vocab_size = group.layout.dims.vocab_size

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else self.group.all_reduce(x)

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(input_ids, weight)
        v0, v1 = self.vocab_range
        mine = (input_ids >= v0) & (input_ids < v1)
        x = F.embedding(torch.where(mine, input_ids - v0, 0), weight)
        x[~mine] = 0
        return self.group.all_reduce(x)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return logits
        return torch.cat(self.group.all_gather(logits), dim=-1)[..., :self.vocab_size]


SINGLE = TPOps()


class ModelShard:
    """What a model builds on this rank: its layers [lo, hi), whether it embeds (first stage) and norms
    (last stage), and its tensor-parallel ops. `ModelShard.whole` is the single-process model."""

    def __init__(self, layers: tuple[int, int], first: bool, last: bool, tp: TPOps = SINGLE) -> None:
        self.layers, self.first, self.last, self.tp = layers, first, last, tp

    @classmethod
    def whole(cls, num_layers: int) -> ModelShard:
        return cls((0, num_layers), True, True)

    @classmethod
    def of(cls, group: RankGroup) -> ModelShard:
        layout = group.layout
        return cls(layout.layers, layout.is_first_stage, layout.is_last_stage, TPOps(group))
