"""lutb_client: talk to a lutb-moe expert server (codec, sync and async clients, routing helpers).

    from lutb_client import ExpertClient
    with ExpertClient("127.0.0.1:50051") as client:
        out = client.forward(layer, hidden_states, topk_ids, topk_weights)

Needs grpcio, protobuf, numpy and torch only (none of the server's dependencies).
"""

from lutb_client.client import (
    DEFAULT_TIMEOUT_S,
    AsyncExpertClient,
    AsyncForwardStream,
    ExpertClient,
    ForwardResult,
    ForwardStream,
)
from lutb_client.errors import ExpertServiceError
from lutb_client.sharded import AsyncShardedExpertClient, ShardedExpertClient

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AsyncExpertClient",
    "AsyncForwardStream",
    "AsyncShardedExpertClient",
    "ExpertClient",
    "ExpertServiceError",
    "ForwardResult",
    "ForwardStream",
    "ShardedExpertClient",
]
