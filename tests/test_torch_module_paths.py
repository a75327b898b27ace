"""Every submodule of ``torch.utils.data`` that user code imports from has a namesake under
``pipeload`` with the same public names, each the same object as at pipeload's top level.

The walk goes over torch's own package, so a submodule or a public name torch adds later fails
here until it is provided or listed below with its reason (the README's compatibility table
lists the same).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch.utils.data as tud

import pipeload

SRC = Path(__file__).resolve().parents[1] / "src"

# Submodules of torch.utils.data with no namesake under pipeload, and why.
MODULES_LEFT_OUT = {
    "_utils.fetch": "torch's loader machinery (fetchers), which pipeload does not use",
    "_utils.pin_memory": "torch's loader machinery (its pin thread)",
    "_utils.signal_handling": "torch's loader machinery (SIGCHLD handlers)",
    "backward_compatibility": "a deprecated worker_init_fn for DataPipes; our loader shards pipes itself",
    "datapipes.dataframe": "DataFrame pipes are not provided",
    "datapipes.utils": "torch's datapipe helpers (decoders, snapshot, common) are not provided",
    "datapipes.gen_pyi": "torch's build script for its type stubs",
}
# Inside datapipes.iter and datapipes.map torch keeps one module per family of operations with
# long class names (MapperIterDataPipe); pipeload's pipes are imported from datapipes.iter/.map.
LEFT_OUT_PREFIXES = ("datapipes._", "datapipes.iter.", "datapipes.map.", "datapipes.dataframe.",
                     "datapipes.utils.")

# Public names of the covered modules that pipeload does not provide, and why.
NAMES_LEFT_OUT = {
    "TYPE_CHECKING": "typing's flag, imported by torch's module",
    "HAS_NUMPY": "a constant of torch's loader machinery",
    "IS_WINDOWS": "a constant of torch's loader machinery",
    "MP_STATUS_CHECK_INTERVAL": "a constant of torch's loader machinery",
    "python_exit_status": "state of torch's loader machinery",
    "ManagerWatchdog": "torch's worker loop's parent check",
    "traverse": "deprecated in torch in favour of traverse_dps",
    "apply_shuffle_seed": "deprecated in torch in favour of apply_random_seed",
    "DFIterDataPipe": "DataFrame pipes are not provided",
    "HAS_DILL": "torch's pickling switch for pipes",
    "dill": "torch's optional pickler, imported by its module",
    "UNTRACABLE_DATAFRAME_PIPES": "DataFrame pipes are not provided",
    "RoutedDecoder": "not provided (README, compatibility)",
}


def torch_submodules() -> list[str]:
    """torch.utils.data's submodules, relative to it (``_utils.collate``, ``sampler``, ...)."""
    found = pkgutil.walk_packages(tud.__path__, "torch.utils.data.")
    return sorted(info.name.removeprefix("torch.utils.data.") for info in found)


COVERED = [name for name in torch_submodules()
           if name not in MODULES_LEFT_OUT and not name.startswith(LEFT_OUT_PREFIXES)]


def public_names(module: types.ModuleType) -> set[str]:
    """What user code imports from ``module``: its ``__all__``, and every public class, function
    and constant it holds that is torch.utils.data's own (not ``os``, ``typing.Any``, ...)."""
    names = set(getattr(module, "__all__", ()))
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        origin = getattr(value, "__module__", None)
        if origin is None or (isinstance(origin, str) and origin.startswith("torch.utils.data")):
            names.add(name)
    return names


def test_the_walk_finds_the_modules_scripts_import_from() -> None:
    assert {"dataloader", "dataset", "sampler", "distributed", "_utils.collate", "_utils.worker",
            "graph", "graph_settings", "datapipes", "datapipes.iter", "datapipes.map"} <= set(COVERED)


@pytest.mark.parametrize("path", COVERED)
def test_each_torch_submodule_has_a_namesake(path: str) -> None:
    importlib.import_module(f"pipeload.{path}")


@pytest.mark.parametrize("path", COVERED)
def test_each_public_name_is_there_and_is_the_top_levels_object(path: str) -> None:
    theirs = importlib.import_module(f"torch.utils.data.{path}")
    ours = importlib.import_module(f"pipeload.{path}")
    wanted = public_names(theirs) - set(NAMES_LEFT_OUT)
    assert sorted(wanted - set(dir(ours))) == []
    for name in wanted:
        if hasattr(pipeload, name) and path not in ("datapipes.iter", "datapipes.map"):  # their Sampler is a pipe
            assert getattr(ours, name) is getattr(pipeload, name), name


@pytest.mark.parametrize("path", [p for p in COVERED if hasattr(importlib.import_module(f"torch.utils.data.{p}"), "__all__")])
def test_star_imports_give_at_least_torchs_names(path: str) -> None:
    theirs = importlib.import_module(f"torch.utils.data.{path}")
    ours = importlib.import_module(f"pipeload.{path}")
    assert sorted(set(theirs.__all__) - set(NAMES_LEFT_OUT) - set(ours.__all__)) == []


