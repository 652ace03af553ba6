"""ragcache's own CPU attention: bf16 on AVX512-BF16 CPUs (kernels/cpu_attention.c) and fp32 on
AVX2 + FMA CPUs (kernels/cpu_attention_f32.c), the dtype the engine runs on CPUs without bf16
dot products.

Each C source ships with the package and is compiled on first use with the system C compiler
(`$CC`, default `gcc`; `-O3 -march=native -fopenmp`) into `$RAGCACHE_HOME/kernels/<digest>/`,
keyed by the source, the flags and the CPU's flags, so another CPU builds its own copy. It is
loaded with ctypes: no Python or torch headers are needed. Where a kernel cannot run (not x86-64
Linux, a CPU without its instructions, no compiler, a failed build) its entry points return None
and the caller uses its torch path; the reason is logged once.

Where a kernel runs but torch's own path is measured faster on this kind of CPU (`prefers_native`,
`linear_max_rows`: prefill attention and bf16 GEMMs of 3+ rows on CPUs with AMX, where torch's
oneDNN kernels compute on AMX tiles or full-width AVX-512), "auto" takes torch's.
`RAGCACHE_CPU_KERNELS=0` turns both libraries off (A/B runs, tests of the torch path); `=1` uses
them wherever they apply and makes a missing build an error instead of a silent fallback.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("ragcache.kernels")

ENV_VAR = "RAGCACHE_CPU_KERNELS"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
SUPPORTED_HEAD_DIMS = (32, 64, 96, 128)
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@dataclass(frozen=True)
class NativeKernel:
    """One native library: the dtype it serves, its source and the CPU flags it needs."""

    dtype: torch.dtype
    source: Path
    cpu_flags: tuple[str, ...]
    suffix: str  # of its entry points (rc_prefill_<suffix>, rc_decode_<suffix>) and its file name


KERNELS = {
    torch.bfloat16: NativeKernel(torch.bfloat16, Path(__file__).with_name("cpu_attention.c"),
                                 ("avx512f", "avx512_bf16"), "bf16"),
    torch.float32: NativeKernel(torch.float32, Path(__file__).with_name("cpu_attention_f32.c"), ("avx2", "fma"),
                                "f32"),
}
SOURCE = KERNELS[torch.bfloat16].source
REQUIRED_CPU_FLAGS = KERNELS[torch.bfloat16].cpu_flags


def _mode() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes"):
        return "on"
    return "auto"


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def forced() -> bool:
    """`RAGCACHE_CPU_KERNELS=1`: the native kernels wherever they apply, faster or not."""
    return _mode() == "on"


def prefers_native(dtype: torch.dtype, dense_causal: bool) -> bool:
    """Whether the native prefill attention is the faster path for `dtype` on this CPU, by what
    was measured (docs/benchmarks.md, "Native CPU attention"). bf16: yes, except with AMX, where
    torch's SDPA runs its GEMMs on AMX tiles, which beat this AVX512 kernel on scattered queries
    and on a dense causal prefill. fp32: never for a dense causal prefill (PyTorch's flash SDPA
    is as fast or faster), and for scattered queries except on those CPUs too (this kernel is
    AVX2: it beats torch on an AVX2-only Zen 3 but not on the AMX Xeon, whose AVX-512 units are
    full width; Zen 4's half-width AVX-512 is not measured, so it keeps the kernel)."""
    if forced():
        return True
    if "amx_bf16" in _cpu_flags():
        return False
    return dtype == torch.bfloat16 or not dense_causal


def _build_dir(compiler: str, kernel: NativeKernel) -> Path:
    home = Path(os.environ.get("RAGCACHE_HOME", Path.home() / ".cache" / "ragcache")).expanduser()
    digest = hashlib.sha256()
    digest.update(kernel.source.read_bytes())
    digest.update(" ".join((compiler, *FLAGS)).encode())
    digest.update(" ".join(sorted(_cpu_flags())).encode())
    return home / "kernels" / digest.hexdigest()[:16]


class BuildError(RuntimeError):
    pass


def unsupported_reason(compiler: str | None = None, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why this machine cannot have the `dtype` kernel at all (platform, CPU, no compiler); None if
    it can, in which case a failing build is a bug, not a reason."""
    kernel = KERNELS[dtype]
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the native CPU kernels are for x86-64 Linux, not {platform.system()} {platform.machine()}"
    missing = [f for f in kernel.cpu_flags if f not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if shutil.which(compiler or os.environ.get("CC", "gcc")) is None:
        return "no C compiler (set $CC or install gcc)"
    return None


def build(compiler: str | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Compile the `dtype` library if this CPU and compiler have no copy yet; its path."""
    if (reason := unsupported_reason(compiler, dtype)) is not None:
        raise BuildError(reason)
    kernel = KERNELS[dtype]
    cc = shutil.which(compiler or os.environ.get("CC", "gcc"))
    assert cc is not None
    target = _build_dir(cc, kernel) / f"libragcache_cpu_attention_{kernel.suffix}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        done = subprocess.run([cc, *FLAGS, "-o", str(partial), str(kernel.source), "-lm"],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BuildError(f"{Path(cc).name} failed: {done.stderr.strip()[-400:]}")
        os.replace(partial, target)  # atomic: concurrent builders never load half a file
    return target


@functools.cache
def _library(dtype: torch.dtype) -> ctypes.CDLL | None:
    suffix = KERNELS[dtype].suffix
    try:
        lib = ctypes.CDLL(str(build(dtype=dtype)))
    except (BuildError, OSError) as exc:
        log.info("native CPU attention (%s) unavailable (%s); using torch's", suffix, exc)
        return None
    prefill = getattr(lib, f"rc_prefill_{suffix}")
    prefill.restype = ctypes.c_int
    prefill.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
                        ctypes.c_float, ctypes.c_int]
    decode = getattr(lib, f"rc_decode_{suffix}")
    decode.restype = ctypes.c_int
    decode.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _PTR, ctypes.c_int]
    rope = getattr(lib, f"rc_rope_{suffix}")
    rope.restype = ctypes.c_int
    rope.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int]
    linear = getattr(lib, f"rc_linear_{suffix}")
    linear.restype = ctypes.c_int
    linear.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int]
    return lib


