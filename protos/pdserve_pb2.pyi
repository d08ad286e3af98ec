from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("text", "chat", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    token_ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: bool = ..., logprobs: bool = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "params", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: Prompt
    params: SamplingParams
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("prompt_token_ids", "num_cached_tokens", "prefill_ms")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    prefill_ms: float
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., prefill_ms: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "params", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: Prompt
    params: SamplingParams
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateDelta(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "usage", "tokens", "top_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    usage: Usage
    tokens: _containers.RepeatedScalarFieldContainer[str]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., tokens: _Optional[_Iterable[str]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("tokens", "logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[str]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("prompt", "cache_salt")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    cache_salt: str
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("total_tokens", "local_hit_tokens", "store_hit_tokens")
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    total_tokens: int
    local_hit_tokens: int
    store_hit_tokens: int
    def __init__(self, total_tokens: _Optional[int] = ..., local_hit_tokens: _Optional[int] = ..., store_hit_tokens: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ok", "role", "served_model_names", "max_model_len")
    OK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    role: str
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    max_model_len: int
    def __init__(self, ok: bool = ..., role: _Optional[str] = ..., served_model_names: _Optional[_Iterable[str]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "kv_usage", "prefix_cache_queries", "prefix_cache_hits")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...