def test_submodules_are_attributes_once_pipeload_is_imported() -> None:
    # As with torch: `import torch.utils.data` alone makes torch.utils.data._utils.collate reachable.
    assert pipeload._utils.collate.default_collate is pipeload.default_collate
    assert pipeload._utils.worker.get_worker_info is pipeload.get_worker_info
    for name in ("dataloader", "dataset", "sampler", "distributed", "graph", "graph_settings", "datapipes"):
        assert isinstance(getattr(pipeload, name), types.ModuleType), name


def test_every_submodule_torchs_import_makes_reachable_pipeloads_import_makes_reachable() -> None:
    # `import torch.utils.data.datapipes as dp; dp.datapipe.IterDataPipe` ran with torch and
    # failed with pipeload (AttributeError): `datapipe` was importable but not yet imported. A fresh
    # process, as each test here has imported the submodules already.
    probe = (
        "import functools, torch.utils.data, pipeload\n"
        "def reach(root, path):\n"
        "    try:\n"
        "        functools.reduce(getattr, path.split('.'), root)\n"
        "    except AttributeError:\n"
        "        return False\n"
        "    return True\n"
        f"print([p for p in {COVERED!r} if reach(torch.utils.data, p) and not reach(pipeload, p)])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_distributed_keeps_its_own_helpers_beside_the_sampler() -> None:
    from pipeload.distributed import DistributedSampler, current_placement

    assert DistributedSampler is pipeload.DistributedSampler
    assert current_placement().world_size >= 1
    assert "DistributedSampler" in dir(pipeload.distributed)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        pipeload.distributed.Nope  # noqa: B018


def test_a_type_added_to_the_collate_map_is_seen_by_default_collate() -> None:
    from pipeload._utils.collate import default_collate_fn_map

    class Box:
        def __init__(self, value: int) -> None:
            self.value = value

    default_collate_fn_map[Box] = lambda batch, *, collate_fn_map=None: sum(b.value for b in batch)
    try:
        assert pipeload.default_collate([Box(1), Box(2)]) == 3
    finally:
        del default_collate_fn_map[Box]


def test_the_graph_module_reexports_the_datapipes_rooms_graph_functions() -> None:
    declared = getattr(pipeload.datapipes.graph, "__all__", None)
    if declared is not None:
        assert set(declared) <= set(pipeload.graph.__all__)
    for name in pipeload.graph.__all__:
        assert getattr(pipeload.graph, name) is getattr(pipeload.datapipes.graph, name), name


def test_the_private_helpers_scripts_import_from_torchs_paths_are_there_and_agree() -> None:
    import torch.utils.data._utils.worker as torch_worker

    import pipeload._utils.worker as our_worker
    import pipeload.graph_settings as our_graph_settings
    from pipeload.datapipes.iter import IterableWrapper

    for base_seed, worker_id in [(0, 0), (2**63 - 1, 3), (1234567890123, 7)]:
        assert our_worker._generate_state(base_seed, worker_id) == torch_worker._generate_state(base_seed, worker_id)
    shuffled = IterableWrapper(range(4)).shuffle()
    assert our_graph_settings._is_shuffle_datapipe(shuffled)
    assert not our_graph_settings._is_shuffle_datapipe(IterableWrapper(range(4)))
    assert our_graph_settings._is_sharding_datapipe(shuffled.sharding_filter())


def _long_named_pipes() -> list[tuple[str, str]]:
    """(torch's submodule inside datapipes.iter/.map, a long class name it defines there)."""
    found = []
    for kind, package in (("iter", "torch.utils.data.datapipes.iter"), ("map", "torch.utils.data.datapipes.map")):
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            module = importlib.import_module(f"{package}.{info.name}")
            suffix = "IterDataPipe" if kind == "iter" else "MapDataPipe"
            found += [(f"datapipes.{kind}.{info.name}", name) for name, value in vars(module).items()
                      if name.endswith(suffix) and not name.startswith("_") and isinstance(value, type)
                      and value.__module__ == module.__name__]
    return sorted(found)


@pytest.mark.parametrize("path, name", _long_named_pipes(), ids=lambda value: str(value))
def test_torchs_long_pipe_names_are_the_same_classes_in_the_submodule_torch_keeps_them_in(path: str,
                                                                                          name: str) -> None:
    # `from torch.utils.data.datapipes.iter.callable import MapperIterDataPipe` had no namesake:
    # a bare ImportError after the one-line switch.
    if name == "RoutedDecoderIterDataPipe":
        pytest.skip(NAMES_LEFT_OUT["RoutedDecoder"])
    short = name.removesuffix("IterDataPipe").removesuffix("MapDataPipe")
    ours = importlib.import_module(f"pipeload.{path}")
    package = importlib.import_module("pipeload." + path.rsplit(".", 1)[0])
    assert getattr(ours, name) is getattr(package, short)
