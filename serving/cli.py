"""Command-line options shared by pd-serve, pd-prefill and pd-decode, and the log set-up of every process.

Launchers build one parser from these pieces and may add their own options; any option whose
dest matches an EngineConfig field (e.g. a launcher's --kv-store) reaches the engine through
engine_kwargs_from_args without further wiring. Importing this module must stay cheap (no
torch): a bad flag should fail in milliseconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any, NoReturn

from pdserve.common.cli_types import port_number
from pdserve.common.units import format_bytes
from pdserve.engine.config import (ATTENTION_BACKENDS, DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_CACHE_MEMORY,
                                   DEVICE_RE, DTYPES, LORA_DTYPES, CacheConfig, DeviceConfig, KVTransferConfig,
                                   LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig)
from pdserve.serving.limits import add_http_timeout_args

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit status 2. Every `--...-port` flag added as an
    int (--port, --grpc-port of every command built on it: pd-serve, pd-prefill, pd-decode, pd-proxy) parses
    as a port_number, so 70000 is a usage error rather than a traceback from bind()."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        for action in self._actions:  # the parser's and its groups' alike
            if action.type is int and any(name.endswith("-port") for name in action.option_strings):
                action.type = port_number
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _int_at_least(lo: int):
    """An argparse type: an integer >= lo, with a message naming the bound."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {value}")
        return value
    parse.__name__ = f"integer >= {lo}"
    return parse


_positive_int, _non_negative_int = _int_at_least(1), _int_at_least(0)


def _fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value:g}")
    return value


_fraction.__name__ = "number in (0, 1]"


def _device(text: str) -> str:
    if not DEVICE_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


_device.__name__ = "device"


def config_default(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (its factory's product where it has one): a flag's
    help quotes it from here, so the text cannot drift from what the dataclass applies."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise ValueError(f"{cls.__name__}.{name} has no default")


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--model and the engine's options (defaults None: the config dataclasses own the defaults, and the
    help texts quote them from there)."""
    d = config_default
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face model directory (default: the built-in tiny model, created on first use)")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help=f"weights and KV dtype (default {d(ModelConfig, 'dtype')}: the checkpoint's)")
    g.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context length (default: the checkpoint's max_position_embeddings)")
    g.add_argument("--block-size", type=_positive_int, default=None,
                   help=f"tokens per KV block, a power of two (default {d(CacheConfig, 'block_size')})")
    g.add_argument("--device", type=_device, default=None,
                   help="auto (CUDA when available), cpu, cuda or cuda:N: where the weights, KV cache and "
                        f"sampling live (default {d(DeviceConfig, 'device')})")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None,
                   help="attention kernels: torch (the reference), cpu (compiled at first use) or triton "
                        f"(default {d(DeviceConfig, 'attention_backend')}: cpu on CPU, triton on CUDA)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="bytes for the paged KV cache of all layers, e.g. 2GiB (default "
                        f"{format_bytes(DEFAULT_KV_CACHE_MEMORY)} on CPU; on CUDA the KV cache is sized by "
                        "--gpu-memory-utilization)")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                   help="CUDA: fraction of the device's memory this engine may use; the KV cache gets what the "
                        "weights and a profiled max-batch forward leave (default "
                        f"{DEFAULT_GPU_MEMORY_UTILIZATION} unless --kv-cache-memory is given)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                   help="disable the local prefix cache")
    g.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help=f"max requests in one batch (default {d(SchedulerConfig, 'max_num_seqs')})")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help=f"token budget of one step (default {d(SchedulerConfig, 'max_num_batched_tokens')})")
    g.add_argument("--long-prefill-token-threshold", type=_non_negative_int, default=None,
                   help="max prompt tokens of one request per step "
                        f"(default {d(SchedulerConfig, 'long_prefill_token_threshold')}: no limit)")
    g.add_argument("--seed", type=int, default=None,
                   help=f"default sampling seed of the engine (default {d(ModelConfig, 'seed')})")
    g.add_argument("-tp", "--tensor-parallel-size", type=_positive_int, default=None,
                   help="ranks that split each layer's heads and MLP (one process each; it must divide the model's "
                        "attention heads: SmolLM2-135M, make serve's default, has 9 and takes 1 or 3; a value the "
                        f"model does not take stops start-up naming those it does; default "
                        f"{d(ParallelConfig, 'tensor_parallel_size')})")
    g.add_argument("-pp", "--pipeline-parallel-size", type=_positive_int, default=None,
                   help="ranks that split the layers into stages (one process each; "
                        f"default {d(ParallelConfig, 'pipeline_parallel_size')})")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="torch (OpenMP) threads of the engine, split over its -tp/-pp ranks (default: the CPUs "
                        "this process may use, from its cgroup CPU quota and affinity mask, not the host's core "
                        "count; OMP_NUM_THREADS, when set, per rank). Logged at start-up with the reason")
    add_lora_args(parser)
    return parser


def add_lora_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """vLLM's LoRA options (docs/lora.md); the bounds' defaults are LoRAConfig's."""
    from pdserve.serving.lora_modules import parse_lora_module  # no torch: the table and its argparse type

    d = config_default
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters: a request's `model` names one (default: off)")
    g.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=[], metavar="NAME=PATH",
                   help="adapters served from start-up: name=path or JSON {\"name\": ..., \"path\": ...} (PEFT "
                        "directories); more can be loaded with POST /v1/load_lora_adapter")
    g.add_argument("--max-loras", type=_positive_int, default=None,
                   help=f"adapters in one batch (default {d(LoRAConfig, 'max_loras')})")
    g.add_argument("--max-lora-rank", type=_positive_int, default=None,
                   help=f"largest adapter rank accepted (default {d(LoRAConfig, 'max_lora_rank')})")
    g.add_argument("--max-cpu-loras", type=_positive_int, default=None,
                   help="adapters kept loaded, least recently used dropped beyond it (default: --max-loras)")
    g.add_argument("--lora-dtype", choices=LORA_DTYPES, default=None,
                   help="dtype of the adapters' weights: auto is the model's, as in vLLM (a bf16 model's adapters "
                        "rounded to bf16: half the bytes per decode step); float32 keeps them as PEFT does "
                        f"(default {d(LoRAConfig, 'lora_dtype')})")
    return parser


