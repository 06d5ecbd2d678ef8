"""``install()`` / ``uninstall()``: put rlmath's verl-compatible functions into a running verl."""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType
from typing import Any, NamedTuple

from rlmath.compat.verl import core_algos as _core_algos
from rlmath.compat.verl import rollout_corr_helper as _rollout_corr_helper
from rlmath.compat.verl import torch_functional as _torch_functional
from rlmath.compat.verl._state import OPTIONS

__all__ = ["install", "is_installed", "uninstall"]

#: The verl version whose signatures this layer reproduces.
VERL_VERSION = "0.9.1"

_MODULES: dict[str, tuple[str, ModuleType]] = {
    "torch_functional": ("verl.utils.torch_functional", _torch_functional),
    "core_algos": ("verl.trainer.ppo.core_algos", _core_algos),
    "rollout_corr_helper": ("verl.trainer.ppo.rollout_corr_helper", _rollout_corr_helper),
}

_REGISTRIES: dict[str, dict[str, Any]] = {
    "POLICY_LOSS_REGISTRY": _core_algos.POLICY_LOSSES,
    "ADV_ESTIMATOR_REGISTRY": _core_algos.ADV_ESTIMATORS,
}


class _Patch(NamedTuple):
    label: str
    target: Any  # a module (attribute patch) or a dict (registry entry)
    key: str
    original: Any
    is_item: bool


_patches: list[_Patch] = []
_selection: tuple[bool, bool, bool, bool] | None = None


def _import_verl(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(
            f"rlmath.compat.verl.install() patches verl, but {name} could not be imported "
            f"({err}). Install verl {VERL_VERSION} (pip install verl=={VERL_VERSION}) or use "
            "the functions of rlmath.compat.verl directly: they do not need verl."
        ) from err


def _check_version() -> None:
    try:
        from importlib.metadata import version

        found = version("verl")
    except Exception:
        return
    if found != VERL_VERSION:
        warnings.warn(
            f"rlmath.compat.verl reproduces verl {VERL_VERSION}'s signatures; verl {found} is "
            "installed, so a function whose signature changed may be called incorrectly",
            stacklevel=3,
        )


def _record() -> dict[str, Any]:
    return {p.label: p.original for p in _patches}


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_patches)


def install(
    *,
    torch_functional: bool = True,
    core_algos: bool = True,
    rollout_corr_helper: bool = True,
    float_metrics: bool = True,
) -> dict[str, Any]:
    """Make verl compute with rlmath: replace verl's math functions by rlmath.compat.verl's.

    For each selected verl module (``verl.utils.torch_functional``,
    ``verl.trainer.ppo.core_algos``, ``verl.trainer.ppo.rollout_corr_helper``)
    every function this layer provides replaces verl's attribute of the same
    name; verl's ``POLICY_LOSS_REGISTRY`` and ``ADV_ESTIMATOR_REGISTRY``
    entries (so ``get_policy_loss_fn`` / ``get_adv_estimator_fn``) return
    rlmath's functions; and every already-imported ``verl.*`` module that
    bound one of the replaced functions by name (``from ... import fn``) is
    rebound too.

    **Call it before your own code takes bindings**: ``from
    verl.trainer.ppo.core_algos import agg_loss`` executed *before*
    ``install()`` outside verl keeps verl's function (as with Liger-Kernel's
    ``apply_liger_kernel_to_*``). verl's Ray workers are separate processes:
    run ``install`` in each, e.g. with the Ray runtime environment
    ``worker_process_setup_hook="rlmath.compat.verl.install"``
    (``docs/migration.md``).

    Metric values have verl's types: Python floats where verl returns floats
    (read back together, a host sync, where verl syncs per value; the
    compat layer is the only part of rlmath that reads values back). ``float_metrics=False`` keeps them detached
    0-d tensors instead (no host sync per call; verl's ``Metric`` accepts
    them, but code that expects floats, such as verl's
    ``test_offpolicy_metrics``, does not).

    Idempotent: calling it again with the same selection changes nothing.
    Returns ``{qualified name: verl's original}`` for everything replaced
    (the same mapping on every call while installed).

    Raises:
        ImportError: verl (or a selected module) is not importable.
        ValueError: already installed with a different selection.
    """
    global _selection
    selection = (
        bool(torch_functional),
        bool(core_algos),
        bool(rollout_corr_helper),
        bool(float_metrics),
    )
    if _patches:
        if selection != _selection:
            raise ValueError(
                "rlmath.compat.verl is already installed with another selection; call "
                "uninstall() first"
            )
        return _record()
    chosen = [key for key, on in zip(_MODULES, selection[:3]) if on]
    verl_modules = {key: _import_verl(_MODULES[key][0]) for key in chosen}
    _check_version()
    replacements: dict[int, tuple[Any, Any]] = {}
    for key in chosen:
        qualname, ours = _MODULES[key]
        target = verl_modules[key]
        for name in ours.VERL_NAMES:
            if not hasattr(target, name):
                continue
            original = getattr(target, name)
            replacement = getattr(ours, name)
            _patches.append(_Patch(f"{qualname}.{name}", target, name, original, False))
            replacements[id(original)] = (original, replacement)
            setattr(target, name, replacement)
    if "core_algos" in verl_modules:
        algos = verl_modules["core_algos"]
        for registry_name, ours_registry in _REGISTRIES.items():
            registry = getattr(algos, registry_name, None)
            if not isinstance(registry, dict):
                continue
            for name, fn in ours_registry.items():
                if name in registry:
                    label = f"verl.trainer.ppo.core_algos.{registry_name}[{name!r}]"
                    _patches.append(_Patch(label, registry, name, registry[name], True))
                    registry[name] = fn
    patched_modules = {id(m) for m in verl_modules.values()}
    for module_name, module in list(sys.modules.items()):
        if not (module_name == "verl" or module_name.startswith("verl.")):
            continue
        if module is None or id(module) in patched_modules:
            continue
        for attr, value in list(vars(module).items()):
            hit = replacements.get(id(value))
            if hit is not None and hit[0] is value:
                _patches.append(_Patch(f"{module_name}.{attr}", module, attr, value, False))
                setattr(module, attr, hit[1])
    _selection = selection
    OPTIONS.float_metrics = selection[3]
    return _record()


def uninstall() -> dict[str, Any]:
    """Undo :func:`install` exactly: every replaced attribute and registry entry gets verl's original.

    Returns ``{qualified name: the restored original}``; ``{}`` when not installed.
    """
    global _selection
    restored = _record()
    for patch in reversed(_patches):
        if patch.is_item:
            patch.target[patch.key] = patch.original
        else:
            setattr(patch.target, patch.key, patch.original)
    _patches.clear()
    _selection = None
    OPTIONS.float_metrics = True
    return restored
