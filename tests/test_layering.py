"""The C++ layers and the one-to-one map from Python op families to C++ files (docs/adding_an_op.md,
"Layers"), read from the source text: no build needed, so a broken layer fails before anything
compiles. Needs the source tree (csrc/); the packaging run outside the tree skips it."""

from __future__ import annotations

import os
import posixpath
import re

import pytest

from rl_engine_ext.ops import OP_MODULES, SPECS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
OPS_DIR = os.path.join(ROOT, "rl_engine_ext", "ops")
SOURCE_EXTENSIONS = (".h", ".cuh", ".cpp", ".cu")

pytestmark = pytest.mark.skipif(not os.path.isdir(CSRC), reason="needs the source tree (csrc/)")

# What each layer may include, itself among them. Arrows run down only:
#   common <- primitives <- cpu kernels, cuda kernels
#   common <- host (device-neutral: no kernel, no binding)
#   cpu kernels + host <- cpu bindings;  cuda kernels + host <- cuda launchers
#   host/typed_op.h <- autograd (it reaches kernels only through the dispatcher, never through a
#   host flow); host <- registration (native constants)
MAY_INCLUDE = {
    "common": {"common"},
    "primitives": {"common", "primitives"},
    "cpu kernels": {"common", "primitives", "cpu kernels"},
    "cuda kernels": {"common", "primitives", "cuda kernels"},
    "host": {"common", "host"},
    "cpu bindings": {"common", "primitives", "cpu kernels", "host", "cpu bindings"},
    "cuda launchers": {"common", "primitives", "cuda kernels", "host", "cuda launchers"},
    "autograd": {"common", "host", "autograd"},
    "registration": {"host"},
}
# The one host header autograd includes.
AUTOGRAD_HOST_HEADERS = {"host/typed_op.h"}
# Layers that CI compiles with plain nvcc / hipcc, or that the CPU and GPU kernels share: no torch.
TORCH_FREE = {"common", "primitives", "cuda kernels"}
TORCH_HEADER = re.compile(r"(ATen|c10|torch|pybind11)/|Python\.h$")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]', re.MULTILINE)


def layer_of(rel: str) -> str | None:
    """The layer of csrc/<rel> (posix path): by top folder; in cpu/ and cuda/ (whose subfolders any
    depth count alike) the torch bindings, <op>_cpu.{cpp,h} and *launcher*, sit above host."""
    top = rel.split("/", 1)[0]
    name = posixpath.basename(rel)
    if rel == "registration.cpp":
        return "registration"
    if top in ("common", "primitives", "host", "autograd"):
        return top
    if top == "cpu":
        return "cpu bindings" if re.fullmatch(r"\w+_cpu\.(cpp|h)", name) else "cpu kernels"
    if top == "cuda":
        return "cuda launchers" if "launcher" in name else "cuda kernels"
    return None


def include_violations(sources: dict[str, str], exists=None) -> list[str]:
    """Every include in `sources` ({csrc-relative posix path: text}) that leaves its layer's
    MAY_INCLUDE, names no file, pulls torch into a torch-free layer, or comes from a file no layer
    claims. `exists(rel)` says whether csrc/<rel> exists (default: the file is in `sources`)."""
    exists = exists or (lambda rel: rel in sources)
    problems = []
    for rel, text in sorted(sources.items()):
        layer = layer_of(rel)
        if layer is None:
            problems.append(f"csrc/{rel}: in no layer (give its folder a rule in tests/test_layering.py)")
            continue
        for kind, target in INCLUDE.findall(text):
            if kind == "<":
                if layer in TORCH_FREE and TORCH_HEADER.match(target):
                    problems.append(f"csrc/{rel} ({layer}, torch-free) includes <{target}>")
                continue
            # Quoted: relative to the file, then to csrc/ (the build's include root).
            beside = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
            candidates = [beside, posixpath.normpath(target)]
            found = next((c for c in candidates if c.startswith("../") or exists(c)), None)
            if found is None:
                problems.append(f'csrc/{rel} includes "{target}", which is not there')
            elif not found.startswith("../"):  # outside csrc/ (rl_engine_ext/schemas.def): no layer
                target_layer = layer_of(found)
                if target_layer not in MAY_INCLUDE[layer]:
                    problems.append(f'csrc/{rel} ({layer}) includes "{target}" ({target_layer}): an arrow up')
                elif layer == "autograd" and target_layer == "host" and found not in AUTOGRAD_HOST_HEADERS:
                    problems.append(f'csrc/{rel} (autograd) includes "{target}", a host flow: only '
                                    f'{", ".join(sorted(AUTOGRAD_HOST_HEADERS))}')
    return problems


def _csrc_sources() -> dict[str, str]:
    sources = {}
    for folder, _, names in os.walk(CSRC):
        for name in names:
            if name.endswith(SOURCE_EXTENSIONS):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    sources[os.path.relpath(path, CSRC).replace(os.sep, "/")] = f.read()
    return sources


def test_includes_run_down_the_layers():
    assert include_violations(_csrc_sources(), lambda rel: os.path.isfile(os.path.join(CSRC, rel))) == []


