"""What a training run is, checked before any process starts.

Kept free of torch: the CLI validates a layout instantly, and `gpuwatch` (the agent's CLI) never
imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gpuwatch.plan.model import ModelConfig

SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
#: Failures the trainer reproduces on purpose (trainer/faults.py), so that diagnosis can be shown to find them.
FAULTS = {
    "duplicate-shards": "every DP rank reads the same data (no distributed sampler)",
    "slow-rank": "one rank (--fault-rank) computes 8x slower, like a throttled GPU",
    "shared-pp-dp-group": "pipeline send/recv and the DP all-reduce on one process group",
    "lr-explode": "a learning rate of 20: the gradient norm explodes",
    "desync": "the last DP replica starts from perturbed weights",
    "fp16-no-scaler": "fp16 without a loss scaler (needs --precision fp16): the loss overflows to NaN",
    "fragment-memory": "odd-sized blocks freed out of order fragment the CUDA allocator (needs a GPU)",
    "hang-rank": "one rank (--fault-rank) blocks for good before the DP all-reduce of step --fault-step",
    "crash-rank": "one rank (--fault-rank) is killed with SIGKILL at step --fault-step",
    "raise-rank": "one rank (--fault-rank) raises an exception at step --fault-step and exits",
    "skip-collective": "one rank (--fault-rank) leaves out its DP all-reduces of step --fault-step",
}
#: The faults that pick a rank with --fault-rank (default: the last rank).
RANK_FAULTS = ("slow-rank", "hang-rank", "crash-rank", "raise-rank", "skip-collective")
#: The faults that strike at a step (--fault-step), after a few healthy ones give the job a rhythm.
STEP_FAULTS = ("hang-rank", "crash-rank", "raise-rank", "skip-collective")


class ConfigError(ValueError):
    """A combination of options that cannot run; the message names the options and the fix."""


@dataclass(frozen=True)
class TrainConfig:
    """One run. `global_batch` and `seed` define the work, whatever the layout (tp, pp, dp)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    steps: int = 30
    global_batch: int = 16
    seed: int = 0
    lr: float = 1e-2
    warmup_steps: int = 5
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    precision: str = "fp32"
    device: str = "auto"
    bucket_bytes: int = 25 * 2**20
    corpus_size: int = 2**14
    log_jsonl: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    telemetry: bool = False  # the hooks, sending to the node agent; `gpuwatch train` turns them on
    telemetry_socket: str | None = None  # default: GPUWATCH_SOCKET, else the agent's well-known places
    job: str | None = None  # default: GPUWATCH_JOB, SLURM_JOB_ID, TORCHELASTIC_RUN_ID, else generated
    run_log: str | None = None  # a directory: every telemetry record, one JSONL file per rank
    grad_similarity_every: int = 10
    checksum_every: int = 10
    memory_every: int = 10
    faults: tuple[str, ...] = ()
    fault_rank: int | None = None  # the rank of RANK_FAULTS; default: the last rank
    fault_step: int = 5  # the step STEP_FAULTS strike at

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def faulty_rank(self) -> int | None:
        """The rank a fault of RANK_FAULTS strikes, or None without one."""
        if not set(self.faults) & set(RANK_FAULTS):
            return None
        return self.world_size - 1 if self.fault_rank is None else self.fault_rank

    @property
    def needs_cuda(self) -> bool:
        """fp16 trains on CUDA only; the fp16-no-scaler fault runs anywhere (it only needs fp16's range)."""
        return self.precision == "fp16" and "fp16-no-scaler" not in self.faults

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch on one DP rank."""
        return self.global_batch // (self.dp * self.micro_batches)

    def validate(self, world_size: int | None = None) -> None:
        """Raise ConfigError for anything that would fail (or hang) later inside the ranks."""
        m = self.model
        positive = {
            "--tp": self.tp, "--pp": self.pp, "--dp": self.dp, "--micro-batches": self.micro_batches,
            "--global-batch": self.global_batch, "--layers": m.layers, "--heads": m.heads,
            "--hidden": m.hidden, "--seq-len": m.seq_len, "--vocab": m.vocab_size,
        }
        for option, value in positive.items():
            if value < 1:
                raise ConfigError(f"{option} must be at least 1 (got {value})")
        checks = [
            (self.schedule in SCHEDULES, f"--schedule must be one of {', '.join(SCHEDULES)}"),
            (self.precision in PRECISIONS, f"--precision must be one of {', '.join(PRECISIONS)}"),
            (self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}"),
            (m.layers % self.pp == 0,
             f"--layers {m.layers} cannot be split into --pp {self.pp} stages of equal size"),
            (m.hidden % m.heads == 0, f"--hidden {m.hidden} is not divisible by --heads {m.heads}"),
            (m.heads % self.tp == 0,
             f"--heads {m.heads} cannot be split across --tp {self.tp} ranks (each rank owns whole heads)"),
            (m.vocab_size % self.tp == 0,
             f"--vocab {m.vocab_size} cannot be split across --tp {self.tp} ranks"),
            (self.global_batch % (self.dp * self.micro_batches) == 0,
             f"--global-batch {self.global_batch} is not divisible by --dp {self.dp} × "
             f"--micro-batches {self.micro_batches} (each DP rank splits its share into equal micro-batches)"),
            (self.steps >= 0, "--steps must not be negative"),
            (self.lr > 0, "--lr must be positive"),
            (self.warmup_steps >= 0, "--warmup-steps must not be negative"),
            (self.clip_grad >= 0, "--clip-grad must not be negative (0 turns clipping off)"),
            (self.checkpoint_every >= 0, "--checkpoint-every must not be negative"),
            (self.checkpoint_dir is not None or (not self.resume and self.checkpoint_every == 0),
             "--resume and --checkpoint-every need --checkpoint-dir"),
            (not (self.needs_cuda and self.device == "cpu"),
             "--precision fp16 needs CUDA; use bf16 on CPU"),
            (min(self.grad_similarity_every, self.checksum_every, self.memory_every) >= 0,
             "--grad-similarity-every, --checksum-every and --memory-every must not be negative (0 turns them off)"),
            (self.telemetry or (self.run_log is None and self.telemetry_socket is None),
             "--run-log and --telemetry-socket need --telemetry"),
        ]
        for ok, message in checks + self._fault_checks():
            if not ok:
                raise ConfigError(message)
        if world_size is not None and world_size != self.world_size:
            raise ConfigError(
                f"--tp {self.tp} × --pp {self.pp} × --dp {self.dp} = {self.world_size} ranks, "
                f"but the job has {world_size} (WORLD_SIZE)"
            )


    def _fault_checks(self) -> list[tuple[bool, str]]:
        """A fault needs the layout it shows up in: replicas to disagree, a pipeline to share a group with."""
        faults, world = set(self.faults), self.world_size
        between_replicas = sorted(faults & {"duplicate-shards", "desync"})
        return [
            (faults <= set(FAULTS), f"--fault must be one of {', '.join(FAULTS)}"),
            (self.dp > 1 or not between_replicas,
             f"--fault {' and --fault '.join(between_replicas)} need{'s' * (len(between_replicas) == 1)} "
             "data-parallel replicas: --dp 2 or more"),
            ((self.pp > 1 and self.dp > 1) or "shared-pp-dp-group" not in faults,
             "--fault shared-pp-dp-group needs both a pipeline and replicas: --pp 2 or more and --dp 2 or more"),
            (self.tp * self.dp > 1 or "slow-rank" not in faults,
             "--fault slow-rank needs peers doing the same work to be slower than: --tp or --dp 2 or more"),
            (self.fault_rank is None or bool(faults & set(RANK_FAULTS)),
             f"--fault-rank picks the rank of --fault {', '.join(RANK_FAULTS)}: add one of them"),
            (self.fault_step >= 1, "--fault-step must be at least 1"),
            (len(faults & set(STEP_FAULTS)) <= 1, f"--fault {', '.join(STEP_FAULTS)}: one at a time"),
            (world > 1 or not faults & set(STEP_FAULTS), f"--fault {', '.join(STEP_FAULTS)} need peers to leave "
             "waiting: 2 ranks or more"),
            (self.fault_rank is None or 0 <= self.fault_rank < world,
             f"--fault-rank {self.fault_rank} is not a rank of this job (0 to {world - 1})"),
            (self.precision == "fp16" or "fp16-no-scaler" not in faults,
             "--fault fp16-no-scaler trains in fp16 without its loss scaler: add --precision fp16"),
            (self.device != "cpu" or "fragment-memory" not in faults,
             "--fault fragment-memory fragments the CUDA caching allocator: it needs a GPU (--device cuda or auto)"),
        ]


def torchrun_world_size() -> int | None:
    """WORLD_SIZE when torchrun (or another elastic launcher) started this process, else None."""
    if all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return int(os.environ["WORLD_SIZE"])
    return None


def gpus_present() -> bool:
    """Whether NVML initialises and sees a GPU: asked of the driver's management library, so CUDA stays
    uninitialised (the fork launcher forks after this) and torch is not imported."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    except pynvml.NVMLError:
        return False
    finally:
        pynvml.nvmlShutdown()
