"""Which modules are units, and which unit owns each parameter: the cut of a model that ZeRO-3 shards by.

A unit is a module whose parameters are gathered together before its forward and reduced together after
its backward (FSDP2 makes one with each `fully_shard(module)` call). The user names them: a list of
modules, or a policy such as `instances_of(nn.TransformerEncoderLayer)`; the lab's model defaults to
`model.blocks`. A parameter belongs to a unit when every module that registers it lies inside that unit;
every other parameter (outside every unit, or shared by two places, like an embedding tied to the head)
belongs to the root, which is gathered for the whole forward and backward, so a shared weight is there
for every use.

`split_root` cuts the root in up to three by where its modules sit between the units (listed in the order
they run): the input unit (before the first unit: the embeddings), the output unit (after the last: the
final norm and the head) and what is left of the root (the model's own parameters, a shared weight).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

ROOT = "root"
INPUT, OUTPUT = "input", "output"  # the root's two parts when it is split (`split_root`)

NamedParams = list[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class InstancesOf:
    """A unit policy: every submodule that is an instance of one of `classes` is a unit (as FSDP1's
    `ModuleWrapPolicy`). Two matches inside one another are nested units, which are refused."""

    classes: tuple[type[nn.Module], ...]

    def select(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if m is not model and isinstance(m, self.classes)]


UnitSpec = Iterable[nn.Module] | InstancesOf | None  # what `ZeRO3(units=...)` takes


def instances_of(*classes: type[nn.Module]) -> InstancesOf:
    """The policy "every instance of these classes is a unit", e.g. `instances_of(nn.TransformerEncoderLayer)`."""
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise ValueError(f"instances_of{classes!r}: pass one or more nn.Module classes")
    return InstancesOf(tuple(classes))


def model_units(model: nn.Module, units: UnitSpec = None) -> list[tuple[str, nn.Module, NamedParams]]:
    """(name, module, its named parameters) per unit: the root first (named "root", its parameters by their
    names in the model), then each unit (named by its path in the model, its parameters by their names in
    it). `units`: modules, an `InstancesOf` policy, or None for `model.blocks`. A unit left without a
    parameter of its own (each one shared with another place, so in the root) is dropped; a ValueError in
    one sentence for a module listed twice, nested units, a module outside the model or without parameters.
    """
    modules = _chosen_modules(model, units)
    names = _unit_names(model, modules)
    owner = _parameter_owners(model, modules, names)
    root = [(n, p) for n, p in model.named_parameters() if owner[id(p)] is None]
    out = [(ROOT, model, root)]
    for module in modules:
        own = [(n, p) for n, p in module.named_parameters() if owner[id(p)] is module]
        if own:
            out.append((names[id(module)], module, own))
    return out


def _chosen_modules(model: nn.Module, units: UnitSpec) -> list[nn.Module]:
    """The unit modules as a list: the policy applied, or `model.blocks` by default."""
    if units is None:
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise ValueError(
                f"{type(model).__name__} has no `blocks` ModuleList to shard; pass units=[...] (its modules, "
                "or instances_of(SomeLayer)) to say which modules ZeRO-3 gathers one at a time"
            )
        return list(blocks)
    if isinstance(units, InstancesOf):
        return units.select(model)
    if isinstance(units, nn.Module):
        raise ValueError(
            f"units={type(units).__name__}(...): pass a list of modules or a policy, e.g. [model.layer]"
        )
    return list(units)


def _unit_names(model: nn.Module, modules: list[nn.Module]) -> dict[int, str]:
    """id(module) -> its path in `model`; refuses the model itself, a stranger, or a module listed twice."""
    paths = {id(m): name for name, m in model.named_modules()}
    names: dict[int, str] = {}
    for i, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            raise ValueError(f"units[{i}] is a {type(module).__name__}; pass modules of the model")
        if module is model:
            raise ValueError(
                f"units[{i}] is the model itself, which is the root; pass its submodules (the root keeps "
                "every parameter that no unit holds)"
            )
        if id(module) not in paths:
            raise ValueError(
                f"units[{i}] (a {type(module).__name__}) is not a submodule of this "
                f"{type(model).__name__}; pass modules of the model being sharded"
            )
        if id(module) in names:
            raise ValueError(f"units lists {paths[id(module)]} twice; list each module once")
        if next(module.parameters(), None) is None:
            raise ValueError(f"unit {paths[id(module)]} has no parameters to shard; leave it out of units")
        names[id(module)] = paths[id(module)]
    return names


def _parameter_owners(model: nn.Module, modules: list[nn.Module], names: dict[int, str]) -> dict:
    """id(parameter) -> the unit module that owns it, or None for the root.

    Walks every path of the module tree (a module registered in two places is walked through both),
    noting the unit each path is inside when it reaches a parameter. A unit met inside another is nested.
    """
    units = {id(m): m for m in modules}
    seen: dict[int, set[int | None]] = {}

    def walk(module: nn.Module, inside: nn.Module | None) -> None:
        if id(module) in units:
            if inside is not None and inside is not module:
                raise ValueError(
                    f"units {names[id(inside)]} and {names[id(module)]} are nested (the second is inside "
                    "the first); list only one of them"
                )
            inside = module
        for p in module.parameters(recurse=False):
            seen.setdefault(id(p), set()).add(None if inside is None else id(inside))
        for child in module.children():
            walk(child, inside)

    walk(model, None)
    owner = {}
    for pid, holders in seen.items():
        (only,) = holders if len(holders) == 1 else (None,)
        owner[pid] = units.get(only) if only is not None else None
    return owner


def split_root(
    model: nn.Module, units: list[tuple[str, nn.Module, NamedParams]]
) -> list[tuple[str, nn.Module, NamedParams]]:
    """`model_units`' list with its root cut by module order: (INPUT, model, ...) first, then what is left of
    the root, the units, (OUTPUT, model, ...) last; an empty part is dropped.

    A root parameter is an input one when the one module that registers it comes before the first unit in
    `model.named_modules()`, an output one when it comes after the last unit; a parameter of the model
    itself, one registered in two places (a tied embedding and head) or one between units stays in the root.
    """
    (_, _, root), blocks = units[0], units[1:]
    if not blocks:
        return units
    place = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    first, last = place[id(blocks[0][1])], place[id(blocks[-1][1])]
    holders: dict[int, list[int]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append(place[id(module)])
    parts: dict[str, NamedParams] = {INPUT: [], ROOT: [], OUTPUT: []}
    for name, p in root:
        places = set(holders[id(p)])
        where = places.pop() if len(places) == 1 else None
        part = ROOT if where in (None, 0) else INPUT if where < first else OUTPUT if where > last else ROOT
        parts[part].append((name, p))
    out = [(INPUT, model, parts[INPUT]), (ROOT, model, parts[ROOT]), *blocks, (OUTPUT, model, parts[OUTPUT])]
    return [u for u in out if u[2]]


def unit_plan(
    model: nn.Module, units: UnitSpec = None, split: bool = False
) -> list[tuple[str, nn.Module, list]]:
    """(name, module, named parameters) of each unit ZeRO3 makes, in its order: `model_units`, the root split
    when `split` (`split_root`), a root left without parameters dropped. What the bytes formula sums over."""
    planned = model_units(model, units)
    return [u for u in (split_root(model, planned) if split else planned) if u[2]]
