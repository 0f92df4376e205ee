"""`option()`: a dataclass field that carries its command-line help, from which `cli.py` generates the options.

`TrainingConfig` (`train`) and `ServingConfig` (`serve`) declare every setting once with it: its name, default,
unit and help. It imports nothing of the package, so that any configuration may use it.
"""

from dataclasses import MISSING, field
from typing import Any


def option(default: Any = MISSING, help: str = "", group: str = "recipe", **argparse: Any) -> Any:
    """A configuration field with its command-line help, group and any other `argparse` setting.

    See README.md, "Command line".

    Args:
        default: the default value; a list or dict default is copied for every config.
        help: the help text, with the unit of the value.
        group: the `--help` section the option is listed in.
        **argparse: passed to `add_argument` (e.g. `choices`, `metavar`, `flag` for another option name).

    Returns:
        A `dataclasses.field`.
    """
    metadata = {"help": help, "group": group, **argparse}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)
