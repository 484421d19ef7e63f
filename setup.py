"""Build of subnet_ext: CPU kernels always, CUDA kernels when torch and nvcc allow.

Environment:
  SUBNET_EXT_CUDA=0|1   force the CUDA kernels off or on (1 fails loudly if impossible).
  TORCH_CUDA_ARCH_LIST  archs to build; defaults to "8.0;9.0" when no GPU is visible.
  CUDA_HOME             toolkit root; otherwise resolved from the real path of `nvcc`.
  MAX_JOBS              ninja parallelism (defaults to the core count).
"""
import glob
import os
import re
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;9.0"


def _nvcc_behind_wrapper(path):
    """Follow a shell wrapper such as `exec /usr/local/cuda-13.0/bin/nvcc "$@"`.

    Torch guesses CUDA_HOME as dirname(dirname(which nvcc)), which lands one level too
    high when `nvcc` on PATH is a script in /usr/local/bin; the real binary tells the truth.
    """
    path = os.path.realpath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return path
    if not head.startswith(b"#!"):
        return path
    match = re.search(rb"exec\s+['\"]?(/[^\s'\"]*nvcc)", head)
    return _nvcc_behind_wrapper(match.group(1).decode()) if match else path


def resolve_cuda_home():
    """Toolkit root: $CUDA_HOME, else the real nvcc's grandparent, else /usr/local/cuda."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = _nvcc_behind_wrapper(nvcc)
        candidate = os.path.dirname(os.path.dirname(real))
        if os.path.exists(os.path.join(candidate, "include", "cuda_runtime.h")):
            return candidate
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    return None


cuda_home = resolve_cuda_home()
if cuda_home:
    # Must be set before torch.utils.cpp_extension is imported: it reads CUDA_HOME once.
    os.environ["CUDA_HOME"] = cuda_home

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

force = os.environ.get("SUBNET_EXT_CUDA")
if force not in (None, "", "0", "1"):
    sys.exit(f"SUBNET_EXT_CUDA must be 0 or 1, got {force!r}")
cuda_possible = torch.version.cuda is not None and cuda_home is not None
if force == "1" and not cuda_possible:
    sys.exit(
        "SUBNET_EXT_CUDA=1 but the CUDA kernels cannot be built: "
        f"torch.version.cuda={torch.version.cuda!r}, CUDA toolkit found at {cuda_home!r}. "
        "Install a CUDA build of torch and the CUDA toolkit (nvcc), or set CUDA_HOME."
    )
with_cuda = cuda_possible if force in (None, "") else force == "1"

archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
if with_cuda and not archs:
    visible = False
    try:
        visible = torch.cuda.is_available()
    except Exception:  # a CUDA torch on a machine without a driver
        visible = False
    if not visible:
        archs = DEFAULT_ARCHS
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    else:
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        archs = ";".join(f"{a}.{b}" for a, b in caps)
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs

sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
cxx_flags = ["-O3", "-std=c++20", "-fopenmp"]
extra_compile_args = {"cxx": cxx_flags}
include_dirs = [os.path.join(ROOT, "csrc")]
if with_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    extra_compile_args["nvcc"] = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
    extension = CUDAExtension
else:
    extension = CppExtension

with open(os.path.join(ROOT, "subnet_ext", "_build_info.py"), "w") as f:
    f.write(
        "# Written by setup.py at build time; not tracked.\n"
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"CUDA_VERSION = {torch.version.cuda if with_cuda else None!r}\n"
        f"CUDA_ARCHS = {archs.split(';') if with_cuda else []!r}\n"
        f"CUDA_HOME = {cuda_home if with_cuda else None!r}\n"
        f"WITH_CUDA = {with_cuda!r}\n"
    )

# Name, version, dependencies, extras and console scripts: pyproject.toml ([project]).
setup(
    ext_modules=[
        extension(
            "subnet_ext._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args=extra_compile_args,
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
