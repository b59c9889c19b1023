"""Machine code of GPU kernel sources at two revisions, kernel by kernel (no GPU needed).

    python3 scripts/compare_sass.py [--base REV] [--arch 90a] csrc/cuda/attention/sm90_fwd.cu ...

Compiles each source as the CMake build does (nvcc -O3 --expt-relaxed-constexpr --fmad=true) for
one architecture, once from the tree at REV (default HEAD) and once from the working tree, then
disassembles both and compares every kernel's SASS instruction by instruction. A kernel whose SASS
is identical behaves identically on the GPU, so a change that leaves every kernel it touches
identical (a refactor, a removed configuration's instantiations) needs no GPU run to keep its bits
and its speed. The per-compile hash that nvcc puts into anonymous-namespace names is folded out.

Prints one line per kernel that differs, appeared or went away, and a count of each; exit 1 when
any kernel differs or appeared or went away, 0 when all are identical.

Needs nvcc (NVCC, else PATH, else /usr/local/cuda/bin), and cuobjdump and nvdisasm (CUOBJDUMP and
NVDISASM_PATH, else PATH); the image's toolkit has neither, the PyPI wheels nvidia-cuda-cuobjdump
and nvidia-cuda-nvdisasm carry both (bin/ inside the unpacked wheel).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC_FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "--fmad=true"]  # as cmake/CMakeLists.txt
FUNCTION = re.compile(r"^\s*Function : (\S+)")
ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")  # an instruction's offset, /*01a0*/
ANONYMOUS = re.compile(r"(_GLOBAL__N__)[0-9a-f]{8}")  # nvcc's per-compile anonymous-namespace hash


def fold_hash(text: str) -> str:
    """The anonymous-namespace hash as zeros (the same length: the name still demangles)."""
    return ANONYMOUS.sub(r"\g<1>00000000", text)


def kernels(sass: str) -> dict[str, list[str]]:
    """cuobjdump -sass output -> {kernel (anonymous-namespace hash folded): its instructions}.
    Each instruction is its text and its encoding words, scheduling control bits included (only the
    offset in front is dropped): a change in a stall count or a dependency barrier is a change."""
    found: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        match = FUNCTION.match(line)
        if match:
            current = fold_hash(match.group(1))
            found[current] = []
            continue
        if current is None:
            continue
        text = ADDRESS.sub("", line).strip()
        if text:
            found[current].append(fold_hash(text))
    return found


def compare(base: dict[str, list[str]], new: dict[str, list[str]]) -> dict[str, list[str]]:
    """The kernels of each kind: identical, changed, gone (only in base), added (only in new)."""
    return {
        "identical": [k for k in new if k in base and base[k] == new[k]],
        "changed": [k for k in new if k in base and base[k] != new[k]],
        "gone": [k for k in base if k not in new],
        "added": [k for k in new if k not in base],
    }


def tool(env: str, name: str) -> str:
    path = os.environ.get(env) or shutil.which(name) or os.path.join("/usr/local/cuda/bin", name)
    if not os.path.isfile(path):
        sys.exit(f"compare_sass: {name} not found (set {env}, or put it on PATH)")
    return path


def disassemble(tree: str, source: str, arch: str, work: str, tag: str) -> dict[str, list[str]]:
    cubin = os.path.join(work, f"{tag}_{os.path.basename(source)}.cubin")
    compiled = subprocess.run(
        [tool("NVCC", "nvcc"), *NVCC_FLAGS, f"-gencode=arch=compute_{arch},code=sm_{arch}", "-I", "csrc", "-cubin",
         "-o", cubin, source], cwd=tree, capture_output=True, text=True)
    if compiled.returncode != 0:
        sys.exit(f"compare_sass: nvcc failed on {source} ({tag}):\n{compiled.stderr}")
    env = dict(os.environ)
    nvdisasm = os.environ.get("NVDISASM_PATH") or shutil.which("nvdisasm")
    if nvdisasm:
        env["NVDISASM_PATH"] = os.path.dirname(nvdisasm) if os.path.isfile(nvdisasm) else nvdisasm
    dumped = subprocess.run([tool("CUOBJDUMP", "cuobjdump"), "-sass", cubin], env=env, capture_output=True, text=True)
    if dumped.returncode != 0:
        sys.exit(f"compare_sass: cuobjdump failed on {cubin}:\n{dumped.stdout}{dumped.stderr}")
    return kernels(dumped.stdout)  # none where the source has no kernel for this architecture


def demangle(name: str) -> str:
    """The kernel's name and template arguments (no parameter list), where c++filt is at hand."""
    filt = shutil.which("c++filt")
    if filt is None:
        return name
    text = subprocess.run([filt, name], capture_output=True, text=True).stdout.strip() or name
    text = text.replace("rl_align::(anonymous namespace)::", "").replace("rl_align::", "")
    return text[:text.rindex(">(") + 1] if ">(" in text else text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", help="kernel sources (.cu), relative to the repository root")
    parser.add_argument("--base", default="HEAD", help="the revision to compare the working tree with")
    parser.add_argument("--arch", default="90a", help="the one architecture compiled (nvcc's compute_/sm_ suffix)")
    args = parser.parse_args()
    differs = False
    with tempfile.TemporaryDirectory() as work:
        base_tree = os.path.join(work, "base")
        os.makedirs(base_tree)
        archive = subprocess.run(["git", "archive", args.base, "csrc"], cwd=ROOT, capture_output=True)
        if archive.returncode != 0:
            sys.exit(f"compare_sass: no csrc/ at revision {args.base!r}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", base_tree], input=archive.stdout, check=True)
        for source in args.sources:
            result = compare(disassemble(base_tree, source, args.arch, work, "base"),
                             disassemble(ROOT, source, args.arch, work, "new"))
            counts = ", ".join(f"{len(v)} {kind}" for kind, v in result.items())
            print(f"{source} (sm_{args.arch}, {args.base} -> working tree): {counts}")
            for kind in ("changed", "gone", "added"):
                for name in result[kind]:
                    print(f"  {kind}: {demangle(name)}")
            differs |= any(result[kind] for kind in ("changed", "gone", "added"))
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