def library(dtype: torch.dtype = torch.bfloat16) -> ctypes.CDLL | None:
    """The loaded `dtype` library, or None where it is off, has no kernel for that dtype, or cannot
    run here."""
    mode = _mode()
    if mode == "off" or dtype not in KERNELS:
        return None
    lib = _library(dtype)
    if lib is None and mode == "on":
        build(dtype=dtype)  # raises with the reason
    return lib


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    return library(dtype) is not None


def _usable(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.device.type == "cpu" and t.dtype == dtype and t.stride(-1) == 1


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: torch.Tensor,
                      key_pos: torch.Tensor) -> torch.Tensor | None:
    """q [Tq, H, D] over k/v [Tk, Hkv, D] (RoPE applied), a query seeing keys at positions <= its
    own; key positions must ascend. None where the kernel does not apply (the caller falls back)."""
    tq, heads, dim = q.shape
    tk, kv_heads = k.shape[0], k.shape[1]
    dtype = q.dtype
    if dtype not in KERNELS or dim not in SUPPORTED_HEAD_DIMS or tq == 0 or tk == 0:
        return None
    if not (_usable(q, dtype) and _usable(k, dtype) and _usable(v, dtype)):
        return None
    if q.stride(1) != dim or k.stride(1) != dim or v.stride(1) != dim or heads % kv_heads:
        return None
    lib = library(dtype)
    if lib is None:
        return None
    qpos = query_pos.to(torch.int64).contiguous()
    kpos = key_pos.to(torch.int64).contiguous()
    out = torch.empty(tq, heads, dim, dtype=q.dtype)
    prefill = getattr(lib, f"rc_prefill_{KERNELS[dtype].suffix}")
    rc = prefill(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
                 qpos.data_ptr(), kpos.data_ptr(), tq, tk, heads, kv_heads, dim, dim**-0.5, torch.get_num_threads())
    return out if rc == 0 else None


def decode_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor | None:
    """One new token per sequence: q [B, H, D]; keys[b]/values[b] [n_b, Hkv, D] (every key visible,
    rows of one stride for all). Returns [B, H * D], or None where the kernel does not apply."""
    batch, heads, dim = q.shape
    dtype = q.dtype
    if not keys or dtype not in KERNELS or dim not in SUPPORTED_HEAD_DIMS or not _usable(q, dtype):
        return None
    if not q.is_contiguous():
        return None
    row_stride = keys[0].stride(0)
    for k, v in zip(keys, values, strict=True):
        if not (_usable(k, dtype) and _usable(v, dtype)) or k.stride(0) != row_stride or v.stride(0) != row_stride:
            return None
        if k.stride(1) != dim or v.stride(1) != dim or k.shape[0] == 0:
            return None
    kv_heads = keys[0].shape[1]
    if heads % kv_heads or heads // kv_heads > 16:
        return None
    lib = library(dtype)
    if lib is None:
        return None
    kptr = torch.tensor([k.data_ptr() for k in keys], dtype=torch.int64)
    vptr = torch.tensor([v.data_ptr() for v in values], dtype=torch.int64)
    lens = torch.tensor([k.shape[0] for k in keys], dtype=torch.int64)
    out = torch.empty(batch, heads * dim, dtype=q.dtype)
    decode = getattr(lib, f"rc_decode_{KERNELS[dtype].suffix}")
    rc = decode(q.data_ptr(), kptr.data_ptr(), vptr.data_ptr(), lens.data_ptr(), batch, heads, kv_heads, dim,
                row_stride, dim**-0.5, out.data_ptr(), torch.get_num_threads())
    return out if rc == 0 else None


