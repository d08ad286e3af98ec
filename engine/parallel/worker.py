"""A rank other than 0: `python -m pdserve.engine.parallel.worker`, its spec as one JSON line on stdin.

It joins rank 0's rendezvous, builds its shard of the model and KV cache through the ordinary ModelRunner,
then follows rank 0's commands until STOP (engine/parallel/step_codec.py). It dies with its parent.
Its torch threads and OpenMP wait come in its environment (`OMP_NUM_THREADS`, `GOMP_SPINCOUNT`), set by rank 0
before this process started, so before its libgomp read them (launcher.py `threads_per_rank`).
"""
from __future__ import annotations

import datetime
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from pdserve.engine.config import (CacheConfig, DeviceConfig, EngineConfig, KVTransferConfig, ModelConfig,
                                   ParallelConfig, SchedulerConfig)
from pdserve.engine.parallel.launcher import joined_key

logger = logging.getLogger("pdserve.engine.parallel.worker")


def config_from_json(d: dict) -> EngineConfig:
    return EngineConfig(model=ModelConfig(**d["model"]), cache=CacheConfig(**d["cache"]),
                        scheduler=SchedulerConfig(**d["scheduler"]), kv_transfer=KVTransferConfig(**d["kv_transfer"]),
                        device=DeviceConfig(**d["device"]), parallel=ParallelConfig(**d["parallel"]))


def import_factory(name: str):
    """`module:qualname` of a pdserve connector factory (engine.kv_connector.ConnectorFactory)."""
    module, _, qualname = name.partition(":")
    if not module.startswith("pdserve."):
        raise ValueError(f"connector factory {name!r} is not pdserve's")
    factory = importlib.import_module(module)
    for part in qualname.split("."):
        factory = getattr(factory, part)
    return factory


def die_with_parent() -> None:
    """Exit within half a second of the parent process. (Not prctl's PDEATHSIG: it fires when the parent
    *thread* that started us ends, and an engine may be built in a thread that ends before the engine.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if os.getppid() != parent:
        os._exit(1)


def serve(runner, group, kv) -> None:
    from pdserve.engine.attention import ForwardContext, build_attention_metadata, set_forward_context
    from pdserve.engine.parallel.kv_ranks import broadcast_bytes, send_bytes
    from pdserve.engine.parallel.stage import StageExecutor
    from pdserve.engine.parallel.step_codec import HEADER, Command, StepLayout

    stage = StageExecutor(group, runner.hf_config.hidden_size, runner.dtype, runner.model.carries_residual)
    h = torch.empty(HEADER, dtype=torch.int64)
    with torch.inference_mode():
        while True:
            group.broadcast(h, idle=True)
            command = Command(int(h[0]))
            if command == Command.STOP:
                return
            if command == Command.COPY:
                pairs = group.broadcast(torch.empty(2 * int(h[1]), dtype=torch.int64)).view(-1, 2).tolist()
                runner.copy_blocks(pairs)
            elif command == Command.LOGITS:
                rows = group.broadcast(torch.empty(int(h[1]), int(h[2]), dtype=runner.dtype))
                if group.layout.is_first_stage:
                    runner.model.compute_logits(rows)
            elif command == Command.CONNECTOR:
                finished, _, delayed = kv.begin(broadcast_bytes(group, None, int(h[1])))
                send_bytes(group, kv.end(finished, delayed, computed=False), 0)
            elif command == Command.STEP:
                layout = StepLayout.decode(h, group.broadcast(torch.empty(StepLayout.payload_size(h),
                                                                          dtype=torch.int64)))
                connector = connector_meta = None
                if StepLayout.kv_bytes(h):
                    finished, connector_meta, delayed = kv.begin(broadcast_bytes(group, None, StepLayout.kv_bytes(h)))
                    connector = kv.connector
                meta = build_attention_metadata(layout.query_start_loc, layout.seq_lens, layout.block_tables,
                                                layout.slot_mapping)
                ctx = ForwardContext(attn_metadata=meta, kv_caches=runner.kv_caches, attn_backend=runner.attn_backend,
                                     connector=connector, connector_metadata=connector_meta)
                with set_forward_context(ctx):
                    stage.forward(lambda carry: runner.model(layout.input_ids, layout.positions, layout.keep_rows,
                                                             carry),
                                  layout.input_ids.numel(), 0)
                if connector is not None:
                    send_bytes(group, kv.end(finished, delayed), 0)


def main() -> int:
    die_with_parent()
    # Rank 0 stops this process (STOP, or its own exit): a SIGINT or SIGTERM to the whole process group (Ctrl-C,
    # systemd, `kill -- -PGID`) must reach rank 0 alone, which drains its requests before it stops its ranks.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    spec = json.loads(sys.stdin.readline())
    rank = spec["rank"]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    config = config_from_json(spec["config"])
    from pdserve.engine.model_runner import ModelRunner, load_hf_config
    from pdserve.engine.parallel.group import RankGroup
    from pdserve.engine.parallel.layout import ModelDims, ParallelLayout

    par = config.parallel
    layout = ParallelLayout(par.tensor_parallel_size, par.pipeline_parallel_size, rank,
                            ModelDims.from_hf(load_hf_config(config.model.model)))
    store = dist.TCPStore("127.0.0.1", spec["port"], layout.world_size, False,
                          timeout=datetime.timedelta(seconds=par.distributed_timeout_s))
    store.set(joined_key(rank), "1")
    group = RankGroup(store, layout, par.distributed_timeout_s)
    runner = ModelRunner(config, group=group)
    kv = None
    if spec.get("connector_factory"):  # the same factory rank 0's engine was given, with this rank's shard
        from pdserve.engine.parallel.kv_ranks import WorkerKV

        runner.connector = import_factory(spec["connector_factory"])(config, runner)
        kv = WorkerKV(runner.connector, group)
        # rank 0 writes the KV lines, one per request: lookups happen there alone, and this rank's loads and saves
        # reach it with the step reports (kv_ranks.py); this rank's warnings (failures) still show here
        logging.getLogger("pdserve.connectors.kv_log").setLevel(logging.WARNING)
    try:
        serve(runner, group, kv)
    except RuntimeError as e:  # rank 0 went away mid-collective: its supervision reports it, not us
        logger.error("rank %d: %s; exiting", rank, str(e).splitlines()[0])
        return 1
    finally:
        if runner.connector is not None:
            runner.connector.shutdown()
        group.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
