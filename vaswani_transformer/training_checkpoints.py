"""A `train` run's checkpoints (§6.1): saved whole, restored exactly, on one process or sharded over many.

`RunCheckpoints` is the part of `training.TrainingRun` that writes and reads them: the weights are the whole
model in float32 even where the processes hold shards of it (FSDP) or of its float32 master weights (DeepSpeed
ZeRO), so that any checkpoint can be averaged, translated with or resumed on another number of processes.
The files themselves, and their averaging, are `checkpoints`'.
"""

import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from . import checkpoints as ckpt
from .files import room_for
from .modeling_vaswani import VaswaniForConditionalGeneration
from .training_config import TrainingConfig

# What DeepSpeed's loss scaler changes as it trains (fp16's dynamic scale); with bf16 its scale stays 1.
_ZERO_LOSS_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of `model`'s weights, each stored once (the shared embedding too, §3.4), for the room a file needs."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


class RunCheckpoints:
    """Saving and restoring a `TrainingRun`'s state, and its whole model however the processes shard it.

    A part of `training.TrainingRun`, which sets what it reads: the run's `config`, `accelerator`, `model` (as
    Accelerate prepared it) and `unwrapped` (the model itself), `optimizer` and `scheduler` (§5.3), `state` (the
    progress saved with every checkpoint), `output_dir`, `checkpoints_dir`, `checkpoint_bytes`, `started` and
    `interval`. It sets `last_save`.
    """

    config: TrainingConfig
    accelerator: Accelerator
    model: torch.nn.Module
    unwrapped: VaswaniForConditionalGeneration
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: dict
    output_dir: Path
    checkpoints_dir: Path
    checkpoint_bytes: int
    started: float
    interval: torch.Tensor
    last_save: float

    def _sharded(self) -> bool:
        # No process holds the whole float32 model: FSDP shards the parameters, DeepSpeed ZeRO the float32 master
        # weights (its module's weights are bf16 copies under --mixed-precision bf16).
        return self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    def _whole_weights(self) -> dict[str, torch.Tensor]:
        # The whole model's float32 weights on the main process's CPU (FSDP leaves the others none), from FSDP's
        # shards or ZeRO's master weights (each summed from its partitions). Every process must call this.
        if self.accelerator.distributed_type != DistributedType.DEEPSPEED:
            return self.accelerator.get_state_dict(self.model)
        from deepspeed.utils import safe_get_full_fp32_param

        masters = {id(p): safe_get_full_fp32_param(p).cpu() for p in self.unwrapped.parameters()}
        parameters = dict(self.unwrapped.named_parameters(remove_duplicate=False))
        state = self.unwrapped.state_dict()
        return {name: masters[id(parameters[name])] if name in parameters else t for name, t in state.items()}

    def _whole_model(self, weights: dict[str, torch.Tensor] | None = None) -> VaswaniForConditionalGeneration:
        # The model as one float32 module, to translate with and to save on the main process: the trained one itself
        # on one process or under DDP; else (`_sharded`) a new one on the same device, holding `weights` if given.
        if not self._sharded():
            return self.unwrapped
        with torch.device(self.accelerator.device):
            model = VaswaniForConditionalGeneration(self.unwrapped.config)
        if weights is not None:
            ckpt.load_model_state(model, weights)
        return model

    def _training_state(self, directory: Path) -> tuple[torch.nn.Module | dict[str, torch.Tensor], dict | None]:
        # The weights and the optimizer state for the main process to write, and under DeepSpeed this process's
        # partition of the optimizer, written here. Every process must call this: FSDP gathers its shards.
        accelerator = self.accelerator
        if accelerator.distributed_type == DistributedType.FSDP:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            # Whole tensors, keyed by parameter name, on the CPU of the main process (the others get none).
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            optimizer = get_optimizer_state_dict(self.model, self.optimizer.optimizer, options=options)
            return self._whole_weights(), optimizer
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            zero = self.optimizer.optimizer  # DeepSpeed's ZeRO optimizer; its `optimizer`, the run's Adam
            partition = {
                "optimizer": zero.optimizer.state_dict(),  # Adam over this process's flat partitions
                "masters": [t.detach().cpu() for t in zero.single_partition_of_fp32_groups],
                "loss_scaler": {k: v for k, v in vars(zero.loss_scaler).items() if k in _ZERO_LOSS_SCALER_STATE},
            }
            ckpt.write_optimizer_partition(directory, accelerator.process_index, partition)
            return self._whole_weights(), None
        return self.unwrapped, self.optimizer.state_dict() if accelerator.is_main_process else None

    def save_checkpoint(self) -> Path:
        """Save the state of the run as `checkpoints/step-N`, to resume exactly or to average (§6.1).

        Every process writes its RNG state (and, under DeepSpeed, its partition of the optimizer), the main
        process the rest (weights, optimizer, schedule, loss scaler and `state`); the weights are the whole
        model in float32 even where the processes hold shards of it (FSDP, DeepSpeed ZeRO). The checkpoint
        appears atomically, and only the last `keep_checkpoints` and the best one stay. Every process must
        call this.

        Returns:
            The checkpoint's directory.

        Raises:
            OSError: writing failed (the incomplete checkpoint is hidden and removed by the next run); where the
                disk has no room for it, before anything is written if it can be told, one line says how much
                room it needs and how to resume.
        """
        accelerator, state = self.accelerator, self.state
        state.update(elapsed_seconds=time.monotonic() - self.started, interval=self.interval.tolist())
        last = ckpt.list_checkpoints(self.checkpoints_dir)
        resume = f"run the same command with --resume: it continues from {last[-1].name if last else 'the start'}"
        with room_for(self.output_dir, self.checkpoint_bytes, f"checkpoint step-{state['step']}", resume):
            directory = ckpt.incomplete_dir(self.checkpoints_dir, state["step"], create=accelerator.is_main_process)
            accelerator.wait_for_everyone()
            ckpt.write_rng_state(directory, accelerator.process_index)
            weights, optimizer = self._training_state(directory)
            accelerator.wait_for_everyone()
            published = self.checkpoints_dir / f"step-{state['step']}"
            if accelerator.is_main_process:
                optimizer_state = {"scheduler": self.scheduler.state_dict()}
                if optimizer is not None:  # None: in the processes' `optimizer-<rank>.pt` (DeepSpeed ZeRO)
                    optimizer_state["optimizer"] = optimizer
                if accelerator.scaler is not None:
                    optimizer_state["scaler"] = accelerator.scaler.state_dict()
                ckpt.write_main_state(directory, weights, optimizer_state, state, self.unwrapped.config)
                best = (state["best_step"],) if state.get("best_step") else ()
                published = ckpt.publish_checkpoint(directory, self.config.keep_checkpoints, protect=best)
        accelerator.wait_for_everyone()
        self.last_save = time.monotonic()
        return published

    def _restore_checkpoint(self, path: Path) -> None:
        # Weights, optimizer, scheduler, loss scaler and this process's RNG state from a verified checkpoint.
        accelerator = self.accelerator
        saved = ckpt.load_optimizer_state(path)
        if accelerator.distributed_type == DistributedType.FSDP:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            # Every process reads the whole state and keeps its shards; the tied copies of the embedding are not saved.
            options = StateDictOptions(full_state_dict=True, strict=False)
            ckpt.check_loaded_names(
                *set_model_state_dict(self.model, ckpt.load_weights(path), options=options), self.unwrapped.config
            )
            set_optimizer_state_dict(self.model, self.optimizer.optimizer, saved["optimizer"], options=options)
        elif accelerator.distributed_type == DistributedType.DEEPSPEED:
            # This process's partition; the module's weights are copied from the masters, as after an optimizer step.
            zero, partition = self.optimizer.optimizer, ckpt.load_optimizer_state(path, accelerator.process_index)
            zero.optimizer.load_state_dict(partition["optimizer"])
            for master, saved_master in zip(zero.single_partition_of_fp32_groups, partition["masters"], strict=True):
                master.data.copy_(saved_master)
            vars(zero.loss_scaler).update(partition["loss_scaler"])
            zero.update_lp_params()
        else:
            ckpt.load_model_state(self.unwrapped, ckpt.load_weights(path))
            self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        if self.accelerator.scaler is not None and "scaler" in saved:
            self.accelerator.scaler.load_state_dict(saved["scaler"])
        ckpt.restore_rng_state(path, self.accelerator.process_index)
