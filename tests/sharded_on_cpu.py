"""`accelerate launch ... tests/sharded_on_cpu.py train ...`: the command line, with FSDP or DeepSpeed on CPU processes.

Accelerate 1.15 turns FSDP on for accelerator devices only (`AcceleratorState` ignores it on a gloo
process group of CPUs), and DeepSpeed only when it is not told to use CPUs, which training does on
machines without GPUs to get a gloo process group. This launcher lifts both limits, so that the CPU
tests run the sharded checkpoint code: FSDP2 (`fully_shard`, which runs on CPUs; FSDP1 needs an accelerator
device) and DeepSpeed ZeRO (with `DS_ACCELERATOR=cpu`) over gloo.
"""

import os
import runpy
import sys

import accelerate
from accelerate import state
from accelerate.utils import DistributedType, InitProcessGroupKwargs

_accelerator_init = accelerate.Accelerator.__init__
_state_init = state.AcceleratorState.__init__


def _accelerator_with_deepspeed_on_cpus(self, *args, **kwargs):
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true":
        # Not `cpu=True`, which turns DeepSpeed off; gloo, which DeepSpeed's CPU accelerator speaks.
        handlers = [*(kwargs.get("kwargs_handlers") or []), InitProcessGroupKwargs(backend="gloo")]
        kwargs.update(cpu=False, kwargs_handlers=handlers)
    _accelerator_init(self, *args, **kwargs)


def _state_with_fsdp_on_cpus(self, *args, **kwargs):
    _state_init(self, *args, **kwargs)
    if kwargs.get("fsdp_plugin") is not None and self.distributed_type == DistributedType.MULTI_CPU:
        # What `AcceleratorState` does on GPUs; `PartialState` keeps a copy of the type that later states read.
        self.distributed_type = state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.fsdp_plugin = kwargs["fsdp_plugin"]


if __name__ == "__main__":
    accelerate.Accelerator.__init__ = _accelerator_with_deepspeed_on_cpus
    state.AcceleratorState.__init__ = _state_with_fsdp_on_cpus
    sys.argv[0] = "vaswani_transformer.cli"
    runpy.run_module("vaswani_transformer.cli", run_name="__main__")
