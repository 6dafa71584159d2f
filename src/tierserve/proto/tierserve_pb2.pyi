from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConstraintKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONSTRAINT_KIND_UNSPECIFIED: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_JSON_SCHEMA: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_REGEX: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_CHOICE: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_GRAMMAR: _ClassVar[ConstraintKind]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
CONSTRAINT_KIND_UNSPECIFIED: ConstraintKind
CONSTRAINT_KIND_JSON_SCHEMA: ConstraintKind
CONSTRAINT_KIND_REGEX: ConstraintKind
CONSTRAINT_KIND_CHOICE: ConstraintKind
CONSTRAINT_KIND_GRAMMAR: ConstraintKind
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role

class KVIdentity(_message.Message):
    __slots__ = ("model", "dtype", "page_size", "num_layers", "num_kv_heads", "head_dim")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class KVRank(_message.Message):
    __slots__ = ("transfer_endpoint", "base_address", "num_slots", "kv_head_start", "kv_heads", "staged", "layer_start", "num_layers", "cp_rank", "cp_size", "draft")
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CP_RANK_FIELD_NUMBER: _ClassVar[int]
    CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    transfer_endpoint: str
    base_address: int
    num_slots: int
    kv_head_start: int
    kv_heads: int
    staged: _containers.RepeatedCompositeFieldContainer[KVStagedPart]
    layer_start: int
    num_layers: int
    cp_rank: int
    cp_size: int
    draft: KVDraftArena
    def __init__(self, transfer_endpoint: _Optional[str] = ..., base_address: _Optional[int] = ..., num_slots: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_heads: _Optional[int] = ..., staged: _Optional[_Iterable[_Union[KVStagedPart, _Mapping]]] = ..., layer_start: _Optional[int] = ..., num_layers: _Optional[int] = ..., cp_rank: _Optional[int] = ..., cp_size: _Optional[int] = ..., draft: _Optional[_Union[KVDraftArena, _Mapping]] = ...) -> None: ...

class KVStagedPart(_message.Message):
    __slots__ = ("kv_head_start", "kv_heads", "address", "tokens")
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    kv_head_start: int
    kv_heads: int
    address: int
    tokens: int
    def __init__(self, kv_head_start: _Optional[int] = ..., kv_heads: _Optional[int] = ..., address: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("reservation_id", "transfer_endpoint", "identity", "base_address", "num_slots", "pages", "cached_tokens", "ranks", "draft")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    transfer_endpoint: str
    identity: KVIdentity
    base_address: int
    num_slots: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    ranks: _containers.RepeatedCompositeFieldContainer[KVRank]
    draft: KVDraftArena
    def __init__(self, reservation_id: _Optional[str] = ..., transfer_endpoint: _Optional[str] = ..., identity: _Optional[_Union[KVIdentity, _Mapping]] = ..., base_address: _Optional[int] = ..., num_slots: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[KVRank, _Mapping]]] = ..., draft: _Optional[_Union[KVDraftArena, _Mapping]] = ...) -> None: ...

