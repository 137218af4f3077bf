"""Plug-ins by import string: "package.module:function", importable from the working directory.
Runs on the driver (checks, data preparation) and in each worker (the model)."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any, Callable

from training.errors import UserError, one_line

_IMPORT_STRING = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def is_import_string(name: str) -> bool:
    return ":" in name


def load_callable(spec: str, field: str) -> Callable:
    """Import `package.module:function`; a clear UserError naming `field` if it cannot be done."""
    if not _IMPORT_STRING.match(spec):
        raise UserError(f"{field}: {spec!r} is not an import string of the form 'package.module:function'")
    module_name, attribute = spec.split(":")
    if "" not in sys.path:  # `python -m` and Ray job drivers import from the working directory
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"{field}: cannot import module {module_name!r} ({exc}); "
                        "is it on PYTHONPATH or in the working directory?") from None
    except (Exception, SystemExit) as exc:  # a SyntaxError, or any error (or sys.exit) in the module's own code
        raise UserError(f"{field}: importing module {module_name!r} failed: {one_line(exc)}; "
                        "fix the module (it runs when imported)") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise UserError(f"{field}: module {module_name!r} has no function {attribute!r}")
    return function


def call_plugin(function: Callable, spec: str, field: str, options_field: str, *args: Any, **options: Any) -> Any:
    """Call a plug-in; anything it raises (or a sys.exit) becomes a UserError naming `field`.
    A TypeError is most often options the function does not take, so the message shows them."""
    try:
        return function(*args, **options)
    except TypeError as exc:
        raise UserError(f"{field} {spec} rejected {options_field} {options}: {exc}") from None
    except (Exception, SystemExit) as exc:
        raise UserError(f"{field} {spec} failed: {one_line(exc)}") from None


def plugin_module_paths(*specs: str) -> list[str]:
    """Local source of the plug-ins named by `specs`, for Ray's `py_modules`: workers on any node
    can then import them. Installed packages (site-packages) are left to the environment."""
    paths = set()
    for spec in specs:
        if not is_import_string(spec):
            continue
        load_callable(spec, "plug-in")
        top = importlib.import_module(spec.split(":")[0].split(".")[0])
        location = list(top.__path__)[0] if hasattr(top, "__path__") else top.__file__
        if location and not {"site-packages", "dist-packages"} & set(Path(location).parts):
            paths.add(str(Path(location).resolve()))
    return sorted(paths)
