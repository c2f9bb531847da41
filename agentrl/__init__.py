"""agentrl: agentic RL post-training for hybrid linear-attention MoE language models."""

__version__ = "0.1.0"
