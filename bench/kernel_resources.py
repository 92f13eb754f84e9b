#!/usr/bin/env python3
"""Registers, spills and shared memory of every CUDA kernel, and what they allow per SM.

No GPU is needed: NVRTC (the PyPI wheel `.ci/run` installs, `nvidia-cuda-nvrtc`) compiles
each kernel family exactly as the engine does (common.cuh, then the family's .cu;
kernels/src/cuda/module.rs) with `-Xptxas -v`, and ptxas reports each kernel's resources.
The occupancy column counts registers alone (not shared memory), for blocks of `--threads`
threads (default 256, the row kernels' and most launchers') under sm_90's limits: 65,536
registers an SM, allocated per warp in units of 256, at most 64 warps and 32 blocks an SM.

    .ci/venv/bin/python bench/kernel_resources.py [family ...] [--arch sm_90] [--threads 256]

Read it before and after a change to a kernel, beside the GPU's timer: a register count
that drops an SM from 4 blocks to 3 costs a memory-bound kernel a quarter of its loads in
flight.

`--count LDS,LDSM,HMMA` adds, per kernel, how many SASS instructions of each opcode the
CUBIN holds (cuobjdump and the nvdisasm it runs, from the `nvidia-cuda-cuobjdump` and
`nvidia-cuda-nvdisasm` wheels, or on the PATH): a static
count of the code, not of what runs (a loop's body counts once), to compare two versions of
one kernel's unrolled inner loop, e.g. its shared-memory loads against its tensor-core ops.

    .ci/venv/bin/pip install nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37
    .ci/venv/bin/python bench/kernel_resources.py attention_mma --threads 128 --count LDS,LDSM,HMMA
"""

import argparse
import collections
import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels", "src", "cuda", "kernels")


def load_nvrtc():
    """libnvrtc from the nvidia-cuda-nvrtc wheel of this Python, or from the loader's path."""
    try:
        import nvidia  # the wheel's namespace package

        for path in glob.glob(os.path.join(nvidia.__path__[0], "cu*", "lib", "libnvrtc.so*")):
            return ctypes.CDLL(path)
    except ImportError:
        pass
    return ctypes.CDLL("libnvrtc.so")


def load_cuobjdump():
    """cuobjdump from the nvidia-cuda-cuobjdump wheel of this Python, or from the PATH."""
    try:
        import nvidia

        for path in glob.glob(os.path.join(nvidia.__path__[0], "cu*", "bin", "cuobjdump")):
            return path
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if not found:
        sys.exit("--count needs cuobjdump: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (NVRTC's version)")
    return found


def compile_family(nvrtc, family, arch):
    """(ptxas's verbose log, the CUBIN) for one family, or an exit with NVRTC's compile log."""
    with open(os.path.join(ROOT, "common.cuh")) as f:
        common = f.read()
    with open(os.path.join(ROOT, family + ".cu")) as f:
        body = f.read()
    source = f'#line 1 "common.cuh"\n{common}\n#line 1 "{family}.cu"\n{body}'
    program = ctypes.c_void_p()
    status = nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{family}.cu".encode(), 0, None, None)
    if status != 0:
        sys.exit(f"{family}: nvrtcCreateProgram failed with status {status}")
    options = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-Xptxas", b"-v"]
    status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    cubin = b""
    if status == 0:
        nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size))
        buffer = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetCUBIN(program, buffer)
        cubin = buffer.raw
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    text = log.value.decode(errors="replace")
    if status != 0:
        sys.exit(f"{family}: compilation failed (status {status})\n{text}")
    return text, cubin


def opcode_counts(cuobjdump, cubin):
    """{kernel: Counter of SASS opcodes (the mnemonic before its first '.')} of a CUBIN."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        # cuobjdump runs nvdisasm, which the wheels install beside it.
        path = os.path.dirname(cuobjdump) + os.pathsep + os.environ.get("PATH", "")
        env = dict(os.environ, PATH=path)
        sass = subprocess.run([cuobjdump, "-sass", f.name], check=True, capture_output=True, text=True, env=env).stdout
    counts, name = {}, None
    for line in sass.splitlines():
        function = re.match(r"\s*Function : (\S+)", line)
        if function:
            name = function.group(1)
            counts[name] = collections.Counter()
            continue
        instruction = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if instruction and name:
            counts[name][instruction.group(1)] += 1
    return counts


def kernels_of(log):
    """(kernel, registers, spill bytes stored, spill bytes loaded, shared bytes) per entry.

    A kernel's spills include those of the device functions it calls that were not inlined
    (`__noinline__`): ptxas reports each such function after the kernel's register count.
    """
    rows, name, spills = [], None, (0, 0)
    for line in log.splitlines():
        entry = re.search(r"Compiling entry function '([^']+)'", line)
        if entry:
            name = entry.group(1)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if spill:
            stored, loaded = int(spill.group(1)), int(spill.group(2))
            if name:
                spills = (spills[0] + stored, spills[1] + loaded)
            elif rows:  # a callee of the kernel just reported
                kernel, registers, kernel_stored, kernel_loaded, smem = rows[-1]
                rows[-1] = (kernel, registers, kernel_stored + stored, kernel_loaded + loaded, smem)
        used = re.search(r"Used (\d+) registers", line)
        if used and name:
            smem = re.search(r"(\d+) bytes smem", line)  # absent when the kernel has none
            rows.append((name, int(used.group(1)), spills[0], spills[1], int(smem.group(1)) if smem else 0))
            name, spills = None, (0, 0)
    return rows


def warps_per_sm(registers, threads):
    """Resident warps an SM for `threads`-thread blocks, by registers alone (sm_90's limits)."""
    warps_per_block = (threads + 31) // 32
    per_warp = ((registers * 32 + 255) // 256) * 256
    blocks = min(65536 // (per_warp * warps_per_block), 32, 64 // warps_per_block)
    return blocks * warps_per_block


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="kernel files without .cu (default: all)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--threads", type=int, default=256, help="threads a block, for the occupancy column")
    parser.add_argument("--count", default="", help="SASS opcodes to count per kernel, comma-separated (LDS,LDSM)")
    args = parser.parse_args()
    families = args.families or sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.cu")))
    opcodes = [op for op in args.count.split(",") if op]
    cuobjdump = load_cuobjdump() if opcodes else None
    nvrtc = load_nvrtc()
    columns = "".join(f" {op:>6}" for op in opcodes)
    print(f"{'kernel':<52} {'regs':>5} {'spill st/ld':>12} {'smem':>7} {'warps/SM':>9}{columns}")
    for family in families:
        log, cubin = compile_family(nvrtc, family, args.arch)
        counts = opcode_counts(cuobjdump, cubin) if opcodes else {}
        for name, registers, stored, loaded, smem in kernels_of(log):
            spill = f"{stored}/{loaded}"
            counted = "".join(f" {counts.get(name, {}).get(op, 0):>6}" for op in opcodes)
            print(
                f"{name:<52} {registers:>5} {spill:>12} {smem:>7} {warps_per_sm(registers, args.threads):>9}{counted}"
            )


if __name__ == "__main__":
    main()
