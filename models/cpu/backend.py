"""The XLA:CPU backend as one static value, chosen once at start-up and passed down.

Contract:
  * ``CpuBackend`` (frozen, hashable): the lowering ``policy`` (``models.cpu.lowering``) and
    which native kernels the model may call: ``matmul_kernels`` (``models.cpu.kernels``),
    ``amx``, ``dpbf16`` (AVX512-BF16), ``tiled`` (AVX512-BF16 on tiled weight copies),
    ``tiled_w8a8`` (AVX512-VNNI on tiled copies of W8A8 weights),
    ``paged_attention`` and its ``paged_bf16_dot`` path, ``lora`` (each row's own LoRA
    adapter for decode rows, ``models.cpu.kernels.lora_group``); on an accelerator,
    ``pallas_attention``: the Pallas kernel decode attention runs (``"gpu"``:
    ``models.gpu.paged_attention``; ``""``: the gather path) and ``pallas_interpret`` (the tests:
    that kernel through Pallas's interpreter, on CPU).
    Steps and KV stores hold it and the model's functions take it as a static argument, so it
    is part of every jit key;
    nothing reads the environment or a module global at trace time.
  * ``CpuBackend()`` (the library default): ``DEFAULT`` policy, no native kernel, no side effect.
  * ``resolve(measure=None, refresh=False) -> Resolved``: what the CLIs call once at start-up:
    reads the switches (``models.cpu.env``), loads the native libraries where allowed and
    available, and chooses the lowering (``lowering.choose``: cached or measured; ``measure``
    None: the environment's say). ``Resolved.backend`` is the value; ``Resolved.report()`` the
    JSON-able account (policy, source, cache key and path, kernels, measurements).
  * ``native(policy=DEFAULT, allowed=True, amx=True)``: every available kernel with ``policy``
    (AMX only if ``amx``), nothing measured (tests, the lab tools).
"""

from __future__ import annotations

import dataclasses

from models.cpu import env, lowering
from models.cpu.lowering import DEFAULT, Choice, CpuPolicy


@dataclasses.dataclass(frozen=True)
class CpuBackend:
  policy: CpuPolicy = DEFAULT
  matmul_kernels: bool = False
  amx: bool = False
  dpbf16: bool = False
  tiled: bool = False
  tiled_w8a8: bool = False
  paged_attention: bool = False
  paged_bf16_dot: bool = False
  lora: bool = False
  pallas_attention: str = ""  # "gpu": models.gpu.paged_attention decodes; "": the gather path
  pallas_interpret: bool = False


@dataclasses.dataclass(frozen=True)
class Resolved:
  backend: CpuBackend
  choice: Choice

  def report(self) -> dict:
    b, c = self.backend, self.choice
    return {"policy": dataclasses.asdict(b.policy), "source": c.source, "key": c.key,
            "cache_path": c.path, "native_kernels": b.matmul_kernels, "amx_kernel": b.amx,
            "dpbf16_kernel": b.dpbf16, "tiled_kernel": b.tiled,
            "tiled_w8a8_kernel": b.tiled_w8a8,
            "paged_attention": b.paged_attention, "lora_kernel": b.lora,
            "pallas_attention": b.pallas_attention or "none",
            "measurements": c.measurements}


def native(policy: CpuPolicy = DEFAULT, allowed: bool = True, amx: bool = True) -> CpuBackend:
  """Every native kernel this process can load (none unless ``allowed``; the AMX ones, and the
  AMX tile state they ask Linux for, only if ``amx``), with ``policy``."""
  if not allowed:
    return CpuBackend(policy)
  from models.cpu import kernels, paged_attention  # loading them builds the libraries
  pa = paged_attention.available()
  return CpuBackend(policy, matmul_kernels=kernels.available(),
                    amx=amx and kernels.available() and kernels.amx_available(),
                    dpbf16=kernels.available() and kernels.dpbf16_available(),
                    tiled=kernels.available() and kernels.tiled_available(),
                    tiled_w8a8=kernels.available() and kernels.tiled_w8a8_available(),
                    paged_attention=pa,
                    paged_bf16_dot=pa and env.paged_bf16_dot()
                    and paged_attention.bf16_dot_supported(),
                    lora=kernels.available() and kernels.lora_available())


def resolve(measure: bool | None = None, refresh: bool = False) -> Resolved:
  """See the module contract; call once at start-up, before any trace."""
  import jax
  b = native(DEFAULT, env.native_kernels(), env.amx())
  if jax.default_backend() == "gpu" and env.pallas_attention():  # decode reads pages in place
    b = dataclasses.replace(b, pallas_attention="gpu")
  choice = lowering.choose(env.measure_lowering() if measure is None else measure,
                           b.matmul_kernels, b.amx, env.cache_dir(), refresh, b.dpbf16, b.tiled)
  return Resolved(dataclasses.replace(b, policy=choice.policy), choice)


__all__ = ["CpuBackend", "Resolved", "resolve", "native"]
