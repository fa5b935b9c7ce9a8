"""lutb_client: talk to a lutb-moe expert server (codec, sync and async clients, routing helpers)."""

__version__ = "0.1.0"
