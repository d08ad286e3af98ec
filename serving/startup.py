"""Start-up of a serving process: check the model directory, build the engine from the command line.

Cheap checks come first and fail with one line (StartupError) before torch is even imported;
the heavy imports happen only once the options and paths are known to be good.
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.config import EngineConfig
from pdserve.serving.cli import engine_kwargs_from_args
from pdserve.serving.errors import StartupError
from pdserve.serving.lora_modules import startup_requests
from pdserve.serving.metrics import EngineMetrics

logger = logging.getLogger(__name__)


def check_model_dir(path: str | None) -> str:
    """The model directory to load (the built-in tiny model if None); StartupError if unusable."""
    if path is None:
        from pdserve.engine.builtin_model import default_model_path

        return str(default_model_path())
    p = Path(path)
    if not p.is_dir():
        raise StartupError(f"model directory {path} does not exist or is not a directory")
    if not os.access(p, os.R_OK | os.X_OK) or not os.access(p / "config.json", os.R_OK):
        raise StartupError(f"model directory {path} is not readable or has no config.json")
    return str(p)


def create_async_engine(args: argparse.Namespace) -> tuple[AsyncLLMEngine, list[str]]:
    """Build LLMEngine + AsyncLLMEngine + metrics from parsed args; StartupError on any failure.

    Returns the engine and the model names clients may use (the first one is reported back).
    """
    kwargs = engine_kwargs_from_args(args)
    modules = getattr(args, "lora_modules", None) or []
    try:  # option errors first, with their own message, before anything slow happens
        EngineConfig.from_kwargs(args.model or "builtin", **kwargs)
        loras = startup_requests(modules)
    except (TypeError, ValueError) as e:
        raise StartupError(f"invalid engine option: {e}") from None
    if loras and not kwargs.get("enable_lora"):
        raise StartupError("--lora-modules needs --enable-lora")
    model = check_model_dir(args.model)  # before the heavy imports (torch): a bad path fails fast
    from pdserve.connectors.factory import create_connector
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.lora.adapter import LoRAError

    def build() -> LLMEngine:
        engine = LLMEngine(config, create_connector)
        for lora in loras:  # the adapters served from the start, loaded on the step thread too
            engine.add_lora(lora)
        return engine

    try:  # built on its step thread: the process's one OpenMP team (engine/async_engine.py)
        config = EngineConfig.from_kwargs(model, **kwargs)
        async_engine = AsyncLLMEngine.build(build, max_waiting_requests=args.max_waiting_requests)
    except LoRAError as e:
        raise StartupError(f"--lora-modules: {e}") from None
    except Exception as e:  # transformers/safetensors/config errors: a one-line reason, no traceback
        logger.debug("engine start-up failed", exc_info=True)
        raise StartupError(f"cannot load model from {model}: {type(e).__name__}: {e}") from None
    # Clients may name the model by directory name or by the path it was loaded from.
    names = [args.served_model_name] if args.served_model_name else [Path(model).name, model]
    llm = async_engine.engine
    async_engine.metrics = EngineMetrics(names[0], lambda: async_engine.stats)
    connector_metrics = getattr(llm.connector, "metrics", None)
    if connector_metrics is not None:  # KV hand-off counters (hits, loads, saves, fallbacks) on /metrics
        async_engine.metrics.registry.register(connector_metrics)
    return async_engine, names