@pytest.mark.parametrize("rel, text, expected", [
    ("host/linear_logprob.h", '#include "../autograd/common.h"', "an arrow up"),  # host -> autograd
    ("cpu/rope_cpu_kernels.cpp", '#include "../host/common.h"', "an arrow up"),  # kernel -> host
    ("autograd/attention.cpp", '#include "../host/attention.h"', "a host flow"),  # only typed_op of host
    ("autograd/common.h", '#include "../host/typed_op.h"', None),
    ("autograd/attention.cpp", '#include "../cpu/rope_cpu.h"', "an arrow up"),  # autograd -> a binding
    ("host/rope.h", '#include "../cuda/rope/rope_kernels.h"', "an arrow up"),  # host is device-neutral
    ("cuda/rope/rope_simt.cu", '#include "../../cpu/rope_cpu_kernels.h"', "an arrow up"),  # across devices
    ("cuda/rope/rope_launcher.cpp", '#include "../../host/rope.h"', None),  # launchers in subfolders
    ("common/rope.h", "#include <ATen/ATen.h>", "torch-free"),
    ("cuda/rope/rope_simt.cu", "#include <c10/util/Half.h>", "torch-free"),
    ("host/rope.h", '#include "gone.h"', "not there"),
    ("python/rope.h", "", "in no layer"),
])
def test_include_rules_catch_each_kind_of_break(rel, text, expected):
    """The checker itself: each rule above reports the include that breaks it, and only that."""
    every_target = lambda target: not target.endswith("gone.h")  # noqa: E731
    problems = include_violations({rel: text}, every_target)
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0], problems


# ------------------------------------------------------------------------------------------------
# One C++ family per Python family
# ------------------------------------------------------------------------------------------------

IMPL = re.compile(r'\bm\.impl\(\s*"(\w+)"')
NOT_DIFFERENTIABLE = re.compile(r"register_not_differentiable\(\s*m\s*,\s*\{([^}]*)\}")
LINE_COMMENT = re.compile(r"//[^\n]*")


def _registered(path: str) -> set[str]:
    """The schema ops a C++ file registers: m.impl("<op>") and register_not_differentiable lists."""
    with open(path, encoding="utf-8") as f:
        text = LINE_COMMENT.sub("", f.read())
    names = set(IMPL.findall(text))
    for block in NOT_DIFFERENTIABLE.findall(text):
        names |= set(re.findall(r'"(\w+)"', block))
    return names


def _family_files(family: str) -> dict[str, str]:
    """The C++ files of op family `family`, by role (docs/adding_an_op.md); the launcher is found
    at any depth under csrc/cuda/."""
    launchers = [os.path.join(folder, name) for folder, _, names in os.walk(os.path.join(CSRC, "cuda"))
                 for name in names if name == f"{family}_launcher.cpp"]
    return {
        "host header": os.path.join(CSRC, "host", f"{family}.h"),
        "CPU binding": os.path.join(CSRC, "cpu", f"{family}_cpu.cpp"),
        "CUDA launcher": launchers[0] if len(launchers) == 1 else f"csrc/cuda/**/{family}_launcher.cpp",
        "autograd": os.path.join(CSRC, "autograd", f"{family}.cpp"),
    }


def test_python_families_are_the_op_modules():
    """rl_engine_ext/ops/<family>.py (public modules) are exactly OP_MODULES, the registry's list."""
    modules = {name[:-3] for name in os.listdir(OPS_DIR) if name.endswith(".py") and not name.startswith("_")}
    assert modules == set(OP_MODULES)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_each_family_has_its_own_cpp_files(spec):
    """Each Python op family has a host header, a CPU binding, a CUDA launcher and an autograd file
    of its own name, and each binding registers exactly the family's schema ops: none of another
    family's (autograd registers the ops without a derivative as not differentiable)."""
    ops = {op.name for op in spec.ops}
    files = _family_files(spec.name)
    missing = [f"{role}: {path}" for role, path in files.items() if not os.path.isfile(path)]
    assert missing == []
    for role in ("CPU binding", "CUDA launcher", "autograd"):
        assert _registered(files[role]) == ops, (role, files[role])


def test_no_file_registers_another_familys_ops():
    """No C++ file outside a family's binding, launcher and autograd file registers one of the
    family's schema ops (files that register runtime ops of no family, such as the kernel
    recorder's, are free to), so the test above sees every registration of every family."""
    owner = {op.name: spec.name for spec in SPECS for op in spec.ops}
    family_files = {os.path.normpath(path): spec.name for spec in SPECS
                    for role, path in _family_files(spec.name).items() if role != "host header"}
    strays = []
    for folder, _, names in os.walk(CSRC):
        for name in names:
            path = os.path.normpath(os.path.join(folder, name))
            if name.endswith(SOURCE_EXTENSIONS):
                for op in sorted(_registered(path) & owner.keys()):
                    if family_files.get(path) != owner[op]:
                        strays.append(f"{os.path.relpath(path, ROOT)} registers {op} ({owner[op]}'s)")
    assert strays == []
