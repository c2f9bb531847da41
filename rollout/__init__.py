"""Policy rollouts: vLLM engines in Ray actors and the multi-turn agent loop (imported as ``agentrl.rollout``)."""