def add_server_args(parser: argparse.ArgumentParser, default_port: int = 8000) -> argparse.ArgumentParser:
    """HTTP server options of a node (pd-serve, pd-prefill, pd-decode); each help quotes its flag's default."""
    g = parser.add_argument_group("server")
    host, waiting, shutdown_s, level = "127.0.0.1", 256, 5.0, "INFO"
    g.add_argument("--host", default=host, help=f"address to listen on (default {host})")
    g.add_argument("--port", type=int, default=default_port,
                   help=f"HTTP port (default {default_port}; 0 picks a free one, shown in the ready line)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients send in `model` (default: the model directory's name)")
    g.add_argument("--max-waiting-requests", type=_non_negative_int, default=waiting,
                   help=f"accepted requests not yet producing tokens before new ones get 503 (default {waiting})")
    g.add_argument("--shutdown-timeout", type=float, default=shutdown_s,
                   help=f"seconds in-flight requests may finish after SIGINT/SIGTERM (default {shutdown_s:g})")
    g.add_argument("--log-level", default=level, choices=LOG_LEVELS, help=f"log level (default {level})")
    add_http_timeout_args(parser)
    add_response_args(parser)
    return parser


def add_response_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """vLLM's options for how answers look, shared by the nodes and pd-proxy (which formats the P/D answers)."""
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="name logprob tokens 'token_id:N' unless a request's return_tokens_as_token_ids says "
                             "otherwise (vLLM's flag)")
    return parser


_ENGINE_FIELDS = [f.name for cls in (ModelConfig, CacheConfig, SchedulerConfig, KVTransferConfig, DeviceConfig,
                                                ParallelConfig, LoRAConfig)
                  for f in dataclasses.fields(cls) if f.name != "model"]


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Flat EngineConfig options from parsed args: every set option whose dest names a config field."""
    return {name: getattr(args, name) for name in _ENGINE_FIELDS if getattr(args, name, None) is not None}


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr, force=True)


def add_log_file(path: str) -> None:
    """Also log to `path` (what pd-kv-hits reads), in the console format."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)
