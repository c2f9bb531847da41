"""Tool environments as gymnasium envs (imported as ``agentrl.envs``). Imports no torch, Ray or vLLM."""
