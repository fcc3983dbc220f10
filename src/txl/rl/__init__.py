"""Memory for agents (GTrXL): txl.rl.memory; the TorchRL module: txl.rl.torchrl_module."""

from txl.rl.memory import AgentMemory, MemoryState, MemoryTransformer, gtrxl_config

__all__ = ["AgentMemory", "MemoryState", "MemoryTransformer", "gtrxl_config"]
