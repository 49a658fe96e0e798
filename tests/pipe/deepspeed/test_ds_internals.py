"""Every private member of DeepSpeed's pipeline classes the package uses exists in the installed DeepSpeed, with the
signature ds_internals.py says; every one our classes override is listed there; no other module names one."""
import importlib
import inspect
import pathlib
import re

import deepspeed
import pytest
from deepspeed.runtime.pipe.schedule import ReduceTiedGrads

from megatron_ds.pipe.deepspeed import ds_internals as ds
from megatron_ds.pipe.engine import ScheduleEngine
from megatron_ds.pipe.foreign.foreign_engine import ForeignScheduleEngine
from megatron_ds.pipe.module import ChunkedPipelineModule, CostPartitionedPipelineModule
from megatron_ds.pipe.moe.moe import with_router_step
from megatron_ds.pipe.parallel.sequence_parallel import SequenceParallelPipelineEngine
from megatron_ds.pipe.trace import TracedDualPipeVEngine, TracedPipelineEngine, TracedSequenceParallelPipelineEngine
from megatron_ds.pipe.deepspeed.zero_internals import ZeroInternals

ROOT = pathlib.Path(__file__).resolve().parents[3]
WHERE = f"DeepSpeed {deepspeed.__version__} (ds_internals.py was written against {ds.DEEPSPEED_VERSION})"
assert ds.DEEPSPEED_VERSION == ZeroInternals.DEEPSPEED_VERSION  # one audit of one DeepSpeed
OURS = (ScheduleEngine, ForeignScheduleEngine, with_router_step(ScheduleEngine), SequenceParallelPipelineEngine,
        TracedPipelineEngine, TracedDualPipeVEngine, TracedSequenceParallelPipelineEngine, ChunkedPipelineModule,
        CostPartitionedPipelineModule)


def resolve(dotted):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def source_of(cls):
    """The source of `cls` and of its DeepSpeed bases (where an attribute may be set)."""
    return "\n".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("deepspeed"))


@pytest.mark.parametrize("table", [ds.OVERRIDDEN, ds.CALLED], ids=["overridden", "called"])
def test_every_private_method_exists_with_the_signature_we_assume(table):
    wrong = {}
    for dotted, methods in table.items():
        cls = resolve(dotted)
        for name, signature in methods.items():
            method = getattr(cls, name, None)
            found = str(inspect.signature(method)) if callable(method) else None
            if found != signature:
                wrong[f"{cls.__name__}.{name}"] = found
    assert not wrong, f"{WHERE}: {wrong} (None: missing)"


def test_every_private_attribute_exists():
    missing = [f"{dotted}.{a}" for dotted, names in ds.ATTRIBUTES.items() for a in names
               if not re.search(rf"self\.{a} = ", source_of(resolve(dotted)))]
    missing += [f"{dotted}.{a}" for dotted, names in ds.STATE.items() for a in names
                if not re.search(rf"self\.{a} = ", source_of(resolve(dotted)))]
    bf16 = inspect.getsource(importlib.import_module("deepspeed.runtime.bf16_optimizer"))
    missing += [a for a in ds.PARAM_ATTRIBUTES if f".{a} = " not in bf16]
    groups = importlib.import_module(ds.GROUPS)
    missing += [a for a in ds.GROUP_REGISTRIES if not isinstance(getattr(groups, a, None), dict)]
    missing += [a for a in ds.GROUP_FUNCTIONS if not callable(getattr(groups, a, None))]
    assert not missing, f"{WHERE} lacks {missing}"


def test_the_instruction_map_is_a_class_attribute_of_handlers_taking_the_engine():
    for dotted, names in ds.CLASS_ATTRIBUTES.items():
        cls = resolve(dotted)
        for name in names:
            assert isinstance(vars(cls).get(name), dict), f"{WHERE}: {cls.__name__}.{name}"
    handlers = ds.instruction_map(resolve(ds.ENGINE))
    assert list(inspect.signature(handlers[ReduceTiedGrads]).parameters) == ["self"]  # sequence_parallel.py


def test_every_private_our_classes_override_is_listed_with_its_signature():
    """A new override of a DeepSpeed private (a method DeepSpeed calls) must be added to OVERRIDDEN."""
    listed = {name: (dotted, sig) for dotted, methods in ds.OVERRIDDEN.items() for name, sig in methods.items()}
    class_attributes = {name for names in ds.CLASS_ATTRIBUTES.values() for name in names}
    unlisted, differs = [], []
    for cls in OURS:
        deepspeeds = [c for c in cls.__mro__ if c.__module__.startswith("deepspeed")]
        for ours in (c for c in cls.__mro__ if c.__module__.startswith("megatron_ds")):
            for name, member in vars(ours).items():
                if not name.startswith("_") or name.startswith("__") or not any(hasattr(c, name) for c in deepspeeds):
                    continue
                if name in class_attributes:
                    continue
                if name not in listed:
                    unlisted.append(f"{ours.__qualname__}.{name}")
                elif str(inspect.signature(member)) != listed[name][1]:
                    differs.append(f"{ours.__qualname__}.{name}{inspect.signature(member)}")
    assert not unlisted, f"overrides of DeepSpeed privates missing from ds_internals.OVERRIDDEN: {unlisted}"
    assert not differs, f"overrides whose signature is not DeepSpeed's: {differs}"


def test_our_engines_set_no_private_attribute_of_deepspeeds_but_through_ds_internals():
    """An attribute of ours that DeepSpeed's engine or module also sets would change what DeepSpeed reads."""
    clashes = []
    for cls in OURS:
        deepspeed_source = source_of(cls)
        for ours in (c for c in cls.__mro__ if c.__module__.startswith("megatron_ds")):
            methods = "\n".join(inspect.getsource(f) for f in vars(ours).values() if inspect.isfunction(f))
            for name in set(re.findall(r"self\.(_[a-z]\w*) *[=,]", methods)):
                if re.search(rf"self\.{name}\b", deepspeed_source):
                    clashes.append(f"{ours.__qualname__}: {name}")
    assert not clashes, clashes


# model/moe_dispatch.py reads the EP group registry itself: model/ stays below pipe/ (docs/DESIGN.md "Layers")
ALLOWED = {"megatron_ds/model/moe_dispatch.py": set(ds.GROUP_FUNCTIONS)}


def test_no_other_module_names_a_listed_private():
    """The template methods (OVERRIDDEN) are ours to define and call; everything else goes through a function."""
    names = {n for methods in ds.CALLED.values() for n in methods}
    names |= {n for attrs in (*ds.ATTRIBUTES.values(), *ds.CLASS_ATTRIBUTES.values()) for n in attrs}
    names |= {*ds.PARAM_ATTRIBUTES, *ds.GROUP_REGISTRIES, *ds.GROUP_FUNCTIONS}
    here = {"megatron_ds/pipe/deepspeed/ds_internals.py", "megatron_ds/pipe/deepspeed/zero_internals.py"}
    found = []
    paths = (p for folder in ("megatron_ds", "bench", "tools", "examples") for p in (ROOT / folder).rglob("*.py"))
    for path in sorted(paths):
        rel = path.relative_to(ROOT).as_posix()
        if rel in here:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"(?<!super\(\))\.(_[A-Za-z]\w*)\b", line):
                if name in names and name not in ALLOWED.get(rel, ()):
                    found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "go through megatron_ds/pipe/deepspeed/ds_internals.py:\n" + "\n".join(found)
