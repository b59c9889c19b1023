"""Build of rl_engine_ext's native library, rl_engine_ext._C.

Three worlds, picked from the installed PyTorch:
  * CPU-only PyTorch: a CppExtension with the C++ CPU kernels.
  * CUDA PyTorch with nvcc: a CUDAExtension that adds the CUDA kernels. Default arch list
    sm_80 + sm_90a (`-gencode=arch=compute_90a,code=sm_90a`: Hopper-only instructions need the
    "a" target); TORCH_CUDA_ARCH_LIST overrides it (e.g. "8.0;9.0a").
  * ROCm PyTorch: the same CUDA sources, hipified by torch.utils.cpp_extension; archs from
    PYTORCH_ROCM_ARCH (default gfx90a;gfx942).
RL_ENGINE_EXT_NO_NATIVE=1 skips the native build: the package then runs every op on its
pure-PyTorch reference (and warns once that bitwise invariance is not guaranteed).
RL_ENGINE_EXT_CPU_ONLY=1 builds only the CPU kernels even where a GPU toolchain is present.
RL_ENGINE_EXT_DEBUG_INFO=1 keeps debug info and nvcc's -lineinfo (profiling builds: ncu source
views); by default the library is stripped at link time.
MAX_JOBS bounds parallel compilation (read by torch's ninja build). Every build of a tree compiles
in its build/temp.* folder (incremental_build_ext), so a rebuild compiles only what changed.

Metadata from the torch that builds it: the version carries the variant as a local label
(0.1.0+cpu, +cu130, +rocm6), and a native build requires that torch's minor release (the library
links libtorch's C++ API, which is not stable across minor releases). Build with the torch you
will run: `pip install --no-build-isolation .`. torch is not a build requirement (pyproject.toml),
so an isolated build cannot import it and stops with that advice instead of compiling against
whatever torch the index would have fetched.
"""

import glob
import os
import sys

from setuptools import setup

# Stable ABI (abi3): the library exports only a module-init stub, no Python API. torch's
# BuildExtension defines Py_LIMITED_API for py_limited_api extensions (CPython 3.10 and up); the
# wheel tag below matches it.
WHEEL_LIMITED_API = "cp310"
VERSION = "0.1.0"
DEBUG_INFO = os.environ.get("RL_ENGINE_EXT_DEBUG_INFO", "0") == "1"


def torch_libstdcxx_link_args() -> list[str]:
    """Links the libstdc++ that torch itself loaded.

    A toolchain whose g++ finds only a static libstdc++.a (seen with a GCC under /opt) would put
    a second copy of libstdc++ in the extension; iostream code from that copy then crashes on
    locale state owned by torch's copy (any error message that formats an integer segfaults).
    Naming torch's shared libstdc++ first makes every libstdc++ symbol resolve to it.
    """
    if not os.path.exists("/proc/self/maps"):
        return []
    import torch  # noqa: F401  (loads libstdc++ into this process)

    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libstdc++.so"):
                return [path]
    return []


