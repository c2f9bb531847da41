"""The DeepSpeed policy optimizer (imported as ``agentrl.trainer``)."""
