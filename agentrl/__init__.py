"""agentrl: agentic RL post-training for hybrid linear-attention MoE language models."""

import os as _os

__version__ = "0.1.0"

# envs/, rollout/ and trainer/ sit beside agentrl/ in the source tree and become agentrl.envs/.rollout/.trainer
# through setuptools' package-dir when installed. A checkout that is imported without being installed — the copy a
# `ray job submit` working_dir puts on every node — needs the same mapping: the tree's root joins the package path.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "envs", "tool_env.py")) and _root not in __path__:
    __path__.append(_root)