def native_extensions():
    """(ext_modules, cmdclass, variant label): the label names what the library was built for."""
    if os.environ.get("RL_ENGINE_EXT_NO_NATIVE", "0") == "1" or BUILDS_SDIST:
        return [], {}, None
    try:
        import torch
    except ImportError as e:
        # torch is deliberately not a build requirement (pyproject.toml): an isolated build would
        # fetch the newest torch from the index and compile against that instead of yours.
        sys.exit(f"rl_engine_ext: the native build compiles against the torch it will run with, and none is "
                 f"importable here ({e}). Install torch first, then build with `pip install "
                 f"--no-build-isolation .` (build isolation hides the installed torch); "
                 f"RL_ENGINE_EXT_NO_NATIVE=1 builds the pure-Python package instead.")
    from torch.utils import cpp_extension

    csrc = "csrc"

    def sources(folder: str, ext: str) -> list[str]:
        return sorted(glob.glob(os.path.join(csrc, folder, "**", "*." + ext), recursive=True))

    # Globs: a new op's files (csrc/{host,cpu,autograd,cuda}/<op>*, or a folder of them such as
    # csrc/cuda/attention/) are picked up with no edit here.
    cpu_sources = (
        [os.path.join(csrc, "registration.cpp")]
        + sources("host", "cpp")
        + sources("autograd", "cpp")
        + sources("cpu", "cpp")
    )
    gpu_sources = sources("cuda", "cpp") + sources("cuda", "cu")
    # Float semantics of the C++ (CPU) kernels, pinned: they promise "an fp32 multiply, then an
    # fp32 add; no fused multiply-add" (csrc/cpu/*_kernels.h). -ffp-contract=off keeps the
    # compiler from fusing a*b+c into an FMA where the target has one (aarch64, -march=native, an
    # FMA-capable x86 -march); -fno-fast-math keeps IEEE semantics (no reassociation, no
    # flush-to-zero, NaN/inf honoured). On baseline x86-64 (no FMA) this changes no bit of today's
    # results.
    # -Wno-c++20-extensions: torch's own headers (c10/core/AutogradState.h) initialise bit-fields,
    # a C++20 feature, and g++ says so twice for every file compiled as C++17.
    # -g0: Python's own compile flags (which torch's build adds first) carry -g, and the link strips
    # the library (-s) unless RL_ENGINE_EXT_DEBUG_INFO=1: the debug info only doubled each file's
    # compile time.
    cxx_flags = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-Wno-c++20-extensions"]
    cxx_flags += [] if DEBUG_INFO else ["-g0"]
    link_args = torch_libstdcxx_link_args() + ([] if DEBUG_INFO else ["-s"])
    is_rocm = torch.version.hip is not None
    has_gpu_toolchain = (torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None) or (
        is_rocm and cpp_extension.ROCM_HOME is not None
    )
    if os.environ.get("RL_ENGINE_EXT_CPU_ONLY", "0") == "1" or not has_gpu_toolchain:
        ext = cpp_extension.CppExtension(
            "rl_engine_ext._C",
            cpu_sources,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_args,
            py_limited_api=True,
        )
        label = "cpu"
    else:
        if is_rocm:
            os.environ.setdefault("PYTORCH_ROCM_ARCH", "gfx90a;gfx942")
            device_flags = ["-O3", "-std=c++17", "-DUSE_ROCM=1"]
            cxx_flags = cxx_flags + ["-DUSE_ROCM=1"]
            label = "rocm" + torch.version.hip.split(".")[0]
        else:
            # sm_80 and sm_90a by default; TORCH_CUDA_ARCH_LIST (read by torch) overrides.
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
            # --fmad=true (nvcc's default, spelled out): FMA contraction is part of the documented
            # GPU arithmetic. Which multiply-adds are fused is fixed by each path's compiled code,
            # never by the batch; where two configurations must agree bit for bit, the GPU tests
            # prove it. Never --use_fast_math.
            device_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "--fmad=true"]
            device_flags += ["-lineinfo"] if DEBUG_INFO else []
            label = "cu" + torch.version.cuda.replace(".", "")
        ext = cpp_extension.CUDAExtension(
            "rl_engine_ext._C",
            cpu_sources + gpu_sources,
            extra_compile_args={"cxx": cxx_flags, "nvcc": device_flags},
            extra_link_args=link_args,
            py_limited_api=True,
        )
    return [ext], {"build_ext": incremental_build_ext()}, label


def incremental_build_ext():
    """torch's BuildExtension compiling in one fixed folder, build/temp.<platform>-<python> of the
    tree being built, whatever command runs it. ninja keeps its objects and dependency log there, so
    `setup.py build_ext --inplace`, `pip install -e .` and `pip wheel .` recompile only what
    changed; setuptools' editable install would otherwise compile everything again in a fresh
    temporary folder every time."""
    from torch.utils.cpp_extension import BuildExtension

    class IncrementalBuildExtension(BuildExtension.with_options(no_python_abi_suffix=True)):
        def finalize_options(self):
            super().finalize_options()
            here = os.path.dirname(os.path.abspath(__file__))
            self.build_temp = os.path.join(here, "build", f"temp.{self.plat_name}-{sys.implementation.cache_tag}")

    return IncrementalBuildExtension


def torch_requirement(native: bool) -> str:
    """The torch a native build loads into: the building torch's minor release."""
    if not native:
        return "torch>=2.6"
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return f"torch>={major}.{minor},<{major}.{minor + 1}"


# An sdist is every variant's source: plain version, any torch (the wheel built from it pins).
BUILDS_SDIST = "sdist" in sys.argv[1:]
ext_modules, cmdclass, variant = native_extensions()

# Name and packages live in pyproject.toml; version and the torch requirement come from the build.
setup(
    version=VERSION + (f"+{variant}" if variant else ""),
    install_requires=[torch_requirement(bool(ext_modules))],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": WHEEL_LIMITED_API}} if ext_modules else {},
)
