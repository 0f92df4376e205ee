"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as a Hugging Face model.

Importing the package registers `VaswaniConfig` and `VaswaniForConditionalGeneration` with the
Auto classes, so that `AutoConfig`, `AutoModel`, `AutoModelForSeq2SeqLM` and `AutoTokenizer`
load saved directories.

"""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from .configuration_vaswani import PRESETS, VaswaniConfig
from .modeling_vaswani import VaswaniForConditionalGeneration, VaswaniModel, VaswaniPreTrainedModel

AutoConfig.register(VaswaniConfig.model_type, VaswaniConfig)
AutoModel.register(VaswaniConfig, VaswaniModel)
AutoModelForSeq2SeqLM.register(VaswaniConfig, VaswaniForConditionalGeneration)
# Saved directories carry the code and an `auto_map`, for users without this package (trust_remote_code).
VaswaniConfig.register_for_auto_class()
VaswaniModel.register_for_auto_class("AutoModel")
VaswaniForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")

__all__ = ["PRESETS", "VaswaniConfig", "VaswaniForConditionalGeneration", "VaswaniModel", "VaswaniPreTrainedModel"]
__version__ = "0.1.0"
