from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_SSD: _ClassVar[Tier]
    TIER_PEER: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_DRAM: Tier
TIER_SSD: Tier
TIER_PEER: Tier

class NamespaceSpec(_message.Message):
    __slots__ = ("model", "revision", "kv_dtype", "block_size", "layout", "tp_rank", "tp_size", "hash_algo", "hash_seed", "block_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    kv_dtype: str
    block_size: int
    layout: str
    tp_rank: int
    tp_size: int
    hash_algo: str
    hash_seed: str
    block_bytes: int
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., layout: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., hash_algo: _Optional[str] = ..., hash_seed: _Optional[str] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class BlockKeys(_message.Message):
    __slots__ = ("hashes", "token_ids", "cache_salt", "lora_name", "packed_hashes")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PACKED_HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    lora_name: str
    packed_hashes: bytes
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., packed_hashes: _Optional[bytes] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("version", "arena_path", "arena_bytes", "lease_ttl_ms", "max_batch_blocks", "packed_keys", "end_stream", "fast_socket", "presence_table", "instance_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    END_STREAM_FIELD_NUMBER: _ClassVar[int]
    FAST_SOCKET_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_TABLE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    version: str
    arena_path: str
    arena_bytes: int
    lease_ttl_ms: int
    max_batch_blocks: int
    packed_keys: bool
    end_stream: bool
    fast_socket: str
    presence_table: str
    instance_id: int
    def __init__(self, version: _Optional[str] = ..., arena_path: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., max_batch_blocks: _Optional[int] = ..., packed_keys: _Optional[bool] = ..., end_stream: _Optional[bool] = ..., fast_socket: _Optional[str] = ..., presence_table: _Optional[str] = ..., instance_id: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("client_name", "pid")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("session_id", "closing", "arena_path", "arena_bytes", "packed_keys", "end_stream", "spare_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLOSING_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    END_STREAM_FIELD_NUMBER: _ClassVar[int]
    SPARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    closing: bool
    arena_path: str
    arena_bytes: int
    packed_keys: bool
    end_stream: bool
    spare_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., closing: _Optional[bool] = ..., arena_path: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., packed_keys: _Optional[bool] = ..., end_stream: _Optional[bool] = ..., spare_bytes: _Optional[int] = ...) -> None: ...

class OpenNamespaceRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: NamespaceSpec
    def __init__(self, spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ...) -> None: ...

class OpenNamespaceResponse(_message.Message):
    __slots__ = ("namespace_id", "spec")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    spec: NamespaceSpec
    def __init__(self, namespace_id: _Optional[int] = ..., spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "lease", "session_id", "peers", "packed_reply", "prompt_blocks")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    PACKED_REPLY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    keys: BlockKeys
    lease: bool
    session_id: str
    peers: bool
    packed_reply: bool
    prompt_blocks: int
    def __init__(self, namespace_id: _Optional[int] = ..., keys: _Optional[_Union[BlockKeys, _Mapping]] = ..., lease: _Optional[bool] = ..., session_id: _Optional[str] = ..., peers: _Optional[bool] = ..., packed_reply: _Optional[bool] = ..., prompt_blocks: _Optional[int] = ...) -> None: ...

class PeerHit(_message.Message):
    __slots__ = ("node_id", "blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    blocks: int
    def __init__(self, node_id: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_blocks", "tiers", "offsets", "lease_id", "lease_ttl_ms", "block_bytes", "block_size", "peer_hits", "packed_tiers", "packed_offsets")
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PEER_HITS_FIELD_NUMBER: _ClassVar[int]
    PACKED_TIERS_FIELD_NUMBER: _ClassVar[int]
    PACKED_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    hit_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    lease_id: int
    lease_ttl_ms: int
    block_bytes: int
    block_size: int
    peer_hits: _containers.RepeatedCompositeFieldContainer[PeerHit]
    packed_tiers: bytes
    packed_offsets: bytes
    def __init__(self, hit_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., offsets: _Optional[_Iterable[int]] = ..., lease_id: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., block_bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., peer_hits: _Optional[_Iterable[_Union[PeerHit, _Mapping]]] = ..., packed_tiers: _Optional[bytes] = ..., packed_offsets: _Optional[bytes] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "keys", "block_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: int
    keys: BlockKeys
    block_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[int] = ..., keys: _Optional[_Union[BlockKeys, _Mapping]] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "present_blocks", "offsets", "ttl_ms")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    PRESENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    present_blocks: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    ttl_ms: int
    def __init__(self, reservation_id: _Optional[int] = ..., present_blocks: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class SealRequest(_message.Message):
    __slots__ = ("session_id", "reservation_id", "push_to")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    PUSH_TO_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reservation_id: int
    push_to: str
    def __init__(self, session_id: _Optional[str] = ..., reservation_id: _Optional[int] = ..., push_to: _Optional[str] = ...) -> None: ...

class SealResponse(_message.Message):
    __slots__ = ("sealed_blocks",)
    SEALED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    sealed_blocks: int
    def __init__(self, sealed_blocks: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "keys", "first", "offsets", "block_bytes", "spares_wanted")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPARES_WANTED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: int
    keys: BlockKeys
    first: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    spares_wanted: int
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[int] = ..., keys: _Optional[_Union[BlockKeys, _Mapping]] = ..., first: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., spares_wanted: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("present_blocks", "stored_blocks", "spare_offsets")
    PRESENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPARE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    present_blocks: int
    stored_blocks: int
    spare_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, present_blocks: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., spare_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_id: int
    def __init__(self, session_id: _Optional[str] = ..., lease_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorDesc(_message.Message):
    __slots__ = ("shm_name", "offset", "shape", "strides", "dtype", "block_dim", "cuda_ipc_handle", "device_uuid")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DIM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    offset: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    strides: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    block_dim: int
    cuda_ipc_handle: bytes
    device_uuid: str
    def __init__(self, shm_name: _Optional[str] = ..., offset: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., strides: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., block_dim: _Optional[int] = ..., cuda_ipc_handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class RegisterBuffersRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "tensors")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorDesc]
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorDesc, _Mapping]]] = ...) -> None: ...

class RegisterBuffersResponse(_message.Message):
    __slots__ = ("buffers_id", "num_blocks", "block_bytes", "layout")
    BUFFERS_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    buffers_id: int
    num_blocks: int
    block_bytes: int
    layout: str
    def __init__(self, buffers_id: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., layout: _Optional[str] = ...) -> None: ...

class UnregisterBuffersRequest(_message.Message):
    __slots__ = ("session_id", "buffers_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    buffers_id: int
    def __init__(self, session_id: _Optional[str] = ..., buffers_id: _Optional[int] = ...) -> None: ...

class UnregisterBuffersResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveBlocksRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "buffers_id", "keys", "block_ids", "packed_block_ids", "push_to")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_TO_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: int
    buffers_id: int
    keys: BlockKeys
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_block_ids: bytes
    push_to: str
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[int] = ..., buffers_id: _Optional[int] = ..., keys: _Optional[_Union[BlockKeys, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., packed_block_ids: _Optional[bytes] = ..., push_to: _Optional[str] = ...) -> None: ...

class SaveBlocksResponse(_message.Message):
    __slots__ = ("present_blocks", "stored_blocks")
    PRESENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    present_blocks: int
    stored_blocks: int
    def __init__(self, present_blocks: _Optional[int] = ..., stored_blocks: _Optional[int] = ...) -> None: ...

class LoadBlocksRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "buffers_id", "keys", "block_ids", "packed_block_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: int
    buffers_id: int
    keys: BlockKeys
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_block_ids: bytes
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[int] = ..., buffers_id: _Optional[int] = ..., keys: _Optional[_Union[BlockKeys, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., packed_block_ids: _Optional[bytes] = ...) -> None: ...

class LoadBlocksResponse(_message.Message):
    __slots__ = ("loaded_blocks", "tiers")
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    loaded_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, loaded_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("namespace_id", "keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    keys: BlockKeys
    def __init__(self, namespace_id: _Optional[int] = ..., keys: _Optional[_Union[BlockKeys, _Mapping]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("hit_blocks", "promoting_blocks")
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMOTING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    hit_blocks: int
    promoting_blocks: int
    def __init__(self, hit_blocks: _Optional[int] = ..., promoting_blocks: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("model", "tier")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    model: str
    tier: Tier
    def __init__(self, model: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...

class FlushProgress(_message.Message):
    __slots__ = ("written_blocks", "left_blocks", "done")
    WRITTEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEFT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    written_blocks: int
    left_blocks: int
    done: bool
    def __init__(self, written_blocks: _Optional[int] = ..., left_blocks: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...

class LoadEvent(_message.Message):
    __slots__ = ("started", "tensor_done", "done")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    started: LoadBlocksResponse
    tensor_done: int
    done: bool
    def __init__(self, started: _Optional[_Union[LoadBlocksResponse, _Mapping]] = ..., tensor_done: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...

class StreamBlocksRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "keys", "buffers_id", "block_ids", "peers", "end_only", "packed_block_ids", "stream_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    END_ONLY_FIELD_NUMBER: _ClassVar[int]
    PACKED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: int
    keys: BlockKeys
    buffers_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    peers: bool
    end_only: bool
    packed_block_ids: bytes
    stream_id: int
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[int] = ..., keys: _Optional[_Union[BlockKeys, _Mapping]] = ..., buffers_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., peers: _Optional[bool] = ..., end_only: _Optional[bool] = ..., packed_block_ids: _Optional[bytes] = ..., stream_id: _Optional[int] = ...) -> None: ...

class EndStreamRequest(_message.Message):
    __slots__ = ("session_id", "stream_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    stream_id: int
    def __init__(self, session_id: _Optional[str] = ..., stream_id: _Optional[int] = ...) -> None: ...

class EndStreamResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockReady(_message.Message):
    __slots__ = ("index", "tier", "peer", "offset")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    index: int
    tier: Tier
    peer: str
    offset: int
    def __init__(self, index: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., peer: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class BlockStreamEnd(_message.Message):
    __slots__ = ("blocks", "requested", "stop", "detail", "lease_id", "lease_ttl_ms")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    requested: int
    stop: str
    detail: str
    lease_id: int
    lease_ttl_ms: int
    def __init__(self, blocks: _Optional[int] = ..., requested: _Optional[int] = ..., stop: _Optional[str] = ..., detail: _Optional[str] = ..., lease_id: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("blocks", "end", "lease_id")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockReady]
    end: BlockStreamEnd
    lease_id: int
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockReady, _Mapping]]] = ..., end: _Optional[_Union[BlockStreamEnd, _Mapping]] = ..., lease_id: _Optional[int] = ...) -> None: ...

class PeersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("node_id", "address", "state", "last_error", "blocks_fetched", "blocks_pushed")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FETCHED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    state: str
    last_error: str
    blocks_fetched: int
    blocks_pushed: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., last_error: _Optional[str] = ..., blocks_fetched: _Optional[int] = ..., blocks_pushed: _Optional[int] = ...) -> None: ...

class PeersResponse(_message.Message):
    __slots__ = ("node_id", "listen", "membership", "peers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LISTEN_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    listen: str
    membership: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    def __init__(self, node_id: _Optional[str] = ..., listen: _Optional[str] = ..., membership: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("to", "model", "prefix", "namespace_id", "drain")
    TO_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    to: str
    model: str
    prefix: BlockKeys
    namespace_id: int
    drain: bool
    def __init__(self, to: _Optional[str] = ..., model: _Optional[str] = ..., prefix: _Optional[_Union[BlockKeys, _Mapping]] = ..., namespace_id: _Optional[int] = ..., drain: _Optional[bool] = ...) -> None: ...

class MigrateProgress(_message.Message):
    __slots__ = ("total_blocks", "pushed_blocks", "failed_blocks", "dropped_blocks", "detail", "done")
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PUSHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FAILED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    pushed_blocks: int
    failed_blocks: int
    dropped_blocks: int
    detail: str
    done: bool
    def __init__(self, total_blocks: _Optional[int] = ..., pushed_blocks: _Optional[int] = ..., failed_blocks: _Optional[int] = ..., dropped_blocks: _Optional[int] = ..., detail: _Optional[str] = ..., done: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "blocks", "evictions", "write_errors", "read_errors")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    READ_ERRORS_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    evictions: int
    write_errors: int
    read_errors: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., evictions: _Optional[int] = ..., write_errors: _Optional[int] = ..., read_errors: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("version", "uptime_s", "tiers", "lookups", "lookup_blocks", "hit_blocks", "hit_tokens", "saved_blocks", "active_leases", "clients", "namespaces", "index_blocks", "promotions", "demotions", "dropped_blocks", "peer_fetched_blocks", "peer_served_blocks", "peer_pushed_blocks", "peer_received_blocks", "peer_failures", "dropped_blocks_by_reason", "room_waits", "room_wait_seconds")
    class DroppedBlocksByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    INDEX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_SERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_PUSHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_RECEIVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BLOCKS_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    ROOM_WAITS_FIELD_NUMBER: _ClassVar[int]
    ROOM_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_s: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    lookups: int
    lookup_blocks: int
    hit_blocks: int
    hit_tokens: int
    saved_blocks: int
    active_leases: int
    clients: int
    namespaces: int
    index_blocks: int
    promotions: int
    demotions: int
    dropped_blocks: int
    peer_fetched_blocks: int
    peer_served_blocks: int
    peer_pushed_blocks: int
    peer_received_blocks: int
    peer_failures: int
    dropped_blocks_by_reason: _containers.ScalarMap[str, int]
    room_waits: int
    room_wait_seconds: float
    def __init__(self, version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., lookups: _Optional[int] = ..., lookup_blocks: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., saved_blocks: _Optional[int] = ..., active_leases: _Optional[int] = ..., clients: _Optional[int] = ..., namespaces: _Optional[int] = ..., index_blocks: _Optional[int] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ..., dropped_blocks: _Optional[int] = ..., peer_fetched_blocks: _Optional[int] = ..., peer_served_blocks: _Optional[int] = ..., peer_pushed_blocks: _Optional[int] = ..., peer_received_blocks: _Optional[int] = ..., peer_failures: _Optional[int] = ..., dropped_blocks_by_reason: _Optional[_Mapping[str, int]] = ..., room_waits: _Optional[int] = ..., room_wait_seconds: _Optional[float] = ...) -> None: ...