class KVDraftArena(_message.Message):
    __slots__ = ("base_address", "num_slots", "num_layers", "num_kv_heads", "head_dim", "kv_head_start")
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    base_address: int
    num_slots: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_head_start: int
    def __init__(self, base_address: _Optional[int] = ..., num_slots: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_head_start: _Optional[int] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "min_tokens", "logprobs", "prompt_logprobs", "prompt_logprobs_start", "constraint", "priority", "deadline_ms")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_START_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    skip_special_tokens: bool
    min_tokens: int
    logprobs: int
    prompt_logprobs: int
    prompt_logprobs_start: int
    constraint: Constraint
    priority: int
    deadline_ms: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., prompt_logprobs_start: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., priority: _Optional[int] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "spec", "strict", "resumed")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    kind: ConstraintKind
    spec: str
    strict: bool
    resumed: int
    def __init__(self, kind: _Optional[_Union[ConstraintKind, str]] = ..., spec: _Optional[str] = ..., strict: _Optional[bool] = ..., resumed: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class CacheReport(_message.Message):
    __slots__ = ("cached_tokens", "device", "host", "storage")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    device: int
    host: int
    storage: int
    def __init__(self, cached_tokens: _Optional[int] = ..., device: _Optional[int] = ..., host: _Optional[int] = ..., storage: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "max_new_tokens", "lease_seconds", "cache_salt", "source_tp_size", "tenant", "router_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    lease_seconds: float
    cache_salt: str
    source_tp_size: int
    tenant: str
    router_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., cache_salt: _Optional[str] = ..., source_tp_size: _Optional[int] = ..., tenant: _Optional[str] = ..., router_id: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("destination", "lease_seconds")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    destination: KVDestination
    lease_seconds: float
    def __init__(self, destination: _Optional[_Union[KVDestination, _Mapping]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "cache_salt", "destination", "timeout_seconds", "tenant", "l3_pending_pages", "router_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    L3_PENDING_PAGES_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingOptions
    cache_salt: str
    destination: KVDestination
    timeout_seconds: float
    tenant: str
    l3_pending_pages: int
    router_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., cache_salt: _Optional[str] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., timeout_seconds: _Optional[float] = ..., tenant: _Optional[str] = ..., l3_pending_pages: _Optional[int] = ..., router_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "cache", "transferred_bytes", "transfer_seconds", "exposed_transfer_seconds", "first_logprob", "prompt_logprobs", "kv_digests", "text", "finish_reason")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    cache: CacheReport
    transferred_bytes: int
    transfer_seconds: float
    exposed_transfer_seconds: float
    first_logprob: TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    kv_digests: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    def __init__(self, first_token: _Optional[int] = ..., cache: _Optional[_Union[CacheReport, _Mapping]] = ..., transferred_bytes: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., exposed_transfer_seconds: _Optional[float] = ..., first_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., kv_digests: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("reservation_id", "first_token", "sampling", "resumed_tokens", "kv_digests", "tenant")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    first_token: int
    sampling: SamplingOptions
    resumed_tokens: int
    kv_digests: _containers.RepeatedScalarFieldContainer[int]
    tenant: str
    def __init__(self, reservation_id: _Optional[str] = ..., first_token: _Optional[int] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., resumed_tokens: _Optional[int] = ..., kv_digests: _Optional[_Iterable[int]] = ..., tenant: _Optional[str] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finished", "finish_reason", "completion_tokens", "logprobs", "spec_draft_tokens", "spec_accepted_tokens", "cache", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    completion_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    spec_draft_tokens: int
    spec_accepted_tokens: int
    cache: CacheReport
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., completion_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., cache: _Optional[_Union[CacheReport, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class LocalGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "cache_salt", "tenant", "router_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingOptions
    cache_salt: str
    tenant: str
    router_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., cache_salt: _Optional[str] = ..., tenant: _Optional[str] = ..., router_id: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("reservation_id", "writer_stopped")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    WRITER_STOPPED_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    writer_stopped: bool
    def __init__(self, reservation_id: _Optional[str] = ..., writer_stopped: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("role", "model", "identity", "namespace_digest", "transfer_endpoint", "max_context_tokens", "kv_events_endpoint", "namespace_seed", "tp_size", "pp_size", "instance_id", "cp_size", "kv_capacity_tokens")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_SEED_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    model: str
    identity: KVIdentity
    namespace_digest: str
    transfer_endpoint: str
    max_context_tokens: int
    kv_events_endpoint: str
    namespace_seed: bytes
    tp_size: int
    pp_size: int
    instance_id: str
    cp_size: int
    kv_capacity_tokens: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., model: _Optional[str] = ..., identity: _Optional[_Union[KVIdentity, _Mapping]] = ..., namespace_digest: _Optional[str] = ..., transfer_endpoint: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., kv_events_endpoint: _Optional[str] = ..., namespace_seed: _Optional[bytes] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., instance_id: _Optional[str] = ..., cp_size: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("running", "waiting", "kv_pages_used", "kv_pages_total", "reservations", "kv_pages_quarantined", "kv_pages_parked", "staging_bytes_used", "prefill_backlog", "l3_read_tokens_per_second")
    class PrefillBacklogEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_PARKED_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    L3_READ_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    reservations: int
    kv_pages_quarantined: int
    kv_pages_parked: int
    staging_bytes_used: int
    prefill_backlog: _containers.ScalarMap[int, int]
    l3_read_tokens_per_second: float
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., reservations: _Optional[int] = ..., kv_pages_quarantined: _Optional[int] = ..., kv_pages_parked: _Optional[int] = ..., staging_bytes_used: _Optional[int] = ..., prefill_backlog: _Optional[_Mapping[int, int]] = ..., l3_read_tokens_per_second: _Optional[float] = ...) -> None: ...

class FlushCacheRequest(_message.Message):
    __slots__ = ("device", "host")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    device: bool
    host: bool
    def __init__(self, device: _Optional[bool] = ..., host: _Optional[bool] = ...) -> None: ...

class FlushCacheResponse(_message.Message):
    __slots__ = ("device_pages", "host_pages")
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    device_pages: int
    host_pages: int
    def __init__(self, device_pages: _Optional[int] = ..., host_pages: _Optional[int] = ...) -> None: ...

class StorageAttachRequest(_message.Message):
    __slots__ = ("backend", "config")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    backend: str
    config: _struct_pb2.Struct
    def __init__(self, backend: _Optional[str] = ..., config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class StorageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StorageStatus(_message.Message):
    __slots__ = ("attached", "backend", "healthy", "stats")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    attached: bool
    backend: str
    healthy: bool
    stats: _struct_pb2.Struct
    def __init__(self, attached: _Optional[bool] = ..., backend: _Optional[str] = ..., healthy: _Optional[bool] = ..., stats: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class KVSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVSnapshotEntry(_message.Message):
    __slots__ = ("key", "medium")
    KEY_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    medium: str
    def __init__(self, key: _Optional[bytes] = ..., medium: _Optional[str] = ...) -> None: ...

class KVSnapshotReply(_message.Message):
    __slots__ = ("sequence", "entries")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    entries: _containers.RepeatedCompositeFieldContainer[KVSnapshotEntry]
    def __init__(self, sequence: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[KVSnapshotEntry, _Mapping]]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("router_id", "interval_seconds")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    interval_seconds: float
    def __init__(self, router_id: _Optional[str] = ..., interval_seconds: _Optional[float] = ...) -> None: ...
