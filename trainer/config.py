"""The trainer's configuration (kept apart from the DeepSpeed code so configs load without importing DeepSpeed)."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentrl.trainer.losses import LossConfig

CUDA_GRAPH_SPARE_SEQUENCES = 2  # a graph's offsets keep room for a padding sequence and an empty closing one

DTYPES = ("auto", "bf16", "fp32")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """The policy optimizer's settings.

    Args:
        run_dir: checkpoints go to `<run_dir>/checkpoints/`, published weights to `<run_dir>/weights/`.
        zero_stage: 2 (optimizer state and gradients sharded) or 3 (parameters sharded too).
        dtype: "bf16", "fp32" or "auto" (bf16 on GPU, fp32 on CPU, where fp32 is faster without AVX-512 BF16).
        lr, betas, adam_eps, weight_decay: torch AdamW (weight decay only on matrices, not norms or gates).
        warmup_steps: linear learning-rate warm-up from 0.
        grad_clip: global gradient-norm clip (0 disables).
        micro_batch_tokens: token budget of one packed micro-batch.
        gradient_checkpointing: recompute each sub-layer in the backward pass.
        routing_replay: train with the experts the engine chose (R3) when trajectories carry them.
        temperature: the sampling temperature whose log-probs the engine recorded; the RL losses use it, SFT
            trains at 1 (trainer/forward.py says why).
        seed: initialises a model built from a config and the RNGs.
        loss: the objective (LossConfig; kind="sft" for supervised warm starts).
        keep_weight_versions: published versions kept on disk.
        keep_checkpoints: training checkpoints kept on disk (the newest; older ones are deleted after each save).
        zero3_param_persistence_threshold: ZeRO-3 leaves parameters smaller than this unsharded.
        num_threads: torch intra-op threads per rank (None: leave as set).
        dist_timeout_s: collective time-out.
        expert_parallel: ranks the routed experts of every MoE layer are sharded over (1: every rank holds all of
            them). Must divide the number of ranks and the number of experts; ZeRO-2 only (DeepSpeed's MoE support
            does not cover ZeRO-3).
        context_parallel: ranks each micro-batch's tokens are split over, in sequence order (1: none), so that one
            trajectory may be longer than a rank holds (agentrl/model/context_parallel.py). Groups of consecutive
            ranks; data parallelism runs across the groups, ZeRO over all ranks; micro_batch_tokens is per rank.
        cuda_graph_tokens: token counts (increasing) of the CUDA graphs a short micro-batch's forward and backward
            replay from (empty: none). A micro-batch is padded to the smallest that holds it, a longer one runs
            eagerly. Each size, per temperature a step trains at (an SFT step's 1.0 records its own), keeps an
            un-checkpointed pass's activations of its size for the trainer's life (trainer/cuda_graphs.py).
            ZeRO-2, CUDA, no context or expert parallelism.
        cuda_graph_sequences: the sequences a graph's offsets hold; a micro-batch of more than this minus two runs
            eagerly.
    """

    run_dir: str
    zero_stage: int = 2
    dtype: str = "auto"
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    micro_batch_tokens: int = 16384
    gradient_checkpointing: bool = True
    routing_replay: bool = True
    temperature: float = 1.0
    seed: int = 0
    loss: LossConfig = field(default_factory=LossConfig)
    keep_weight_versions: int = 3
    keep_checkpoints: int = 2
    zero3_param_persistence_threshold: int = 100_000
    num_threads: int | None = None
    dist_timeout_s: float = 600.0
    expert_parallel: int = 1
    context_parallel: int = 1
    cuda_graph_tokens: tuple[int, ...] = ()
    cuda_graph_sequences: int = 64

    def __post_init__(self) -> None:
        if self.zero_stage not in (2, 3):
            raise ValueError(f"trainer.zero_stage must be 2 or 3, got {self.zero_stage}")
        if self.dtype not in DTYPES:
            raise ValueError(f"trainer.dtype={self.dtype!r} is not one of {DTYPES}")
        if self.lr <= 0:
            raise ValueError(f"trainer.lr must be > 0, got {self.lr}")
        if self.micro_batch_tokens < 2:
            raise ValueError(f"trainer.micro_batch_tokens must be >= 2, got {self.micro_batch_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"trainer.temperature must be > 0, got {self.temperature}")
        if self.warmup_steps < 0 or self.grad_clip < 0:
            raise ValueError(f"trainer.warmup_steps and trainer.grad_clip must be >= 0, got {self.warmup_steps}, "
                             f"{self.grad_clip}")
        if self.expert_parallel < 1:
            raise ValueError(f"trainer.expert_parallel must be >= 1, got {self.expert_parallel}")
        if self.context_parallel < 1:
            raise ValueError(f"trainer.context_parallel must be >= 1, got {self.context_parallel}")
        if self.context_parallel > 1 and self.expert_parallel > 1:
            raise ValueError("trainer.context_parallel and trainer.expert_parallel cannot both be > 1 yet: the "
                             "expert-parallel all-to-alls would need the CP ranks' groups laid out around them")
        if self.context_parallel > 1 and self.loss.kind == "gspo":
            raise ValueError("trainer.loss.kind=gspo with trainer.context_parallel > 1: GSPO's sequence-level ratio "
                             "sums over a whole sequence, which context parallelism splits over ranks; use ppo")
        if self.expert_parallel > 1 and self.zero_stage == 3:
            raise ValueError(f"trainer.expert_parallel={self.expert_parallel} needs zero_stage=2: DeepSpeed "
                             f"partitions expert parameters over expert-data-parallel groups only under ZeRO-1/2")
        if self.cuda_graph_tokens:
            self._check_cuda_graphs()
        if self.keep_weight_versions < 1:
            raise ValueError(f"trainer.keep_weight_versions must be >= 1, got {self.keep_weight_versions}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"trainer.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")

    def _check_cuda_graphs(self) -> None:
        """What rules CUDA graphs out whatever the machine (trainer/cuda_graphs.py; the trainer checks for CUDA)."""
        buckets = list(self.cuda_graph_tokens)
        if any(b < 2 for b in buckets) or buckets != sorted(set(buckets)):
            raise ValueError(f"trainer.cuda_graph_tokens must be increasing token counts >= 2, got {buckets}")
        if self.cuda_graph_sequences <= CUDA_GRAPH_SPARE_SEQUENCES:
            raise ValueError(f"trainer.cuda_graph_sequences must be > {CUDA_GRAPH_SPARE_SEQUENCES} (that many are "
                             f"kept for padding), got {self.cuda_graph_sequences}")
        if self.zero_stage == 3:
            raise ValueError("trainer.cuda_graph_tokens needs zero_stage=2: ZeRO-3 frees each parameter after use "
                             "and gathers it again through module hooks, which a graph replay skips")
        if self.context_parallel > 1 or self.expert_parallel > 1:
            raise ValueError("trainer.cuda_graph_tokens with context or expert parallelism: their collectives run "
                             "inside the model, and a graph would replay them without their host-side bookkeeping")
