"""Which collectives a compiled step contains: kind, result shape, bytes and the JAX op behind each.

Used by the training loop (`config.train.hlo_report`) to show where data moves between devices:
parameter all-gathers and gradient reduce-scatters under FSDP, activation all-reduces under tensor
parallelism, and (the point of the check) none inside the attention op, whose kernels run per device
under shard_map (nsa_jax.ops).
"""

from __future__ import annotations

import collections
import re

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
         "ragged-all-to-all")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
                "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# "%x = <result shape> <kind>[-start](operands...), ..., metadata={op_name="..." ...}"
_LINE = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<kind>" + "|".join(KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"(?P<dt>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')


def _arrays(shape: str):
  return [(m["dt"], tuple(int(d) for d in m["dims"].split(",") if d))
          for m in _ARRAY.finditer(shape)]


def collectives(hlo_text: str) -> list[dict]:
  """One record per collective instruction of an optimized HLO module's text."""
  out = []
  for line in hlo_text.splitlines():
    m = _LINE.search(line)
    if not m or "-done" in line.split("=", 1)[0]:
      continue
    arrays = _arrays(m["shape"])
    # An async start returns (operands, results[, scratch]); its result is the largest array.
    dt, dims = max(arrays, key=lambda a: _DTYPE_BYTES.get(a[0], 4) * _numel(a[1]),
                   default=("f32", ()))
    name = _OP_NAME.search(line)
    out.append(dict(kind=m["kind"], dtype=dt, shape=list(dims),
                    bytes=_DTYPE_BYTES.get(dt, 4) * _numel(dims),
                    op_name=name["name"] if name else ""))
  return out


def _numel(dims):
  n = 1
  for d in dims:
    n *= d
  return n


def summarize(records: list[dict], seq_len: int) -> dict:
  """Counts and bytes per kind, plus the collectives that carry a sequence-length dimension and
  those whose op_name points into an attention op (shard_map body or the kernels)."""
  per_kind = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
  for r in records:
    per_kind[r["kind"]]["count"] += 1
    per_kind[r["kind"]]["bytes"] += r["bytes"]
  with_seq = [r for r in records if seq_len in r["shape"]]
  # nsa_jax.ops names its ops with jax.named_scope; resharding at the op's boundary counts too.
  in_attention = [r for r in records if re.search(r"nsa_attention|dense_attention", r["op_name"])]
  return {"per_kind": dict(per_kind), "with_sequence_dim": with_seq,
          "in_attention_op": in_attention, "total": len(records)}
