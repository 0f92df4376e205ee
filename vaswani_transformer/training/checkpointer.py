"""A `train` run's checkpoints (§6.1): saved whole, restored exactly, on one process or sharded over many.

`Checkpointer` writes and reads them: the weights are the whole model in float32 even where the processes hold
shards of it (FSDP) or of its float32 master weights (DeepSpeed ZeRO), so that any checkpoint can be averaged,
translated with or resumed on another number of processes. `WholeModel` gathers that whole model, for the
checkpoints, validation BLEU (`validation`) and the averaged model (`finish`). The files themselves, and their
averaging, are `checkpoints`'.
"""

from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ..model.modeling_vaswani import VaswaniForConditionalGeneration
from ..utils.files import room_for
from . import checkpoints as ckpt
from .state import RunState

# What DeepSpeed's loss scaler changes as it trains (fp16's dynamic scale); with bf16 its scale stays 1.
_ZERO_LOSS_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of `model`'s weights, each stored once (the shared embedding too, §3.4), for the room a file needs."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """The bytes a checkpoint of `model` needs on disk: its weights and Adam's two moments of each (§5.3).

    The few kB of the other files (schedule, RNG states, progress) are left out.
    """
    return 3 * weight_bytes(model)


class WholeModel:
    """The trained model as one float32 module, however the processes shard it: to translate with and to save.

    Args:
        accelerator: the run's processes.
        model: the model as Accelerate prepared it (data parallel, FSDP, DeepSpeed, or the model itself).
        unwrapped: `accelerator.unwrap_model(model)`.
    """

    def __init__(
        self, accelerator: Accelerator, model: torch.nn.Module, unwrapped: VaswaniForConditionalGeneration
    ) -> None:
        self.accelerator, self.model, self.unwrapped = accelerator, model, unwrapped

    @property
    def sharded(self) -> bool:
        """Whether no process holds the whole float32 model: FSDP shards the parameters, DeepSpeed ZeRO the
        float32 master weights (its module's weights are bf16 copies under `--mixed-precision bf16`)."""
        return self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    def forward_module(self) -> torch.nn.Module:
        """The module to run forward passes with outside training's step, on every process (validation loss).

        The model itself, whose forward does not synchronise as a data-parallel wrapper's would; under FSDP the
        wrapped one, whose forward gathers the sharded parameters: every process must then run as many batches.
        """
        return self.model if self.accelerator.distributed_type == DistributedType.FSDP else self.unwrapped

    def weights(self) -> dict[str, torch.Tensor]:
        """The whole model's float32 weights, by name, on the main process's CPU (FSDP leaves the others none).

        From FSDP's shards or ZeRO's master weights (each summed from its partitions), else the model's own
        state dict. Every process must call this: they take part in gathering.
        """
        if self.accelerator.distributed_type != DistributedType.DEEPSPEED:
            return self.accelerator.get_state_dict(self.model)
        from deepspeed.utils import safe_get_full_fp32_param

        masters = {id(p): safe_get_full_fp32_param(p).cpu() for p in self.unwrapped.parameters()}
        parameters = dict(self.unwrapped.named_parameters(remove_duplicate=False))
        state = self.unwrapped.state_dict()
        return {name: masters[id(parameters[name])] if name in parameters else t for name, t in state.items()}

    def module(self, weights: dict[str, torch.Tensor] | None = None) -> VaswaniForConditionalGeneration:
        """The model as one module on the main process: the trained one itself on one process or under DDP.

        Args:
            weights: from `weights`, for a sharded run (`sharded`); ignored otherwise.

        Returns:
            The trained module itself where it is whole (changing it changes the run's model); else a new model
            on the run's device, holding `weights` if given (else its initial ones).
        """
        if not self.sharded:
            return self.unwrapped
        with torch.device(self.accelerator.device):
            model = VaswaniForConditionalGeneration(self.unwrapped.config)
        if weights is not None:
            ckpt.load_model_state(model, weights)
        return model


class Checkpointer:
    """Saving a run's whole training state as `checkpoints/step-N`, and restoring it exactly (§6.1).

    Args:
        accelerator: the run's processes.
        whole: the run's model, whole however it is sharded; `whole.model` as Accelerate prepared it.
        optimizer, scheduler: Adam (as Accelerate prepared it) and the schedule of Eq. 3 (§5.3).
        state: the run's progress, saved with every checkpoint; `save` brings its `elapsed_seconds` up to date,
            sets its `last_save`, and keeps the checkpoint of its `best_step`.
        output_dir: the run's output directory, whose disk must have room for a checkpoint.
        checkpoints_dir: where the checkpoints go (`output_dir / "checkpoints"`).
        keep: how many of the newest checkpoints stay (`keep_checkpoints`), besides the best.
        needs_bytes: the room a checkpoint needs (`checkpoint_bytes`), checked before anything is written.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        whole: WholeModel,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LambdaLR,
        state: RunState,
        output_dir: Path,
        checkpoints_dir: Path,
        keep: int,
        needs_bytes: int,
    ) -> None:
        self.accelerator, self.whole = accelerator, whole
        self.model, self.unwrapped = whole.model, whole.unwrapped
        self.optimizer, self.scheduler, self.state = optimizer, scheduler, state
        self.output_dir, self.checkpoints_dir = output_dir, checkpoints_dir
        self.keep, self.needs_bytes = keep, needs_bytes

    def _training_state(self, directory: Path) -> tuple[torch.nn.Module | dict[str, torch.Tensor], dict | None]:
        # The weights and the optimizer state for the main process to write, and under DeepSpeed this process's
        # partition of the optimizer, written here. Every process must call this: FSDP gathers its shards.
        accelerator = self.accelerator
        if accelerator.distributed_type == DistributedType.FSDP:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            # Whole tensors, keyed by parameter name, on the CPU of the main process (the others get none).
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            optimizer = get_optimizer_state_dict(self.model, self.optimizer.optimizer, options=options)
            return self.whole.weights(), optimizer
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            zero = self.optimizer.optimizer  # DeepSpeed's ZeRO optimizer; its `optimizer`, the run's Adam
            partition = {
                "optimizer": zero.optimizer.state_dict(),  # Adam over this process's flat partitions
                "masters": [t.detach().cpu() for t in zero.single_partition_of_fp32_groups],
                "loss_scaler": {k: v for k, v in vars(zero.loss_scaler).items() if k in _ZERO_LOSS_SCALER_STATE},
            }
            ckpt.write_optimizer_partition(directory, accelerator.process_index, partition)
            return self.whole.weights(), None
        return self.unwrapped, self.optimizer.state_dict() if accelerator.is_main_process else None

    def save(self) -> Path:
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
        progress = state.to_checkpoint()
        last = ckpt.list_checkpoints(self.checkpoints_dir)
        resume = f"run the same command with --resume: it continues from {last[-1].name if last else 'the start'}"
        with room_for(self.output_dir, self.needs_bytes, f"checkpoint step-{state.step}", resume):
            directory = ckpt.incomplete_dir(self.checkpoints_dir, state.step, create=accelerator.is_main_process)
            accelerator.wait_for_everyone()
            ckpt.write_rng_state(directory, accelerator.process_index)
            weights, optimizer = self._training_state(directory)
            accelerator.wait_for_everyone()
            published = self.checkpoints_dir / f"step-{state.step}"
            if accelerator.is_main_process:
                optimizer_state = {"scheduler": self.scheduler.state_dict()}
                if optimizer is not None:  # None: in the processes' `optimizer-<rank>.pt` (DeepSpeed ZeRO)
                    optimizer_state["optimizer"] = optimizer
                if accelerator.scaler is not None:
                    optimizer_state["scaler"] = accelerator.scaler.state_dict()
                ckpt.write_main_state(directory, weights, optimizer_state, progress, self.unwrapped.config)
                best = (state.best_step,) if state.best_step else ()
                published = ckpt.publish_checkpoint(directory, self.keep, protect=best)
        accelerator.wait_for_everyone()
        state.mark_saved()
        return published

    def restore(self, path: Path) -> None:
        """Load the weights, optimizer, schedule, loss scaler and this process's RNG state of a checkpoint.

        The run's progress (`trainer_state.json`) is `state.RunState.from_checkpoint`'s. Every process must call
        this, before the first step.

        Args:
            path: a `step-N` directory, verified (`checkpoints.latest_good_checkpoint`) by as many processes.
        """
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
