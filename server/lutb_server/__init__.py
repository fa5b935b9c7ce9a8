"""lutb_server: serves LUT-B MoE experts over gRPC (settings, engine, scheduler, servicer, metrics, CLI)."""

__version__ = "0.1.0"
