from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteNamespace(_message.Message):
    __slots__ = ("model", "revision", "kv_dtype", "block_size", "layout", "tp_rank", "tp_size", "hash_algo", "hash_seed", "full_shard")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    FULL_SHARD_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    kv_dtype: str
    block_size: int
    layout: str
    tp_rank: int
    tp_size: int
    hash_algo: str
    hash_seed: str
    full_shard: bool
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., layout: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., hash_algo: _Optional[str] = ..., hash_seed: _Optional[str] = ..., full_shard: _Optional[bool] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("namespace", "token_ids", "block_hashes", "block_keys", "tokens", "candidates", "cache_salt", "lora_name")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    namespace: RouteNamespace
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    tokens: int
    candidates: _containers.RepeatedScalarFieldContainer[str]
    cache_salt: str
    lora_name: str
    def __init__(self, namespace: _Optional[_Union[RouteNamespace, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., tokens: _Optional[int] = ..., candidates: _Optional[_Iterable[str]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("node", "ttft_s", "queue_s", "prefill_s", "fetch_s", "decode_s", "cached_blocks", "local_blocks", "pulled_blocks", "pull_from")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    FETCH_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULL_FROM_FIELD_NUMBER: _ClassVar[int]
    node: str
    ttft_s: float
    queue_s: float
    prefill_s: float
    fetch_s: float
    decode_s: float
    cached_blocks: int
    local_blocks: int
    pulled_blocks: int
    pull_from: str
    def __init__(self, node: _Optional[str] = ..., ttft_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., fetch_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., cached_blocks: _Optional[int] = ..., local_blocks: _Optional[int] = ..., pulled_blocks: _Optional[int] = ..., pull_from: _Optional[str] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("node", "namespace_id", "blocks", "tokens", "candidates")
    NODE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    node: str
    namespace_id: int
    blocks: int
    tokens: int
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    def __init__(self, node: _Optional[str] = ..., namespace_id: _Optional[int] = ..., blocks: _Optional[int] = ..., tokens: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ...) -> None: ...

class Prefill(_message.Message):
    __slots__ = ("model", "tokens", "cached_tokens", "seconds")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokens: int
    cached_tokens: int
    seconds: float
    def __init__(self, model: _Optional[str] = ..., tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("node", "has_queue", "queued_prefill_s", "prefills")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HAS_QUEUE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_FIELD_NUMBER: _ClassVar[int]
    node: str
    has_queue: bool
    queued_prefill_s: float
    prefills: _containers.RepeatedCompositeFieldContainer[Prefill]
    def __init__(self, node: _Optional[str] = ..., has_queue: _Optional[bool] = ..., queued_prefill_s: _Optional[float] = ..., prefills: _Optional[_Iterable[_Union[Prefill, _Mapping]]] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
