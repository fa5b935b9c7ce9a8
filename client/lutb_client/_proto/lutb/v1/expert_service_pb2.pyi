# Post-processed by lutb_client._proto.generate (grpcio-tools 1.85.4): package-relative
# imports, no protobuf runtime version guard; needs protobuf>=5.27, grpcio>=1.66.0.
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    BFLOAT16: _ClassVar[DataType]
    FLOAT16: _ClassVar[DataType]
    FLOAT32: _ClassVar[DataType]
    INT32: _ClassVar[DataType]
    INT64: _ClassVar[DataType]
    UINT8: _ClassVar[DataType]
    FLOAT8_E4M3FN: _ClassVar[DataType]

class OutputMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_MODE_UNSPECIFIED: _ClassVar[OutputMode]
    COMBINED: _ClassVar[OutputMode]
    ROUTE_MAJOR: _ClassVar[OutputMode]
DATA_TYPE_UNSPECIFIED: DataType
BFLOAT16: DataType
FLOAT16: DataType
FLOAT32: DataType
INT32: DataType
INT64: DataType
UINT8: DataType
FLOAT8_E4M3FN: DataType
OUTPUT_MODE_UNSPECIFIED: OutputMode
COMBINED: OutputMode
ROUTE_MAJOR: OutputMode

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerInfo(_message.Message):
    __slots__ = ("layer", "expert_ids")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., expert_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("format", "format_version", "hidden_size", "intermediate_size", "num_experts", "layers", "activation", "dtype", "mxfp8_scale_mode", "backend", "backend_reason", "device", "max_tokens_per_request", "content_hash", "server_version", "max_batch_tokens", "front_end", "front_ends", "max_message_bytes", "instance_id", "max_top_k")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MXFP8_SCALE_MODE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_REASON_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FRONT_END_FIELD_NUMBER: _ClassVar[int]
    FRONT_ENDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_K_FIELD_NUMBER: _ClassVar[int]
    format: str
    format_version: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerInfo]
    activation: str
    dtype: DataType
    mxfp8_scale_mode: str
    backend: str
    backend_reason: str
    device: str
    max_tokens_per_request: int
    content_hash: str
    server_version: str
    max_batch_tokens: int
    front_end: int
    front_ends: int
    max_message_bytes: int
    instance_id: str
    max_top_k: int
    def __init__(self, format: _Optional[str] = ..., format_version: _Optional[int] = ..., hidden_size: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., num_experts: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerInfo, _Mapping]]] = ..., activation: _Optional[str] = ..., dtype: _Optional[_Union[DataType, str]] = ..., mxfp8_scale_mode: _Optional[str] = ..., backend: _Optional[str] = ..., backend_reason: _Optional[str] = ..., device: _Optional[str] = ..., max_tokens_per_request: _Optional[int] = ..., content_hash: _Optional[str] = ..., server_version: _Optional[str] = ..., max_batch_tokens: _Optional[int] = ..., front_end: _Optional[int] = ..., front_ends: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., instance_id: _Optional[str] = ..., max_top_k: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("request_id", "layer", "hidden_states", "topk_ids", "topk_weights", "apply_router_weight_on_input", "output_mode", "hidden_scales", "expected_content_hash")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    APPLY_ROUTER_WEIGHT_ON_INPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MODE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SCALES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    layer: int
    hidden_states: Tensor
    topk_ids: Tensor
    topk_weights: Tensor
    apply_router_weight_on_input: bool
    output_mode: OutputMode
    hidden_scales: Tensor
    expected_content_hash: str
    def __init__(self, request_id: _Optional[int] = ..., layer: _Optional[int] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., topk_ids: _Optional[_Union[Tensor, _Mapping]] = ..., topk_weights: _Optional[_Union[Tensor, _Mapping]] = ..., apply_router_weight_on_input: _Optional[bool] = ..., output_mode: _Optional[_Union[OutputMode, str]] = ..., hidden_scales: _Optional[_Union[Tensor, _Mapping]] = ..., expected_content_hash: _Optional[str] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_us", "compute_us", "total_us", "batch_tokens", "handoff_us", "prepare_us", "encode_us", "wait_us")
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    TOTAL_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_US_FIELD_NUMBER: _ClassVar[int]
    PREPARE_US_FIELD_NUMBER: _ClassVar[int]
    ENCODE_US_FIELD_NUMBER: _ClassVar[int]
    WAIT_US_FIELD_NUMBER: _ClassVar[int]
    queue_us: int
    compute_us: int
    total_us: int
    batch_tokens: int
    handoff_us: int
    prepare_us: int
    encode_us: int
    wait_us: int
    def __init__(self, queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., total_us: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., handoff_us: _Optional[int] = ..., prepare_us: _Optional[int] = ..., encode_us: _Optional[int] = ..., wait_us: _Optional[int] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("request_id", "output", "timing", "status")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    output: Tensor
    timing: Timing
    status: Status
    def __init__(self, request_id: _Optional[int] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., status: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...
