"""Memory for agents (GTrXL): txl.rl.memory; acting as one CUDA graph: txl.rl.acting; the TorchRL module:
txl.rl.torchrl_module."""

from txl.rl.acting import RingMemory
from txl.rl.memory import AgentMemory, MemoryState, MemoryTransformer, gtrxl_config

__all__ = ["AgentMemory", "MemoryState", "MemoryTransformer", "RingMemory", "gtrxl_config"]