def _rows_of_heads(t: torch.Tensor) -> bool:
    """[T, heads, dim] or [layers, T, heads, dim] on the CPU, each token's heads one dense run."""
    return t.device.type == "cpu" and t.dim() in (3, 4) and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [T, heads, dim] or [layers, T, heads, dim] rotated (NeoX halves) by tables [T, dim] in
    x's dtype, with torch's roundings, into `out` (x's shape and dtype; a new tensor when None).
    None where the kernel does not apply (the caller uses torch's ops)."""
    dtype = x.dtype
    if dtype not in KERNELS or not _rows_of_heads(x) or x.shape[-1] % 2 or x.numel() == 0:
        return None
    if cos.dtype != dtype or sin.dtype != dtype or cos.device.type != "cpu" or sin.device.type != "cpu":
        return None
    tokens, heads, dim = x.shape[-3:]
    if cos.shape != (tokens, dim) or sin.shape != (tokens, dim):
        return None
    if out is not None and (out.shape != x.shape or out.dtype != dtype or not _rows_of_heads(out)):
        return None
    lib = library(dtype)
    if lib is None:
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    layers, x_ls = (x.shape[0], x.stride(0)) if x.dim() == 4 else (1, 0)
    out = torch.empty(x.shape, dtype=dtype) if out is None else out
    o_ls = out.stride(0) if x.dim() == 4 else 0
    rc = getattr(lib, f"rc_rope_{KERNELS[dtype].suffix}")(
        x.data_ptr(), x_ls, x.stride(-3), out.data_ptr(), o_ls, out.stride(-3), cos.data_ptr(), sin.data_ptr(),
        layers, tokens, heads, dim, torch.get_num_threads())
    return out if rc == 0 else None


# The most activation rows the native linear layer takes (a decode step's batch); past that the
# BLAS GEMM torch calls reads the weights once too.
LINEAR_MAX_ROWS = 8
# With AMX, torch's bf16 GEMM runs on AMX tiles and is the faster one from 3 rows on
# (docs/benchmarks.md, "Native CPU attention").
AMX_LINEAR_MAX_ROWS = 2


def linear_max_rows(dtype: torch.dtype) -> int:
    """The most rows the native linear layer takes for `dtype` on this CPU in "auto"."""
    if dtype == torch.bfloat16 and "amx_bf16" in _cpu_flags() and not forced():
        return min(LINEAR_MAX_ROWS, AMX_LINEAR_MAX_ROWS)
    return LINEAR_MAX_ROWS


_LINEAR_MULTIPLE = {torch.bfloat16: (32, 16), torch.float32: (8, 8)}  # K, N multiples the kernels take


def linear(x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None,
           max_rows: int | None = None) -> torch.Tensor | None:
    """x [M, K] @ weight[N, K]^T, plus `add` ([M, N] residual rows, or a [N] bias) where given, for
    M <= `max_rows` (default `linear_max_rows(x.dtype)`, at most LINEAR_MAX_ROWS), summed in fp32
    and rounded once to x's dtype. None where the kernel does not apply (the caller uses torch's
    GEMM)."""
    dtype = x.dtype
    if dtype not in KERNELS or x.dim() != 2 or weight.dim() != 2:
        return None
    limit = linear_max_rows(dtype) if max_rows is None else min(max_rows, LINEAR_MAX_ROWS)
    if not 1 <= x.shape[0] <= limit:
        return None
    rows, kdim = x.shape
    n = weight.shape[0]
    k_multiple, n_multiple = _LINEAR_MULTIPLE[dtype]
    if weight.shape[1] != kdim or kdim % k_multiple or n % n_multiple:
        return None
    if not (_usable(x, dtype) and _usable(weight, dtype)) or weight.stride(0) != kdim:
        return None
    add_rs = 0
    if add is not None:
        if not _usable(add, dtype):
            return None
        if add.dim() == 1 and add.shape[0] == n:
            add_rs = 0
        elif add.dim() == 2 and add.shape == (rows, n):
            add_rs = add.stride(0)
        else:
            return None
    lib = library(dtype)
    if lib is None:
        return None
    out = torch.empty(rows, n, dtype=dtype)
    rc = getattr(lib, f"rc_linear_{KERNELS[dtype].suffix}")(
        x.data_ptr(), x.stride(0), weight.data_ptr(), kdim, add.data_ptr() if add is not None else None, add_rs,
        out.data_ptr(), n, rows, n, kdim, torch.get_num_threads())
    return out if rc == 0 else None
