"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as a Hugging Face model.

Importing the package registers `VaswaniConfig` and `VaswaniForConditionalGeneration` with the
Auto classes, so that `AutoConfig`, `AutoModel`, `AutoModelForSeq2SeqLM` and `AutoTokenizer`
load saved directories.

The package itself imports neither torch nor transformers, so that `vaswani-transformer --help`
answers at once: its classes load on first use (PEP 562), and the registration happens as soon as
transformers is imported, where this package's own modules are not half-way through theirs.
"""

import importlib
import importlib.abc
import sys
import threading

__all__ = ["PRESETS", "VaswaniConfig", "VaswaniForConditionalGeneration", "VaswaniModel", "VaswaniPreTrainedModel"]
__version__ = "0.2.0"

_MODULE_OF = {
    "PRESETS": "model.configuration_vaswani",
    "VaswaniConfig": "model.configuration_vaswani",
    "VaswaniForConditionalGeneration": "model.modeling_vaswani",
    "VaswaniModel": "model.modeling_vaswani",
    "VaswaniPreTrainedModel": "model.modeling_vaswani",
}


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULE_OF])


def _register() -> None:
    from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

    from .model.configuration_vaswani import VaswaniConfig
    from .model.modeling_vaswani import VaswaniForConditionalGeneration, VaswaniModel

    AutoConfig.register(VaswaniConfig.model_type, VaswaniConfig)
    AutoModel.register(VaswaniConfig, VaswaniModel)
    AutoModelForSeq2SeqLM.register(VaswaniConfig, VaswaniForConditionalGeneration)
    # Saved directories carry the code and an `auto_map`, for users without this package (trust_remote_code).
    VaswaniConfig.register_for_auto_class()
    VaswaniModel.register_for_auto_class("AutoModel")
    VaswaniForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the classes once transformers is imported and none of this package's modules is being executed.

    Registering imports `configuration_vaswani` and `modeling_vaswani`, which import transformers: when one of
    them (or a module they import) is what imports transformers, registering at that moment would import it
    half-made, so the registration waits for the package's outermost module to finish.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.executing = 0  # modules of this package being executed, in any thread
        self.transformers_loaded = self.registered = False

    def find_spec(self, name: str, path=None, target=None):
        if self.registered or (name != "transformers" and not name.startswith(f"{__name__}.")):
            return None
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if finder is not self else None
            if spec is not None:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = _NotifyingLoader(spec.loader, self, is_ours=name != "transformers")
                return spec
        return None

    def started(self, is_ours: bool) -> None:
        with self.lock:
            self.executing += is_ours

    def finished(self, is_ours: bool, succeeded: bool) -> None:
        with self.lock:
            self.executing -= is_ours
            self.transformers_loaded |= succeeded and not is_ours
            ready = succeeded and self.transformers_loaded and not self.executing and not self.registered
            self.registered |= ready
        if ready:
            _register()


class _NotifyingLoader(importlib.abc.Loader):
    """A module's own loader, telling `_RegisterOnImport` when the module starts and finishes executing."""

    def __init__(self, loader: importlib.abc.Loader, finder: _RegisterOnImport, is_ours: bool) -> None:
        self.loader, self.finder, self.is_ours = loader, finder, is_ours

    def __getattr__(self, name: str):  # get_code, get_source, get_resource_reader...: the module's own loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.finder.started(self.is_ours)
        succeeded = False
        try:
            self.loader.exec_module(module)
            succeeded = True
        finally:
            self.finder.finished(self.is_ours, succeeded)


if "transformers" in sys.modules:
    _register()
else:
    sys.meta_path.insert(0, _RegisterOnImport())
