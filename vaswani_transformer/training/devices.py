"""The processes and devices of a `train` run on Accelerate: their precision, their attention kernel, a fresh state.

Mixed precision is not in the paper (§5.2 names only its 8 P100 GPUs); `--mixed-precision auto` chooses it per
machine, once per run. Every process of a run computes alike: what one process decides, it gives to all.
"""

from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, TorchDynamoPlugin, broadcast, broadcast_object_list, parse_flag_from_env

from ..inference.cpu_kernels import bfloat16_products_are_faster
from . import checkpoints as ckpt
from .config import MIXED_PRECISIONS, TrainingConfig
from .directory import read_record


def fastest_mixed_precision(device: torch.device) -> str:
    """What `--mixed-precision auto` trains in on `device`: "bf16" where it is clearly faster, else "no".

    Mixed precision is not in the paper (§5.2 names only its 8 P100 GPUs); it changes the rounding of
    the products, not the model. On a CUDA GPU, "bf16" from compute capability 8.0
    (Ampere), whose matrix units compute bfloat16 (older GPUs emulate it). On the CPU it is measured,
    since it depends on the processor's instructions: "bf16" where
    `bfloat16_products_are_faster()`, as on CPUs with AVX512_BF16 or AMX
    (docs/performance.md, "Mixed precision on CPUs"). Weights, Adam's state, the softmax over the
    vocabulary and, on CPUs where that is faster, attention stay in float32. Other devices: "no".

    Args:
        device: the device training runs on.

    Returns:
        "bf16" or "no", a value of `TrainingConfig.mixed_precision`.
    """
    if device.type == "cuda":
        return "bf16" if torch.cuda.get_device_capability(device) >= (8, 0) else "no"
    if device.type == "cpu":
        return "bf16" if bfloat16_products_are_faster() else "no"
    return "no"


def avoid_cudnn_attention() -> None:
    """Keep PyTorch's scaled-dot-product attention (§3.2.1, Eq. 1) off its cuDNN kernel, for training on CUDA.

    Batches of sentences change shape at nearly every step, and cuDNN's attention builds a plan for
    every new shape, which costs far more than PyTorch's flash and memory-efficient kernels save
    (docs/performance.md, "Attention kernels on GPUs"). Decoding in bfloat16 or float16 (§6.1), whose
    keys grow by one position a step, gains the same (docs/gpu.md, "Decoding"); float32 never takes
    that kernel. The setting is process-wide; nothing happens on machines without CUDA.
    """
    torch.backends.cuda.enable_cudnn_sdp(False)


def resolve_mixed_precision(config: TrainingConfig, launched_on_cpus: bool) -> str:
    """What `--mixed-precision auto` means for this run, decided before Accelerate starts, the same on every process.

    The resumed run's choice where there is one (its `training_config.json`), so that a run never changes
    precision halfway; else measured by the main process alone (`fastest_mixed_precision`), while the others
    wait, and given to all. Every process must call this.

    Args:
        config: the run's settings (`mixed_precision` "auto"; `output_dir` and `resume` say whether it resumes).
        launched_on_cpus: the processes were launched on CPUs (Accelerate forms their process group only when
            told); `accelerate launch --cpu` says so through the environment, which PartialState does not read.

    Returns:
        "bf16" or "no" (or a resumed run's recorded "fp16").
    """
    state = PartialState(cpu=launched_on_cpus or parse_flag_from_env("ACCELERATE_USE_CPU"))
    choice = [None]
    if state.is_main_process:
        if config.resume and ckpt.list_checkpoints(Path(config.output_dir) / "checkpoints"):
            choice = [read_record(Path(config.output_dir)).get("mixed_precision")]  # measured anew where unreadable
        if choice[0] not in MIXED_PRECISIONS or choice[0] == "auto":
            choice = [fastest_mixed_precision(state.device)]
    return broadcast_object_list(choice)[0]


def start_accelerator(config: TrainingConfig, launched_on_cpus: bool) -> Accelerator:
    """The run's Accelerator: its processes, precision, compilation and trackers, from a fresh Accelerate state.

    Args:
        config: the run's settings, `mixed_precision` resolved (not "auto").
        launched_on_cpus: the processes were launched on CPUs (see `resolve_mixed_precision`).

    Returns:
        The Accelerator; on CUDA, attention is kept off cuDNN (`avoid_cudnn_attention`).

    Raises:
        ValueError: `config.update_freq` is above 1 under DeepSpeed, which updates the weights after every batch.
    """
    if AcceleratorState._shared_state and PartialState().num_processes == 1:
        # Accelerate keeps its first Accelerator's state for the process: a second run in one Python session (a
        # notebook) would keep that run's precision and compile settings. Afresh, as TrainingArguments does.
        AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(
        cpu=launched_on_cpus,  # Accelerate forms a gloo process group on CPUs only when told to use them
        mixed_precision=config.mixed_precision,
        # Dynamic shapes: token batches vary in sentences and length at every step, and a graph per shape
        # would recompile without end. None leaves `accelerate launch --dynamo_backend` in charge.
        dynamo_plugin=TorchDynamoPlugin(backend="inductor", dynamic=True) if config.compile else None,
        log_with=config.report_to or None,
        project_dir=str(Path(config.output_dir) / "runs"),
    )
    if accelerator.device.type == "cuda":
        avoid_cudnn_attention()
    if accelerator.distributed_type == DistributedType.DEEPSPEED and config.update_freq > 1:
        # DeepSpeed applies the update inside every backward pass: accumulated batches would be separate steps.
        raise ValueError(
            f"--update-freq {config.update_freq} does not work under DeepSpeed, which updates the weights after "
            "every batch: use --update-freq 1 and reach the batch size with --max-tokens or more processes."
        )
    return accelerator


def broadcast_from_main(accelerator: Accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """The main process's `tensor` on every process, on the accelerator's device (Accelerate's `broadcast`).

    Every process must call this; with one process, `tensor` itself.
    """
    return broadcast(tensor.to(accelerator.device)) if accelerator.num_processes > 1 else tensor
